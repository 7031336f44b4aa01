"""The embedded engine behaves as SGLang 0.5.23 where a client written for SGLang depends on it
field by field: n > 1 with one prefill, SSE streaming, prompt
log-probs and max_new_tokens = 0, top_logprobs_num, text input, sampling_seed,
spaces_between_special_tokens, unknown top-level keys ignored, string versions, 5xx on engine
errors, min_new_tokens, /abort_request {}, behaviour log-probs before top-k/top-p, and the rank
layout read from /server_info with dp_size."""

import asyncio
import json
import logging

import aiohttp
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.actors.engine.embedded.server import EmbeddedEngine, serve, version_spans
from slime_async.actors.engine.weight_push import PushError, WeightPusher, engine_ranks
from slime_async.config import ConfigError, EngineConfig, load_config
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import push_config, start_engine

PROMPT = [2, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("model"), family="qwen3", seed=5, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("model2"), family="qwen3", seed=6, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    child, url = start_engine(
        model_dir, tmp_path_factory.mktemp("logs"), "engine.embedded.max_context_len=512"
    )
    try:
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


async def _post(url, path, body):
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()


async def _generate(url, body):
    status, raw = await _post(url, "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


async def _info(url):
    async with EngineClient(url) as c:
        return await c.get_server_info()


def _hf_logp(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of HF at every position: [len(ids), V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, -1)


async def test_n_samples_share_one_prefill(engine):
    before = (await _info(engine))["prefill_tokens"]
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    out = await _generate(engine, body)
    assert isinstance(out, list) and len(out) == 3  # SGLang answers a list of n results
    assert len({tuple(o["output_ids"]) for o in out}) == 1  # greedy: the same n times
    assert (await _info(engine))["prefill_tokens"] - before == len(PROMPT)  # prefilled once
    # Two prompts x n = 2: four results, each prompt's samples one after the other.
    body = {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"n": 2, "max_new_tokens": 2}}
    out = await _generate(engine, body)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 5, 3, 3]


async def test_stream_is_sse_with_cumulative_chunks_then_done(engine):
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as s, s.post(engine + "/generate", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 5  # cumulative
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5
    whole = await _generate(engine, {**body, "stream": False})
    assert whole["output_ids"] == chunks[-1]["output_ids"]


async def test_prompt_logprobs_and_max_new_tokens_zero(engine, hf):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0},
    }
    out = await _generate(engine, body)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == PROMPT and got[0][0] is None  # the first has no context
    ref = _hf_logp(hf, PROMPT)
    for i in range(1, len(PROMPT)):
        assert got[i][0] == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
    # From logprob_start_len on, and alongside generated tokens.
    body = {**body, "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 2}}
    out = await _generate(engine, body)
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == PROMPT[2:]
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


async def test_top_logprobs_num_and_text_in_logprobs(engine, hf):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    meta = (await _generate(engine, body))["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    for top, (lp, tok, text) in zip(tops, meta["output_token_logprobs"], strict=True):
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-6)  # greedy: the best
        assert isinstance(text, str)


async def test_text_input_goes_through_the_models_tokenizer(engine, model_dir):
    tok = load_tokenizer(model_dir)
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    by_text = await _generate(engine, {"text": "12+3=", "sampling_params": params})
    ids = list(tok.encode("12+3="))
    by_ids = await _generate(engine, {"input_ids": ids, "sampling_params": params})
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)


async def test_sampling_seed_and_spaces_between_special_tokens(engine):
    params = {
        "max_new_tokens": 8,
        "temperature": 1.0,
        "sampling_seed": 1234,
        "ignore_eos": True,
        "spaces_between_special_tokens": False,
    }
    # The same seed gives the same tokens, alone or among other requests.
    alone = await _generate(engine, {"input_ids": PROMPT, "sampling_params": params})
    noise = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    crowd = await asyncio.gather(
        _generate(engine, {"input_ids": PROMPT, "sampling_params": params}),
        *(_generate(engine, {"input_ids": PROMPT, "sampling_params": noise}) for _ in range(3)),
    )
    assert crowd[0]["output_ids"] == alone["output_ids"]


async def test_unknown_top_level_keys_are_logged_and_ignored(engine):
    before = (await _info(engine))["ignored_fields"]
    out = await _generate(
        engine,
        {
            "input_ids": PROMPT,
            "frobnicate": 1,
            "bootstrap_room": 3,
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert len(out["output_ids"]) <= 2
    assert (await _info(engine))["ignored_fields"] == before + 1
    # Unknown sampling_params keys stay refused, as SGLang refuses them.
    status, raw = await _post(
        engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"warp": 1}}
    )
    assert status == 400 and b"warp" in raw


async def test_string_versions_and_weight_calls_answer_as_sglang(engine, other_model, model_dir):
    async with EngineClient(engine) as c:
        status, raw = await _post(engine, "/update_weight_version", {"new_version": "v-abc"})
        assert status == 200 and json.loads(raw)["new_version"] == "v-abc"
        info = await c.call("GET", "/model_info")
        assert info["weight_version"] == "v-abc"
        out = await _generate(
            engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        )
        assert out["meta_info"]["weight_version"] == "v-abc"
        # A bad path: success false, 400, the version untouched (applied only on success).
        status, raw = await _post(
            engine,
            "/update_weights_from_disk",
            {"model_path": "/nonexistent", "weight_version": "bad"},
        )
        body = json.loads(raw)
        assert status == 400 and body["success"] is False and "num_paused_requests" in body
        assert (await c.call("GET", "/model_info"))["weight_version"] == "v-abc"
        status, raw = await _post(
            engine,
            "/update_weights_from_disk",
            {"model_path": str(other_model), "weight_version": "step-7"},
        )
        assert status == 200 and json.loads(raw)["success"] is True
        assert (await c.call("GET", "/get_weight_version"))["weight_version"] == "step-7"
        await c.update_weights_from_disk(str(model_dir), weight_version="default")  # back
        # /abort_request {} is 200, as SGLang.
        assert (await _post(engine, "/abort_request", {}))[0] == 200


async def test_min_new_tokens_does_not_crash_the_step(engine):
    """It did: an in-place write on an inference tensor aborted EVERY running request."""
    others = [
        asyncio.create_task(
            _generate(
                engine,
                {
                    "input_ids": PROMPT[:3],
                    "sampling_params": {"max_new_tokens": 30, "ignore_eos": True},
                },
            )
        )
        for _ in range(2)
    ]
    out = await _generate(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 20,
                "min_new_tokens": 10,
                "stop_token_ids": list(range(3, 120)),
            },
        },
    )
    assert len(out["output_ids"]) >= 10 and out["meta_info"]["finish_reason"]["type"] != "abort"
    for o in await asyncio.gather(*others):
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 30}


async def test_behaviour_logprobs_are_full_vocab_log_softmax_before_top_k_top_p(engine, hf):
    """Found 6: the engine reports log_softmax(logits / T) before filtering, as SGLang does."""
    params = {"max_new_tokens": 8, "temperature": 0.7, "top_k": 3, "top_p": 0.9, "ignore_eos": True}
    out = await _generate(
        engine, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": params}
    )
    ids = PROMPT + out["output_ids"]
    ref = _hf_logp(hf, ids, 0.7)
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(ref[len(PROMPT) - 1 + i, tok].item(), abs=1e-4)
    # Greedy reports at T = 1.0.
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = await _generate(
        engine, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": params}
    )
    ref = _hf_logp(hf, PROMPT + out["output_ids"], 1.0)
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(ref[len(PROMPT) - 1 + i, tok].item(), abs=1e-4)


async def test_engine_errors_are_5xx_and_the_server_serves_on(model_dir, caplog):
    eng = EmbeddedEngine(
        EngineConfig(model_path=str(model_dir), port=0, embedded={"device": "cpu"})
    )
    runner, url = await serve(eng, "127.0.0.1", 0)
    real = eng.runner.decode
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in decode")
        return real(*a, **k)

    eng.runner.decode = flaky
    try:
        params = {"max_new_tokens": 5, "ignore_eos": True}
        async with EngineClient(url, max_retries=0) as c:
            with caplog.at_level(logging.ERROR), pytest.raises(EngineError) as err:
                await c.generate(PROMPT, params)
            assert err.value.status == 500 and "boom in decode" in str(err.value)
            out = await c.generate(PROMPT, params)  # the next request is served
            assert len(out.token_ids) == 5
    finally:
        await runner.cleanup()


async def test_rank_layout_from_server_info_with_the_old_route_as_fallback():
    """Ranks as SGLang numbers them (rank_offset + tp_rank; tests/unit/engine/test_push_rules.py
    has the refused layouts), read from /server_info, or /get_server_info where that is missing."""
    assert engine_ranks("http://e", {"tp_size": 2}) == 2
    assert engine_ranks("http://e", {}) == 1
    seen = []

    async def info(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/server_info" and request.host.endswith(str(ports[1])):
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"tp_size": 3, "dp_size": 1})

    runners, ports = [], []
    for _ in range(2):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", info)
        r = web.AppRunner(app)
        await r.setup()
        site = web.TCPSite(r, "127.0.0.1", 0)
        await site.start()
        runners.append(r)
        ports.append(site._server.sockets[0].getsockname()[1])
    p = WeightPusher([f"http://127.0.0.1:{q}" for q in ports], push_config())
    try:
        ranks = await asyncio.to_thread(p._ranks, p.urls)
    finally:
        await asyncio.to_thread(p.close)
        for r in runners:
            await r.cleanup()
    assert ranks == [3, 3]
    assert "/server_info" in seen and "/get_server_info" in seen  # the old route as fallback


def test_version_spans_follow_sglang():
    assert version_spans(["1", "1", "2"], "2") == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 3},
    ]
    assert version_spans([], "7") == [{"version": "7", "start": 0, "end": 0}]


async def test_handshake_failure_names_the_engine_at_once():
    """An engine that cannot join (e.g. the store address is unreachable from its node) ends
    the learner's wait at once with its URL and the step; no silent 300 s."""

    async def fake(request: web.Request) -> web.Response:
        if request.path == "/model_info":
            return web.json_response({"weight_version": "default"})
        if request.path == "/init_weights_update_group":
            return web.json_response(
                {"success": False, "message": "connect to 10.9.9.9 timed out"}, status=400
            )
        return web.json_response({"tp_size": 1})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    p = WeightPusher([url], push_config(timeout_s=300))
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(PushError, match=r"step init_weights_update_group, engine http://127"):
            await asyncio.to_thread(p.connect)
        assert asyncio.get_running_loop().time() - t0 < 30
    finally:
        await asyncio.to_thread(p.close)
        await runner.cleanup()


def test_embedded_only_keys_refused_with_external_engines():
    with pytest.raises(
        ConfigError, match=r"engine\.embedded\.strict_sglang: only the embedded engine"
    ):
        load_config([], ["engine.kind=external", "engine.embedded.strict_sglang=true"])


async def test_flush_is_polled_until_200_and_its_timeout_is_named():
    answers = {"n": 0}

    async def flush(request: web.Request) -> web.Response:
        answers["n"] += 1
        ok = answers["ok_after"] is not None and answers["n"] > answers["ok_after"]
        return web.Response(
            text="Cache flushed.\n" if ok else "not flushed\n", status=200 if ok else 400
        )

    async def serve_flush(ok_after):
        app = web.Application()
        answers["ok_after"], answers["n"] = ok_after, 0
        app.router.add_route("*", "/flush_cache", flush)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    runner, url = await serve_flush(ok_after=3)  # refused three times, then flushed
    p = WeightPusher([url], push_config(flush_timeout_s=20))
    try:
        await asyncio.to_thread(p._flush, [url])
        assert answers["n"] == 4 and p.counters["flush_polls"] == 3
    finally:
        await asyncio.to_thread(p.close)
        await runner.cleanup()
    runner, url = await serve_flush(ok_after=None)  # never flushed
    p = WeightPusher([url], push_config(flush_timeout_s=0.5))
    try:
        with pytest.raises(
            PushError, match=r"step flush_cache, engine http://127.*flush_timeout_s"
        ):
            await asyncio.to_thread(p._flush, [url])
    finally:
        await asyncio.to_thread(p.close)
        await runner.cleanup()
