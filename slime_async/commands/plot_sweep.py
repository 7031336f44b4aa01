"""Figures over several runs: a sweep's (its run directories, or only its summary.json) or any
runs named together, drawn by the rules of `figures.py`.

A sweep's grid decides the layout: the first grid key whose values are all integers (a lag) is
the x axis or the colour, ordered; the other keys (a loss) make one panel per value. Seeds of one
point are one line: their mean, with a band or bar for its 95% interval.

  eval_accuracy.png      the evaluation metric against the evaluated version, per point
  sweep_final.png        the last evaluation per point (and the first, in grey); below it the
                         seconds to the target accuracy, when the summary has a target
  staleness_hist.png     the lag of every trained trajectory, per point (run directories only)
  iw_by_lag.png          importance weight pi_prox/mu and its ESS by lag, per panel key
  trust_region_by_lag.png  clip fraction and tokens outside the trust region by lag
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_async import metrics as m
from slime_async.commands.figures import (
    distinct_colours,
    integer_ticks,
    mean_interval,
    ordered_colours,
)
from slime_async.commands.plot_run import load_run_metrics


@dataclass
class SweepRun:
    """One run of a sweep (or one of several runs), as the figures need it."""

    point: str
    """Its grid point's name (`fixed_lag-2__loss-tis`), or the run directory's name."""
    params: dict[str, str]
    """The point's grid values by short key (`fixed_lag` -> "2"); empty outside a sweep."""
    curve: list[tuple[int, float, float]]
    """(evaluated version, seconds since the learner was ready, metric value)."""
    learner: list[dict[str, Any]] = field(default_factory=list)
    """The learner's records ([] when read from a summary)."""
    time_to_target_s: float | None = None


def _params_of(point: str) -> dict[str, str]:
    parts = [] if point == "base" else point.split("__")
    if not all("-" in p for p in parts):
        return {}
    return dict(p.split("-", 1) for p in parts)


def _is_int(text: str | None) -> bool:
    return text is not None and re.fullmatch(r"-?\d+", text) is not None


def runs_from_dirs(
    runs: list[tuple[str, Path]], metric: str, target: float | None
) -> list[SweepRun]:
    """`find_runs`' (label, run dir) pairs; a sweep's runs (`<point>/seed<k>`) get their grid
    values from the point's name."""
    out = []
    for label, rd in runs:
        by_role = load_run_metrics(rd)
        learner = by_role.get("learner", [])
        t0 = _learner_t0(rd, learner)
        rows = [r for r in by_role.get("eval", []) if isinstance(r.get(metric), (int, float))]
        curve = [(int(r["step"]), r["time"] - t0, float(r[metric])) for r in rows]
        swept = re.fullmatch(r"seed\d+", rd.name) is not None and rd.parent.name == label
        reached = [t for _, t, v in curve if target is not None and v >= target]
        out.append(
            SweepRun(
                label,
                _params_of(label) if swept else {},
                curve,
                learner,
                min(reached, default=None),
            )
        )
    return out


def runs_from_summary(path: Path) -> tuple[list[SweepRun], str, float | None]:
    """The runs of a sweep's summary.json, its metric and its target accuracy."""
    summary = json.loads(path.read_text())
    params = {
        p["point"]: {
            k.rsplit(".", 1)[-1]: v for k, _, v in (o.partition("=") for o in p["overrides"])
        }
        for p in summary.get("points", [])
    }
    runs = [
        SweepRun(
            r["point"],
            params.get(r["point"], _params_of(r["point"])),
            [(int(v), float(t), float(a)) for v, t, a in r.get("eval_curve") or []],
            time_to_target_s=r.get("time_to_target_s"),
        )
        for r in summary.get("runs", [])
    ]
    if not runs:
        raise FileNotFoundError(f"{path}: a summary without runs")
    return runs, summary.get("metric", m.EVAL_ACC_GREEDY), summary.get("target_accuracy")


def _learner_t0(run_dir: Path, learner: list[dict[str, Any]]) -> float:
    ready = run_dir / "ready" / "learner"
    if ready.exists():
        return ready.stat().st_mtime
    return learner[0]["time"] - float(learner[0].get(m.STEP_SECONDS, 0.0)) if learner else 0.0


@dataclass
class Layout:
    x_key: str | None
    """The ordered key (a lag): the x axis of the final figure, the colour of the curves."""
    panels: dict[str, list[SweepRun]]
    """Panel title -> its runs (one panel per value of the other keys)."""

    def series_of(self, run: SweepRun) -> str:
        return run.params[self.x_key] if self.x_key else run.point

    def colours(self, runs: list[SweepRun]) -> dict[str, Any]:
        if self.x_key:
            return ordered_colours(sorted({r.params[self.x_key] for r in runs}, key=int))
        return distinct_colours([r.point for r in runs])

    def label(self, value: str, n: int) -> str:
        name = f"{self.x_key} = {value}" if self.x_key else value
        return f"{name} ({n} seed{'s' if n != 1 else ''})"


def layout_of(runs: list[SweepRun]) -> Layout:
    keys = list(dict.fromkeys(k for r in runs for k in r.params))
    if not keys or any(set(r.params) != set(keys) for r in runs):
        return Layout(None, {"": runs})
    ints = [k for k in keys if all(_is_int(r.params[k]) for r in runs)]
    x_key = ints[0] if ints else None
    rest = [k for k in keys if k != x_key]
    panels: dict[str, list[SweepRun]] = {}
    for r in runs:
        title = ", ".join(f"{k} = {r.params[k]}" for k in rest)
        panels.setdefault(title, []).append(r)
    return Layout(x_key, panels)


def _grouped(lay: Layout, runs: list[SweepRun]) -> list[tuple[str, list[SweepRun]]]:
    groups: dict[str, list[SweepRun]] = {}
    for r in runs:
        groups.setdefault(lay.series_of(r), []).append(r)
    order = sorted(groups, key=int) if lay.x_key else list(groups)
    return [(k, groups[k]) for k in order]


def _panels(plt: Any, n: int, rows: int = 1, height: float = 4.0):
    cols = min(n, 4)
    grid_rows = -(-n // cols)
    fig, axes = plt.subplots(
        grid_rows * rows, cols, figsize=(4.6 * cols, height * grid_rows * rows), squeeze=False
    )
    return fig, axes, cols


def plot_sweep(runs: list[SweepRun], out: Path, metric: str, save) -> None:
    """eval_accuracy.png and sweep_final.png from `runs`."""
    import matplotlib.pyplot as plt

    lay = layout_of(runs)
    colour = lay.colours(runs)
    if not any(r.curve for r in runs):
        print(f"plot: no '{metric}' records; eval_accuracy.png skipped", file=sys.stderr)
        return
    fig, axes, cols = _panels(plt, len(lay.panels))
    for i, (title, mine) in enumerate(lay.panels.items()):
        ax = axes[i // cols][i % cols]
        groups = _grouped(lay, mine)
        versions_all = sorted({v for r in mine for v, _, _ in r.curve})
        gap = min((b - a for a, b in itertools.pairwise(versions_all)), default=1)
        dodge = 0.5 * gap / max(len(groups), 1)  # error bars of one version side by side
        for j, (value, group) in enumerate(groups):
            versions = sorted({v for r in group for v, _, _ in r.curve})
            pts = [
                mean_interval([100 * a for r in group for v2, _, a in r.curve if v2 == v])
                for v in versions
            ]
            xs = [v + (j - (len(groups) - 1) / 2) * dodge for v in versions]
            ax.errorbar(
                xs,
                [p[0] for p in pts],
                yerr=[p[1] for p in pts],
                marker="o",
                linewidth=2,
                capsize=3,
                color=colour[value],
                label=lay.label(value, len(group)),
            )
        ax.set_title(title or metric)
        ax.set_xlabel("evaluated version (learner step)")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_ylim(0, 100)
        ax.set_xticks(versions_all)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    _hide_rest(axes, len(lay.panels))
    fig.suptitle(f"{metric}: mean over seeds ± 95% t-interval of the mean")
    save(fig, "eval_accuracy.png")
    if lay.x_key is None and len(lay.panels) == 1 and not any(r.params for r in runs):
        return  # runs named together, not a sweep: no grid to summarise
    _final(plt, lay, colour, runs, metric, save)


def _final(plt: Any, lay: Layout, colour: dict, runs: list[SweepRun], metric: str, save) -> None:
    from matplotlib.lines import Line2D

    target = any(r.time_to_target_s is not None for r in runs)
    n = len(lay.panels)
    fig, axes = plt.subplots(
        2 if target else 1, n, figsize=(4.6 * n, 7.5 if target else 4), squeeze=False
    )
    for i, (title, mine) in enumerate(lay.panels.items()):
        ax = axes[0][i]
        groups = _grouped(lay, mine)
        values = [v for v, _ in groups]
        for x, (value, group) in enumerate(groups):
            last = [100 * r.curve[-1][2] for r in group if r.curve]
            first = [100 * r.curve[0][2] for r in group if r.curve]
            if not last:
                continue
            (mu, h), (mu0, h0) = mean_interval(last), mean_interval(first)
            ax.errorbar([x], [mu0], yerr=[h0], fmt="o", mfc="none", color="0.6", capsize=3)
            ax.errorbar([x], [mu], yerr=[h], fmt="o", color=colour[value], capsize=4, ms=8)
        ax.set_title(title or metric)
        ax.set_ylabel(f"{metric} (%)")
        ax.set_ylim(0, 100)
        _x_axis(ax, lay, values)
        if target:
            tax = axes[1][i]
            for x, (value, group) in enumerate(groups):
                times = [r.time_to_target_s for r in group if r.time_to_target_s is not None]
                if times:
                    mu, h = mean_interval(times)
                    tax.errorbar([x], [mu], yerr=[h], fmt="s", color=colour[value], capsize=4)
                tax.annotate(
                    f"{len(times)}/{len(group)}",
                    (x, 0),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=8,
                )
            tax.set_ylim(bottom=0)
            tax.set_ylabel("seconds to the target")
            tax.set_title("time to the target accuracy (n/N runs reached it)", fontsize=9)
            _x_axis(tax, lay, values)
    axes[0][0].legend(
        handles=[
            Line2D([], [], marker="o", color="0.2", ls="none", ms=8, label="last evaluation"),
            Line2D(
                [], [], marker="o", color="0.6", mfc="none", ls="none", label="first (version 0)"
            ),
        ],
        fontsize=8,
        loc="lower left",
    )
    fig.suptitle(f"each point: mean over seeds ± 95% t-interval ({metric})")
    save(fig, "sweep_final.png")


def _x_axis(ax: Any, lay: Layout, values: list[str]) -> None:
    """One evenly spaced tick per point, labelled by its value (lags 0, 1, 2, 4, 8, 16 read
    apart, where a linear axis crowds the small ones)."""
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(values, rotation=0 if lay.x_key else 30, fontsize=8 if lay.x_key else 7)
    ax.set_xlabel(f"{lay.x_key} (versions)" if lay.x_key else "point")
    ax.set_xlim(-0.5, len(values) - 0.5)
    ax.grid(alpha=0.3)


def _hide_rest(axes: Any, used: int) -> None:
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)


def plot_lags(runs: list[SweepRun], save) -> None:
    """staleness_hist.png, iw_by_lag.png and trust_region_by_lag.png (need learner records)."""
    import matplotlib.pyplot as plt

    lay = layout_of(runs)
    colour = lay.colours(runs)
    if not any(r.learner for r in runs):
        print("plot: no run directories; staleness and per-lag figures skipped", file=sys.stderr)
        return
    fig, axes, cols = _panels(plt, len(lay.panels))
    drawn = False
    for i, (title, mine) in enumerate(lay.panels.items()):
        ax = axes[i // cols][i % cols]
        groups = _grouped(lay, mine)
        width = 0.8 / max(len(groups), 1)
        for j, (value, group) in enumerate(groups):
            hs = [
                r[m.STALENESS_HIST]
                for g in group
                for r in g.learner
                if isinstance(r.get(m.STALENESS_HIST), dict)
            ]
            total = m.merge_int_histograms([h for h in hs if "values" in h])
            n = sum(total["counts"]) or 1
            if total["values"]:
                drawn = True
                xs = [x + (j - (len(groups) - 1) / 2) * width for x in total["values"]]
                ax.bar(
                    xs,
                    [c / n for c in total["counts"]],
                    width=width,
                    color=colour[value],
                    label=lay.label(value, len(group)),
                )
        ax.set_title(title or "staleness")
        ax.set_xlabel("staleness of trained trajectories (versions)")
        ax.set_ylabel("share of trajectories")
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        if ax.patches:
            ax.legend(fontsize=7)
    _hide_rest(axes, len(lay.panels))
    if drawn:
        save(fig, "staleness_hist.png")
    else:
        plt.close(fig)
        print("plot: no staleness histograms; staleness_hist.png skipped", file=sys.stderr)
    for stats, ylabels, scale, name in (
        (
            (m.IW_MEAN, m.IW_ESS),
            ("importance weight pi_prox/mu (mean)", "normalised ESS"),
            1,
            "iw_by_lag.png",
        ),
        (
            (m.CLIP_FRAC, m.RATIO_OUTSIDE),
            ("clip fraction (%)", "ratio outside [1-eps, 1+eps] (%)"),
            100,
            "trust_region_by_lag.png",
        ),
    ):
        _by_lag_figure(plt, lay, stats, ylabels, scale, name, save)


def _by_lag_figure(plt, lay: Layout, stats, ylabels, scale, name, save) -> None:
    series: dict[str, dict[int, dict[str, list[float]]]] = {}  # panel -> lag -> stat -> per run
    for title, mine in lay.panels.items():
        for r in mine:
            per: dict[tuple[int, str], list[float]] = {}
            for rec in r.learner:
                for key, value in rec.items():
                    for stat in stats:
                        if key.startswith(f"{stat}/lag_") and isinstance(value, (int, float)):
                            per.setdefault((int(key.rsplit("_", 1)[1]), stat), []).append(
                                float(value)
                            )
            for (lag, stat), vals in per.items():  # one value per run: its mean over steps
                cell = series.setdefault(title, {}).setdefault(lag, {})
                cell.setdefault(stat, []).append(scale * sum(vals) / len(vals))
    if not series:
        print(f"plot: no per-lag {', '.join(stats)}; {name} skipped", file=sys.stderr)
        return
    colour = distinct_colours(list(series))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, stat, ylabel in zip(axes, stats, ylabels, strict=True):
        for title, lags in series.items():
            pts = [
                (lag, *mean_interval(lags[lag][stat]))
                for lag in sorted(lags)
                if lags[lag].get(stat)
            ]
            if pts:
                xs, mu, h = zip(*pts, strict=True)
                ax.errorbar(
                    xs,
                    mu,
                    yerr=h,
                    marker="o",
                    capsize=3,
                    color=colour[title],
                    label=title or "runs",
                )
        ax.set_xlabel("lag of the trained tokens (versions)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # shares and weights: an interval's lower end below 0 is cut
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle("by lag: mean over runs of each run's mean over steps, ± 95% t-interval")
    save(fig, name)
