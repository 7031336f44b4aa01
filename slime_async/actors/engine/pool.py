"""A pool of engines behind one `generate`: least in-flight first, fail-over, liveness probing.

A failed request (connection error, timeout, 5xx) marks its engine down and is retried at once on
another engine that is up, or, when none is, after the back-off of `engine_retry_policy` (the
client's: doubling from `backoff_s`, jittered); a 4xx is the request's own fault and is raised.
Every engine is probed while the pool runs (`EngineWatch`, `engine.liveness`: GET /ready, else
GET /health, every `probe_interval_s`): a down engine is used again once it answers 200, and one
that answers nothing for `hung_after_s` is reported hung and marked down, and the requests in
flight there are given up and sent to another engine (counted in `hung_cancelled`). With one URL
(e.g. a sglang-router) the pool is a retrying client; `watch_urls` (the engines behind that
router) are then probed and reported too, without changing where requests go. Ties between
equally busy engines are broken by the pool's own `random.Random(seed)` (the generator's seed).

Engines behind the learner: with `min_version` set (the learner's version as of the last grant),
an answer whose first token comes from an older weight version (an engine that restarted from
the base model, or one still holding a dead learner's weights) is thrown away, counted
(`behind`), logged, and the call sent again like a failed one; the engine is left out until its
`weight_version` (GET /model_info, every `probe_interval_s`) reaches the version again; a router
is used again once one engine behind it (`watch_urls`) that is up serves it: answers of the others
are still thrown away one by one, and waiting for all of them could wait forever (an engine that
comes back after missing pushes is updated only by the learner's next push, which needs this
generator's answers). That check is apart from the liveness watch: an engine behind is alive,
just not usable yet.
With `seed_requests` (engine.deterministic_inference) every request without a `sampling_seed`
gets one drawn from the pool's seed: SGLang under deterministic inference draws all of them with
42 (the generator's start-up check: actors/generator/seeding.py).
Memory: one client, one counter and one probe per engine, plus one version check per engine
behind.
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
from slime_async.actors.engine.health import EngineWatch, State
from slime_async.config.engine import LivenessConfig

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
        probe_interval_s: float | None = None,
        seed: int | None = None,
        liveness: LivenessConfig | None = None,
        watch_urls: list[str] | None = None,
        owner: str = "engine pool",
        admin_api_key: str | None = None,
        seed_requests: bool = False,
    ):
        """`api_key`, `admin_api_key`: engine.api_key and engine.admin_api_key (the admin key
        goes with the admin routes, e.g. /abort_request: `client.ADMIN_ROUTES`); `liveness`: the probes (default `LivenessConfig()`; `probe_interval_s` overrides its
        interval); `watch_urls`: engines probed and reported but not sent requests (behind a
        router); `owner` names the role in liveness messages; `seed_requests`
        (engine.deterministic_inference): every request without a `sampling_seed` gets one of its
        own, drawn from `seed` (SGLang with deterministic inference draws them all with 42)."""
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate engine URLs: {urls}")
        self.clients = {
            u: EngineClient(u, api_key, timeout_s, max_retries=0, admin_api_key=admin_api_key)
            for u in self.urls
        }
        self.retry = engine_retry_policy(backoff_s, max_attempts=max_retries + 1)
        self._rng = random.Random(seed)
        self.seed_requests = seed_requests
        self._seeds = random.Random(f"sampling_seed/{seed}")
        self.seeded_requests = 0
        """Requests given a sampling_seed of their own (`seed_requests`)."""
        liveness = liveness or LivenessConfig()
        if probe_interval_s is not None:
            liveness = liveness.model_copy(update={"probe_interval_s": probe_interval_s})
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.failures = dict.fromkeys(self.urls, 0)
        """Per engine: requests that failed there (each failed over or retried, and logged)."""
        self.backoffs = 0
        """Waits because no engine was up (each logged)."""
        self.hung_cancelled = 0
        """Requests given up because their engine was reported hung (each sent again)."""
        watched = dict(self.clients)
        for u in (w.rstrip("/") for w in watch_urls or []):
            watched.setdefault(u, EngineClient(u, api_key, timeout_s, max_retries=0))
        self._watch_only = [u for u in watched if u not in self.clients]
        self.watch = EngineWatch(watched, liveness, owner, on_change=self._on_change)
        self._hung: dict[str, asyncio.Event] = {}
        """Per engine reported hung: set, so that requests in flight there give up."""
        self.probe_interval_s = liveness.probe_interval_s
        self.behind = dict.fromkeys(self.urls, 0)
        """Per engine: answers thrown away as made by weights behind `min_version`."""
        self.min_version: Callable[[], int] | None = None
        """The oldest weight version an answer may start with (None: any); read per call."""
        self._left_behind: set[str] = set()
        """Engines left out until they serve `min_version` (alive: the watch keeps them up)."""
        self._catch_ups: dict[str, asyncio.Task] = {}

    @classmethod
    def from_config(
        cls,
        cfg,
        urls: list[str] | None = None,
        seed: int | None = None,
        owner: str = "engine pool",
    ) -> EnginePool:
        """From an `EngineConfig` (its `urls` unless `urls` is given: then, when `urls` is one
        router's, its engines `cfg.urls` are watched as well)."""
        urls = urls or cfg.urls
        return cls(
            urls,
            api_key=cfg.api_key,
            admin_api_key=cfg.admin_api_key,
            timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries,
            seed=seed,
            liveness=cfg.liveness,
            watch_urls=[u for u in cfg.urls if u not in urls],
            owner=owner,
            seed_requests=cfg.deterministic_inference,
        )

    @property
    def down(self) -> set[str]:
        """The engines requests avoid now (down, hung, or behind `min_version`)."""
        return {u for u in self.urls if self.watch.state(u) != "up" or u in self._left_behind}

    async def __aenter__(self) -> EnginePool:
        self.watch.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.watch.stop()
        for task in self._catch_ups.values():
            task.cancel()
        for task in self._catch_ups.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._catch_ups.clear()
        await asyncio.gather(*(c.close() for c in self.watch_clients()))

    def watch_clients(self) -> list[EngineClient]:
        """Every client: the engines requests go to, and the ones only watched."""
        return [
            *self.clients.values(),
            *(self.watch.engines[u].probe.client for u in self._watch_only),
        ]

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
        routed_start: int = 0,
    ) -> GenerateOutput:
        """/generate on the least busy engine that is up, failing over as described above
        (`routed_start`: see `EngineClient.generate`)."""
        if self.seed_requests and sampling_params.get("sampling_seed") is None:
            sampling_params = {**sampling_params, "sampling_seed": self._seeds.getrandbits(31)}
            self.seeded_requests += 1  # kept through retries: one draw per request
        attempt, last_error = 0, None
        while True:
            self.watch.start()  # a pool used without `async with`
            url = self._pick()
            if url is not None:
                floor = self.min_version() if self.min_version is not None else None
                self.in_flight[url] += 1
                try:
                    out = await self._until_hung(
                        url,
                        self.clients[url].generate(
                            input_ids,
                            sampling_params,
                            rid,
                            return_logprob,
                            max_retries=0,
                            routed_start=routed_start,
                        ),
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

    async def _until_hung(self, url: str, call) -> GenerateOutput:
        """`call`, unless `url` is reported hung first: then EngineError (retried elsewhere)."""
        hung = self._hung.setdefault(url, asyncio.Event())
        request = asyncio.ensure_future(call)
        if hung.is_set():  # reported hung after it was picked
            request.cancel()
        waiter = asyncio.ensure_future(hung.wait())
        try:
            await asyncio.wait({request, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not request.done():
                request.cancel()
        with contextlib.suppress(asyncio.CancelledError, EngineError):
            await request  # a cancelled request ends here (its connection closed)
        if request.cancelled():
            self.hung_cancelled += 1
            raise EngineError(
                url,
                "POST /generate",
                f"given up: the engine is hung ({self.watch.reason(url)}); sent again elsewhere",
            )
        return request.result()

    def _mark_down(self, url: str, error: EngineError) -> None:
        self.failures[url] += 1
        if url not in self.down:
            log.warning("engine %s is down (%s); failing over, probing it", url, error)
        self.watch.mark_down(url, str(error))

    def _on_change(self, url: str, old: State, new: State, reason: str) -> None:
        if url not in self.clients:
            return  # watched only (an engine behind the router): reported, nothing to do here
        if new == "hung":
            self._hung.setdefault(url, asyncio.Event()).set()
        elif new == "up":
            self._hung[url] = asyncio.Event()  # requests sent from now on may wait there again

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
        self._left_behind.add(url)
        task = self._catch_ups.get(url)
        if task is None or task.done():
            self._catch_ups[url] = asyncio.get_running_loop().create_task(self._catch_up(url))

    async def _catch_up(self, url: str) -> None:
        """Wait until `url` serves `min_version` or later (GET /model_info), then use it again.
        A router has no /model_info of its own: the engines behind it (`watch_urls`) that are up
        are asked instead. Where no version can be read at all, the engine is used again at once
        (logged): each answer is still checked, so nothing behind is used either way."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            floor = self.min_version() if self.min_version is not None else 0
            try:
                served = await self._served_version(url)
            except EngineRequestError as e:
                self._left_behind.discard(url)
                log.warning(
                    "engine %s reports no weight version (%s): used again, its answers are "
                    "still checked one by one",
                    url,
                    e,
                )
                return
            except EngineError:
                continue  # down as well (the watch reports that): asked again at the next probe
            if served is not None and served >= floor:
                self._left_behind.discard(url)
                log.info("engine %s serves version %d: used again", url, served)
                return

    async def _served_version(self, url: str) -> int | None:
        """The version `url` serves; behind a router, the newest its up engines serve (None
        while none is up): the router is usable once one of them is current."""
        if not self._watch_only:
            return await self.clients[url].get_weight_version()
        up = [u for u in self._watch_only if self.watch.state(u) == "up"]
        clients = [self.watch.engines[u].probe.client for u in up]
        served = await asyncio.gather(*(c.get_weight_version() for c in clients))
        return max(served, default=None)

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
            "hung_cancelled": self.hung_cancelled,
            "seeded_requests": self.seeded_requests,
            "liveness": dict(self.watch.counts),
            "watched": {u: self.watch.state(u) for u in self.watch.engines},
        }
