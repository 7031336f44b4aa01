"""The liveness probes of running engines (`actors/engine/health.py`) and the pool's use of them,
against real HTTP servers on loopback that behave like SGLang 0.5.23: a /health that takes more
than a second (a one-token generation), a /ready that answers at once (503 while paused), and an
engine that stops answering while its port stays open (a SIGSTOPped process)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import web

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.health import EngineWatch
from slime_async.actors.engine.pool import EnginePool
from slime_async.config import ConfigError, load_config
from slime_async.config.engine import LivenessConfig

FAST = LivenessConfig(
    probe_interval_s=0.1, ready_timeout_s=0.3, health_timeout_s=5.0, hung_after_s=0.6
)
"""Probes every 0.1 s, hung after 0.6 s: the loopback servers here answer in milliseconds."""

GENERATED = {
    "text": "a",
    "output_ids": [7],
    "meta_info": {
        "finish_reason": {"type": "length"},
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, 7, None]],
    },
}


class FakeSGLang:
    """An HTTP server with SGLang's probe routes; `mode` switches how it behaves."""

    def __init__(self, ready_route: bool, health_s: float = 0.0, info_route: bool = True):
        self.ready_route = ready_route
        self.info_route = info_route
        """Whether it answers GET /model_info (sglang-router does not: 404)."""
        self.health_s = health_s
        self.mode = "ok"  # ok | fail (5xx on /generate) | paused (/ready 503) | hung (no answers)
        self.version = 0
        """The weight version it serves (/generate and /model_info)."""
        self.hits: list[str] = []
        self.url = ""
        self._resume = asyncio.Event()

    def wake(self) -> None:
        """A hung server answers again (SIGCONT)."""
        self.mode = "ok"
        self._resume.set()
        self._resume = asyncio.Event()

    async def _hang_if_hung(self) -> None:
        if self.mode == "hung":
            await self._resume.wait()

    async def ready(self, request: web.Request) -> web.Response:
        self.hits.append("/ready")
        await self._hang_if_hung()
        if not self.ready_route:
            return web.Response(status=404)
        return web.Response(status=503 if self.mode == "paused" else 200)

    async def health(self, request: web.Request) -> web.Response:
        self.hits.append("/health")
        await self._hang_if_hung()
        await asyncio.sleep(self.health_s)  # SGLang: a one-token generation, >= 1 s
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.Response:
        self.hits.append("/generate")
        await self._hang_if_hung()
        if self.mode == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        meta = {**GENERATED["meta_info"], "weight_version": str(self.version)}
        return web.json_response({**GENERATED, "meta_info": meta})

    async def model_info(self, request: web.Request) -> web.Response:
        self.hits.append("/model_info")
        await self._hang_if_hung()
        if not self.info_route:
            return web.Response(status=404)
        return web.json_response({"weight_version": str(self.version)})

    @contextlib.asynccontextmanager
    async def serve(self):
        app = web.Application()
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/health", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/model_info", self.model_info)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            self.wake()
            await runner.cleanup()


async def _until(pred, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_an_engine_whose_health_takes_over_a_second_comes_back(caplog):
    """SGLang's /health answers no sooner than 1 s and an older server has no /ready: a probe of
    /health with a 1 s timeout never succeeds there, so a down engine must be probed with more."""
    caplog.set_level("INFO", logger="slime_async.actors.engine")
    async with FakeSGLang(ready_route=False, health_s=1.3).serve() as eng:
        eng.mode = "fail"
        async with EnginePool(
            [eng.url], max_retries=0, backoff_s=0.01, probe_interval_s=0.2
        ) as pool:
            with pytest.raises(Exception, match="HTTP 500"):
                await pool.generate([1], {"max_new_tokens": 1})
            assert eng.url in pool.down
            eng.mode = "ok"
            await _until(lambda: eng.url not in pool.down, 15, "the engine to be marked up")
            assert (await pool.generate([1], {"max_new_tokens": 1})).token_ids == [7]
        # /ready was asked once, found missing, and /health is probed from then on.
        assert eng.hits.count("/ready") == 1 and "/health" in eng.hits
        assert "has no GET /ready (HTTP 404): probing GET /health" in caplog.text
        assert pool.stats()["liveness"]["back"] >= 1


async def test_ready_503_while_paused_is_alive_not_down():
    async with FakeSGLang(ready_route=True).serve() as eng:
        watch = EngineWatch({eng.url: EngineClient(eng.url)}, FAST, "test")
        eng.mode = "paused"
        watch.start()
        try:
            await _until(lambda: eng.hits.count("/ready") >= 10, 10, "ten probes")
            assert watch.state(eng.url) == "up"  # a weight push pauses it: not an outage
            assert watch.counts == {"hung": 0, "down": 0, "back": 0}
            assert "/health" not in eng.hits  # /ready exists (503 is an answer)
        finally:
            await watch.stop()
            await watch.engines[eng.url].probe.client.close()


async def test_a_hung_engine_is_reported_its_requests_go_elsewhere_and_it_comes_back(caplog):
    """An engine that stops answering with its port open (SIGSTOP): reported hung within
    hung_after_s with its URL and what timed out, counted, marked down; the request in flight
    there is given up and answered by the other engine; after it answers again it is used again."""
    caplog.set_level("INFO", logger="slime_async.actors.engine")
    async with (
        FakeSGLang(ready_route=True).serve() as a,
        FakeSGLang(ready_route=True).serve() as b,
    ):
        pool = EnginePool([a.url, b.url], max_retries=3, backoff_s=0.01, liveness=FAST, seed=0)
        async with pool:
            b.mode = "hung"
            pool.in_flight[a.url] += 100  # the first request goes to b, the hung one
            out = await asyncio.wait_for(pool.generate([1], {"max_new_tokens": 1}), 10)
            pool.in_flight[a.url] -= 100
            assert out.engine_url == a.url
            assert pool.down == {b.url}
            assert pool.hung_cancelled == 1 and pool.failures[b.url] == 1
            stats = pool.stats()
            assert stats["liveness"]["hung"] == 1
            assert f"engine {b.url} is hung: no answer to any probe" in caplog.text
            assert "GET /ready: no answer in 0.3s" in caplog.text
            b.wake()
            await _until(lambda: b.url not in pool.down, 10, "the engine to be back")
            assert f"engine {b.url} is back: GET /ready answered 200 (it was hung" in caplog.text
            assert pool.stats()["liveness"]["back"] == 1


async def test_an_engine_behind_the_learner_stays_out_while_its_probes_say_up(caplog):
    """An engine behind the learner's version answers its liveness probes (the watch keeps it up),
    yet the pool leaves it out until /model_info reports the version; when it also fails and
    comes back meanwhile, the watch's "back" does not put it back in use early."""
    caplog.set_level("INFO", logger="slime_async.actors.engine")
    async with (
        FakeSGLang(ready_route=True).serve() as a,
        FakeSGLang(ready_route=True).serve() as b,
    ):
        a.version = 3
        pool = EnginePool([a.url, b.url], max_retries=3, backoff_s=0.01, liveness=FAST, seed=0)
        pool.min_version = lambda: 3
        async with pool:
            pool.in_flight[a.url] += 100  # the first request goes to b, the one behind
            out = await asyncio.wait_for(pool.generate([1], {"max_new_tokens": 1}), 10)
            pool.in_flight[a.url] -= 100
            assert out.engine_url == a.url and out.versions == [3]
            assert pool.stats()["behind"] == {a.url: 0, b.url: 1}
            assert "serves weights of version 0, behind the learner's 3" in caplog.text
            # It fails, and its probes find it ready again: up for the watch, still behind.
            b.mode = "fail"
            pool.watch.mark_down(b.url, "HTTP 500")
            b.mode = "ok"
            await _until(lambda: pool.watch.state(b.url) == "up", 10, "the watch to see it up")
            await _until(lambda: b.hits.count("/model_info") >= 3, 10, "version checks")
            assert pool.down == {b.url}
            outs = [await pool.generate([1], {"max_new_tokens": 1}) for _ in range(4)]
            assert {o.engine_url for o in outs} == {a.url}
            b.version = 3
            await _until(lambda: b.url not in pool.down, 10, "the engine to serve version 3")
            assert f"engine {b.url} serves version 3: used again" in caplog.text
            assert pool.stats()["down"] == []


async def test_engines_behind_a_router_are_watched_and_reported():
    async with (
        FakeSGLang(ready_route=False).serve() as router,
        FakeSGLang(ready_route=True).serve() as engine,
    ):
        pool = EnginePool([router.url], liveness=FAST, watch_urls=[engine.url])
        async with pool:
            engine.mode = "hung"
            await _until(lambda: pool.stats()["watched"][engine.url] == "hung", 10, "hung")
            assert pool.down == set()  # requests still go to the router
            assert pool.stats()["liveness"]["hung"] == 1


async def test_a_router_behind_the_learner_is_used_again_once_one_engine_catches_up(caplog):
    """sglang-router answers no /model_info: the engines behind it are asked for their versions,
    and the router is used again once one that is up serves the learner's version. Waiting for
    every one deadlocked a run: an engine that came back after missing pushes is updated only by
    the learner's next push, and that push waits for this generator's answers."""
    caplog.set_level("INFO", logger="slime_async.actors.engine")
    async with (
        FakeSGLang(ready_route=False, info_route=False).serve() as router,
        FakeSGLang(ready_route=True).serve() as a,
        FakeSGLang(ready_route=True).serve() as b,
    ):
        pool = EnginePool(
            [router.url], max_retries=0, liveness=FAST, watch_urls=[a.url, b.url], seed=0
        )
        pool.min_version = lambda: 3
        async with pool:
            with pytest.raises(Exception, match="version 0, behind the learner's 3"):
                await pool.generate([1], {"max_new_tokens": 1})
            assert pool.down == {router.url} and pool.stats()["behind"] == {router.url: 1}
            await _until(lambda: a.hits.count("/model_info") >= 2, 10, "version checks")
            assert pool.down == {router.url}  # neither engine serves 3 yet
            a.version = router.version = 3  # b still serves 0: its answers are thrown away
            await _until(lambda: not pool.down, 10, "the router to be used again")
            assert (await pool.generate([1], {"max_new_tokens": 1})).versions == [3]
            assert f"engine {router.url} serves version 3: used again" in caplog.text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.liveness.probe_interval_s=20", "must be below engine.liveness.hung_after_s"),
        ("engine.liveness.ready_timeout_s=11", "a slow answer to /ready"),
        ("engine.liveness.restart_after_s=5", "must exceed engine.liveness.hung_after_s"),
        ("engine.liveness.health_timeout_s=1", "greater than 1"),
        ("push.stall_deadline_s=200", "must exceed the longest wait of one push step"),
        ("push.report_after_s=700", "must be below push.stall_deadline_s"),
    ],
)
def test_deadlines_that_cannot_work_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [override])


def test_the_defaults_fit_sglang_and_report_within_15_seconds():
    cfg = load_config([], []).engine.liveness
    # /ready answers at once; an engine silent for hung_after_s, whose last probe timed out, is
    # reported: at most hung_after_s + probe_interval_s + ready_timeout_s after it stopped.
    assert cfg.hung_after_s + cfg.probe_interval_s <= 15
    assert cfg.health_timeout_s > 20  # SGLang's paused /health answers 503 after about 20 s
    assert cfg.restart_after_s > cfg.hung_after_s


STALL = """
import logging, sys, time
from slime_async.actors.engine.push_watch import StallWatch
from slime_async.config import PushConfig
from slime_async.utils.restart_requests import request_restart

logging.basicConfig(level=logging.INFO)
# Below what the config accepts (a deadline 30 s past the longest wait): seconds, not minutes.
push = PushConfig().model_copy(update={"report_after_s": 0.3, "stall_deadline_s": 1.0})
def on_deadline(urls, why):
    for url in urls:
        request_restart(sys.argv[1], url, why, by="learner")
stall = StallWatch(push, on_deadline)
stall.step("broadcast of bucket 1", ["http://127.0.0.1:9"])
time.sleep(30)
"""


def test_a_push_stuck_past_its_deadline_ends_the_learner_for_a_restart(tmp_path):
    """A push step that honours no timeout: reported after report_after_s, and past
    stall_deadline_s the process exits 75 after asking for the engine's restart."""
    import os
    import subprocess
    import sys

    from slime_async.actors.engine.push_watch import PUSH_STALLED_EXIT
    from slime_async.utils.restart_requests import take_restart_requests
    from tests.support.repo import REPO, pythonpath_with_repo

    proc = subprocess.run(
        [sys.executable, "-c", STALL, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath_with_repo()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == PUSH_STALLED_EXIT, proc.stderr[-2000:]
    assert "step broadcast of bucket 1 has waited 0s for ['http://127.0.0.1:9']" in proc.stderr
    assert "stuck for 1s (push.stall_deadline_s) waiting for" in proc.stderr
    (req,) = take_restart_requests(tmp_path)
    assert req["url"] == "http://127.0.0.1:9" and "push.stall_deadline_s" in req["reason"]
    assert take_restart_requests(tmp_path) == []  # read once
