"""Weight updates while serving: the test process is the learner's rank 0 of a gloo group with two
embedded engines; pushes, in-flight updates with per-token versions, loads from disk."""

import asyncio

import pytest
import torch
from engine_util import hf_greedy, start_engines
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineRequestError
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.testing.models import make_tiny_model

PROMPTS = [[2, 9, 10, 11], [2, 30, 31], [2, 40, 41, 42, 43, 44]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shape = dict(family="qwen3", max_position_embeddings=2048)
    return make_tiny_model(root / "v0", seed=1, **shape), make_tiny_model(
        root / "v1", seed=2, **shape
    )


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = start_engines(2, models[0], logs, "engine.max_context_len=1200")
    try:
        yield [url for _, url in started]
    finally:
        for child, _ in started:
            child.stop()


@pytest.fixture(scope="module")
def pusher(engines):
    p = WeightPusher(engines, backend="gloo", group_name="test_weights", timeout_s=60)
    p.connect()
    try:
        yield p
    finally:
        p.close()


def buckets_of(model_dir, bucket_tensors: int = 5) -> list[list[tuple[str, torch.Tensor]]]:
    sd = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    items = list(sd.items())
    return [items[i : i + bucket_tensors] for i in range(0, len(items), bucket_tensors)]


async def greedy_on(url: str, prompts=PROMPTS) -> list:
    async with EngineClient(url) as c:
        return [await c.generate(p, GREEDY) for p in prompts]


def assert_matches_hf(outs, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    for out, p in zip(outs, PROMPTS, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, p, GREEDY["max_new_tokens"])
        assert out.token_ids == ref_tokens
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(ref_logps), atol=1e-4, rtol=0
        )


async def test_push_then_greedy_equals_hf_with_new_weights(engines, pusher, models):
    for url in engines:
        assert_matches_hf(await greedy_on(url), models[0])
    stats = await asyncio.to_thread(pusher.push, iter(buckets_of(models[1])), 1)
    n_bytes = sum(t.numel() * t.element_size() for b in buckets_of(models[1]) for _, t in b)
    assert stats["bytes"] == n_bytes and stats["buckets"] == len(buckets_of(models[1]))
    assert stats["bytes_per_s"] > 0
    for url in engines:
        outs = await greedy_on(url)
        assert_matches_hf(outs, models[1])
        assert all(o.weight_version == 1 and set(o.versions) == {1} for o in outs)
        async with EngineClient(url) as c:
            assert await c.get_weight_version() == 1
    # And back: a second push advances the version again.
    await asyncio.to_thread(pusher.push, buckets_of(models[0]), 2)
    for url in engines:
        outs = await greedy_on(url)
        assert_matches_hf(outs, models[0])
        assert {o.weight_version for o in outs} == {2}


async def test_in_flight_update_marks_versions_per_token(engines, pusher, models):
    long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    async with EngineClient(engines[0]) as c:
        before = await c.get_weight_version()
        task = asyncio.create_task(c.generate(PROMPTS[0], long))
        for _ in range(5000):  # until admitted: its first token is then sampled under `before`
            if (await c.get_server_info())["running"] == 1:
                break
            await asyncio.sleep(0.002)
        # Hold it where it is (the push pauses in place too; this only narrows the window).
        await c.pause_generation("in_place")
        await asyncio.to_thread(pusher.push, buckets_of(models[1]), before + 1)
        out = await task
    # Not dropped: the request ran to its length, the first tokens under the old version and the
    # rest under the new one, never interleaved.
    assert out.finish_reason == "length" and len(out.token_ids) == 1000
    switch = out.versions.index(before + 1)
    assert 0 < switch < 1000
    assert out.versions == [before] * switch + [before + 1] * (1000 - switch)
    assert out.weight_version == before + 1


async def test_rejected_bucket_names_the_parameter_and_keeps_serving(engines, pusher, models):
    async with EngineClient(engines[0]) as c:
        version = await c.get_weight_version()
    bad = [[("model.layers.0.nope.weight", torch.zeros(3, 4))]]
    with pytest.raises(
        EngineRequestError, match=r"unknown parameter 'model\.layers\.0\.nope\.weight'"
    ):
        await asyncio.to_thread(pusher.push, bad, version + 1)
    async with EngineClient(engines[0]) as c:
        assert await c.get_weight_version() == version
    # The group is still in step: the next push goes through.
    await asyncio.to_thread(pusher.push, buckets_of(models[0]), version + 2)
    assert_matches_hf(await greedy_on(engines[0]), models[0])


async def test_update_weights_from_disk(engines, models):
    async with EngineClient(engines[1]) as c:
        await c.update_weights_from_disk(str(models[1]), weight_version=40)
        assert await c.get_weight_version() == 40
    outs = await greedy_on(engines[1])
    assert_matches_hf(outs, models[1])
    assert {o.weight_version for o in outs} == {40}
