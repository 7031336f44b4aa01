"""A pool of engines behind one `generate`: least in-flight first, fail-over, health probing.

A failed request (connection error, timeout, 5xx) marks its engine down and is retried at once on
another engine that is up, or, when none is, after the back-off of `engine_retry_policy` (the
client's: doubling from `backoff_s`, jittered); a 4xx is the request's own fault and is raised.
A down engine is probed with GET /health every `probe_interval_s` and used again as soon as it
answers. With one URL (e.g. a sglang-router) the pool is a retrying client. Ties between equally
busy engines are broken by the pool's own `random.Random(seed)` (the generator's seed).

Engines behind the learner: with `min_version` set (the learner's version as of the last grant),
an answer whose first token comes from an older weight version (an engine that restarted from
the base model, or one still holding a dead learner's weights) is thrown away, counted
(`behind`), logged, and the call sent again like a failed one; the engine is left out until its
`weight_version` (GET /model_info, every `probe_interval_s`) reaches the version again.
Memory: one client and one counter per engine, plus one probe task per down or behind engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

from slime_async.actors.engine.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    GenerateOutput,
    engine_retry_policy,
)

log = logging.getLogger(__name__)


class EnginePool:
    """Use as `async with EnginePool(urls) as pool: await pool.generate(ids, params)`."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 0.2,
        probe_interval_s: float = 1.0,
        seed: int | None = None,
    ):
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate engine URLs: {urls}")
        self.clients = {u: EngineClient(u, api_key, timeout_s, max_retries=0) for u in self.urls}
        self.retry = engine_retry_policy(backoff_s, max_attempts=max_retries + 1)
        self._rng = random.Random(seed)
        self.probe_interval_s = probe_interval_s
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.down: set[str] = set()
        self.failures = dict.fromkeys(self.urls, 0)
        """Per engine: requests that failed there (each failed over or retried, and logged)."""
        self.backoffs = 0
        """Waits because no engine was up (each logged)."""
        self.behind = dict.fromkeys(self.urls, 0)
        """Per engine: answers thrown away as made by weights behind `min_version`."""
        self.min_version: Callable[[], int] | None = None
        """The oldest weight version an answer may start with (None: any); read per call."""
        self._probes: dict[str, asyncio.Task] = {}

    @classmethod
    def from_config(cls, cfg, urls: list[str] | None = None, seed: int | None = None) -> EnginePool:
        """From an `EngineConfig` (its `urls` unless `urls` is given)."""
        return cls(
            urls or cfg.urls,
            api_key=cfg.api_key,
            timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries,
            seed=seed,
        )

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        for task in self._probes.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._probes.clear()
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    def _pick(self) -> str | None:
        up = [u for u in self.urls if u not in self.down]
        if not up:
            return None
        least = min(self.in_flight[u] for u in up)
        return self._rng.choice([u for u in up if self.in_flight[u] == least])

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateOutput:
        """/generate on the least busy engine that is up, failing over as described above."""
        attempt, last_error = 0, None
        while True:
            url = self._pick()
            if url is not None:
                floor = self.min_version() if self.min_version is not None else None
                self.in_flight[url] += 1
                try:
                    out = await self.clients[url].generate(
                        input_ids, sampling_params, rid, return_logprob, max_retries=0
                    )
                    if floor is None or not out.versions or out.versions[0] >= floor:
                        return out
                    last_error = EngineError(
                        url,
                        "POST /generate",
                        f"answered with weights of version {out.versions[0]}, behind the "
                        f"learner's {floor} (thrown away)",
                    )
                    self._mark_behind(url, out.versions[0], floor)
                except EngineRequestError:
                    raise
                except EngineError as e:
                    last_error = e
                    self._mark_down(url, e)
                finally:
                    self.in_flight[url] -= 1
            attempt += 1
            if self.retry.exhausted(attempt):
                raise EngineError(
                    ",".join(self.urls),
                    "POST /generate",
                    f"no engine succeeded in {attempt} attempts; last error: {last_error}",
                )
            if self._pick() is None:  # fail over at once while an engine is up, else back off
                delay = self.retry.delay(attempt, self._rng)
                self.backoffs += 1
                log.warning(
                    "no engine is up; /generate again in %.2fs (attempt %d)", delay, attempt
                )
                await asyncio.sleep(delay)

    def _mark_down(self, url: str, error: EngineError) -> None:
        self.failures[url] += 1
        if url not in self.down:
            log.warning("engine %s is down (%s); failing over, probing it", url, error)
        self.down.add(url)
        if url not in self._probes or self._probes[url].done():
            self._probes[url] = asyncio.get_running_loop().create_task(self._probe(url))

    def _mark_behind(self, url: str, served: int, floor: int) -> None:
        self.behind[url] += 1
        if url not in self.down:
            log.warning(
                "engine %s serves weights of version %d, behind the learner's %d (restarted, or "
                "not yet updated): its answer is thrown away and it is left out until it serves "
                "version %d",
                url,
                served,
                floor,
                floor,
            )
        self.down.add(url)
        if url not in self._probes or self._probes[url].done():
            self._probes[url] = asyncio.get_running_loop().create_task(self._catch_up(url))

    async def _catch_up(self, url: str) -> None:
        """Wait until `url` serves `min_version` or later (GET /model_info), then use it again."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            floor = self.min_version() if self.min_version is not None else 0
            try:
                served = await self.clients[url].get_weight_version()
            except EngineError:
                continue  # down as well: asked again at the next probe
            if served >= floor:
                self.down.discard(url)
                log.info("engine %s serves version %d: used again", url, served)
                return

    async def _probe(self, url: str) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            if await self.clients[url].health(timeout_s=max(1.0, self.probe_interval_s)):
                self.down.discard(url)
                log.info("engine %s is back (GET /health answered)", url)
                return

    async def for_all(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call `EngineClient.<method>` on every engine concurrently; url -> result or exception."""
        urls = self.urls
        results = await asyncio.gather(
            *(getattr(self.clients[u], method)(*args, **kwargs) for u in urls),
            return_exceptions=True,
        )
        return dict(zip(urls, results, strict=True))

    def stats(self) -> dict[str, Any]:
        return {
            "engines": len(self.urls),
            "down": sorted(self.down),
            "in_flight": dict(self.in_flight),
            "failures": dict(self.failures),
            "behind": dict(self.behind),
            "backoffs": self.backoffs,
        }
