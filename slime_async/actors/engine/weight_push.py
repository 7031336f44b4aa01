"""Learner side of the weight push: rank 0 broadcasts HF-named tensors to every engine.

    learner rank 0 --POST /init_weights_update_group (all engines, concurrently)--> engines join
                   hosts the TCPStore at master_addr:master_port; group = 1 + sum(engine TP sizes)
    push(buckets, version):
        POST /pause_generation {mode: in_place}     (no token is sampled from half-new weights)
        per bucket: POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
                    weight_version, flush_cache} to all engines, and while those calls are in
                    flight broadcast(src=0) each tensor of the bucket in `names` order
        POST /continue_generation                   (running requests go on under the new weights)

Only SGLang's fields are used, so the same code pushes to real SGLang servers (give it the
engines' own URLs, not a router's). Engine TP ranks get `rank_offset`; each engine's TP size is
read from /get_server_info (`tp_size`, 1 if absent) unless given. Memory: one bucket at a time
(the caller's iterator produces them); HTTP calls run on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Iterable
from typing import Any

import torch

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.actors.engine.weight_sync import WeightGroup, init_weight_group
from slime_async.utils.procs import free_port

log = logging.getLogger(__name__)


class WeightPusher:
    """Synchronous API for the learner: connect(), push(buckets, version), close()."""

    def __init__(
        self,
        urls: list[str],
        backend: str = "gloo",
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "slime_async_weights",
        api_key: str | None = None,
        device: str | torch.device | None = None,
        tp_sizes: list[int] | None = None,
        pause_mode: str | None = "in_place",
        timeout_s: float = 300.0,
    ):
        if not urls:
            raise ValueError("WeightPusher needs at least one engine URL")
        if pause_mode not in (None, "in_place", "retract", "abort"):
            raise ValueError(
                f"pause_mode must be in_place, retract, abort or None, got {pause_mode!r}"
            )
        self.urls = list(urls)
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self.group_name = group_name
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.tp_sizes = tp_sizes
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.clients = [EngineClient(u, api_key, timeout_s=timeout_s, max_retries=2) for u in urls]
        self.group: WeightGroup | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weight-push-http", daemon=True
        )
        self._thread.start()

    def _submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[concurrent.futures.Future]:
        return [self._submit(getattr(c, method)(*args, **kwargs)) for c in self.clients]

    def _wait(self, futs: list[concurrent.futures.Future]) -> list[Any]:
        return [f.result(timeout=self.timeout_s) for f in futs]

    def connect(self) -> None:
        """Create the group: every engine joins (HTTP, concurrently) while this process hosts rank 0."""
        if self.group is not None:
            return
        tp = self.tp_sizes
        if tp is None:
            infos = self._wait(self._all("get_server_info"))
            tp = [int(i.get("tp_size", 1)) if isinstance(i, dict) else 1 for i in infos]
        if len(tp) != len(self.urls):
            raise ValueError(f"{len(tp)} tp_sizes for {len(self.urls)} engines")
        world = 1 + sum(tp)
        port = self.master_port or free_port(self.master_addr)
        offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        futs = [
            self._submit(
                c.init_weights_update_group(
                    self.master_addr, port, off, world, self.group_name, self.backend
                )
            )
            for c, off in zip(self.clients, offsets, strict=True)
        ]
        try:
            self.group = init_weight_group(
                self.master_addr,
                port,
                0,
                world,
                self.group_name,
                self.backend,
                self.device,
                self.timeout_s,
            )
        except Exception as e:
            errors = [str(f.exception()) for f in futs if f.done() and f.exception()]
            raise RuntimeError(
                f"weight-update group handshake failed: {e}; engines said: {errors}"
            ) from e
        self._wait(futs)
        log.info(
            "weight-update group %s: %d engines, world size %d",
            self.group_name,
            len(self.urls),
            world,
        )

    def push(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int
    ) -> dict[str, float]:
        """Send every bucket; the engines report `version` from this push on. Returns bytes,
        seconds, bytes_per_s, buckets, tensors."""
        if self.group is None:
            raise RuntimeError("WeightPusher.push before connect()")
        t0 = time.perf_counter()
        nbytes = ntensors = nbuckets = 0
        if self.pause_mode:
            self._wait(self._all("pause_generation", self.pause_mode))
        try:
            it = iter(buckets)
            bucket = next(it, None)
            while bucket is not None:
                following = next(it, None)
                tensors = [(n, t.detach().to(self.device).contiguous()) for n, t in bucket]
                futs = self._all(
                    "update_weights_from_distributed",
                    [n for n, _ in tensors],
                    [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                    [list(t.shape) for _, t in tensors],
                    self.group_name,
                    weight_version=version,
                    flush_cache=following is None,
                )
                for _, t in tensors:
                    failed = [f for f in futs if f.done() and f.exception() is not None]
                    if failed:  # an engine refused the bucket: it will not receive, stop here
                        raise failed[0].exception()
                    self.group.broadcast(t)
                    nbytes += t.numel() * t.element_size()
                self._wait(futs)
                ntensors += len(tensors)
                nbuckets += 1
                bucket = following
        finally:
            if self.pause_mode:
                self._wait(self._all("continue_generation"))
        seconds = time.perf_counter() - t0
        stats = {
            "bytes": float(nbytes),
            "seconds": seconds,
            "bytes_per_s": nbytes / seconds if seconds > 0 else 0.0,
            "buckets": float(nbuckets),
            "tensors": float(ntensors),
        }
        log.info(
            "pushed version %d: %.1f MB in %d buckets, %.3f s, %.2f GB/s",
            version, nbytes / 1e6, nbuckets, seconds, stats["bytes_per_s"] / 1e9,
        )  # fmt: skip
        return stats

    def close(self) -> None:
        """Destroy the group on the engines and here; stop the HTTP thread."""
        if self.group is not None:
            futs = self._all("destroy_weights_update_group", self.group_name)
            for f in futs:
                try:
                    f.result(timeout=30)
                except (EngineError, concurrent.futures.TimeoutError) as e:
                    log.warning("destroy_weights_update_group: %s", e)
            self.group.destroy()
            self.group = None
        if self._thread.is_alive():
            self._wait([self._submit(c.close()) for c in self.clients])
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> WeightPusher:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
