"""`slime-async sweep`: every point of a grid x seeds, one run directory each, and a summary.

    sweep_dir/
      sweep.json                     the grid, seeds, base configs and overrides (checked on resume)
      fixed_lag-2__loss-tis/seed0/   a complete `slime-async run` directory, + SWEEP_DONE at success
      fixed_lag-2__loss-tis/seed0.out  the run's console output
      summary.json, summary.md       one row per point (mean +- sd over seeds), one per run in json
      plots/                         `slime-async plot` of all runs, overlaid by point

Points run on this machine, one after another or `jobs` at once (`--jobs N`), each as
`python -m slime_async run CONFIG... KEY=VALUE...` (the same machinery as a single run: its own
supervisor owns the point's processes, and its own free ports and run directory keep concurrent
points apart). The summary reads the run directories in grid order, so it is the same whatever
order the points finished in. Running points across a Ray cluster is not built.
Resumable: a point whose run directory holds `SWEEP_DONE` is not run again; an unfinished one
(killed sweep) is moved aside to `<dir>.failed-<n>` and started afresh (counted, logged).
A time limit (`--time-limit S`, for a machine lent for minutes) makes the sweep stop itself: no
point starts once the runs finished so far say it could not end within S seconds of the sweep's
start, and points still running at S are stopped (SIGTERM to their supervisors, left unfinished
for a resume); the summary then covers what finished.
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_async.config.moved import moved_key
from slime_async.launch.paired_summary import paired_summary, paired_table
from slime_async.metrics import names as M
from slime_async.metrics import read_metrics

DONE = "SWEEP_DONE"
"""Written into a point's run directory when its run exited 0."""


@dataclass(frozen=True)
class Point:
    """One grid point: its overrides in grid order."""

    items: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """`fixed_lag-2__loss-tis`: the last part of each key and its value. Never an "=": a path
        with one would read as a KEY=VALUE override on a command line."""
        return "__".join(f"{_short(k)}-{_safe(v)}" for k, v in self.items) or "base"

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.items]


def _matches(point: Point, rule: list[tuple[str, list[str]]]) -> bool:
    values = dict(point.items)
    return all(values.get(key) in allowed for key, allowed in rule)


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _safe(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", value)  # no "=", "/", spaces


@dataclass
class Sweep:
    """A grid over config keys, crossed with seeds, run `jobs` points at a time."""

    configs: list[str]
    grid: list[tuple[str, list[str]]]
    seeds: int = 1
    out: Path = Path("runs/sweep")
    overrides: list[str] = field(default_factory=list)
    target_accuracy: float | None = None
    metric: str = M.EVAL_ACC_GREEDY
    seed_base: int = 0
    jobs: int = 1
    """Points run at once on this machine, each its own `slime-async run`."""
    exclude: list[list[tuple[str, list[str]]]] = field(default_factory=list)
    """Points left out: one where, for every key of an entry, its value is one of the listed
    (e.g. lag 0 with all but one loss: at lag 0 every loss is the same objective)."""
    time_limit_s: float | None = None
    """Stop the sweep by this many seconds after it started (None: no limit): no point starts
    that the longest finished run says would end later, running points are stopped at it."""
    reference: str | None = None
    """The point every other is compared with, seed by seed (its name, or its `key=value`
    pairs separated by spaces); None: no paired comparison."""
    equivalence: float | None = None
    """TOST margin in points of the metric (x 100): a point is equivalent to the reference when
    its paired 90% interval lies within +-this (None: no equivalence test)."""

    def __post_init__(self) -> None:
        self.out = Path(self.out).absolute()
        shorts = [_short(k) for k, _ in self.grid]
        if len(set(shorts)) != len(shorts):
            raise ValueError(
                f"--grid keys {shorts}: two end in the same name (run directories are named by it)"
            )
        if len({k for k, _ in self.grid}) != len(self.grid):
            raise ValueError("--grid: a key is given twice")
        if self.seeds < 1:
            raise ValueError("--seeds must be >= 1")
        if self.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        for rule in self.exclude:
            unknown = [k for k, _ in rule if k not in {key for key, _ in self.grid}]
            if unknown:
                raise ValueError(f"--exclude {unknown}: not a --grid key (nothing to leave out)")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError("--time-limit must be > 0 seconds")
        if self.equivalence is not None and self.equivalence <= 0:
            raise ValueError("--equivalence must be > 0 points")
        if self.equivalence is not None and self.reference is None:
            raise ValueError("--equivalence needs --reference (the point to be equivalent to)")
        if self.reference is not None:
            self.reference_point()  # a reference that names no point fails now, not at the end

    def reference_point(self) -> Point:
        """The grid point `reference` names (by name, or by all of its key=value pairs)."""
        ref = self.reference or ""
        points = self.points()
        if "=" in ref:
            rule = parse_exclude([ref])[0]
            hits = [p for p in points if _matches(p, rule) and len(rule) == len(p.items)]
        else:
            hits = [p for p in points if p.name == ref]
        if len(hits) != 1:
            names = ", ".join(p.name for p in points)
            raise ValueError(f"--reference {ref!r} names no single grid point (points: {names})")
        return hits[0]

    def points(self) -> list[Point]:
        keys = [k for k, _ in self.grid]
        every = [
            Point(tuple(zip(keys, vals, strict=True)))
            for vals in itertools.product(*(v for _, v in self.grid))
        ]
        return [p for p in every if not any(_matches(p, rule) for rule in self.exclude)]

    def run_dir(self, point: Point, seed: int) -> Path:
        return self.out / point.name / f"seed{seed}"

    def seed_values(self) -> list[int]:
        return [self.seed_base + i for i in range(self.seeds)]

    # ------------------------------------------------------------------------------- running
    def describe(self) -> dict[str, Any]:
        return {
            "configs": [str(Path(c).absolute()) for c in self.configs],
            "grid": [[k, v] for k, v in self.grid],
            "overrides": self.overrides,
            "seeds": self.seed_values(),
            "exclude": [[[k, v] for k, v in rule] for rule in self.exclude],
        }

    def check_resume(self) -> None:
        """A sweep directory holds one sweep: refuse another grid or base config in it."""
        meta = self.out / "sweep.json"
        if meta.exists():
            old = json.loads(meta.read_text())
            new = self.describe()
            for key in ("configs", "overrides"):
                if old.get(key) != new[key]:
                    raise ValueError(
                        f"{self.out} holds a sweep with other {key} ({old.get(key)}); "
                        "use another --out"
                    )
        self.out.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(self.describe(), indent=2) + "\n")

    def run(self, log: Any = print) -> dict[str, int]:
        """Run every unfinished (point, seed), up to `jobs` at once; return counts: ran, skipped,
        failed, restarted (and with a time limit: stopped at it, not started for it)."""
        self.check_resume()
        counts = {"ran": 0, "skipped": 0, "failed": 0, "restarted": 0}
        if self.time_limit_s is not None:
            counts.update(stopped=0, not_started=0)
        # Seed-major: every point once before any point twice (a cut-short sweep still compares).
        todo = [(p, s) for s in self.seed_values() for p in self.points()]
        pending: list[tuple[str, Point, int, Path]] = []
        for n, (point, seed) in enumerate(todo, 1):
            rd = self.run_dir(point, seed)
            tag = f"[sweep {n}/{len(todo)}] {point.name} seed {seed}"
            if (rd / DONE).exists():
                counts["skipped"] += 1
                log(f"{tag}: finished before, skipped ({rd / DONE})")
                continue
            if rd.exists():  # a killed sweep left it unfinished: keep it aside, start afresh
                k = 1
                while rd.with_name(f"{rd.name}.failed-{k}").exists():
                    k += 1
                rd.rename(rd.with_name(f"{rd.name}.failed-{k}"))
                counts["restarted"] += 1
                log(f"{tag}: unfinished run directory moved to {rd.name}.failed-{k}; rerunning")
            pending.append((tag, point, seed, rd))
        for (tag, point, seed, rd), code, t0, t1 in self._run_all(pending, log, counts):
            if code is None:  # stopped at the time limit: unfinished, resumable
                counts["stopped"] += 1
                continue
            if code == 0:
                counts["ran"] += 1
                info = {
                    "point": point.name,
                    "overrides": point.overrides,
                    "seed": seed,
                    "seconds": t1 - t0,
                    "started": t0,
                    "finished": t1,
                }
                (rd / DONE).write_text(json.dumps(info) + "\n")
            else:
                counts["failed"] += 1
                log(f"{tag}: FAILED with exit code {code}; see {rd}.out (left unfinished)")
        return counts

    def _run_all(
        self, pending: list[tuple[str, Point, int, Path]], log: Any, counts: dict[str, int]
    ) -> Iterator[Any]:
        """Start the runs of `pending` in order, at most `jobs` at a time; yield each one as it
        ends: (its entry, exit code or None if stopped at the time limit, start and end time in
        epoch seconds).

        One thread per running point only waits for its process and reports to the main thread,
        which starts the next one. SIGTERM to the sweep is passed on to every running point's
        supervisor (which stops its roles), and the sweep stops after they have ended; so does a
        point killed by a signal (the others are stopped the same way). At the time limit the
        running points are stopped the same way, but the sweep returns normally (its summary
        covers what finished) and counts what it stopped or never started."""
        done: queue.Queue[tuple[int, int]] = queue.Queue()
        running: dict[int, tuple[subprocess.Popen, Any, float]] = {}
        stopping: list[str] = []
        t_start = time.time()
        deadline = None if self.time_limit_s is None else t_start + self.time_limit_s
        longest = [0.0]  # the longest finished run so far: how long a new one would take
        timed_out: list[str] = []

        def stop_all(reason: str) -> None:
            if not stopping:
                stopping.append(reason)
            for proc, _, _ in running.values():
                if proc.poll() is None:
                    proc.terminate()

        def on_sigterm(*_: Any) -> None:
            stop_all("the sweep got SIGTERM")

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        waiting = list(enumerate(pending))
        try:
            while waiting or running:
                if deadline is not None and "hard" not in timed_out:
                    now = time.time()
                    if now >= deadline:
                        timed_out.append("hard")
                        log(
                            f"sweep: time limit of {self.time_limit_s:.0f} s reached: stopping "
                            f"{len(running)} running point(s), {len(waiting)} not started"
                        )
                        for proc, _, _ in running.values():
                            if proc.poll() is None:
                                proc.terminate()
                    elif waiting and len(running) < self.jobs and now + longest[0] > deadline:
                        timed_out.append("soft")
                        log(
                            f"sweep: {len(waiting)} point(s) not started: one takes up to "
                            f"{longest[0]:.0f} s and {deadline - now:.0f} s of the time limit "
                            "are left (rerun the same command to resume)"
                        )
                if timed_out and waiting:
                    counts["not_started"] += len(waiting)
                    waiting.clear()
                while waiting and len(running) < self.jobs and not stopping:
                    i, (tag, point, seed, rd) = waiting.pop(0)
                    proc = self._launch(point, seed, rd, tag, log)
                    running[i] = (proc, pending[i], time.time())
                    threading.Thread(
                        target=lambda i=i, p=proc: done.put((i, p.wait())),
                        name=f"sweep-wait-{i}",
                        daemon=True,
                    ).start()
                if not running:
                    break  # stopping: nothing left to wait for
                try:
                    i, code = done.get(timeout=1.0)  # bounded, so a signal is handled promptly
                except queue.Empty:
                    continue
                proc, entry, t0 = running.pop(i)
                t1 = time.time()
                tag = entry[0]
                log(f"{tag}: exit {code} after {t1 - t0:.0f}s")
                if code == 0:
                    longest[0] = max(longest[0], t1 - t0)
                if "hard" in timed_out and (code < 0 or code == 128 + signal.SIGTERM):
                    log(f"{tag}: stopped at the time limit (unfinished; a rerun starts it afresh)")
                    yield entry, None, t0, t1
                    continue
                if code < 0 or code == 128 + signal.SIGTERM:
                    stop_all(f"{tag} was stopped by a signal (exit {code})")
                    continue
                yield entry, code, t0, t1
        except BaseException:
            stop_all("the sweep was interrupted")
            for proc, _, _ in running.values():
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    log(f"sweep: pid {proc.pid} still running after SIGTERM + 120 s; SIGKILL")
                    proc.kill()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        if stopping:
            raise SystemExit(f"[sweep] {stopping[0]}; the sweep stops (rerun it to resume)")

    def _launch(self, point: Point, seed: int, rd: Path, tag: str, log: Any) -> subprocess.Popen:
        """Start one point's `slime-async run` (its own supervisor, ports and run directory)."""
        rd.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "slime_async",
            "run",
            *self.configs,
            *self.overrides,
            *point.overrides,
            f"run.seed={seed}",
            f"run.run_dir={rd}",
            "run.progress=plain",
        ]
        log(f"{tag}: {' '.join(argv[3:])}")
        with open(rd.with_name(rd.name + ".out"), "w") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    # ------------------------------------------------------------------------------- summary
    def summarize(self) -> dict[str, Any]:
        """Per run and per point (mean +- sd over the finished seeds); written as JSON and MD."""
        runs, rows = [], []
        for point in self.points():
            mine = []
            for seed in self.seed_values():
                rd = self.run_dir(point, seed)
                if (rd / DONE).exists():
                    r = run_summary(rd, self.metric, self.target_accuracy)
                    r.update(point=point.name, seed=seed, run_dir=str(rd))
                    mine.append(r)
            runs += mine
            rows.append(point_row(point, mine, len(self.seed_values())))
        out = {
            "metric": self.metric,
            "target_accuracy": self.target_accuracy,
            "points": rows,
            "runs": runs,
        }
        if self.reference is not None:
            out["paired"] = paired_summary(
                self.points(), runs, self.reference_point(), self.metric, self.equivalence
            )
        self.out.mkdir(parents=True, exist_ok=True)  # --summary-only of a sweep not run yet
        (self.out / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
        (self.out / "summary.md").write_text(markdown_table(out) + "\n")
        return out


# ----------------------------------------------------------------------------------- one run
def _learner_start(rd: Path, learner: list[dict[str, Any]]) -> float:
    ready = rd / "ready" / "learner"
    if ready.exists():
        return ready.stat().st_mtime
    first = learner[0]
    return first["time"] - float(first.get(M.STEP_SECONDS, 0.0))


def run_summary(rd: str | Path, metric: str, target: float | None) -> dict[str, Any]:
    """The numbers of one finished run (see `COLUMNS`)."""
    rd = Path(rd)
    learner = read_metrics(rd / "metrics" / "learner.jsonl")
    evals = [r for r in read_metrics(rd / "metrics" / "eval.jsonl") if metric in r]
    if not learner:
        raise FileNotFoundError(f"{rd}: no learner metrics")
    t0 = _learner_start(rd, learner)
    span = max(learner[-1]["time"] - t0, 1e-9)
    tokens = [float(r.get(M.TOKENS, 0.0)) for r in learner]
    given = sum(float(r.get(M.GROUPS_GIVEN, 0.0)) for r in learner)
    dropped = float(learner[-1].get(M.BUFFER_DROPPED_ALL, 0.0))
    masked = sum(float(r.get(M.STALE_MASKED_GROUPS, 0.0)) for r in learner)
    out: dict[str, Any] = {
        "steps": len(learner),
        "wall_s": span,
        "trained_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / span,
        "dropped_share": dropped / max(given + dropped, 1.0),
        "masked_share": masked / max(given, 1.0),
        "iw_mean": _mean(learner, M.IW_MEAN),
        # cut at the bound: clamped (truncate: tis, decoupled_ppo) or zeroed (mask: mis)
        "iw_truncated": _first_of(
            _mean(learner, M.IS_TRUNCATED_FRAC), _mean(learner, M.IS_DROPPED_FRAC)
        ),
        "iw_ess": _mean(learner, M.IW_ESS),
        "clip_frac": _mean(learner, M.CLIP_FRAC),
        # naive PPO's failure against a far-away mu: ratios outside the trust region
        "ratio_outside": _mean(learner, M.RATIO_OUTSIDE),
        "lag_min": min((r.get(M.STALENESS_LEARNER_MIN, math.inf) for r in learner), default=None),
        "lag_max": max((r.get(M.STALENESS_LEARNER_MAX, -1) for r in learner), default=None),
        "train_accuracy_last10": _mean(learner[-10:], M.ACCURACY),
        "eval_first": evals[0][metric] if evals else None,
        "eval_final": evals[-1][metric] if evals else None,
        "eval_final_version": evals[-1]["step"] if evals else None,
        # whole-answer diagnostics of the behaviour weights (the token ESS hides them)
        "seq_ess": _mean(learner, M.SEQ_IW_ESS),
        "log_ratio_m2": _mean(learner, M.LOG_RATIO_M2),
        "seq_max_log_ratio": _mean(learner, M.SEQ_MAX_LOG_RATIO),
        "eval_curve": [[r["step"], r["time"] - t0, r[metric]] for r in evals],
    }
    out["time_to_target_s"] = out["tokens_to_target"] = None
    if target is not None:
        hit = next((r for r in evals if r[metric] >= target), None)
        if hit is not None:
            out["time_to_target_s"] = max(hit["time"] - t0, 0.0)
            # version v is the weights after step v (no skipped batches): its tokens so far
            out["tokens_to_target"] = sum(
                float(r.get(M.TOKENS, 0.0)) for r in learner if r["step"] <= hit["step"]
            )
    return out


def _first_of(*xs: float | None) -> float | None:
    return next((x for x in xs if x is not None), None)


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    xs = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------------- one point
def _stats(xs: list[Any]) -> tuple[float | None, float | None]:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def point_row(point: Point, runs: list[dict[str, Any]], seeds: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "point": point.name,
        "overrides": point.overrides,
        "runs": len(runs),
        "seeds": seeds,
    }
    for key in (
        "eval_final",
        "eval_first",
        "time_to_target_s",
        "tokens_to_target",
        "tokens_per_s",
        "dropped_share",
        "masked_share",
        "iw_mean",
        "iw_truncated",
        "iw_ess",
        "clip_frac",
        "ratio_outside",
        "seq_ess",
        "log_ratio_m2",
        "seq_max_log_ratio",
        "wall_s",
    ):
        row[key], row[key + "_sd"] = _stats([r.get(key) for r in runs])
    row["reached_target"] = sum(r.get("time_to_target_s") is not None for r in runs)
    row["lag_min"] = min((r["lag_min"] for r in runs if r.get("lag_min") is not None), default=None)
    row["lag_max"] = max((r["lag_max"] for r in runs if r.get("lag_max") is not None), default=None)
    return row


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def markdown_table(summary: dict[str, Any]) -> str:
    target = summary.get("target_accuracy")
    metric = summary["metric"]
    head = [
        "point",
        "runs",
        f"final {metric} (%)",
        "first (%)",
        f"time to {'' if target is None else f'{100 * target:.0f}% '}(s)",
        "tokens to target",
        "trained tok/s",
        "dropped / masked groups",
        "IW mean",
        "IW cut at bound",
        "IW ESS",
        "clip frac",
        "outside trust region",
        "answer ESS",
        "M2",
        "max log-ratio / answer",
        "trained lag",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in summary["points"]:
        reached = f" ({r['reached_target']}/{r['runs']})" if target is not None else ""
        lag = (
            "-"
            if r["lag_min"] is None
            else (
                f"{r['lag_min']:.0f}"
                if r["lag_min"] == r["lag_max"]
                else f"{r['lag_min']:.0f}-{r['lag_max']:.0f}"
            )
        )
        cells = [
            f"`{r['point']}`",
            f"{r['runs']}/{r['seeds']}",
            f"{_fmt(r['eval_final'], '.1f', 100)} ± {_fmt(r['eval_final_sd'], '.1f', 100)}",
            _fmt(r["eval_first"], ".1f", 100),
            _fmt(r["time_to_target_s"], ".0f") + reached,
            _fmt(r["tokens_to_target"], ".3g"),
            _fmt(r["tokens_per_s"], ".0f"),
            f"{_fmt(r['dropped_share'], '.1%')} / {_fmt(r['masked_share'], '.1%')}",
            _fmt(r["iw_mean"], ".3f"),
            _fmt(r["iw_truncated"], ".2%"),
            _fmt(r["iw_ess"], ".3f"),
            _fmt(r["clip_frac"], ".2%"),
            _fmt(r.get("ratio_outside"), ".2%"),
            _fmt(r.get("seq_ess"), ".3f"),
            _fmt(r.get("log_ratio_m2"), ".2e"),
            _fmt(r.get("seq_max_log_ratio"), ".3f"),
            lag,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if summary.get("paired"):
        lines += ["", paired_table(summary["paired"])]
    return "\n".join(lines)


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`["buffer.fixed_lag=0,2", "algo.loss=tis,mis"]` -> [(key, [values...]), ...]."""
    grid = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or "." not in key or not vals:
            raise ValueError(f"--grid {spec!r}: expected section.key=v1,v2,...")
        if (why := moved_key(key.strip())) is not None:  # an --exclude pair would match nothing
            raise ValueError(f"--grid {spec!r}: {why}")
        grid.append((key.strip(), vals))
    return grid


def parse_exclude(specs: list[str]) -> list[list[tuple[str, list[str]]]]:
    """`["buffer.fixed_lag=0 algo.loss=tis,mis"]` -> one rule per spec: its pairs, space-separated."""
    rules = []
    for spec in specs:
        pairs = spec.split()
        if not pairs:
            raise ValueError("--exclude '': expected 'section.key=v1,v2 [section.key=v ...]'")
        rules.append(parse_grid(pairs))
    return rules


def clear_point(sweep: Sweep, point: Point) -> None:
    """Forget a point's runs (tests, or to redo it on purpose)."""
    for seed in sweep.seed_values():
        shutil.rmtree(sweep.run_dir(point, seed), ignore_errors=True)
