"""Prefix keys end to end: the generator's /generate bodies carry SGLang's extra_key naming the
engine's weight version, through the real sglang-router, and after an in_place version change
that keeps the prefix cache (as SGLang keeps its radix cache when an update does not flush) new
requests do not run over KV cached under the old version; the generator counts what was reused.

    RolloutContext --EnginePool--> sglang-router --> EngineProxy --> embedded engine (strict)
"""

from __future__ import annotations

import asyncio

import pytest

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.generator.loop import Generator
from slime_async.actors.generator.rollout import RolloutContext
from slime_async.config import GeneratorConfig, SamplingConfig
from slime_async.metrics import (
    GEN_CACHED_PROMPT_TOKENS,
    GEN_PREFIX_KEY_BEHIND,
    GEN_TOKENS_OVER_CACHED_PREFIX,
)
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import make_tiny_model
from tests.support.engine_proxy import EngineProxy
from tests.support.engine_util import start_engine
from tests.support.router import Router

BLOCK = 16  # engine.embedded.block_size's default: the cache shares whole blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), family="qwen3", seed=4)


async def _scenario(router_url: str, engine_url: str, gen: Generator, tok) -> list:
    async with EnginePool([router_url], max_retries=2, backoff_s=0.05) as pool:
        for client in pool.clients.values():  # as the generator process sets it
            client.prefix_keys = gen.cfg.prefix_keys
        ctx = RolloutContext(
            pool,
            tok,
            SamplingConfig(temperature=0.0, max_new_tokens=4),
            stats=gen.rollout_stats,
            rid_prefix="pk/",
        )
        ids = ctx.encode("12*3+4=40; 7*6-2=40; 5*8+0=40; 9*4+4=40;")  # > 2 full blocks
        outs = [await ctx.generate(ids) for _ in range(2)]  # version 0: the second reuses
        async with EngineClient(engine_url) as c:
            # What an in_place push does around its broadcast, minus the tensors: running
            # requests and the prefix cache are kept, the engine now serves version 1.
            await c.pause_generation("in_place")
            await c.update_weight_version("1", abort_all=False)
            await c.continue_generation()
        outs += [await ctx.generate(ids) for _ in range(3)]
        return [ids, outs]


@pytest.mark.parametrize("keys", [True, False])
def test_generator_keys_requests_by_version_through_the_router(model_dir, tmp_path, keys):
    """generator.prefix_keys off shows what the keys prevent: after the version change every
    request runs over the prompt KV that version 0 cached."""
    tok = load_tokenizer(model_dir)
    child, engine_url = start_engine(model_dir, tmp_path, "engine.embedded.strict_sglang=true")
    try:
        with (
            EngineProxy(engine_url) as proxy,
            Router([proxy.url], log_path=tmp_path / "router.log") as router,
        ):
            data = tmp_path / "d.jsonl"
            data.write_text('{"prompt": "1+1", "answer": "2"}\n')
            gen = Generator(
                GeneratorConfig(dataset=str(data), group_size=1, prefix_keys=keys), None, tok
            )
            ids, outs = asyncio.run(_scenario(router.url, engine_url, gen, tok))
            calls = proxy.recorded("/generate")
            rec = gen._take_window()
    finally:
        child.stop()
    generated = [(b, a) for b, a in calls if str(b.get("rid", "")).startswith("pk/")]
    assert len(generated) == 5
    assert [o.versions[0] for o in outs] == [0, 0, 1, 1, 1]
    full = (len(ids) - 1) // BLOCK * BLOCK
    assert full >= 2 * BLOCK
    cached = [a["meta_info"]["cached_tokens"] for _, a in generated]
    if not keys:
        assert all("extra_key" not in b for b, _ in generated)
        assert cached == [0, full, full, full, full]
        assert rec[GEN_CACHED_PROMPT_TOKENS] == 4 * full and rec[GEN_PREFIX_KEY_BEHIND] == 0
        return
    # The router forwarded extra_key (it drops fields SGLang lacks): the version of the latest
    # answer. The first request after the change still carries the old version's key: no answer
    # of version 1 had come back yet.
    assert [b["extra_key"] for b, _ in generated] == ["weights-0"] * 3 + ["weights-1"] * 2
    # Reused: the second request of version 0 (its own key), the lagging one (counted as behind),
    # and the second request keyed by version 1; the first one keyed by version 1 prefills all:
    # without keys it would run over the prompt KV that version 0 cached.
    assert cached == [0, full, full, 0, full]
    assert rec[GEN_CACHED_PROMPT_TOKENS] == 3 * full
    assert rec[GEN_TOKENS_OVER_CACHED_PREFIX] == sum(len(outs[i].token_ids) for i in (1, 2, 4))
    assert rec[GEN_PREFIX_KEY_BEHIND] == 1
