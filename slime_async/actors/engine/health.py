"""Liveness of running engines: the probe every role sends, and the watch that repeats it.

    probe = EngineProbe(client, liveness)     # GET /ready; where that is missing, GET /health
    answer = await probe.once()               # Answer: alive? ready? which path, how long
    watch = EngineWatch({url: client}, liveness, owner="generator0", on_change=cb)
    watch.start()                             # a task on the running loop; watch.stop()

What is probed. SGLang 0.5.23 answers `GET /ready` at once: 200 when it takes requests, 503
while generation is paused (every weight push pauses it) or the server is starting. Its `GET
/health` runs a one-token generation: no answer before 1 s, up to 20 s (then 503 while paused).
So /ready comes first; an engine that answers it 404 or 405 (an older server, a router) is probed
at `GET /health` from then on, with `engine.liveness.health_timeout_s`, and that is remembered per
engine (logged once). Any HTTP answer means the process is alive; only 200 means ready.

States, per engine: up, down (refused the connection, failed, or not ready after being down),
hung (no answer to any probe for `hung_after_s`, and the last probe timed out). Every change is
logged with the engine's URL and the reason, counted (`EngineWatch.counts`) and handed to
`on_change`. A paused engine that answers 503 stays up: a weight push is not an outage.

Memory: one probe and one state per engine, one probe task at most per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.config.engine import LivenessConfig

log = logging.getLogger(__name__)

READY, HEALTH = "/ready", "/health"
MISSING_ROUTE = (404, 405)
"""Answers to GET /ready that mean the server has no such route: probe /health instead."""

State = Literal["up", "down", "hung"]


@dataclass
class Answer:
    """One probe's outcome."""

    path: str
    """The route that was probed (/ready or /health)."""
    alive: bool
    """The engine answered HTTP at all (any status)."""
    ready: bool
    """It answered 200."""
    seconds: float
    timed_out: bool = False
    """No answer within the path's timeout."""
    status: int | None = None
    error: str | None = None
    """What went wrong (a connection error, a timeout, a status), for messages."""


class EngineProbe:
    """One engine's probe: /ready until it proves missing, then /health (remembered)."""

    def __init__(self, client: EngineClient, liveness: LivenessConfig):
        self.client = client
        self.liveness = liveness
        self.path = READY
        """The route this engine answers; /health once /ready proved missing."""

    def timeout_s(self, path: str | None = None) -> float:
        """How long one probe of `path` (default: the current one) may go unanswered."""
        path = path or self.path
        return self.liveness.ready_timeout_s if path == READY else self.liveness.health_timeout_s

    async def once(self) -> Answer:
        """Probe once (twice when /ready turns out to be missing: /health at once)."""
        answer = await self._get(self.path)
        if self.path == READY and answer.status in MISSING_ROUTE:
            self.path = HEALTH
            log.info(
                "engine %s has no GET /ready (HTTP %d): probing GET /health from now on, "
                "%.0fs timeout (engine.liveness.health_timeout_s; SGLang's /health runs a "
                "generation and takes at least 1 s)",
                self.client.url,
                answer.status,
                self.liveness.health_timeout_s,
            )
            answer = await self._get(self.path)
        return answer

    async def _get(self, path: str) -> Answer:
        t0 = time.monotonic()
        timeout = self.timeout_s(path)
        try:
            await self.client.call("GET", path, timeout_s=timeout, max_retries=0)
        except EngineError as e:
            seconds = time.monotonic() - t0
            if e.status is not None:  # an HTTP answer: the process lives
                return Answer(path, True, False, seconds, status=e.status, error=e.message)
            timed_out = "Timeout" in e.message or seconds >= 0.95 * timeout
            error = f"no answer in {timeout:.1f}s" if timed_out else e.message
            return Answer(path, False, False, seconds, timed_out=timed_out, error=error)
        return Answer(path, True, True, time.monotonic() - t0, status=200)


@dataclass
class _Engine:
    probe: EngineProbe
    state: State = "up"
    last_answer: float = 0.0
    """monotonic time of the last HTTP answer (any status)."""
    timeouts: int = 0
    """Probes that timed out since the last answer."""
    reason: str = ""
    """Why it is down or hung (for messages)."""
    last_error: str = ""
    """The last probe's failure."""
    changed_at: float = 0.0
    """monotonic time of the last state change."""
    task: asyncio.Task | None = None


class EngineWatch:
    """Probes every engine every `probe_interval_s` while it runs; see the module docstring."""

    def __init__(
        self,
        clients: Mapping[str, EngineClient],
        liveness: LivenessConfig,
        owner: str,
        on_change: Callable[[str, State, State, str], None] | None = None,
    ):
        """`owner` names the role in messages ("generator0", "weight push", "supervisor");
        `on_change(url, old, new, reason)` runs on the watch's loop after each change."""
        self.liveness = liveness
        self.owner = owner
        self.on_change = on_change
        self.engines: dict[str, _Engine] = {}
        for url, client in clients.items():
            self.add(url, client)
        self.counts = {"hung": 0, "down": 0, "back": 0}
        """State changes since start: reported hung, marked down (a failure), marked up again."""
        self._task: asyncio.Task | None = None

    # ---- what the roles ask ------------------------------------------------------------------

    def state(self, url: str) -> State:
        return self.engines[url].state

    def reason(self, url: str) -> str:
        return self.engines[url].reason

    def last_error(self, url: str) -> str:
        """The engine's last probe failure."""
        return self.engines[url].last_error

    def silent_s(self, url: str) -> float:
        """Seconds since the engine last answered a probe."""
        return time.monotonic() - self.engines[url].last_answer

    def mark_down(self, url: str, reason: str) -> None:
        """A role saw the engine fail (a request error, logged by the role): down until a probe
        finds it ready."""
        e = self.engines[url]
        if e.state == "up":
            self._change(url, e, "down", reason, quiet=True)

    def add(self, url: str, client: EngineClient) -> None:
        """Watch one more engine, silent since now (once running: call on the watch's loop)."""
        now = time.monotonic()
        self.engines[url] = _Engine(
            EngineProbe(client, self.liveness), last_answer=now, changed_at=now
        )

    def remove(self, url: str) -> EngineClient | None:
        """Stop watching `url` (call on the watch's loop); its client, for the caller to close."""
        e = self.engines.pop(url, None)
        if e is None:
            return None
        if e.task is not None:
            e.task.cancel()
        return e.probe.client

    # ---- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start probing on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *(e.task for e in self.engines.values())) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._task = None

    async def _run(self) -> None:
        while True:
            # The first probe after one interval: the role has just checked the engine's start.
            await asyncio.sleep(self.liveness.probe_interval_s)
            for url, e in list(self.engines.items()):
                if e.task is None or e.task.done():
                    e.task = asyncio.get_running_loop().create_task(self._probe(url, e))
                self._check_hung(url, e)

    async def _probe(self, url: str, e: _Engine) -> None:
        answer = await e.probe.once()
        if self.engines.get(url) is not e:
            return  # no longer watched
        now = time.monotonic()
        if answer.alive:
            e.last_answer, e.timeouts = now, 0
            if answer.ready and e.state != "up":
                self._change(url, e, "up", f"GET {answer.path} answered 200")
            elif not answer.ready and e.state == "hung":  # alive again, not ready (starting)
                self._change(url, e, "down", f"GET {answer.path}: {answer.error}")
        elif answer.timed_out:
            e.timeouts += 1
            e.last_error = f"GET {answer.path}: {answer.error}"
            self._check_hung(url, e)
        elif e.state == "up":
            self._change(url, e, "down", f"GET {answer.path}: {answer.error}")

    def _check_hung(self, url: str, e: _Engine) -> None:
        silent = time.monotonic() - e.last_answer
        if e.state != "hung" and e.timeouts and silent >= self.liveness.hung_after_s:
            self._change(
                url,
                e,
                "hung",
                f"no answer to any probe for {silent:.1f}s (last: {e.last_error}; "
                f"engine.liveness.hung_after_s = {self.liveness.hung_after_s:g})",
            )

    def _change(self, url: str, e: _Engine, new: State, reason: str, quiet: bool = False) -> None:
        now = time.monotonic()
        old, since = e.state, now - e.changed_at
        e.state, e.reason, e.changed_at = new, reason, now
        if new == "hung":
            self.counts["hung"] += 1
            log.warning("%s: engine %s is hung: %s; marked down", self.owner, url, reason)
        elif new == "down":
            self.counts["down"] += 1
            if not quiet:
                log.warning("%s: engine %s is down: %s", self.owner, url, reason)
        else:
            self.counts["back"] += 1
            log.info(
                "%s: engine %s is back: %s (it was %s for %.1fs)",
                self.owner,
                url,
                reason,
                old,
                since,
            )
        if self.on_change is not None:
            self.on_change(url, old, new, reason)
