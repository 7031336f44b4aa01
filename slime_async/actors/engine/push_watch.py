"""The weight push's watch over its engines and over itself, beside `WeightPusher`.

    watch = PushLiveness(urls, liveness, api_key, loop, request_restart)  # probes on `loop`
    watch.unavailable(url)   # hung (no answer to probes) or stuck (an update call that never ended)
    watch.mark_stuck(url, why)   # left out of the group, restart asked for (counted)
    stall = StallWatch(push, on_deadline)   # a thread: stall.step("pause_generation", urls) ...

Hung engines. `EngineWatch` probes every engine while the learner runs (`engine.liveness`); a
member reported hung ends the push step that waits for it (the step fails naming the engine and
what timed out) and is left out of the next group at once instead of being waited for.

Stuck engines. A member of an NCCL group that never receives does not come free when the learner
closes its end (gloo's members do), and SGLang's side of the group waits for the default 30
minutes. Such an engine still answers its probes, but its update call never completes: after
`push.timeout_s` the push marks it stuck, leaves it out of the group, and asks `slime-async run`
to restart it (`request_restart`: a file in the run directory that the supervisor acts on,
`slime_async/launch/liveness.py`). A stuck engine rejoins once its probes saw it go away
(restarted) and answer again; it then serves its initial version, and the pusher's version
check brings it the current weights.

Stalls. A push step that does not finish for `push.report_after_s` is reported (logged with the
step and the engines it waits for, counted). One stuck for `push.stall_deadline_s` (a collective
that honours no timeout) ends the learner with `PUSH_STALLED_EXIT`, after asking for restarts of
the engines it waited for: the supervisor restarts the learner from its checkpoint.

Memory: one probe per engine, one watchdog thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.health import EngineWatch, State
from slime_async.config import PushConfig
from slime_async.config.engine import LivenessConfig

log = logging.getLogger(__name__)

PUSH_STALLED_EXIT = 75
"""Exit code of a learner whose push stalled past push.stall_deadline_s (EX_TEMPFAIL: the
supervisor restarts it)."""

RestartRequester = Callable[[str, str], bool]
"""(engine url, reason) -> True when a launcher took the request."""


class PushLiveness:
    """Hung and stuck engines, as the weight push sees them; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        liveness: LivenessConfig,
        api_key: str | None,
        loop: asyncio.AbstractEventLoop,
        request_restart: RestartRequester | None = None,
    ):
        self._loop = loop
        self.request_restart = request_restart
        clients = {
            u: EngineClient(u, api_key, liveness.ready_timeout_s, max_retries=0) for u in urls
        }
        self.watch = EngineWatch(clients, liveness, "weight push", on_change=self._on_change)
        self.stuck: dict[str, str] = {}
        """Engines whose update call never completed, and why (left out until restarted)."""
        self.counts = {"stuck": 0, "restart_requests": 0}
        asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout=10)

    async def _start(self) -> None:
        self.watch.start()

    def close(self) -> None:
        """Stop probing and close the probes' connections."""
        fut = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        try:
            fut.result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("weight push: stopping the engine probes: %s", e or type(e).__name__)

    async def _close(self) -> None:
        await self.watch.stop()
        await asyncio.gather(*(e.probe.client.close() for e in self.watch.engines.values()))

    def hung(self, url: str) -> str | None:
        """Why `url` is hung (its probes' last failure), or None."""
        return self.watch.reason(url) if self.watch.state(url) == "hung" else None

    def unavailable(self, url: str) -> str | None:
        """Why the push should not wait for `url` (hung, or stuck in an update), or None."""
        return self.hung(url) or self.stuck.get(url)

    def mark_stuck(self, url: str, why: str) -> None:
        """`url`'s update call never completed although it answers probes: leave it out of the
        group and have it restarted (counted, logged)."""
        if url in self.stuck:
            return
        self.stuck[url] = why
        self.counts["stuck"] += 1
        asked = False
        if self.request_restart is not None:
            asked = self.request_restart(url, f"stuck in its weight update: {why}")
        if asked:
            self.counts["restart_requests"] += 1
        log.error(
            "weight push: engine %s is stuck (%s); it is left out of the weight group until it "
            "restarts%s",
            url,
            why,
            ": restart asked of slime-async run"
            if asked
            else "; nothing here can restart it (no slime-async run): restart it by hand",
        )

    def _on_change(self, url: str, old: State, new: State, reason: str) -> None:
        if new == "down" and url in self.stuck:  # it went away: restarted (or being restarted)
            log.info("weight push: stuck engine %s went away (%s): it may rejoin", url, reason)
            del self.stuck[url]


class StallWatch:
    """A watchdog thread over the push's steps; see the module docstring."""

    def __init__(self, push: PushConfig, on_deadline: Callable[[list[str], str], None]):
        """`on_deadline(urls, why)` runs on the watchdog thread past the deadline, then the
        process exits with PUSH_STALLED_EXIT."""
        self.report_after_s = push.report_after_s
        self.deadline_s = push.stall_deadline_s
        self.on_deadline = on_deadline
        self.stalls = 0
        """Steps reported as stalled."""
        self._lock = threading.Lock()
        self._step: tuple[str, list[str], float, bool] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="push-stall-watch", daemon=True)
        self._thread.start()

    def step(self, name: str, urls: list[str]) -> None:
        """The push starts step `name`, waiting for `urls`."""
        with self._lock:
            self._step = (name, list(urls), time.monotonic(), False)

    def idle(self) -> None:
        """No push step in progress."""
        with self._lock:
            self._step = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.report_after_s / 2)):
            with self._lock:
                if self._step is None:
                    continue
                name, urls, t0, reported = self._step
                waited = time.monotonic() - t0
                if waited >= self.report_after_s and not reported:
                    self._step = (name, urls, t0, True)
                    self.stalls += 1
                    log.warning(
                        "weight push: step %s has waited %.0fs for %s (push.report_after_s = "
                        "%g; the learner gives up at push.stall_deadline_s = %g)",
                        name,
                        waited,
                        urls,
                        self.report_after_s,
                        self.deadline_s,
                    )
            if waited >= self.deadline_s:
                why = f"push step {name} stuck for {waited:.0f}s (push.stall_deadline_s)"
                log.critical(
                    "weight push: %s waiting for %s; the learner exits (code %d) to be restarted",
                    why,
                    urls,
                    PUSH_STALLED_EXIT,
                )
                try:
                    self.on_deadline(urls, why)
                finally:
                    logging.shutdown()
                    os._exit(PUSH_STALLED_EXIT)
