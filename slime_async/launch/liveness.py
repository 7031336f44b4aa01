"""Liveness of the engines `slime-async run` started, and restarts asked for by other roles.

    watch = RoleLiveness({"engine0": url0, ...}, cfg.engine.liveness, api_key)   # a thread
    for role, why, cause in watch.due(children): ...restart it...                # each poll
    request_restart(run_dir, url, reason, by="learner")   # any role (utils/restart_requests.py)

The supervisor probes every engine role it started, once that role is ready, with the same probe
as the generators and the learner (`actors/engine/health.py`: GET /ready, else GET /health, every
`engine.liveness.probe_interval_s`). Its state changes (hung, down, back) are returned by
`events()` for the supervisor's log. An engine that has answered no probe for
`engine.liveness.restart_after_s` (0: never) is due for a restart (cause "hung").

A role that finds an engine it cannot recover (the weight push: an engine stuck in its update
call, `actors/engine/push_watch.py`) writes a request file under `<run_dir>/restart_requests/`;
the supervisor reads and removes each one, and restarts the engine role of that URL (cause
"requested") unless it was (re)started after the request was made. A URL that is no role of the
run (an external engine) is reported and left alone.

Runs one thread with its own event loop; memory: one probe per engine role, the request files
until they are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Protocol

from slime_async.config.engine import LivenessConfig
from slime_async.utils.restart_requests import take_restart_requests

log = logging.getLogger(__name__)

Cause = Literal["hung", "requested"]


class _Child(Protocol):
    started_at: float


class RoleLiveness:
    """Probes the engine roles of a run on a thread; see the module docstring."""

    def __init__(
        self,
        urls: Mapping[str, str],
        liveness: LivenessConfig,
        api_key: str | None,
        run_dir: Path | None = None,
    ):
        """`urls`: role name -> the engine's base URL."""
        # Here, not at the top: `slime-async run` imports the supervisor before it needs these.
        from slime_async.actors.engine.client import EngineClient
        from slime_async.actors.engine.health import EngineWatch

        self.roles = {role: url.rstrip("/") for role, url in urls.items()}
        self.by_url = {url: role for role, url in self.roles.items()}
        self.liveness = liveness
        self.run_dir = run_dir
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-liveness", daemon=True
        )
        self._thread.start()

        self._api_key = api_key
        self._client = EngineClient

        async def build() -> EngineWatch:
            watch = EngineWatch({}, liveness, "supervisor", on_change=self._on_change)
            watch.start()
            return watch

        self.watch = asyncio.run_coroutine_threadsafe(build(), self._loop).result(timeout=10)
        self._watched: set[str] = set()
        """The roles probed now: ready, not being stopped."""

    def watch_role(self, role: str) -> None:
        """`role` is ready (started or restarted): probe it from now on, silent since now."""
        if role not in self.roles:
            return
        url = self.roles[role]
        client = self._client(url, self._api_key, self.liveness.ready_timeout_s, max_retries=0)
        self._run_here(lambda: self.watch.add(url, client))
        self._watched.add(role)

    def unwatch_role(self, role: str) -> None:
        """`role` is being stopped or restarted: not probed, no restart due, meanwhile."""
        if role not in self._watched:
            return
        self._watched.discard(role)
        url = self.roles[role]

        async def remove() -> None:
            client = self.watch.remove(url)
            if client is not None:
                await client.close()

        asyncio.run_coroutine_threadsafe(remove(), self._loop).result(timeout=10)

    def _run_here(self, fn) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def events(self) -> list[str]:
        """State changes since the last call, as lines for the supervisor's log."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def due(self, children: Mapping[str, _Child]) -> list[tuple[str, str, Cause]]:
        """(role, reason, cause) of each engine role to restart now."""
        out: list[tuple[str, str, Cause]] = []
        limit = self.liveness.restart_after_s
        for role in sorted(self._watched):
            url = self.roles[role]
            if url not in self.watch.engines:
                continue
            silent = self.watch.silent_s(url)
            if limit and self.watch.state(url) == "hung" and silent >= limit:
                out.append(
                    (
                        role,
                        f"{role} ({url}) answered no probe for {silent:.0f}s "
                        f"(engine.liveness.restart_after_s = {limit:g}; last: "
                        f"{self.watch.last_error(url)})",
                        "hung",
                    )
                )
        if self.run_dir is None:
            return out
        for req in take_restart_requests(self.run_dir):
            url = str(req.get("url", "")).rstrip("/")
            role = self.by_url.get(url)
            by, reason = req.get("by", "a role"), req.get("reason", "")
            if role is None:
                self._events.put(
                    f"restart of engine {url or '?'} asked by {by} ({reason}): no role of this "
                    "run serves it; restart it by hand"
                )
                continue
            child = children.get(role)
            if child is not None and child.started_at > float(req.get("time", 0.0)):
                self._events.put(f"restart of {role} asked by {by}: already restarted since")
                continue
            if role not in {r for r, _, _ in out}:
                out.append((role, f"{role} ({url}): restart asked by {by}: {reason}", "requested"))
        return out

    def close(self) -> None:
        async def stop() -> None:
            await self.watch.stop()
            await asyncio.gather(*(e.probe.client.close() for e in self.watch.engines.values()))

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _on_change(self, url: str, old: str, new: str, reason: str) -> None:
        role = self.by_url.get(url, url)
        if new == "hung":
            self._events.put(f"{role} ({url}) is hung: {reason}")
        elif new == "down":
            self._events.put(f"{role} ({url}) is down: {reason}")
        else:
            self._events.put(f"{role} ({url}) is back: {reason} (it was {old})")
