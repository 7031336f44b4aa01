"""`slime-async plot RUN_DIR`: PNG figures from a run's metrics JSONL files.

Writes into RUN_DIR/plots (or --out):
  reward.png      reward (and accuracy) against step and against wall time
  staleness.png   staleness histogram over the whole run, and mean/max staleness against step
  throughput.png  generation and training tokens/s over wall time; generator idle %, learner wait %
  training.png    loss, grad norm, response length, importance weights, clip fraction, push time
A figure whose metrics the run never logged is skipped with a note.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from slime_async import metrics as m

HELP = "draw PNGs (reward, staleness, throughput, training) from a run directory's metrics"

# training.png: one panel per entry, each with the keys of that entry the run logged.
TRAINING_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", (m.LOSS, "pg_loss")),
    ("grad norm", (m.GRAD_NORM,)),
    ("response length (tokens)", (m.RESPONSE_LEN,)),
    ("importance weight", (m.IW_MEAN, m.IW_MAX, "ratio", "ratio_max")),
    ("clipped fraction", (m.CLIP_FRAC,)),
    ("weight push (s)", (m.PUSH_S,)),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics/*.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default RUN_DIR/plots)")


def _series(records: list[dict[str, Any]], key: str, t0: float) -> tuple[list, list, list]:
    """(steps, minutes since t0, values) of the records that carry a number under `key`."""
    rows = [r for r in records if isinstance(r.get(key), (int, float))]
    return (
        [r["step"] for r in rows],
        [(r["time"] - t0) / 60 for r in rows],
        [r[key] for r in rows],
    )


def load_run_metrics(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """role -> its records sorted by step (metrics/<role>.jsonl)."""
    metrics_dir = Path(run_dir) / "metrics"
    return {p.stem: m.read_metrics(p) for p in sorted(metrics_dir.glob("*.jsonl"))}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures of `run_dir`; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    by_role = load_run_metrics(run_dir)
    records = [r for recs in by_role.values() for r in recs]
    if not records:
        raise FileNotFoundError(f"{run_dir}: no metrics records under {Path(run_dir) / 'metrics'}")
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    t0 = min(r["time"] for r in records if isinstance(r.get("time"), (int, float)))
    learner = by_role.get("learner", records)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    # reward ------------------------------------------------------------------------------------
    curves = [(k, _series(learner, k, t0)) for k in (m.REWARD, m.ACCURACY)]
    curves = [(k, s) for k, s in curves if s[0]]
    if curves:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
        for key, (steps, minutes, values) in curves:
            by_step.plot(steps, values, marker=".", label=key)
            by_time.plot(minutes, values, marker=".", label=key)
        by_step.set_xlabel("step")
        by_time.set_xlabel("wall time (min)")
        for ax in (by_step, by_time):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle("reward")
        save(fig, "reward.png")
    else:
        print(
            f"plot: no '{m.REWARD}' or '{m.ACCURACY}' records; reward.png skipped", file=sys.stderr
        )

    # staleness ---------------------------------------------------------------------------------
    hists = [r[m.STALENESS_HIST] for r in learner if isinstance(r.get(m.STALENESS_HIST), dict)]
    hists = [h for h in hists if "values" in h]
    stale_curves = [(k, _series(learner, k, t0)) for k in (m.STALENESS_MEAN, m.STALENESS_MAX)]
    stale_curves = [(k, s) for k, s in stale_curves if s[0]]
    if hists or stale_curves:
        fig, (hist_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4))
        if hists:
            total = m.merge_int_histograms(hists)
            hist_ax.bar(total["values"], total["counts"], width=0.8)
            hist_ax.set_xlabel("staleness (policy versions behind the learner)")
            hist_ax.set_ylabel("trajectories")
            hist_ax.set_xticks(total["values"])
        for key, (steps, _minutes, values) in stale_curves:
            step_ax.plot(steps, values, marker=".", label=key)
        step_ax.set_xlabel("step")
        if stale_curves:
            step_ax.legend()
        step_ax.grid(alpha=0.3)
        fig.suptitle("staleness")
        save(fig, "staleness.png")
    else:
        print("plot: no staleness records; staleness.png skipped", file=sys.stderr)

    # throughput ----------------------------------------------------------------------------------
    rates = [
        (f"{role}: {k}", _series(recs, k, t0))
        for role, recs in by_role.items()
        for k in (m.GEN_TOKENS_PER_S, m.TRAIN_TOKENS_PER_S)
    ]
    idles = [
        (f"{role}: {k}", _series(recs, k, t0))
        for role, recs in by_role.items()
        for k in (m.GENERATOR_IDLE_PCT, m.LEARNER_WAIT_PCT)
    ]
    rates = [(k, s) for k, s in rates if s[0]]
    idles = [(k, s) for k, s in idles if s[0]]
    if rates or idles:
        fig, (rate_ax, idle_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for label, (_steps, minutes, values) in rates:
            rate_ax.plot(minutes, values, marker=".", label=label)
        rate_ax.set_ylabel("tokens/s")
        for label, (_steps, minutes, values) in idles:
            idle_ax.plot(minutes, values, marker=".", label=label)
        idle_ax.set_ylabel("% of wall time")
        idle_ax.set_ylim(0, 100)
        for ax in (rate_ax, idle_ax):
            ax.set_xlabel("wall time (min)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend()
        fig.suptitle("throughput")
        save(fig, "throughput.png")
    else:
        print("plot: no throughput records; throughput.png skipped", file=sys.stderr)

    # training ------------------------------------------------------------------------------------
    panels = [
        (title, [(k, _series(learner, k, t0)) for k in keys]) for title, keys in TRAINING_PANELS
    ]
    panels = [(title, [(k, s) for k, s in curves if s[0]]) for title, curves in panels]
    panels = [(title, curves) for title, curves in panels if curves]
    if panels:
        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
        for ax, (title, curves) in zip(axes.flat, panels, strict=False):
            for key, (steps, _minutes, values) in curves:
                ax.plot(steps, values, marker=".", label=key)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        save(fig, "training.png")
    else:
        print("plot: no training records; training.png skipped", file=sys.stderr)
    return written


def main(args: argparse.Namespace) -> int:
    try:
        written = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"slime-async plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
