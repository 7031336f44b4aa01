"""`sampling_seed` as SGLang 0.5.23 treats it, on real embedded engine processes over loopback:
ignored without deterministic inference in strict mode (counted), every unseeded request drawn
with seed 42 under `engine.deterministic_inference` (so the samples of one prompt are one answer),
and the pool that gives each request a seed of its own there (what the generator uses), checked
against the engines by the generator's start-up check."""

import asyncio

import pytest

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.generator import seeding
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import serve_engine

PROMPT = [5, 9, 14, 3, 22, 7]
SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), family="qwen3", seed=11)


@pytest.fixture(scope="module")
def strict(model_dir, tmp_path_factory):
    yield from serve_engine(
        model_dir, tmp_path_factory.mktemp("logs"), "engine.embedded.strict_sglang=true"
    )


@pytest.fixture(scope="module")
def deterministic(model_dir, tmp_path_factory):
    yield from serve_engine(
        model_dir, tmp_path_factory.mktemp("logs"), "engine.deterministic_inference=true"
    )


async def _tokens(url: str, n: int, params: dict) -> list[list[int]]:
    async with EngineClient(url) as c:
        outs = [await c.generate(PROMPT, params) for _ in range(n)]
    return [o.token_ids for o in outs]


async def _info(url: str) -> dict:
    async with EngineClient(url) as c:
        return await c.get_server_info()


def test_strict_engine_ignores_a_seed_without_deterministic_inference_and_counts_it(strict):
    info = asyncio.run(_info(strict))
    assert info["enable_deterministic_inference"] is False
    assert seeding.check(strict, info, deterministic=False) is False
    asyncio.run(_tokens(strict, 2, {**SAMPLED, "sampling_seed": 7}))
    assert asyncio.run(_info(strict))["ignored_seeds"] == info["ignored_seeds"] + 2
    with pytest.raises(seeding.SeedingMismatch):
        seeding.check(strict, info, deterministic=True)


def test_deterministic_engine_draws_unseeded_requests_alike_and_the_pool_seeds_each(
    deterministic,
):
    info = asyncio.run(_info(deterministic))
    assert info["enable_deterministic_inference"] is True
    assert info["sampling_backend"] == "pytorch"
    # As SGLang: every request without a seed draws with 42, so repeated samples are one answer
    same = asyncio.run(_tokens(deterministic, 3, SAMPLED))
    assert same[0] == same[1] == same[2]
    assert asyncio.run(_tokens(deterministic, 1, {**SAMPLED, "sampling_seed": 42})) == same[:1]
    with pytest.raises(seeding.SeedingMismatch, match="seed 42"):
        seeding.check(deterministic, info, deterministic=False)

    async def pooled() -> tuple[list[list[int]], int]:
        async with EnginePool([deterministic], seed=3, seed_requests=True) as pool:
            outs = [await pool.generate(PROMPT, dict(SAMPLED)) for _ in range(4)]
            seeded = await pool.generate(PROMPT, {**SAMPLED, "sampling_seed": 42})
            assert seeded.token_ids == same[0]  # a request's own seed is kept
            return [o.token_ids for o in outs], pool.stats()["seeded_requests"]

    outs, seeded = asyncio.run(pooled())
    assert seeded == 4
    assert len({tuple(t) for t in outs}) == 4  # each request its own draws
