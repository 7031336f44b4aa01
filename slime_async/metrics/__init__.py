"""Metrics: named records, reduced once per step, written to JSONL from one place.

    metrics = MetricsLogger(run_dir, "learner")
    metrics.log(step, {"reward": mean(rewards), "staleness/hist": int_histogram(staleness)})
    metrics.close()

Each role owns one logger and calls `log` once per step with everything it measured in that
step; the logger adds `step` and `time` (unix seconds) and appends one JSON line to
`<run_dir>/metrics/<role>.jsonl` (flushed at once, so the supervisor's progress display and
`slime-async plot` can read it live). The job's supervisor forwards every role's records from
there to one wandb run and one TensorBoard directory (`run.trackers`, `trackers.py`).

A value is a number or a histogram. Histograms are plain dicts so the JSONL stays readable:
`{"values": [0, 1, 2], "counts": [5, 3, 1]}` for integer-valued data (staleness) or
`{"edges": [e0, ..., eK], "counts": [c1, ..., cK]}` for binned real values.
Non-finite numbers are written as JSON null (a NaN loss is an event worth keeping).

Every name a role writes and a reader looks for is defined once, in `slime_async/metrics/names.py`
(re-exported here); roles may log other names too, but a name that someone reads belongs there.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from slime_async.metrics.names import *  # noqa: F403  (one definition of each name)

Histogram = dict[str, list]


def metrics_path(run_dir: str | Path, role: str) -> Path:
    """Where `role` writes its records: `<run_dir>/metrics/<role>.jsonl`."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", role):
        raise ValueError(f"metrics role {role!r}: use letters, digits, '_', '-', '.' only")
    return Path(run_dir) / "metrics" / f"{role}.jsonl"


def _number(key: str, value: Any) -> float | int | None:
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise ValueError(f"metric {key!r}: expected a number or a histogram dict, got {value!r}")


def _clean(record: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric name {key!r}: expected a non-empty string")
        if key in ("step", "time"):
            raise ValueError(f"metric {key!r}: the logger sets it; use another name")
        if isinstance(value, Mapping):
            out[key] = _check_histogram(key, value)
        else:
            out[key] = _number(key, value)
    return out


def _check_histogram(key: str, h: Mapping[str, Any]) -> Histogram:
    counts = [int(c) for c in h.get("counts", ())]
    if "values" in h:
        values = [_number(key, v) for v in h["values"]]
        if len(values) != len(counts):
            raise ValueError(
                f"metric {key!r}: histogram has {len(values)} values, {len(counts)} counts"
            )
        return {"values": values, "counts": counts}
    if "edges" in h:
        edges = [float(e) for e in h["edges"]]
        if len(edges) != len(counts) + 1:
            raise ValueError(f"metric {key!r}: histogram needs len(edges) == len(counts) + 1")
        return {"edges": edges, "counts": counts}
    raise ValueError(f"metric {key!r}: a histogram dict needs 'counts' and 'values' or 'edges'")


class MetricsLogger:
    """One role's metrics sink: `<run_dir>/metrics/<role>.jsonl` (the trackers read it there)."""

    def __init__(self, run_dir: str | Path, role: str):
        self.role = role
        self.path = metrics_path(run_dir, role)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file (readers keep the last line of a step).
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Write one step's record (numbers and histogram dicts; see the module docstring)."""
        clean = _clean(record)
        line = {"step": int(step), "time": time.time(), **clean}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----- reducers -------------------------------------------------------------------------------


def mean(xs: Iterable[float]) -> float:
    """Mean of `xs`; NaN for none (written as null) rather than a misleading 0."""
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(prefix: str, xs: Iterable[float]) -> dict[str, float]:
    """`{prefix/mean, prefix/min, prefix/max}` of `xs` (NaN when empty)."""
    xs = [float(x) for x in xs]
    if not xs:
        nan = float("nan")
        return {f"{prefix}/mean": nan, f"{prefix}/min": nan, f"{prefix}/max": nan}
    return {f"{prefix}/mean": sum(xs) / len(xs), f"{prefix}/min": min(xs), f"{prefix}/max": max(xs)}


def int_histogram(xs: Iterable[int]) -> Histogram:
    """Counts of each integer value present, in increasing order (e.g. staleness per trajectory)."""
    counts: dict[int, int] = {}
    for x in xs:
        counts[int(x)] = counts.get(int(x), 0) + 1
    keys = sorted(counts)
    return {"values": keys, "counts": [counts[k] for k in keys]}


def histogram(
    xs: Iterable[float], bins: int = 20, lo: float | None = None, hi: float | None = None
) -> Histogram:
    """`bins` equal-width bins over [lo, hi] (default: the data's range); values outside are dropped."""
    xs = [float(x) for x in xs if math.isfinite(float(x))]
    lo = min(xs, default=0.0) if lo is None else lo
    hi = max(xs, default=1.0) if hi is None else hi
    if hi <= lo:
        hi = lo + 1.0
    width = (hi - lo) / bins
    counts = [0] * bins
    for x in xs:
        if lo <= x <= hi:
            counts[min(int((x - lo) / width), bins - 1)] += 1
    return {"edges": [lo + i * width for i in range(bins + 1)], "counts": counts}


def merge_int_histograms(hs: Iterable[Mapping[str, list]]) -> Histogram:
    """Sum integer-valued histograms (e.g. the staleness of every step of a run)."""
    total: dict[int, int] = {}
    for h in hs:
        for v, c in zip(h["values"], h["counts"], strict=True):
            total[int(v)] = total.get(int(v), 0) + int(c)
    keys = sorted(total)
    return {"values": keys, "counts": [total[k] for k in keys]}


# ----- time accounting ------------------------------------------------------------------------


class Stopwatch:
    """Wall time per named section, summed until `take()`: `with sw("push"): ...`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._sums: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            self._sums[name] = self._sums.get(name, 0.0) + self._clock() - t0

    def take(self, prefix: str = "time/") -> dict[str, float]:
        """Seconds per section since the last take (`time/<name>`), then reset."""
        out = {f"{prefix}{k}": v for k, v in self._sums.items()}
        self._sums.clear()
        return out


class IdleMeter:
    """Share of wall time spent waiting, for `generator/idle_pct` and `learner/wait_pct`.

    Waits may overlap (many coroutines awaiting at once): time counts as idle while at least
    one `waiting()` block is open, so the share never exceeds 100%.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        now = clock()
        self._window_start = now
        self._open = 0
        self._idle_since = 0.0
        self._idle = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self._open == 0:
            self._idle_since = self._clock()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                self._idle += self._clock() - self._idle_since

    def take_pct(self) -> float:
        """Idle % of the wall time since the previous call (or creation), then start a new window."""
        now = self._clock()
        idle = self._idle
        if self._open:  # an open wait counts up to now and continues in the next window
            idle += now - self._idle_since
            self._idle_since = now
        window = now - self._window_start
        self._window_start, self._idle = now, 0.0
        return 100.0 * idle / window if window > 0 else 0.0


# ----- reading ---------------------------------------------------------------------------------


class MetricsTail:
    """Reads the records appended to a metrics JSONL file since the last call (live runs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next call
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by a crash; the rest of the file is still good
        return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, sorted by step; for a repeated step (after a resume from an
    earlier checkpoint) the later line wins."""
    by_step: dict[int, dict[str, Any]] = {}
    tail = MetricsTail(path)
    for rec in tail.read_new():
        if isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
