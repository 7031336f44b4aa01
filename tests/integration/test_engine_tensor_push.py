"""The colocated weight push on the CPU, against a real embedded engine process: the test
process is the learner and sends buckets through `POST /update_weights_from_tensor` with CPU
tensors in shared memory (torch's file_system strategy: the engine is not our multiprocessing
child), the same code path as CUDA IPC handles as far as a CPU allows. Bad input is refused with
400 naming the field and changes nothing; an engine without the route (an aiohttp proxy that
answers 404 on it, in front of a real engine) gets the broadcast instead."""

import asyncio
import base64
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
from aiohttp import ClientSession
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineRequestError
from slime_async.actors.engine.embedded.server import EmbeddedEngine, serve
from slime_async.actors.engine.tensor_push import (
    IPC_OPEN_FAILED,
    ROUTE,
    fallback_reason,
    flatten,
    request_body,
)
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.config import EngineConfig
from slime_async.metrics import names as M
from slime_async.models.toy import make_tiny_model
from tests.support.engine_proxy import EngineProxy
from tests.support.engine_util import hf_greedy, push_config, start_engine
from tests.support.repo import REPO, pythonpath_with_repo

PROMPT = [2, 9, 10, 11]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shape = dict(family="qwen3", max_position_embeddings=512)
    return make_tiny_model(root / "v0", seed=1, **shape), make_tiny_model(
        root / "v1", seed=2, **shape
    )


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    child, url = start_engine(models[0], tmp_path_factory.mktemp("logs"))
    try:
        yield url
    finally:
        child.stop()


def named_params(model_dir) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def reference(model_dir) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf_greedy(model, PROMPT, GREEDY["max_new_tokens"])[0]


def call(url: str, method: str, path: str, body=None) -> tuple[int, dict]:
    async def go():
        async with ClientSession() as s, s.request(method, url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def generate(url: str) -> list[int]:
    status, out = call(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200, out
    return out["output_ids"]


def version(url: str) -> str:
    return call(url, "GET", "/get_weight_version")[1]["weight_version"]


def post_tensors(url: str, body: dict) -> tuple[int, dict]:
    return call(url, "POST", ROUTE, body)


def test_a_push_by_shared_memory_changes_the_weights_and_the_version(engine, models):
    v1 = named_params(models[1])
    half = len(v1) // 2
    # two buckets, the version with the last one only (as the pusher sends them)
    status, out = post_tensors(engine, request_body(v1[:half]))
    assert status == 200 and out["success"], out
    assert version(engine) != "ipc-1"
    status, out = post_tensors(engine, request_body(v1[half:], weight_version="ipc-1"))
    assert status == 200 and out["success"], out
    assert version(engine) == "ipc-1"
    assert generate(engine) == reference(models[1])
    # back to v0, so the other tests start from the engine's own weights
    status, out = post_tensors(engine, request_body(named_params(models[0]), weight_version="0"))
    assert status == 200, out
    assert generate(engine) == reference(models[0])


def _bogus_shm_payload() -> str:
    """A pickle naming a shared-memory file that does not exist (a handle that cannot open)."""

    class Fake:
        def __reduce__(self):
            from torch.multiprocessing.reductions import rebuild_storage_filename

            return rebuild_storage_filename, (torch.UntypedStorage, b"/tmp/none", b"/torch_0_x", 64)

    return base64.b64encode(pickle.dumps([("model.norm.weight", Fake())])).decode()


def _flat_past_the_end(t: torch.Tensor):
    flat, metas = flatten([("model.norm.weight", t)])
    metas[0].end_idx += 4  # one element more than the flat tensor holds
    metas[0].start_idx += 4
    return flat, metas


def _unsafe_payload() -> str:
    buf = io.BytesIO()
    pickle.Pickler(buf).dump([("x", print)])
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    "mutate, says",
    [
        (
            lambda b, t: b.update(serialized_named_tensors=["%%%not base64"]),
            "serialized_named_tensors[0]",
        ),
        (lambda b, t: b.update(serialized_named_tensors=[]), "serialized_named_tensors"),
        (lambda b, t: b.update(serialized_named_tensors=[_unsafe_payload()]), "not admitted"),
        (lambda b, t: b.update(load_format="my_pkg.loader"), "load_format"),
        (  # a flattened bucket whose metadata points past its flat tensor
            lambda b, t: b.update(request_body(_flat_past_the_end(t))),
            "do not hold",
        ),
        (  # a flattened bucket of an unknown name: checked before any copy, as unflattened
            lambda b, t: b.update(request_body(flatten([("model.no_such.weight", t)]))),
            "model.no_such.weight",
        ),
        (
            lambda b, t: b.update(request_body([("model.no_such.weight", t)])),
            "model.no_such.weight",
        ),
        (
            lambda b, t: b.update(request_body([("model.norm.weight", torch.zeros(3))])),
            "model.norm.weight",
        ),
        (
            lambda b, t: b.update(
                request_body([("model.norm.weight", torch.zeros(t.shape, dtype=torch.int32))])
            ),
            "dtype",
        ),
        (lambda b, t: b.update(serialized_named_tensors=[_bogus_shm_payload()]), IPC_OPEN_FAILED),
    ],
    ids=[
        "base64",
        "empty",
        "unsafe-global",
        "load-format",
        "flat-bounds",
        "flat-name",
        "name",
        "shape",
        "dtype",
        "no-shm",
    ],
)
def test_bad_input_is_refused_naming_the_field_and_changes_nothing(engine, models, mutate, says):
    before_version, before_ids = version(engine), generate(engine)
    norm = dict(named_params(models[1]))["model.norm.weight"]
    body = request_body([("model.norm.weight", norm)], weight_version="never")
    mutate(body, norm)
    body["weight_version"] = "never"
    status, out = post_tensors(engine, body)
    assert status == 400, out
    message = out.get("message") or out["error"]["message"]
    assert says in message
    assert version(engine) == before_version
    assert generate(engine) == before_ids  # alive, and the weights are the old ones


def test_an_engine_that_cannot_open_the_handles_tells_the_sender_to_fall_back(engine):
    async def go():
        c = EngineClient(engine, max_retries=0)
        try:
            body = request_body([])
            body["serialized_named_tensors"] = [_bogus_shm_payload()]
            with pytest.raises(EngineRequestError) as e:
                await c.call("POST", ROUTE, body, max_retries=0)
            return e.value
        finally:
            await c.close()

    err = asyncio.run(go())
    assert fallback_reason(err) is not None and IPC_OPEN_FAILED in fallback_reason(err)


def test_pusher_by_handle_then_fallback_to_the_broadcast_on_404(engine, models, tmp_path):
    v1 = named_params(models[1])
    # the real path: push.backend = ipc, straight to the engine, no group
    p = WeightPusher([engine], push_config(backend="ipc", timeout_s=60))
    try:
        p.connect()
        assert p.ipc == {engine: "push.backend = ipc"} and p.group is None
        stats = p.push([v1[:5], v1[5:]], version=11)
        assert stats["failed"] == 0.0 and version(engine) == "11"
        assert generate(engine) == reference(models[1])
        m = p.metrics()
        assert m[M.PUSH_IPC_ENGINES] == 1.0 and m[M.PUSH_IPC_FALLBACKS] == 0.0
        assert m[M.PUSH_IPC_FLAT_REFUSED] == 0.0  # each bucket went flattened
        assert m[M.PUSH_IPC_BYTES] == stats["bytes"] > 0 and m[M.PUSH_IPC_GB_PER_S] > 0
    finally:
        p.close()
    # a second engine behind a proxy without the route: it falls back, and the pool is mixed
    v0 = named_params(models[0])
    child, other = start_engine(models[1], tmp_path)
    try:
        with EngineProxy(other) as proxy:
            proxy.answer[ROUTE] = (404, {"detail": "Not Found"})  # an engine without the route
            p = WeightPusher([engine, proxy.url], push_config(backend="ipc", timeout_s=60))
            try:
                p.connect()
                assert set(p.ipc) == {engine, proxy.url}
                first = p.push([v0], version=12)
                assert first["failed"] == 1.0 and len(proxy.calls(ROUTE)) == 1
                assert p.resync_needed()
                assert p.metrics()[M.PUSH_IPC_FALLBACKS] == 1.0
                again = p.push([v0[:5], v0[5:]], version=12)  # resync: by handle + gloo group
                assert again["failed"] == 0.0 and len(proxy.calls(ROUTE)) == 1
                assert list(p.ipc) == [engine] and p.group is not None and p.backend == "gloo"
                assert p.members == [engine, proxy.url]
                for url in (engine, other):
                    assert version(url) == "12" and generate(url) == reference(models[0])
                m = p.metrics()
                assert m[M.PUSH_IPC_ENGINES] == 1.0 and m[M.PUSH_ENGINES] == 2.0
            finally:
                p.close()
    finally:
        child.stop()


def test_the_colocated_push_bench_runs_on_the_cpu_at_tiny_size(tmp_path):
    """bench/bench_engine.py --push-backend ipc,gloo: both pushes and the raw copy, 5 times each."""
    out = subprocess.run(
        [sys.executable, "bench/bench_engine.py", "--push-backend", "ipc,gloo", "--reps", "5"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath_with_repo()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[2:5]] == [
        "| raw copy_ (same device, same bytes)",
        "| WeightPusher, push.backend = ipc",
        "| WeightPusher, push.backend = gloo",
    ]
    # the parts of a push, each backend: probe .. continue, then the transfer against the copy
    assert (
        rows[5]
        == "| backend | probe | pause | begin | transfer | end | continue | transfer / raw copy |"
    )
    assert [r.split(" | ")[0] for r in rows[7:]] == ["| ipc", "| gloo"]
    assert "opened in" in out.stdout  # the engine's own timing of each call by handle


@pytest.mark.parametrize("flat", [False, True], ids=["one-by-one", "flattened"])
async def test_a_strict_engine_takes_tensors_only_inside_a_weight_update_session(models, flat):
    """SGLang 0.5.23 (scheduler_components/weight_updater.py: update_weights_from_tensor):
    outside /begin_weight_update .. /end_weight_update the call is refused, 400 {success: false}
    with the wheel's message, and the weights stay as they were; inside a session it loads.
    Both forms the pusher sends: tensor by tensor, and a flattened bucket."""

    def body_of(named, **kw):
        return request_body(flatten(named) if flat else named, **kw)

    eng = EmbeddedEngine(
        EngineConfig(
            model_path=str(models[0]),
            port=0,
            embedded={"device": "cpu", "strict_sglang": True, "health_delay_s": 0.0},
        )
    )
    runner, url = await serve(eng, "127.0.0.1", 0)
    norm = dict(named_params(models[1]))["model.norm.weight"]
    before = eng.runner.model.get_parameter("model.norm.weight").detach().clone()
    tensors = eng.weights.tensors
    try:
        async with ClientSession() as s:
            body = body_of([("model.norm.weight", norm)], weight_version="s1")
            async with s.post(url + ROUTE, json=body) as r:
                out = await r.json()
                assert r.status == 400 and out["success"] is False
                assert (
                    "must run between begin_weight_update() and end_weight_update()"
                    in (out["message"])
                )
            assert eng.scheduler.version != "s1"
            assert torch.equal(eng.runner.model.get_parameter("model.norm.weight"), before)
            async with s.post(url + "/begin_weight_update", json={}) as r:
                assert r.status == 200, await r.text()
            body = body_of([("model.norm.weight", norm)], weight_version="s1")
            async with s.post(url + ROUTE, json=body) as r:
                assert r.status == 200, await r.text()
            async with s.post(url + "/end_weight_update", json={}) as r:
                assert r.status == 200, await r.text()
        assert eng.scheduler.version == "s1"
        assert torch.equal(eng.runner.model.get_parameter("model.norm.weight"), norm)
        assert tensors.refused == 1 and tensors.updates == 1
    finally:
        await runner.cleanup()
