"""Real embedded engine processes over loopback held to SGLang 0.5.23's rules: weight-update
sessions (strict: an update from distributed outside one is refused and the engine does not join
the learner's gloo broadcast), admin_api_key's auth levels, /update_weight_version aborting by
default, a refused flush after an update (400, weights and served version in place, engine
alive), and /health as slow as SGLang's while /ready answers at once."""

import asyncio
import json
import time

import aiohttp
import pytest
import torch

from slime_async.actors.engine.embedded.weights import FLUSH_FAILED
from slime_async.actors.engine.weight_sync import init_weight_group
from slime_async.models.toy import make_tiny_model
from slime_async.utils.procs import free_port
from tests.support.engine_util import serve_engine

KEY, ADMIN = "plain-key", "admin-key"
OUTSIDE = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
LONG = {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("model"), family="qwen3", seed=3, max_position_embeddings=1024
    )


def _engine(model_dir, logs, *overrides, **kw):
    yield from serve_engine(
        model_dir, logs, "engine.embedded.max_context_len=1000", *overrides, **kw
    )


@pytest.fixture(scope="module")
def strict(model_dir, tmp_path_factory):
    yield from _engine(
        model_dir,
        tmp_path_factory.mktemp("logs"),
        "engine.embedded.strict_sglang=true",
        # SGLang gives up after 20 s; 2 s keeps the paused /health test short (delay: default).
        "engine.embedded.health_timeout_s=2",
    )


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """Not strict, with both keys: auth is honoured in both modes."""
    yield from _engine(
        model_dir, tmp_path_factory.mktemp("logs"), f"engine.admin_api_key={ADMIN}", api_key=KEY
    )


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _call(url, method, path, body=None, key=None):
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, json=body, headers=_auth(key)) as r,
    ):
        raw = await r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw.decode()


async def _post(url, path, body=None, key=None):
    return await _call(url, "POST", path, {} if body is None else body, key)


async def _running(url, key=None, n=1):
    """Wait (bounded) until `n` requests run on the engine."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, info = await _call(url, "GET", "/server_info", key=key)
        if info["running"] >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no request started running on {url} within 60 s")


def _norm(model_dir) -> tuple[str, list[int]]:
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    return "model.norm.weight", [hidden]


async def _group(url, name, key=None, timeout_s=3.0):
    """The learner's side (rank 0) of a weight-update group with the engine (rank 1), built with
    the project's recipe (weight_sync.init_weight_group), and the engine's side over HTTP."""
    port = free_port()
    learner, (status, body) = await asyncio.gather(
        asyncio.to_thread(
            init_weight_group, "127.0.0.1", port, 0, 2, name, "gloo", "cpu", timeout_s
        ),
        _post(
            url,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": name,
                "backend": "gloo",
            },
            key,
        ),
    )
    assert (status, body["success"]) == (200, True), body
    return learner


def _update_body(model_dir, name, version):
    param, shape = _norm(model_dir)
    return {
        "names": [param],
        "dtypes": ["float32"],
        "shapes": [shape],
        "group_name": name,
        "weight_version": version,
        "flush_cache": False,
    }


def _broadcast(group, tensor) -> float:
    t0 = time.monotonic()
    group.broadcast(tensor)
    return time.monotonic() - t0


async def test_strict_update_outside_session_is_refused_and_not_joined(strict, model_dir):
    """Found on main: the engine served updates with no session, where SGLang 0.5.23's
    scheduler refuses them before receiving anything, so the learner's broadcast blocks."""
    _, shape = _norm(model_dir)
    g = await _group(strict, "outside")
    try:
        status, body = await _post(
            strict, "/update_weights_from_distributed", _update_body(model_dir, "outside", "7")
        )
        assert (status, body) == (400, {"success": False, "message": OUTSIDE})
        # The engine did not join: the learner's broadcast has no receiver and times out (the
        # group's 3 s), where a joined engine takes it in milliseconds (below).
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?i)timed out|timeout"):
            await asyncio.to_thread(_broadcast, g, torch.full(shape, 2.0))
        assert time.monotonic() - t0 >= 2.5
    finally:
        g.destroy()
        await _post(strict, "/destroy_weights_update_group", {"group_name": "outside"})
    _, info = await _call(strict, "GET", "/model_info")
    assert info["weight_version"] == "default"

    g = await _group(strict, "inside")
    try:
        assert await _post(strict, "/begin_weight_update", {}) == (
            200,
            {"success": True, "message": "Success"},
        )
        (status, body), took = await asyncio.gather(
            _post(
                strict, "/update_weights_from_distributed", _update_body(model_dir, "inside", "7")
            ),
            asyncio.to_thread(_broadcast, g, torch.full(shape, 2.0)),
        )
        assert (status, body["success"]) == (200, True), body
        assert took < 3.0
        assert await _post(strict, "/end_weight_update", {}) == (
            200,
            {"success": True, "message": "Success"},
        )
    finally:
        g.destroy()
        await _post(strict, "/destroy_weights_update_group", {"group_name": "inside"})
    _, info = await _call(strict, "GET", "/model_info")
    assert info["weight_version"] == "7"
    _, out = await _post(
        strict, "/generate", {"input_ids": [2, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    )
    assert out["meta_info"]["weight_version"] == "7"


async def test_session_rules_as_the_wheel(strict):
    """Found on main: no session routes (404)."""
    assert (await _post(strict, "/begin_weight_update", {"selector": "draft_only"}))[0] == 400
    assert (await _post(strict, "/begin_weight_update", {"selector": "target"}))[0] == 200
    status, body = await _post(strict, "/begin_weight_update", {})
    assert (status, body["success"]) == (400, False)
    assert "already open" in body["message"]
    assert (await _post(strict, "/end_weight_update", {}))[0] == 200
    status, body = await _post(strict, "/end_weight_update", {})
    assert (status, body["success"]) == (400, False)
    assert "no weight-update session is open" in body["message"]
    assert (await _post(strict, "/begin_weight_update", None))[0] == 200  # {} from _post
    assert (await _post(strict, "/end_weight_update"))[0] == 200
    async with aiohttp.ClientSession() as s, s.post(strict + "/begin_weight_update") as r:
        assert r.status == 400  # no body at all
    # io_struct.py: InitWeightsUpdateGroupReqInput.rank_offset has no default.
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    status, out = await _post(strict, "/init_weights_update_group", body)
    assert status == 400 and "rank_offset" in out["error"]["message"]


async def test_non_strict_serves_updates_outside_session_counted(keyed, model_dir):
    _, shape = _norm(model_dir)
    g = await _group(keyed, "loose", key=ADMIN)
    try:
        (status, body), _ = await asyncio.gather(
            _post(
                keyed,
                "/update_weights_from_distributed",
                _update_body(model_dir, "loose", "3"),
                ADMIN,
            ),
            asyncio.to_thread(_broadcast, g, torch.ones(shape)),
        )
        assert (status, body["success"]) == (200, True), body
    finally:
        g.destroy()
        await _post(keyed, "/destroy_weights_update_group", {"group_name": "loose"}, ADMIN)
    _, info = await _call(keyed, "GET", "/server_info", key=KEY)
    assert info["updates_outside_session"] == 1 and info["weight_version"] == "3"


async def test_admin_key_opens_control_routes_and_plain_key_the_rest(keyed):
    """Found on main: no admin key; the plain key opened every route. As srt/utils/auth.py."""
    for key in (KEY, None, "wrong"):
        status, _ = await _post(keyed, "/pause_generation", {"mode": "abort"}, key)
        assert status == 401, key
        assert (await _post(keyed, "/begin_weight_update", {}, key))[0] == 401
    assert (await _post(keyed, "/pause_generation", {"mode": "abort"}, ADMIN))[0] == 200
    assert (await _post(keyed, "/continue_generation", {}, ADMIN))[0] == 200
    gen = {"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 1}}
    assert (await _post(keyed, "/generate", gen, KEY))[0] == 200
    # NORMAL routes take the plain key only, even from the admin.
    assert (await _post(keyed, "/generate", gen, ADMIN))[0] == 401
    assert (await _call(keyed, "GET", "/server_info", key=ADMIN))[0] == 401
    for path in ("/health", "/health_generate", "/ready"):
        assert (await _call(keyed, "GET", path))[0] == 200, path
    # /freeze_gc is ADMIN_OPTIONAL too (http_server.py: freeze_gc_async)
    assert (await _post(keyed, "/freeze_gc", {}, KEY))[0] == 401
    assert (await _post(keyed, "/freeze_gc", {}, ADMIN)) == (200, "Garbage collection frozen.\n")


async def test_strict_engine_freezes_at_start_and_serves_freeze_gc(strict):
    """The strict engine as the e2e runs use it: its start-up heap frozen before the first
    request, /freeze_gc answered as SGLang's (GET and POST, a text body)."""
    _, before = await _call(strict, "GET", "/get_server_info")
    assert before["strict_sglang"] and before["gc_frozen_objects"] > 0
    for method in ("GET", "POST"):
        assert (await _call(strict, method, "/freeze_gc")) == (200, "Garbage collection frozen.\n")
    _, after = await _call(strict, "GET", "/get_server_info")
    assert after["gc_frozen_objects"] > before["gc_frozen_objects"]


async def test_update_weight_version_aborts_running_requests_by_default(strict):
    """Found on main: `abort_all_requests` defaulted to false; io_struct.py's default is true."""
    gen = asyncio.create_task(
        _post(strict, "/generate", {"input_ids": [2, 7, 8], "sampling_params": LONG})
    )
    await _running(strict)
    status, body = await _post(strict, "/update_weight_version", {"new_version": "v-abort"})
    assert (status, body["success"]) == (200, True)
    status, out = await asyncio.wait_for(gen, 60)
    assert status == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < LONG["max_new_tokens"]
    _, info = await _call(strict, "GET", "/model_info")
    assert info["weight_version"] == "v-abort"


async def test_refused_flush_after_update_answers_400_with_weights_in(strict, model_dir):
    """Found on main: strict stopped the engine here (older SGLang). 0.5.23 loads the weights,
    records the version, answers 400 (weight_updater.py: flush_cache_after_weight_update) and
    serves on; its /model_info keeps the old version (the tokenizer records it only when the
    call succeeded)."""
    _, before = await _call(strict, "GET", "/model_info")
    gen = asyncio.create_task(
        _post(strict, "/generate", {"input_ids": [2, 9, 10], "sampling_params": LONG})
    )
    await _running(strict)
    assert (await _post(strict, "/pause_generation", {"mode": "in_place"}))[0] == 200
    status, body = await _post(
        strict,
        "/update_weights_from_disk",
        {"model_path": str(model_dir), "weight_version": "5"},  # flush_cache: true by default
    )
    assert (status, body) == (
        400,
        {"success": False, "message": FLUSH_FAILED, "num_paused_requests": 0},
    )
    assert (await _post(strict, "/continue_generation", {}))[0] == 200
    status, out = await asyncio.wait_for(gen, 120)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    spans = out["meta_info"]["weight_versions"]
    assert spans[-1]["version"] == "5" and len(spans) == 2  # later tokens: the new weights
    _, info = await _call(strict, "GET", "/model_info")
    assert info["weight_version"] == before["weight_version"]
    _, server = await _call(strict, "GET", "/server_info")
    assert server["update_flush_failed"] == 1
    assert (await _call(strict, "GET", "/ready"))[0] == 200  # still serving


async def test_health_takes_sglang_time_ready_does_not(strict, keyed):
    """Found on main: /health answered at once, where SGLang's waits 1 s at least."""
    for path in ("/health", "/health_generate"):
        t0 = time.monotonic()
        assert (await _call(strict, "GET", path))[0] == 200
        assert time.monotonic() - t0 >= 1.0, path
    t0 = time.monotonic()
    assert (await _call(strict, "GET", "/ready"))[0] == 200
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    assert (await _call(keyed, "GET", "/health"))[0] == 200
    assert time.monotonic() - t0 < 0.5  # not strict: no delay by default
    # Paused: SGLang's one-token generation cannot run; 503 after health_timeout_s (2 s here).
    assert (await _post(strict, "/pause_generation", {"mode": "abort"}))[0] == 200
    try:
        t0 = time.monotonic()
        assert (await _call(strict, "GET", "/health"))[0] == 503
        assert time.monotonic() - t0 >= 2.0
        assert (await _call(strict, "GET", "/ready"))[0] == 503
    finally:
        assert (await _post(strict, "/continue_generation", {}))[0] == 200
    assert (await _call(strict, "GET", "/health"))[0] == 200


async def test_server_info_reports_the_layout_as_server_args(strict):
    """Found on main: attn_dp_size missing; /get_weight_version served where 0.5.23 has none."""
    assert (await _call(strict, "GET", "/get_weight_version"))[0] == 404
    _, info = await _call(strict, "GET", "/server_info")
    for key in ("tp_size", "pp_size", "dp_size", "attn_dp_size"):
        assert info[key] == 1, key
    assert info["enable_dp_attention"] is False


async def test_an_update_without_flush_keeps_cached_prefixes_apart_by_extra_key(strict, model_dir):
    """SGLang 0.5.23 keeps its radix cache through an update not asked to flush
    (weight_updater.py: flush_cache_after_weight_update), so KV computed by the old weights is
    reused by a request of the same `extra_key` (radix_cache.py: RadixKey keys children by it)
    and never by one of another key. Found on main: the strict engine forgot every cached prefix
    on each update, so the prefix-key tests could not see what real SGLang does."""
    prompt = list(range(3, 3 + 40))  # two full 16-token blocks and a part
    one = {"max_new_tokens": 1, "temperature": 0}

    async def cached(key: str) -> int:
        status, out = await _post(
            strict, "/generate", {"input_ids": prompt, "sampling_params": one, "extra_key": key}
        )
        assert status == 200, out
        return out["meta_info"]["cached_tokens"]

    assert (await _post(strict, "/flush_cache", {}))[0] == 200
    assert await cached("weights-0") == 0
    assert await cached("weights-0") == 32  # the two full blocks
    status, body = await _post(
        strict,
        "/update_weights_from_disk",
        {"model_path": str(model_dir), "weight_version": "9", "flush_cache": False},
    )
    assert status == 200, body
    assert await cached("weights-0") == 32  # kept through the update: old-weights KV
    assert await cached("weights-9") == 0  # another key never shares it
    assert (await _post(strict, "/flush_cache", {}))[0] == 200
    assert await cached("weights-0") == 0
