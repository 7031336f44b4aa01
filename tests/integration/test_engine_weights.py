"""Weight updates while serving, against STRICT embedded engines (they fail where SGLang 0.5.23
fails): the test process is the learner's rank 0 of a gloo group with two engines; pushes in every
pause mode with requests in flight, per-token versions from spans, the weight group's address,
engine and learner restarts, loads from disk."""

import asyncio
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.actors.engine.weight_push import WeightPusher, routable_address
from slime_async.actors.engine.weight_sync import choose_backend
from slime_async.actors.learner.process import push_backend
from slime_async.config import PushConfig
from slime_async.models.toy import make_tiny_model
from slime_async.utils.procs import wait_until
from tests.support.engine_util import (
    hf_greedy,
    launch_engine,
    push_config,
    start_engine,
    start_engines,
)

PROMPTS = [[2, 9, 10, 11], [2, 30, 31], [2, 40, 41, 42, 43, 44]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
STRICT = ("engine.embedded.max_context_len=1200", "engine.embedded.strict_sglang=true")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shape = dict(family="qwen3", max_position_embeddings=2048)
    return make_tiny_model(root / "v0", seed=1, **shape), make_tiny_model(
        root / "v1", seed=2, **shape
    )


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def started(models, logs):
    started = start_engines(2, models[0], logs, *STRICT)
    try:
        yield started
    finally:
        for child, _ in started:
            child.stop()


@pytest.fixture(scope="module")
def engines(started):
    return [url for _, url in started]


@pytest.fixture(scope="module")
def pusher(engines, tmp_path_factory):
    state = tmp_path_factory.mktemp("state") / "weight_group.json"
    # backend "auto", as the learner starts it (push.backend's default)
    p = WeightPusher(engines, push_config(backend="auto", timeout_s=60), state_path=state)
    p.connect()
    try:
        yield p
    finally:
        p.close()


def test_auto_backend_is_gloo_for_engines_on_the_cpu(pusher, engines):
    """The pusher read each engine's device from /server_info and chose gloo (CPU engines)."""
    assert pusher.backend == "gloo" and pusher.device == torch.device("cpu")
    assert {u: (i["device"], i["gpu_uuid"]) for u, i in pusher.infos.items()} == {
        u: ("cpu", None) for u in engines
    }


def test_push_backend_choice_names_why():
    """NCCL only where every rank holds a GPU of its own; gloo for an engine on the CPU or one
    sharing the learner's GPU (NCCL: 'invalid usage'); SGLang reports no gpu_uuid."""
    own = {"device": "cuda", "gpu_uuid": "GPU-a"}
    other = {"device": "cuda:0", "gpu_uuid": "GPU-b"}
    assert choose_backend("GPU-a", {"e1": other, "e2": {"device": "cuda"}})[0] == "nccl"
    assert choose_backend("GPU-a", {"e1": {}})[0] == "nccl"  # SGLang's default device: cuda
    assert choose_backend(None, {"e1": other}) == ("gloo", "the learner is not on a GPU")
    assert choose_backend("GPU-a", {"e1": other, "e2": {"device": "cpu"}}) == (
        "gloo",
        "engine e2 is on cpu",
    )
    backend, why = choose_backend("GPU-a", {"e1": other, "e2": own})
    assert backend == "gloo" and "e2 shares the learner's GPU (GPU-a)" in why
    assert push_backend("auto", learner_on_gpu=False) == "gloo"
    assert push_backend("auto", learner_on_gpu=True) == "auto"
    assert push_backend("nccl", learner_on_gpu=True) == "nccl"
    with pytest.raises(ValueError, match=r"push.backend = 'nccl' needs the learner on a GPU"):
        push_backend("nccl", learner_on_gpu=False)


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
    assert stats["failed"] == 0.0 and stats["engines"] == 2.0
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


async def _in_flight(url: str, n: int = 3, max_new_tokens: int = 400):
    """Start `n` long requests on `url` and wait until they all run; returns (client, tasks)."""
    c = EngineClient(url)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    tasks = [asyncio.create_task(c.generate(PROMPTS[i % 3], params)) for i in range(n)]
    for _ in range(5000):
        info = await c.get_server_info()
        if info["running"] == n and info["decode_steps"] > 2:
            return c, tasks
        await asyncio.sleep(0.005)
    raise AssertionError(f"{n} requests never ran together on {url}: {info}")


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_push_with_requests_in_flight_in_every_pause_mode(
    started, engines, pusher, models, mode
):
    """Found 1 and 4: the push never asks a strict engine to flush while requests run (SGLang's
    update would fail, its cache not flushed); each token's version comes from the response's spans."""
    async with EngineClient(engines[0]) as c:
        before = await c.get_weight_version()
    pusher.pause_mode = mode
    clients, tasks = [], []
    for url in engines:
        c, t = await _in_flight(url)
        clients.append(c)
        tasks += t
    stats = await asyncio.to_thread(pusher.push, buckets_of(models[1]), before + 1)
    outs = await asyncio.gather(*tasks)
    for c in clients:
        await c.close()
    assert stats["failed"] == 0.0
    for child, url in started:  # no engine died, every one serves the new version
        assert child.alive()
        async with EngineClient(url) as c:
            assert await c.health() and await c.get_weight_version() == before + 1
    for out in outs:
        assert out.versions and out.versions[0] == before
        if mode == "abort":  # ended by the pause, every token of the old weights
            assert out.finish_reason == "abort" and set(out.versions) == {before}
            assert 0 < len(out.token_ids) < 400
        else:  # kept (retract: re-queued and recomputed; in_place: kept with its KV cache)
            assert out.finish_reason == "length" and len(out.token_ids) == 400
            switch = out.versions.index(before + 1)
            assert out.versions == [before] * switch + [before + 1] * (400 - switch)
            assert out.weight_version == before + 1
            spans = out.meta_info["weight_versions"]
            assert spans == [
                {"version": str(before), "start": 0, "end": switch},
                {"version": str(before + 1), "start": switch, "end": 400},
            ]
    if mode in ("abort", "retract"):
        assert pusher.counters["flush_polls"] >= 0  # polled until 200 (counted when refused)
    assert_matches_hf(await greedy_on(engines[1]), models[1])
    await asyncio.to_thread(pusher.push, buckets_of(models[0]), before + 2)
    pusher.pause_mode = "abort"


async def test_an_update_that_flushes_while_requests_run_fails_and_the_engine_serves_on(
    models, logs
):
    """What the old pusher did (in_place pause, flush_cache=true on the update) fails on a strict
    engine as on SGLang 0.5.23 (srt/managers/scheduler_components/weight_updater.py:
    flush_cache_after_weight_update): the flush is refused while requests run, so the update
    answers 400 (the weights are loaded), and the server keeps serving."""
    child, url = start_engine(models[0], logs, *STRICT)
    try:
        c, tasks = await _in_flight(url, n=1, max_new_tokens=200)
        async with c:
            assert not await c.flush_cache()  # 400 while a request runs
            await c.pause_generation("in_place")
            assert not await c.flush_cache()  # in_place keeps it running
            await c.continue_generation()
            body = {"model_path": str(models[1]), "flush_cache": True, "weight_version": "7"}
            with pytest.raises(EngineError, match="the cache was not flushed"):
                await c.call("POST", "/update_weights_from_disk", body, max_retries=0)
            outs = await asyncio.gather(*tasks)
            assert outs[0].finish_reason == "length"  # the request ran on to its end
            assert await c.flush_cache()  # nothing runs now
        assert child.proc.poll() is None  # the server did not stop
    finally:
        child.stop()


async def test_engine_restart_rejoins_the_group_with_the_current_weights(
    started, engines, pusher, models, logs
):
    """Found 3: an engine that restarts comes back with its initial weights and without the
    group; the next push (or the learner's per-step check) rebuilds the group and feeds it."""
    await asyncio.to_thread(pusher.push, buckets_of(models[1]), 50)
    child, url = started[1]
    port = int(url.rsplit(":", 1)[1])
    child.kill()
    assert await asyncio.to_thread(pusher.resync_needed)  # gone: the group is rebuilt without it
    stats = await asyncio.to_thread(pusher.push, buckets_of(models[1]), 51)
    assert stats["engines"] == 1.0 and pusher.counters["engines_left_out"] >= 1
    new_child, new_url = launch_engine(models[0], logs, *STRICT, port=port)
    started[1] = (new_child, new_url)
    await asyncio.to_thread(
        wait_until, lambda: _healthy(new_url), 120, f"engine at {new_url}", child=new_child
    )
    async with EngineClient(new_url) as c:
        assert await c.get_weight_version() == 0  # "default": its initial weights
    assert await asyncio.to_thread(pusher.resync_needed)
    resyncs = pusher.counters["resyncs"]
    stats = await asyncio.to_thread(pusher.push, buckets_of(models[1]), 51)
    assert stats["engines"] == 2.0 and pusher.counters["resyncs"] == resyncs + 1
    for url in engines:
        async with EngineClient(url) as c:
            assert await c.get_weight_version() == 51
            assert (await c.get_server_info())["weight_groups"] == [pusher.group_name]
    assert_matches_hf(await greedy_on(new_url), models[1])
    assert not await asyncio.to_thread(pusher.resync_needed)


async def test_restarted_learner_recreates_its_group_with_every_engine(engines, pusher, models):
    """Found 3: a second learner (the first one died without closing) builds a group under a
    fresh name after destroying the dead one's (named in the state file) on every engine."""
    old = pusher.group_name
    state = json.loads(pusher.state_path.read_text())
    assert state["group_name"] == old
    second = WeightPusher(engines, push_config(timeout_s=60), state_path=pusher.state_path)
    try:
        second.connect()
        assert second.group_name != old
        for url in engines:
            async with EngineClient(url) as c:
                assert (await c.get_server_info())["weight_groups"] == [second.group_name]
        await asyncio.to_thread(second.push, buckets_of(models[0]), 60)
        assert_matches_hf(await greedy_on(engines[0]), models[0])
    finally:
        second.close()
    # The first pusher's group is gone on the engines: it rebuilds before its next push.
    pusher._broken = True
    await asyncio.to_thread(pusher.push, buckets_of(models[0]), 61)
    async with EngineClient(engines[0]) as c:
        assert await c.get_weight_version() == 61


async def test_weight_group_address_from_config(models, logs):
    """Found 2: the store address is configurable; an engine told 127.0.0.2 joins there, while
    the learner's own default (its node's routable address) is something else."""
    assert PushConfig().master_addr is None
    assert routable_address() != "127.0.0.2"
    child, url = start_engine(models[0], logs, *STRICT)
    try:
        with WeightPusher([url], push_config(master_addr="127.0.0.2", timeout_s=60)) as p:
            assert p.master_addr == "127.0.0.2"
            await asyncio.to_thread(p.push, buckets_of(models[1]), 7)
        async with EngineClient(url) as c:
            assert await c.get_weight_version() == 7
    finally:
        child.stop()


def _healthy(url: str) -> bool:
    async def probe():
        async with EngineClient(url) as c:
            return await c.health(timeout_s=2)

    return asyncio.run(probe())


async def test_rejected_bucket_names_engine_and_parameter_then_resyncs(
    engines, pusher, models, caplog
):
    async with EngineClient(engines[0]) as c:
        version = await c.get_weight_version()
    bad = [[("model.layers.0.nope.weight", torch.zeros(3, 4))]]
    with caplog.at_level(logging.ERROR):
        stats = await asyncio.to_thread(pusher.push, bad, version + 1)
    assert stats["failed"] == 1.0
    assert "unknown parameter 'model.layers.0.nope.weight'" in caplog.text
    # both engines refuse the name; the push stops at whichever answers first and names it
    assert "update_weights_from_distributed" in caplog.text
    assert any(f"engine {u}" in caplog.text for u in engines)
    async with EngineClient(engines[0]) as c:
        assert await c.get_weight_version() == version
    # The push asks for a resync: the next one rebuilds the group and continues the engines.
    assert await asyncio.to_thread(pusher.resync_needed)
    await asyncio.to_thread(pusher.push, buckets_of(models[0]), version + 2)
    assert_matches_hf(await greedy_on(engines[0]), models[0])


async def test_update_weights_from_disk(engines, models):
    async with EngineClient(engines[1]) as c:
        await c.update_weights_from_disk(str(models[1]), weight_version=40)
        assert await c.get_weight_version() == 40
    outs = await greedy_on(engines[1])
    assert_matches_hf(outs, models[1])
    assert {o.weight_version for o in outs} == {40}
