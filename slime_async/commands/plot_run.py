"""The figures of one run directory (`slime-async plot RUN_DIR`), drawn by the rules of
`figures.py`:

  reward.png      reward (its own panel) and accuracy (training, and the pinned evaluation in
                  bold), against step and against wall time
  staleness.png   staleness histogram over the run, and mean/max staleness against step
  throughput.png  generation and training tokens/s over wall time; generator idle %, learner wait %
  training.png    loss, grad norm (log axis when it spans decades), response length, importance
                  weights, clip fraction, push time
A figure whose metrics the run never logged is skipped with a note.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from slime_async import metrics as m
from slime_async.commands.figures import (
    EVAL,
    distinct_colours,
    integer_ticks,
    log_if_spread,
    plot_smoothed,
)

# training.png: one panel per entry (title, y label, keys), each with the keys the run logged.
TRAINING_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("loss", "loss per token", (m.LOSS, "pg_loss")),
    ("grad norm", "gradient norm (before clipping)", (m.GRAD_NORM,)),
    ("response length", "tokens per response", (m.RESPONSE_LEN,)),
    ("importance weight", "weight", (m.IW_MEAN, m.IW_MAX, "ratio", "ratio_max")),
    ("clipped fraction", "share of tokens", (m.CLIP_FRAC,)),
    ("weight push", "seconds", (m.PUSH_S,)),
)


MAXIMA = frozenset({m.STALENESS_MAX, m.IW_MAX, "ratio_max", m.RESPONSE_LEN_MAX})
"""Per-step maxima: drawn as they are (a rolling mean of maxima is no step's maximum)."""


def series(records: list[dict[str, Any]], key: str, t0: float) -> tuple[list, list, list]:
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

    def save(fig: Any, name: str, title: str) -> None:
        fig.suptitle(f"{title} — {Path(run_dir).name}")
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    for draw in (reward_figure, staleness_figure, throughput_figure, training_figure):
        drawn = draw(plt, learner, by_role, t0)
        if drawn is None:
            continue
        fig, name, title = drawn
        save(fig, name, title)
    return written


def reward_figure(plt: Any, learner: list, by_role: dict, t0: float):
    reward = series(learner, m.REWARD, t0)
    acc = [(k, series(learner, k, t0)) for k in (m.ACCURACY,)]
    evals = by_role.get("eval", [])
    acc += [(k, series(evals, k, t0)) for k in (m.EVAL_ACC_GREEDY, m.EVAL_ACC_SAMPLED)]
    acc = [(k, s) for k, s in acc if s[0]]
    if not reward[0] and not acc:
        print(
            f"plot: no '{m.REWARD}' or '{m.ACCURACY}' records; reward.png skipped", file=sys.stderr
        )
        return None
    colour = distinct_colours([m.REWARD, m.ACCURACY, m.EVAL_ACC_GREEDY, m.EVAL_ACC_SAMPLED])
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), squeeze=False)
    for row, (xi, xlabel) in enumerate(((0, "learner step"), (1, "wall time (min)"))):
        r_ax, a_ax = axes[row]
        if reward[0]:
            plot_smoothed(r_ax, reward[xi], reward[2], m.REWARD, colour[m.REWARD])
        r_ax.set_ylabel("reward (mean per step)")
        r_ax.set_title("reward")
        for key, s in acc:
            pct = [100 * v for v in s[2]]
            if key == m.ACCURACY:
                plot_smoothed(a_ax, s[xi], pct, "training accuracy", colour[key])
            else:
                a_ax.plot(s[xi], pct, color=colour[key], label=key, **EVAL)
        a_ax.set_ylabel("accuracy (%)")
        a_ax.set_ylim(0, 100)
        a_ax.set_title("accuracy: training, and the pinned evaluation (bold)")
        for ax in (r_ax, a_ax):
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    return fig, "reward.png", "reward and accuracy"


def staleness_figure(plt: Any, learner: list, by_role: dict, t0: float):
    hists = [r[m.STALENESS_HIST] for r in learner if isinstance(r.get(m.STALENESS_HIST), dict)]
    hists = [h for h in hists if "values" in h]
    curves = [(k, series(learner, k, t0)) for k in (m.STALENESS_MEAN, m.STALENESS_MAX)]
    curves = [(k, s) for k, s in curves if s[0]]
    if not hists and not curves:
        print("plot: no staleness records; staleness.png skipped", file=sys.stderr)
        return None
    fig, (hist_ax, step_ax) = plt.subplots(1, 2, figsize=(12, 4))
    if hists:
        total = m.merge_int_histograms(hists)
        hist_ax.bar(total["values"], total["counts"], width=0.8)
        hist_ax.set_xticks(total["values"])
    hist_ax.set_xlabel("staleness (policy versions behind the learner)")
    hist_ax.set_ylabel("trajectories trained")
    hist_ax.set_title("over the whole run")
    colour = distinct_colours([k for k, _ in curves])
    for key, (steps, _minutes, values) in curves:
        how = "none" if key in MAXIMA else "mean"
        plot_smoothed(step_ax, steps, values, key, colour[key], how)
    step_ax.set_xlabel("learner step")
    step_ax.set_ylabel("staleness (versions)")
    step_ax.set_title("per step")
    integer_ticks(step_ax, "y")
    if step_ax.lines:
        step_ax.legend(fontsize=8)
    for ax in (hist_ax, step_ax):
        ax.grid(alpha=0.3)
    return fig, "staleness.png", "staleness"


def throughput_figure(plt: Any, learner: list, by_role: dict, t0: float):
    def found(keys: tuple[str, ...]) -> list:
        got = [
            (f"{role}: {k}", series(recs, k, t0)) for role, recs in by_role.items() for k in keys
        ]
        return [(label, s) for label, s in got if s[0]]

    rates = found((m.GEN_TOKENS_PER_S, m.TRAIN_TOKENS_PER_S))
    idles = found((m.GENERATOR_IDLE_PCT, m.LEARNER_WAIT_PCT))
    if not rates and not idles:
        print("plot: no throughput records; throughput.png skipped", file=sys.stderr)
        return None
    colour = distinct_colours([label for label, _ in rates + idles])
    fig, (rate_ax, idle_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for ax, curves, ylabel, title in (
        (rate_ax, rates, "tokens/s", "throughput"),
        (idle_ax, idles, "% of wall time", "waiting"),
    ):
        for label, (_steps, minutes, values) in curves:
            plot_smoothed(ax, minutes, values, label, colour[label])
        ax.set_xlabel("wall time (min)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    idle_ax.set_ylim(0, 100)
    return fig, "throughput.png", "throughput"


def training_figure(plt: Any, learner: list, by_role: dict, t0: float):
    panels = []
    for title, ylabel, keys in TRAINING_PANELS:
        curves = [(k, series(learner, k, t0)) for k in keys]
        curves = [(k, s) for k, s in curves if s[0]]
        if curves:
            panels.append((title, ylabel, curves))
    if not panels:
        print("plot: no training records; training.png skipped", file=sys.stderr)
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, ylabel, curves) in zip(axes.flat, panels, strict=False):
        colour = distinct_colours([k for k, _ in curves])
        label = log_if_spread(ax, [v for _, s in curves for v in s[2]], ylabel)
        how = "median" if ax.get_yscale() == "log" else "mean"
        for key, (steps, _minutes, values) in curves:
            plot_smoothed(ax, steps, values, key, colour[key], "none" if key in MAXIMA else how)
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    return fig, "training.png", "training"
