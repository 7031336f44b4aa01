"""`slime-async plot RUN_OR_SWEEP...`: PNG figures from runs' metrics JSONL files.

One run directory: reward, staleness, throughput and training figures into RUN_DIR/plots (or
--out); `plot_run.py` lists them. Several runs, a sweep directory (`slime-async sweep`; its
finished runs, labelled by grid point) or a sweep's summary.json alone: the overlays of
`plot_sweep.py` into SWEEP_DIR/plots (or the first directory's, or --out). `figures.py` holds the
rules every figure follows (smoothing, log axes, bold evaluations, intervals, colours).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from slime_async import metrics as m
from slime_async.commands.plot_run import plot_run
from slime_async.commands.plot_sweep import plot_lags, plot_sweep, runs_from_dirs, runs_from_summary

__all__ = ["find_runs", "plot_run", "plot_runs", "plot_summary"]

HELP = "draw PNGs from a run's metrics, or overlay several runs or a sweep's"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir",
        nargs="+",
        metavar="RUN_OR_SWEEP",
        help="run directories (hold metrics/*.jsonl), sweep directories (hold sweep.json) or a "
        "sweep's summary.json",
    )
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default <first>/plots)")
    p.add_argument(
        "--metric",
        default=m.EVAL_ACC_GREEDY,
        help=f"evaluation metric of the overlay (default {m.EVAL_ACC_GREEDY})",
    )


def main(args: argparse.Namespace) -> int:
    try:
        dirs = [Path(d) for d in args.run_dir]
        first = dirs[0]
        if len(dirs) == 1 and first.suffix == ".json":
            written = plot_summary(first, Path(args.out) if args.out else first.parent / "plots")
        elif len(dirs) == 1 and _only_a_summary(first):
            written = plot_summary(first / "summary.json", Path(args.out or first / "plots"))
        elif len(dirs) == 1 and not (first / "sweep.json").exists():
            written = plot_run(first, args.out)
        else:
            out = Path(args.out) if args.out else first / "plots"
            written = plot_runs(find_runs(dirs), out, args.metric)
    except FileNotFoundError as e:
        print(f"slime-async plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _only_a_summary(d: Path) -> bool:
    """A sweep directory whose run directories are gone but whose summary.json is there."""
    from slime_async.launch.sweep import DONE

    has_runs = any(d.glob(f"*/*/{DONE}"))
    return (d / "sweep.json").exists() and not has_runs and (d / "summary.json").is_file()


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


def _saver(out: Path, written: list[Path]):
    import matplotlib.pyplot as plt

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written.append(out / name)

    return save


def _target_of(runs: list[tuple[str, Path]]) -> float | None:
    """The sweep's target accuracy, from the summary next to its runs (None: none known)."""
    for _, rd in runs:
        summary = rd.parent.parent / "summary.json"
        if summary.is_file():
            return json.loads(summary.read_text()).get("target_accuracy")
    return None


def plot_runs(runs: list[tuple[str, Path]], out_dir: str | Path, metric: str) -> list[Path]:
    """Overlay `runs` (label, run dir): evaluation by point, the sweep's final values, staleness
    and weights by lag."""
    import matplotlib

    matplotlib.use("Agg")
    data = runs_from_dirs(runs, metric, _target_of(runs))
    if not any(r.learner for r in data):
        raise FileNotFoundError(f"no learner metrics in {[str(rd) for _, rd in runs]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    save = _saver(out, written)
    plot_sweep(data, out, metric, save)
    plot_lags(data, save)
    return written


def plot_summary(path: str | Path, out_dir: str | Path) -> list[Path]:
    """The figures a sweep's summary.json holds the data for (its runs may be gone)."""
    import matplotlib

    matplotlib.use("Agg")
    data, metric, _target = runs_from_summary(Path(path))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    plot_sweep(data, out, metric, _saver(out, written))
    print(
        "plot: a summary holds no per-step records; staleness and per-lag figures skipped",
        file=sys.stderr,
    )
    return written
