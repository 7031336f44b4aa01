"""`slime-async plot RUN_OR_SWEEP...`: PNG figures from runs' metrics JSONL files.

One run directory: writes into RUN_DIR/plots (or --out):
  reward.png      reward, training accuracy and pinned evaluation accuracy against step and time
  staleness.png   staleness histogram over the whole run, and mean/max staleness against step
  throughput.png  generation and training tokens/s over wall time; generator idle %, learner wait %
  training.png    loss, grad norm, response length, importance weights, clip fraction, push time
A figure whose metrics the run never logged is skipped with a note.

Several runs, or a sweep directory (`slime-async sweep`; its finished runs, labelled by grid
point): overlays them, into SWEEP_DIR/plots (or the first directory's, or --out):
  eval_accuracy.png    evaluation accuracy (eval/accuracy_greedy, or --metric) against the
                       evaluated version (= learner step) and against wall-clock since the
                       learner was ready; one colour per point, one line per seed
  staleness_hist.png   the lag of every trained trajectory, per point (share of trajectories)
  iw_by_lag.png        importance weight pi_prox/mu (mean, and its ESS) by lag, per point
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from slime_async import metrics as m

HELP = "draw PNGs from a run's metrics, or overlay several runs or a sweep's"

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
    p.add_argument(
        "run_dir",
        nargs="+",
        metavar="RUN_OR_SWEEP",
        help="run directories (hold metrics/*.jsonl) or sweep directories (hold sweep.json)",
    )
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default <first>/plots)")
    p.add_argument(
        "--metric",
        default=m.EVAL_ACC_GREEDY,
        help=f"evaluation metric of the overlay (default {m.EVAL_ACC_GREEDY})",
    )


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
    evals = by_role.get("eval", [])
    curves += [(k, _series(evals, k, t0)) for k in (m.EVAL_ACC_GREEDY, m.EVAL_ACC_SAMPLED)]
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
        dirs = [Path(d) for d in args.run_dir]
        if len(dirs) == 1 and not (dirs[0] / "sweep.json").exists():
            written = plot_run(dirs[0], args.out)
        else:
            out = Path(args.out) if args.out else dirs[0] / "plots"
            written = plot_runs(find_runs(dirs), out, args.metric)
    except FileNotFoundError as e:
        print(f"slime-async plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


# ----------------------------------------------------------------------------- several runs
def find_runs(dirs: list[Path]) -> list[tuple[str, Path]]:
    """(label, run directory) of each run dir, and of each finished run of each sweep dir."""
    from slime_async.launch.sweep import DONE

    runs: list[tuple[str, Path]] = []
    for d in dirs:
        if (d / "sweep.json").exists():
            found = sorted(p.parent for p in d.glob(f"*/*/{DONE}"))
            if not found:
                raise FileNotFoundError(f"{d}: a sweep directory without finished runs")
            runs += [(p.parent.name, p) for p in found]
        elif (d / "metrics").is_dir():
            runs.append((d.name, d))
        else:
            raise FileNotFoundError(
                f"{d}: neither a run directory (metrics/) nor a sweep (sweep.json)"
            )
    return runs


def _learner_t0(run_dir: Path, learner: list[dict[str, Any]]) -> float:
    ready = run_dir / "ready" / "learner"
    if ready.exists():
        return ready.stat().st_mtime
    return learner[0]["time"] - float(learner[0].get(m.STEP_SECONDS, 0.0)) if learner else 0.0


def plot_runs(runs: list[tuple[str, Path]], out_dir: str | Path, metric: str) -> list[Path]:
    """Overlay `runs` (label, run dir): evaluation accuracy, staleness, weights by lag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = list(dict.fromkeys(label for label, _ in runs))
    cmap, n = (plt.get_cmap("tab10"), 10) if len(labels) <= 10 else (plt.get_cmap("tab20"), 20)
    colour = {lab: cmap(i % n) for i, lab in enumerate(labels)}
    data = []
    for label, rd in runs:
        by_role = load_run_metrics(rd)
        learner = by_role.get("learner", [])
        data.append((label, rd, learner, by_role.get("eval", []), _learner_t0(rd, learner)))
    if not any(learner for _, _, learner, _, _ in data):
        raise FileNotFoundError(f"no learner metrics in {[str(rd) for _, rd in runs]}")
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(out / name)

    # evaluation accuracy -------------------------------------------------------------------------
    if any(any(metric in r for r in ev) for *_, ev, _ in data):
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
        seen: set[str] = set()
        for label, _rd, _learner, ev, t0 in data:
            rows = [r for r in ev if isinstance(r.get(metric), (int, float))]
            if not rows:
                continue
            kw = {"color": colour[label], "marker": ".", "alpha": 0.8}
            if label not in seen:
                kw["label"] = label
                seen.add(label)
            by_step.plot([r["step"] for r in rows], [100 * r[metric] for r in rows], **kw)
            kw.pop("label", None)
            by_time.plot([r["time"] - t0 for r in rows], [100 * r[metric] for r in rows], **kw)
        by_step.set_xlabel("evaluated version (learner step)")
        by_time.set_xlabel("wall-clock since the learner was ready (s)")
        for ax in (by_step, by_time):
            ax.set_ylabel(f"{metric} (%)")
            ax.grid(alpha=0.3)
        by_step.legend(fontsize=7)
        save(fig, "eval_accuracy.png")
    else:
        print(f"plot: no '{metric}' records; eval_accuracy.png skipped", file=sys.stderr)

    # staleness histograms per point -----------------------------------------------------------
    hist: dict[str, dict[int, int]] = {}
    for label, _rd, learner, _ev, _t0 in data:
        hs = [r[m.STALENESS_HIST] for r in learner if isinstance(r.get(m.STALENESS_HIST), dict)]
        total = m.merge_int_histograms([h for h in hs if "values" in h])
        mine = hist.setdefault(label, {})
        for v, c in zip(total["values"], total["counts"], strict=True):
            mine[v] = mine.get(v, 0) + c
    if any(hist.values()):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(len(hist), 1)
        for i, (label, h) in enumerate(hist.items()):
            n = sum(h.values()) or 1
            xs = sorted(h)
            ax.bar(
                [x + i * width for x in xs],
                [h[x] / n for x in xs],
                width=width,
                color=colour[label],
                label=label,
            )
        ax.set_xlabel("staleness of trained trajectories (versions)")
        ax.set_ylabel("share of trajectories")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        save(fig, "staleness_hist.png")
    else:
        print("plot: no staleness histograms; staleness_hist.png skipped", file=sys.stderr)

    # importance weights by lag; the trust region by lag (naive PPO clips against a far-away mu)
    for stats, ylabels, scale, name, what in (
        (
            (m.IW_MEAN, m.IW_ESS),
            ("importance weight pi_prox/mu, mean", "normalised ESS"),
            1,
            "iw_by_lag.png",
            "per-lag importance weights",
        ),
        (
            (m.CLIP_FRAC, m.RATIO_OUTSIDE),
            ("clip fraction (%)", "tokens with the ratio outside [1-eps, 1+eps] (%)"),
            100,
            "trust_region_by_lag.png",
            "per-lag clip fractions",
        ),
    ):
        by_lag = _by_lag(data, stats)
        if not by_lag:
            print(f"plot: no {what}; {name} skipped", file=sys.stderr)
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for label, lags in by_lag.items():
            for ax, stat in zip(axes, stats, strict=True):
                pts = [
                    (x, scale * sum(v) / len(v)) for x in sorted(lags) if (v := lags[x].get(stat))
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", color=colour[label], label=label)
        for ax, ylabel in zip(axes, ylabels, strict=True):
            ax.set_ylabel(ylabel)
            ax.set_xlabel("lag (versions)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        save(fig, name)
    return written


def _by_lag(data: list[Any], stats: tuple[str, ...]) -> dict[str, dict[int, dict[str, list]]]:
    """{label: {lag: {stat: [value per step]}}} from the learner's `<stat>/lag_<k>` metrics."""
    out: dict[str, dict[int, dict[str, list[float]]]] = {}
    for label, _rd, learner, _ev, _t0 in data:
        for r in learner:
            for key, value in r.items():
                for stat in stats:
                    prefix = f"{stat}/lag_"
                    if key.startswith(prefix) and isinstance(value, (int, float)):
                        cell = out.setdefault(label, {}).setdefault(int(key[len(prefix) :]), {})
                        cell.setdefault(stat, []).append(float(value))
    return out
