"""The weight push against what SGLang 0.5.23 asks of it, on real embedded engines over loopback
(the test process is the learner's rank 0 of a gloo group): every update inside a
/begin_weight_update../end_weight_update session (strict engines refuse one outside), an older
server without the session routes, a refused begin, a member whose update call fails while the
learner broadcasts (the push stops at once instead of waiting out the group's timeout), engine
layouts the group does not cover, and the admin key on the control routes. Where a real server
would answer what the embedded engine does not, an `EngineProxy` in front of it answers instead.
"""

import asyncio
import logging
import time

import pytest
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.weight_push import EngineLayoutError, WeightPusher
from slime_async.metrics import names as M
from slime_async.models.toy import make_tiny_model
from tests.support.engine_proxy import EngineProxy
from tests.support.engine_util import push_config, start_engine, start_engines

STRICT = ("engine.embedded.max_context_len=512", "engine.embedded.strict_sglang=true")
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
UPDATE = "/update_weights_from_distributed"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def strict(model, logs):
    """Two strict engines, each behind a proxy (the pusher talks to the proxies)."""
    started = start_engines(2, model, logs, *STRICT)
    proxies = [EngineProxy(url).start() for _, url in started]
    try:
        yield proxies
    finally:
        for p in proxies:
            p.stop()
        for child, _ in started:
            child.stop()


@pytest.fixture()
def proxies(strict):
    for p in strict:
        p.answer.clear()
        p.rewrite.clear()
        p.requests.clear()
    return strict


def buckets(model_dir, scale: float = 1.0, per_bucket: int = 4):
    sd = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    items = [(n, t * scale) for n, t in sd.items()]
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


def pusher_for(urls, **push) -> WeightPusher:
    return WeightPusher(urls, push_config(**{"timeout_s": 60, **push}))


async def version_of(url: str, **kw) -> int:
    async with EngineClient(url, **kw) as c:
        return await c.get_weight_version()


async def server_info(url: str, **kw) -> dict:
    async with EngineClient(url, **kw) as c:
        return await c.get_server_info()


async def call(url: str, method: str, **kw):
    async with EngineClient(url, **kw) as c:
        return await getattr(c, method)()


def test_pushes_run_in_sessions_on_strict_engines(proxies, model):
    """Each push opens one session per engine before its first bucket and ends it after the
    last; a strict engine (like SGLang 0.5.23) refuses an update outside one."""
    pusher = pusher_for([p.url for p in proxies])
    try:
        for v in (1, 2, 3):
            stats = pusher.push(buckets(model), v)
            assert stats["failed"] == 0.0 and stats["buckets"] > 1
        m = pusher.metrics()
        assert m[M.PUSH_SESSIONS_OPENED] == 6 and m[M.PUSH_SESSIONS_ENDED] == 6
        assert m[M.PUSH_SESSIONS_SKIPPED] == 0 and m[M.PUSH_SESSION_END_FAILURES] == 0
        for p in proxies:
            paths = [
                path for _, path, _ in p.requests if path.startswith(("/begin", "/end", UPDATE))
            ]
            per_push = ["/begin_weight_update"] + [UPDATE] * int(stats["buckets"])
            assert paths == [*per_push, "/end_weight_update"] * 3
            assert asyncio.run(version_of(p.url)) == 3
            info = asyncio.run(server_info(p.url))
            assert info["weight_update_session"] is False  # every session was ended
    finally:
        pusher.close()


def test_a_session_left_open_is_ended_and_begun_again(proxies, model, caplog):
    """A learner that died in a push leaves its session open (SGLang then refuses begin:
    "already open"): the next push ends it, begins again and goes through."""
    asyncio.run(call(proxies[0].url, "begin_weight_update"))
    pusher = pusher_for([p.url for p in proxies])
    try:
        with caplog.at_level(logging.WARNING):
            assert pusher.push(buckets(model), 5)["failed"] == 0.0
        assert f"engine {proxies[0].url} already holds an open weight-update session" in caplog.text
        m = pusher.metrics()
        assert m[M.PUSH_SESSIONS_RECLAIMED] == 1 and m[M.PUSH_SESSIONS_OPENED] == 2
        assert asyncio.run(server_info(proxies[0].url))["weight_update_session"] is False
    finally:
        pusher.close()


def test_a_refused_begin_fails_the_push_before_any_broadcast(proxies, model, caplog):
    proxies[1].answer["/begin_weight_update"] = (
        400,
        {"success": False, "message": "weight cache busy"},
    )
    pusher = pusher_for([p.url for p in proxies])
    try:
        pusher.connect()
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR):
            stats = pusher.push(buckets(model), 11)
        assert stats["failed"] == 1.0 and time.monotonic() - t0 < 20
        assert "begin_weight_update" in caplog.text and proxies[1].url in caplog.text
        assert "weight cache busy" in caplog.text
        assert not proxies[0].calls(UPDATE) and not proxies[1].calls(UPDATE)
        assert len(proxies[0].calls("/end_weight_update")) == 1  # the session it opened
        assert pusher.resync_needed()
        proxies[1].answer.clear()
        assert pusher.push(buckets(model), 12)["failed"] == 0.0
        assert [asyncio.run(version_of(p.url)) for p in proxies] == [12, 12]
    finally:
        pusher.close()


def test_an_update_that_fails_mid_broadcast_stops_the_push_at_once(proxies, model, caplog):
    """The second engine's update call is answered 400 without reaching it (it never joins the
    broadcast): the push fails within seconds naming it and the bucket, not after the group's
    timeout; the other engine's session is ended; the next push rebuilds and succeeds."""
    proxies[1].answer[UPDATE] = (400, {"success": False, "message": "not in a session"})
    pusher = pusher_for([p.url for p in proxies], timeout_s=120)
    try:
        pusher.connect()
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR):
            stats = pusher.push(buckets(model, 2.0), 21)
        took = time.monotonic() - t0
        assert stats["failed"] == 1.0
        assert took < 20, f"the push took {took:.0f}s: it waited for the group instead of stopping"
        assert (
            f"update_weights_from_distributed of bucket 1, engine {proxies[1].url}" in caplog.text
        )
        assert "not in a session" in caplog.text
        m = pusher.metrics()
        assert m[M.PUSH_STOPPED_BROADCASTS] == 1 and m[M.PUSH_SESSION_END_FAILURES] == 0
        assert len(proxies[0].calls("/end_weight_update")) == 1
        assert pusher.resync_needed()
        proxies[1].answer.clear()
        stats = pusher.push(buckets(model), 22)
        assert stats["failed"] == 0.0
        assert [asyncio.run(version_of(p.url)) for p in proxies] == [22, 22]
    finally:
        pusher.close()


@pytest.fixture(scope="module")
def lenient(model, logs):
    """One engine that is not strict (it takes updates outside a session, as SGLang before the
    session feature did), behind a proxy."""
    child, url = start_engine(model, logs, "engine.embedded.max_context_len=512")
    proxy = EngineProxy(url).start()
    try:
        yield proxy
    finally:
        proxy.stop()
        child.stop()


def test_an_older_server_without_sessions_is_pushed_to_without_them(lenient, model, caplog):
    lenient.requests.clear()
    lenient.answer["/begin_weight_update"] = (404, {"detail": "Not Found"})
    lenient.answer["/end_weight_update"] = (404, {"detail": "Not Found"})
    pusher = pusher_for([lenient.url])
    try:
        with caplog.at_level(logging.WARNING):
            for v in (31, 32):
                assert pusher.push(buckets(model), v)["failed"] == 0.0
        assert caplog.text.count("has no /begin_weight_update (404") == 1
        assert lenient.url in caplog.text
        m = pusher.metrics()
        assert m[M.PUSH_SESSIONS_SKIPPED] == 2 and m[M.PUSH_SESSIONS_OPENED] == 0
        assert len(lenient.calls("/begin_weight_update")) == 1  # asked once, then known
        assert not lenient.calls("/end_weight_update")
        assert asyncio.run(version_of(lenient.url)) == 32
    finally:
        pusher.close()
        lenient.answer.clear()


@pytest.mark.parametrize(
    "fields, layout",
    [
        ({"pp_size": 2}, "tp_size=1, pp_size=2, dp_size=1"),
        ({"dp_size": 2}, "tp_size=1, pp_size=1, dp_size=2"),
        ({"dp_size": 2, "attn_dp_size": 2}, "tp_size=1, pp_size=1, dp_size=2, attn_dp_size=2"),
    ],
)
def test_a_layout_the_group_does_not_cover_is_refused_at_connect(lenient, fields, layout):
    lenient.requests.clear()
    lenient.rewrite["/server_info"] = lambda body: {**body, **fields}
    pusher = pusher_for([lenient.url])
    try:
        with pytest.raises(
            EngineLayoutError, match=rf"engine {lenient.url}: refused.*\({layout}\)"
        ):
            pusher.connect()
        with pytest.raises(EngineLayoutError):  # a push does not swallow it either
            pusher.push([], 41)
        assert pusher.metrics()[M.PUSH_ENGINES_REFUSED] >= 1
        assert not lenient.calls("/init_weights_update_group")
    finally:
        pusher.close()
        lenient.rewrite.clear()
        lenient.requests.clear()


@pytest.mark.parametrize(
    "fields",
    [
        {"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True},  # SGLang 0.5.23
        {"dp_size": 2, "enable_dp_attention": True},  # the deprecated spelling (older servers)
    ],
)
def test_attention_dp_adds_no_ranks(lenient, model, fields):
    """Attention DP lives inside the TP ranks: one replica, tp_size ranks; the push goes
    through. 0.5.23 reports its width as attn_dp_size; an older server as dp_size with
    enable_dp_attention (no attn_dp_size field)."""

    def rewrite(body):
        body = {k: v for k, v in body.items() if k != "attn_dp_size"}
        return {**body, **fields}

    lenient.rewrite["/server_info"] = rewrite
    pusher = pusher_for([lenient.url])
    try:
        assert pusher.push(buckets(model), 42)["failed"] == 0.0
        assert pusher.ranks == {lenient.url: 1}
    finally:
        pusher.close()
        lenient.rewrite.clear()


def test_control_calls_carry_the_admin_key(model, logs):
    """An engine with both keys (SGLang's --api-key and --admin-api-key) takes only the admin key
    on the admin routes: the pusher sends it there and the api key elsewhere; /generate takes
    the api key. A pusher without the admin key is refused."""
    child, url = start_engine(model, logs, *STRICT, "engine.admin_api_key=adm1n", api_key="us3r")
    try:
        with EngineProxy(url) as proxy:
            keyed = WeightPusher(
                [proxy.url],
                push_config(timeout_s=60),
                api_key="us3r",
                admin_api_key="adm1n",
            )
            try:
                assert keyed.push(buckets(model), 51)["failed"] == 0.0
            finally:
                keyed.close()
            sent = {path: auth for _, path, auth in proxy.requests}
            for path in (
                "/init_weights_update_group",
                "/pause_generation",
                "/flush_cache",
                "/begin_weight_update",
                UPDATE,
                "/end_weight_update",
                "/continue_generation",
                "/destroy_weights_update_group",
            ):
                assert sent[path] == "Bearer adm1n", path
            assert sent["/model_info"] == sent["/server_info"] == "Bearer us3r"
            assert asyncio.run(version_of(url, api_key="us3r")) == 51

            async def generate():
                async with EngineClient(url, api_key="us3r", admin_api_key="adm1n") as c:
                    return await c.generate([2, 5, 6], GREEDY)

            assert len(asyncio.run(generate()).token_ids) == 4

            plain = WeightPusher([proxy.url], push_config(timeout_s=60), api_key="us3r")
            try:
                assert plain.push(buckets(model), 52)["failed"] == 1.0  # 401 on the admin routes
            finally:
                plain.close()
            assert asyncio.run(version_of(url, api_key="us3r")) == 51
    finally:
        child.stop()
