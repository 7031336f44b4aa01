"""The project's real requests checked against SGLang's released wheel: every request the engine
client, the pool, the liveness probe and the learner's weight pusher send is captured by a
recording proxy (tests/support/sglang_capture.py) in front of a real strict embedded engine, then
checked by the wheel's route table and request structs (tests/support/sglang_wheel.py): the
route exists with that method, every body field is a field of the handler's struct, required
fields are there, every `sampling_params` key is a SamplingParams field, the auth level is noted.

Nothing here lists the request bodies: what the code sends is what is checked, so a request or a
field added later is checked once it is sent. The routes the project uses are listed once, in
tests/support/sglang_rules.py (docs/sglang.md's table is generated from it); a captured route not
listed there, or a listed one that no code path sent, fails. The static half (the parsers, the
checker on misspelt fields, the behaviour rules, the docs' tables) is
tests/unit/engine/test_sglang_wheel.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient, EngineRequestError
from slime_async.actors.engine.health import EngineProbe
from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.actors.generator.rollout import sampling_params
from slime_async.config import SamplingConfig
from slime_async.config.engine import LivenessConfig
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import push_config, start_engine
from tests.support.sglang_capture import RecordingProxy
from tests.support.sglang_rules import PROJECT_ROUTES, RULES, ProjectRoute
from tests.support.sglang_wheel import SGLangAPI, api_or_skip, check_request

KEY = "conformance-key"
STRICT = ("engine.embedded.max_context_len=1200", "engine.embedded.strict_sglang=true")
OLDER = {"/ready", "/model_info", "/server_info"}
"""Routes the second proxy answers 404, as an older server or a router would: the fall-backs run."""
PROMPT = [2, 9, 10, 11]


@pytest.fixture(scope="module")
def api() -> SGLangAPI:
    return api_or_skip()


async def drive_client(url: str, model_dir: str) -> None:
    """The client's and the pool's calls, as the generators and the learner make them."""
    params = sampling_params(None, SamplingConfig(max_new_tokens=3))  # the generators' params
    async with EnginePool([url], api_key=KEY, liveness=LivenessConfig()) as pool:
        await pool.generate(PROMPT, params, rid="capture-pool")
    async with EngineClient(url, KEY) as c:
        await c.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0}, rid="capture-1")
        c.return_routed_experts = True  # routing replay; a dense model refuses it (400)
        with pytest.raises(EngineRequestError):
            await c.generate(PROMPT, params, rid="capture-2", routed_start=2)
        c.return_routed_experts = False
        assert await c.health() and await c.health_generate()
        await c.get_model_info()
        await c.get_server_info()
        await c.get_weight_version()
        await c.update_weight_version("3")
        await c.abort(rid="capture-none")
        await c.abort(abort_all=True)
        await c.pause_generation("retract")
        assert await c.flush_cache()
        await c.continue_generation()
        await c.update_weights_from_disk(model_dir, weight_version=4)
        assert (await EngineProbe(c, LivenessConfig()).once()).ready


async def drive_older(url: str) -> None:
    """The fall-backs, against a server without /ready, /model_info and /server_info."""
    async with EngineClient(url, KEY) as c:
        probe = EngineProbe(c, LivenessConfig())
        answer = await probe.once()
        assert (answer.path, answer.ready) == ("/health", True)
        await c.get_server_info()
        # The strict engine, as 0.5.23, has no /get_weight_version (404): the request is
        # captured (an older server's route, checked as absent from the wheel) and refused.
        with pytest.raises(EngineRequestError, match="404"):
            await c.get_weight_version()


def buckets_of(model_dir) -> list[list[tuple[str, torch.Tensor]]]:
    sd = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    items = list(sd.items())
    return [items[i : i + 8] for i in range(0, len(items), 8)]


@pytest.fixture(scope="module")
def captured(api, tmp_path_factory):
    """Every request of one session of client calls, a weight push and the fall-backs."""
    root = tmp_path_factory.mktemp("conformance")
    v0 = make_tiny_model(root / "v0", seed=1, family="qwen3", max_position_embeddings=2048)
    v1 = make_tiny_model(root / "v1", seed=2, family="qwen3", max_position_embeddings=2048)
    child, url = start_engine(v0, root, *STRICT, api_key=KEY)
    try:
        with RecordingProxy(url) as proxy, RecordingProxy(url, refuse=OLDER) as older:
            asyncio.run(drive_client(proxy.url, str(v1)))
            asyncio.run(drive_older(older.url))
            pusher = WeightPusher(
                [proxy.url], push_config(timeout_s=60), api_key=KEY, state_path=root / "g.json"
            )
            try:
                pusher.connect()
                stats = pusher.push(buckets_of(v0), 5)
            finally:
                pusher.close()
            assert stats["failed"] == 0.0, stats
            return proxy.captured + older.captured
    finally:
        child.stop()


def test_every_captured_route_is_listed_and_every_listed_one_sent(api, captured):
    sent = {(c.method, c.path) for c in captured}
    listed = {(r.method, r.path) for r in PROJECT_ROUTES}
    unlisted = sorted(f"{m} {p}" for m, p in sent - listed)
    verdicts = [
        p
        for c in captured
        if (c.method, c.path) not in listed
        for p in check_request(api, c).problems
    ]
    assert not unlisted, (
        f"the project sends {unlisted}, not listed in tests/support/sglang_rules.py "
        "PROJECT_ROUTES (docs/sglang.md's table): add it (sender, method) and regenerate the docs. "
        f"The wheel's verdict on those requests: {list(dict.fromkeys(verdicts)) or 'they fit'}"
    )
    unsent = sorted(f"{m} {p}" for m, p in listed - sent)
    assert not unsent, f"PROJECT_ROUTES lists {unsent}, which no code path here sent"


KNOWN = {
    # (method, path): why today's code fails the check; strict, so the fix is noticed.
}


def route_params() -> list:
    return [
        pytest.param(
            r,
            id=f"{r.method} {r.path}",
            marks=[pytest.mark.xfail(strict=True, reason=why)]
            if (why := KNOWN.get((r.method, r.path)))
            else [],
        )
        for r in PROJECT_ROUTES
    ]


@pytest.mark.parametrize("route", route_params())
def test_each_request_fits_the_wheel(api, captured, route: ProjectRoute):
    reqs = [c for c in captured if (c.method, c.path) == (route.method, route.path)]
    assert reqs, f"{route.method} {route.path} was not sent"
    problems: dict[str, None] = {}
    notes: dict[str, None] = {}
    for req in reqs:
        verdict = check_request(api, req)
        problems.update(dict.fromkeys(verdict.problems))
        notes.update(dict.fromkeys(verdict.notes))
    print("\n".join(notes))
    if route.older_only:
        assert list(problems) == [
            f"{route.method} {route.path}: SGLang {api.version} has no route {route.path}"
        ], "an older server's route: expected absent from the wheel"
        return
    assert not problems, "\n".join(problems)


def test_weight_updates_run_inside_a_weight_update_session(api, captured):
    """Rule (a): SGLang 0.5.23 refuses /update_weights_from_distributed outside
    /begin_weight_update .. /end_weight_update (400, the engine never joins the broadcast)."""
    rule = next(r for r in RULES if r.key == "a")
    in_session, outside = False, 0  # one engine behind both proxies
    for req in captured:
        if req.path in ("/begin_weight_update", "/end_weight_update"):
            in_session = req.path == "/begin_weight_update"
        elif req.path == "/update_weights_from_distributed" and not in_session:
            outside += 1
    assert outside == 0, (
        f"{outside} POST /update_weights_from_distributed sent outside a weight-update "
        f"session; SGLang {api.version} answers 400 ({rule.file}: {rule.locator!r})"
    )
