"""Python's garbage collector in a long-running role: what start-up made frozen out of its sight,
and every collection timed.

A process that imported torch, transformers and megatron-core and built a model holds some
hundreds of thousands of objects the collector tracks. A full (generation-2) collection walks
all of them: a few hundred milliseconds in which the role's thread holds the GIL and does
nothing else (an engine's decode steps stall, every request in flight waits). CPython starts
one whenever enough new objects survived two younger collections, so the stall comes at no
particular step. `freeze` after start-up (SGLang does the same after its warm-up, and on
`/freeze_gc`) moves the objects alive then to the permanent generation: later collections walk
only what came after. `GcWatch` times each collection through `gc.callbacks`, counts them by
generation and logs every one longer than its threshold (with the objects in each
generation), so a pause is never silent.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def freeze(context: str, collect: bool = True) -> int:
    """Collect (unless `collect` is False: a full collection is the pause this avoids), then
    freeze every object alive now out of later collections' sight. Returns how many objects are
    frozen in all (`gc.get_freeze_count`); logged with `context`."""
    t0 = time.perf_counter()
    if collect:
        gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "%s: %d objects frozen out of the garbage collector's sight (gc.freeze, %.2f s)",
        context,
        frozen,
        time.perf_counter() - t0,
    )
    return frozen


@dataclass
class GcWatch:
    """Times every collection of this process (`install` adds the callback, `close` removes
    it); one longer than `warn_s` is logged as a warning and counted in `long`."""

    role: str
    warn_s: float = 0.05
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0
    long: int = 0
    _started: float | None = None

    def install(self) -> GcWatch:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        took = time.perf_counter() - self._started
        self._started = None
        gen = int(info.get("generation", 2))
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.longest_s = max(self.longest_s, took)
        if took > self.warn_s:
            self.long += 1
            log.warning(
                "%s: a generation-%d garbage collection took %.3f s (%d objects frozen out of "
                "its sight); collections longer than %.3f s so far: %d",
                self.role,
                gen,
                took,
                gc.get_freeze_count(),
                self.warn_s,
                self.long,
            )

    def stats(self) -> dict[str, object]:
        """Cumulative: collections and their seconds by generation, the longest, how many were
        longer than the threshold, objects frozen."""
        return {
            "gc_collections": list(self.collections),
            "gc_seconds": [round(s, 4) for s in self.seconds],
            "gc_longest_s": round(self.longest_s, 4),
            "gc_long_collections": self.long,
            "gc_frozen_objects": gc.get_freeze_count(),
        }
