"""The embedded engine over HTTP: SGLang's protocol field by field, continuous batching equal to
one-at-a-time decoding, abort, pause, bad requests and the API key."""

import asyncio
import contextlib
import json
import re

import aiohttp
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineError, EngineRequestError
from slime_async.actors.engine.pool import EnginePool
from slime_async.models.toy import make_tiny_model
from slime_async.utils.procs import free_port
from tests.support.engine_util import hf_greedy, start_engine

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("model"), family="qwen3", seed=11, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def engine_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def engine(model_dir, engine_logs):
    child, url = start_engine(
        model_dir,
        engine_logs,
        "engine.embedded.max_context_len=1024",
        api_key=KEY,
    )
    try:
        yield url
    finally:
        child.stop()


def prompt(i: int) -> list[int]:
    return [2] + [8 + (i * 7 + j) % 60 for j in range(3 + i % 9)]


async def _post(url: str, path: str, body=None, data=None, headers=AUTH):
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, json=body, data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


async def _get(url: str, path: str, headers=AUTH):
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
        return r.status, await r.json(content_type=None) if await r.read() else None


async def test_generate_response_uses_sglang_fields(engine, model_dir):
    status, body = await _post(
        engine,
        "/generate",
        {
            "input_ids": prompt(0),
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "rid": "proto-1",
        },
    )
    assert status == 200
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    for key in (
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "output_token_logprobs",
    ):
        assert key in meta, key
    assert meta["id"] == "proto-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(prompt(0)) and meta["completion_tokens"] == 5
    assert isinstance(meta["weight_version"], str) and meta["weight_version"] == "default"
    assert len(body["output_ids"]) == 5
    for (lp, tok, text), out_tok in zip(
        meta["output_token_logprobs"], body["output_ids"], strict=True
    ):
        assert isinstance(lp, float) and lp <= 0 and tok == out_tok and text is None
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    # Without return_logprob there are no logprobs, as in SGLang.
    _, body = await _post(
        engine, "/generate", {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}
    )
    assert "output_token_logprobs" not in body["meta_info"]
    # Batched input_ids give a list of responses.
    _, body = await _post(
        engine,
        "/generate",
        {
            "input_ids": [prompt(1), prompt(2)],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        },
    )
    assert isinstance(body, list) and [len(b["output_ids"]) for b in body] == [3, 3]
    # Output matches HF greedy decoding of the served model.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    async with EngineClient(engine, api_key=KEY) as c:
        out = await c.generate(
            prompt(3), {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
    ref_tokens, ref_logps = hf_greedy(hf, prompt(3), 8)
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.tensor(ref_logps), atol=1e-4, rtol=0
    )


async def test_info_endpoints(engine, model_dir):
    for path in ("/get_model_info", "/model_info"):
        status, info = await _get(engine, path)
        assert (
            status == 200
            and info["model_path"] == str(model_dir)
            and info["weight_version"] == "default"
        )
    for path in ("/get_server_info", "/server_info"):
        status, info = await _get(engine, path)
        assert status == 200 and info["model_path"] == str(model_dir) and info["tp_size"] == 1
        assert info["version"] == "0.5.23" and info["dp_size"] == 1
    assert (await _get(engine, "/get_weight_version")) == (200, {"weight_version": "default"})
    async with EngineClient(engine, api_key=KEY) as c:
        assert await c.health() and await c.health_generate()
        assert await c.get_weight_version() == 0


async def test_start_up_is_frozen_out_of_the_collector_and_freeze_gc_answers_as_sglang(
    engine, engine_logs
):
    """The engine process freezes what start-up made before serving (a full collection of it
    would stall every request; SGLang freezes after its warm-up), times every collection in
    /get_server_info, and serves SGLang's /freeze_gc (GET and POST, ADMIN_OPTIONAL, a text
    answer)."""
    port = engine.rsplit(":", 1)[1]
    log_text = (engine_logs / f"engine-{port}.log").read_text()
    assert re.search(r"engine start-up: \d+ objects frozen out of the garbage collector", log_text)
    status, info = await _get(engine, "/get_server_info")
    assert status == 200 and info["gc_frozen_objects"] > 0
    assert len(info["gc_collections"]) == len(info["gc_seconds"]) == 3
    assert info["gc_long_collections"] >= 0 and info["gc_longest_s"] >= 0
    async with aiohttp.ClientSession() as s:
        async with s.post(engine + "/freeze_gc") as r:  # the API key opens admin routes here
            assert r.status == 401
        for method in ("GET", "POST"):
            async with s.request(method, engine + "/freeze_gc", headers=AUTH) as r:
                assert (r.status, await r.text()) == (200, "Garbage collection frozen.\n")
    after = (await _get(engine, "/get_server_info"))[1]
    assert after["gc_frozen_objects"] > info["gc_frozen_objects"]
    assert "GET /freeze_gc: " in (engine_logs / f"engine-{port}.log").read_text()


async def test_64_concurrent_equal_one_at_a_time(engine):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = [prompt(i) for i in range(64)]
    async with EngineClient(engine, api_key=KEY) as c:
        alone = [await c.generate(p, params) for p in prompts]
        together = await asyncio.gather(*(c.generate(p, params) for p in prompts))
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
        assert b.completion_tokens == 24 and b.finish_reason == "length"


async def _wait_running(c: EngineClient, n: int) -> None:
    for _ in range(2000):
        info = await c.get_server_info()
        if info["running"] >= n and info["decode_steps"] > 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never saw {n} running requests")


async def test_abort_by_rid_prefix_returns_partial_output(engine):
    # Long enough that none finishes in the moment between seeing it run and aborting it.
    long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    async with EngineClient(engine, api_key=KEY) as c:
        tasks = [
            asyncio.create_task(c.generate(prompt(i), long, rid=rid))
            for i, rid in enumerate(["job7-a", "job7-b", "other"])
        ]
        await _wait_running(c, 3)
        await c.abort(rid="job7")
        a, b = await asyncio.gather(tasks[0], tasks[1])
        await c.abort(abort_all=True)
        other = await tasks[2]
    for out in (a, b):
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 1000
        assert len(out.logprobs) == len(out.token_ids) == out.completion_tokens
    assert other.finish_reason == "abort"


async def test_pause_modes_and_continue(engine):
    params = {"max_new_tokens": 800, "temperature": 0, "ignore_eos": True}
    async with EngineClient(engine, api_key=KEY) as c:
        ref = await c.generate(prompt(5), params)
        # in_place: a running request keeps its KV and finishes with the same tokens after continue.
        task = asyncio.create_task(c.generate(prompt(5), params))
        await _wait_running(c, 1)
        await c.pause_generation("in_place")
        steps = (await c.get_server_info())["decode_steps"]
        await asyncio.sleep(0.2)
        assert (await c.get_server_info())["decode_steps"] == steps and not task.done()
        await c.continue_generation()
        assert (await task).token_ids == ref.token_ids
        # retract: requeued and recomputed, same greedy tokens.
        task = asyncio.create_task(c.generate(prompt(5), params))
        await _wait_running(c, 1)
        await c.pause_generation("retract")
        assert (await c.get_server_info())["running"] == 0
        await c.continue_generation()
        out = await task
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0
        )
        # abort: the running request ends; a new one waits until continue_generation.
        task = asyncio.create_task(c.generate(prompt(5), params))
        await _wait_running(c, 1)
        await c.pause_generation("abort")
        assert (await task).finish_reason == "abort"
        waiting = asyncio.create_task(
            c.generate(prompt(6), {"max_new_tokens": 3, "ignore_eos": True})
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await c.continue_generation()
        assert len((await waiting).token_ids) == 3


@pytest.mark.parametrize(
    "path, body, raw, status, words",
    [
        ("/generate", {"sampling_params": {}}, None, 400, "give input_ids or text"),
        ("/generate", {"input_ids": [2, 500]}, None, 400, "outside the vocabulary"),
        ("/generate", {"input_ids": [2, -1]}, None, 400, "outside the vocabulary"),
        ("/generate", {"input_ids": []}, None, 400, "non-empty list"),
        ("/generate", {"input_ids": [2, "a"]}, None, 400, "outside the vocabulary"),
        (
            "/generate",
            {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": -5}},
            None,
            400,
            "max_new_tokens must be >= 0",
        ),
        ("/generate", {"input_ids": [2, 3], "sampling_params": {"n": 0}}, None, 400, "n must be"),
        ("/generate", {"input_ids": [2, 3], "top_logprobs_num": -1}, None, 400, "top_logprobs_num"),
        (
            "/generate",
            {"input_ids": [2, 3], "return_logprob": True, "logprob_start_len": 2},
            None,
            400,
            "logprob_start_len 2 is not below the prompt length 2",
        ),
        (
            "/generate",
            {"input_ids": [2, 3], "return_hidden_states": True},
            None,
            400,
            "not supported by the embedded engine: ['return_hidden_states']",
        ),
        (
            "/generate",
            {"input_ids": [2, 3], "sampling_params": {"warp": 1}},
            None,
            400,
            "unknown sampling_params field 'warp'",
        ),
        ("/generate", {"input_ids": [2] * 1100}, None, 400, "does not fit the context"),
        ("/generate", None, b"{not json", 400, "malformed JSON"),
        ("/generate", None, b"[1, 2]", 400, "must be an object"),
        ("/pause_generation", None, b"", 400, "needs a JSON body"),
        ("/pause_generation", {"mode": "sideways"}, None, 400, "mode must be"),
        ("/update_weights_from_distributed", {"names": []}, None, 400, "missing or bad field"),
        (
            "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": []},
            None,
            400,
            "no weight-update group",
        ),
        ("/update_weights_from_disk", {}, None, 400, "needs model_path"),
        (
            "/update_weights_from_disk",
            {"model_path": "/nonexistent"},
            None,
            400,
            "no *.safetensors",
        ),
        ("/no_such_endpoint", {}, None, 404, "unknown endpoint POST /no_such_endpoint"),
    ],
)
async def test_bad_requests_get_4xx_and_server_keeps_serving(
    engine, path, body, raw, status, words
):
    got_status, got = await _post(
        engine, path, body, data=raw, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert got_status == status
    message = got["error"]["message"] if "error" in got else got["message"]
    assert words in message
    async with EngineClient(engine, api_key=KEY) as c:
        assert (
            len((await c.generate(prompt(1), {"max_new_tokens": 2, "ignore_eos": True})).token_ids)
            == 2
        )


async def test_api_key_guards_every_endpoint_but_health(engine):
    for path in ("/get_model_info", "/get_server_info", "/get_weight_version"):
        status, body = await _get(engine, path, headers={})
        assert status == 401 and "API key" in body["error"]["message"]
    for path in ("/health", "/health_generate"):  # as SGLang: the router probes without a key
        assert (await _get(engine, path, headers={}))[0] == 200
    for path in (
        "/generate",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/abort_request",
    ):
        status, body = await _post(engine, path, {}, headers={"Authorization": "Bearer wrong"})
        assert status == 401
    async with EngineClient(engine) as c:  # no key
        with pytest.raises(
            EngineRequestError, match=r"POST /generate to http://127\.0\.0\.1:\d+ failed: HTTP 401"
        ):
            await c.generate([2, 3], {"max_new_tokens": 1})


async def test_client_names_engine_and_call_and_retries():
    port = free_port()
    async with EngineClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01) as c:
        with pytest.raises(
            EngineError, match=rf"POST /generate to http://127\.0\.0\.1:{port} failed"
        ):
            await c.generate([2], {"max_new_tokens": 1})


async def test_client_requests_use_sglang_fields():
    """A capture server records what the client sends, call by call."""
    seen: dict[str, object] = {}

    async def record(request: web.Request) -> web.Response:
        raw = await request.read()
        seen[request.path] = json.loads(raw) if raw else None
        if request.path == "/generate" and seen[request.path].get("rid") == "spans":
            # SGLang 0.5.23's shape: spans over the output tokens, end exclusive (as SGLang's
            # utils/weight_versions.py builds them); weight_version is the last span's.
            return web.json_response(
                {
                    "text": "xyz",
                    "meta_info": {
                        "finish_reason": {"type": "length", "length": 5},
                        "weight_version": "12",
                        "weight_versions": [
                            {"version": "10", "start": 0, "end": 2},
                            {"version": "12", "start": 2, "end": 5},
                        ],
                        "output_token_logprobs": [[-0.1, 4, None]] * 5,
                    },
                }
            )
        if request.path == "/generate":
            return web.json_response(
                {
                    "text": "x",
                    "meta_info": {
                        "finish_reason": {"type": "stop", "matched": 1},
                        "weight_version": "7",
                        "prompt_tokens": 2,
                        "completion_tokens": 2,
                        "output_token_logprobs": [[-0.5, 4, None], [-0.25, 1, None]],
                    },
                }
            )
        if request.path == "/model_info":
            return web.json_response({"model_path": "/m", "weight_version": "7"})
        return web.json_response({"success": True, "message": ""})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with EngineClient(url) as c:
            spanned = await c.generate([2, 3], {"max_new_tokens": 5}, rid="spans")
            out = await c.generate([2, 3], {"max_new_tokens": 2, "temperature": 0.5}, rid="r1")
            await c.pause_generation("in_place")
            await c.continue_generation()
            await c.abort(rid="r")
            await c.flush_cache()
            assert await c.get_weight_version() == 7
            await c.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "gloo")
            await c.update_weights_from_distributed(
                ["w"], ["bfloat16"], [[2, 3]], "g", weight_version=8
            )
            await c.destroy_weights_update_group("g")
            await c.update_weights_from_disk("/ckpt", weight_version=9)
    finally:
        await runner.cleanup()
    assert seen["/generate"] == {
        "input_ids": [2, 3],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.5},
        "return_logprob": True,
        "rid": "r1",
        "extra_key": "weights-12",  # the version of the latest answer: `spanned`'s last span
    }
    assert (spanned.prefix_version, out.prefix_version) == (0, 12)
    # Real SGLang lacks output_ids and per-token versions: ids come from the logprob triples and
    # every token is taken to be of the response's weight_version.
    assert (out.token_ids, out.logprobs, out.versions, out.weight_version) == (
        [4, 1],
        [-0.5, -0.25],
        [7, 7],
        7,
    )
    assert out.finish_reason == "stop"
    # Found 4: each token gets its span's version, not the response's final weight_version.
    assert spanned.versions == [10, 10, 12, 12, 12] and spanned.weight_version == 12
    assert seen["/pause_generation"] == {"mode": "in_place"}
    assert seen["/continue_generation"] == {}
    assert seen["/abort_request"] == {"abort_all": False, "rid": "r"}
    assert seen["/flush_cache"] == {}
    assert seen["/init_weights_update_group"] == {
        "master_address": "127.0.0.1",
        "master_port": 1234,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    }
    assert seen["/update_weights_from_distributed"] == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": "8",
    }
    assert seen["/destroy_weights_update_group"] == {"group_name": "g"}
    assert seen["/update_weights_from_disk"] == {
        "model_path": "/ckpt",
        "flush_cache": False,
        "weight_version": "9",
    }


@contextlib.asynccontextmanager
async def failing_server(status: dict[str, int], hits: list[str]):
    """A server that answers every call with `status["code"]` and records the paths it got."""

    async def answer(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"error": {"message": "busy"}}, status=status["code"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_client_retries_5xx_but_not_4xx(caplog):
    caplog.set_level("WARNING", logger="slime_async.actors.engine.client")
    status, hits = {"code": 503}, []
    async with (
        failing_server(status, hits) as url,
        EngineClient(url, max_retries=2, backoff_s=0.001) as c,
    ):
        with pytest.raises(EngineError, match="HTTP 503: busy") as err:
            await c.call("GET", "/get_server_info")
        assert type(err.value) is EngineError and err.value.status == 503
        assert hits == ["/get_server_info"] * 3  # the first attempt and max_retries retries
        assert c.retries == 2  # every retry counted and logged with its reason
        assert caplog.text.count("HTTP 503: busy; retry") == 2
        hits.clear()
        assert not await c.health()  # health checks are never retried
        assert hits == ["/health"]
        hits.clear()
        status["code"] = 400
        with pytest.raises(EngineRequestError, match="HTTP 400: busy"):
            await c.call("GET", "/get_server_info")
        assert hits == ["/get_server_info"]


async def test_pool_fails_over_then_backs_off_and_gives_up(caplog):
    caplog.set_level("WARNING", logger="slime_async.actors.engine.pool")
    status, hits_a, hits_b = {"code": 503}, [], []
    async with failing_server(status, hits_a) as a, failing_server(status, hits_b) as b:
        pool = EnginePool([a, b], max_retries=2, backoff_s=0.001, probe_interval_s=60)
        async with pool:
            # attempt 1 fails on one engine, attempt 2 on the other at once, attempt 3 finds none
            with pytest.raises(EngineError, match=r"no engine succeeded in 3 attempts.*HTTP 503"):
                await pool.generate([2], {"max_new_tokens": 1})
            assert (hits_a, hits_b) == (["/generate"], ["/generate"])
            assert pool.down == {a, b}
            assert pool.stats()["failures"] == {a: 1, b: 1} and pool.backoffs == 1
            assert caplog.text.count("is down (POST /generate") == 2
            assert "no engine is up; /generate again in" in caplog.text
        status["code"] = 400
        async with EnginePool([a], max_retries=2, backoff_s=0.001) as pool:
            with pytest.raises(EngineRequestError, match="HTTP 400"):
                await pool.generate([2], {"max_new_tokens": 1})
            assert hits_a == ["/generate"] * 2 and not pool.down  # a 4xx is not the engine's fault


async def test_extra_key_and_cache_salt_keep_cached_prefixes_apart(engine):
    """SGLang's radix cache keys prefixes by (extra_key, cache_salt): the same prompt under
    another key reports cached_tokens 0, under the same key the cached full blocks; a batch takes
    one key per prompt; malformed keys are refused naming the field (GenerateReqInput's rules)."""
    ids = [2] + [8 + (j * 5) % 53 for j in range(40)]  # 41 tokens: two full blocks of 16
    sp = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}

    async def cached(**fields):
        status, body = await _post(
            engine, "/generate", {"input_ids": ids, "sampling_params": sp, **fields}
        )
        assert status == 200, body
        return [
            b["meta_info"]["cached_tokens"] for b in (body if isinstance(body, list) else [body])
        ]

    assert await cached(extra_key="pk-a") == [0]
    assert await cached(extra_key="pk-b") == [0]
    assert await cached(extra_key="pk-a") == [32]
    assert await cached(extra_key="pk-a", cache_salt="salt") == [0]
    assert await cached(extra_key="pk-a", cache_salt="salt") == [32]
    assert await cached(input_ids=[ids, ids], extra_key=["pk-b", "pk-c"]) == [32, 0]
    # One key for the batch: the first takes pk-c's cached blocks, the second is its twin.
    assert await cached(input_ids=[ids, ids], extra_key="pk-c") == [32, 41]
    for bad, why in (
        (["pk-a"], "extra_key must be one string for a single prompt"),
        (7, "extra_key must be a string or a list of strings"),
    ):
        status, body = await _post(
            engine, "/generate", {"input_ids": ids, "sampling_params": sp, "extra_key": bad}
        )
        assert status == 400 and why in body["error"]["message"], body
    status, body = await _post(
        engine,
        "/generate",
        {"input_ids": [ids, ids], "sampling_params": sp, "cache_salt": ["a"]},
    )
    assert status == 400 and "cache_salt holds 1 keys for a batch of 2" in body["error"]["message"]
