"""`slime-async sweep CONFIG... [KEY=VALUE...] --grid key=v1,v2 [--grid ...] [--seeds N]`.

Every point of the grid x every seed is one `slime-async run` in its own directory under
`--out`, on this machine, `--jobs N` at once (default 1: one after another;
slime_async/launch/sweep.py), within `--time-limit S` seconds if given; a finished point is
skipped when the same command runs again. Then the summary table (summary.md, summary.json) and
the overlaid plots (plots/) are written next to the runs. `--summary-only` redoes those alone.
With `--reference POINT` the summary compares every point with that one seed by seed (the seeds
pair data order, initial weights and evaluation samplers): mean difference, 95% intervals, and
with `--equivalence M` a TOST verdict within +-M points, per lag (plots/paired_difference.png).
"""

from __future__ import annotations

import argparse

from slime_async.commands import add_config_arguments

HELP = "run a grid of configs x seeds, --jobs at once (resumable); table and plots"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a config key and its values (repeat for a product grid), e.g. buffer.fixed_lag=0,2,8",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per point (run.seed = 0..N-1)")
    p.add_argument("--seed-base", type=int, default=0, help="first run.seed (default 0)")
    p.add_argument("--out", default="runs/sweep", help="the sweep directory (default runs/sweep)")
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        metavar="X",
        help="report wall-clock and trained tokens until the evaluation metric first reaches X",
    )
    p.add_argument(
        "--metric",
        default="eval/accuracy_greedy",
        help="evaluation metric of the table (default eval/accuracy_greedy)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="points run at once on this machine, each its own run (default 1: one after another)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="'KEY=V1,V2 [KEY=V ...]'",
        help="leave out the grid points matching every pair (repeatable), e.g. "
        "'buffer.fixed_lag=0 algo.loss=decoupled_ppo,mis'",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="S",
        help="stop by S seconds after the start: start no point the longest finished run says "
        "would end later, stop running points at S (unfinished, resumable); summary of the rest",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="POINT",
        help="compare every point with this one seed by seed (its name, or its 'KEY=V KEY=V' "
        "pairs): mean difference, 95%% CI (paired t and bootstrap), per lag",
    )
    p.add_argument(
        "--equivalence",
        type=float,
        default=None,
        metavar="M",
        help="TOST equivalence margin in points (e.g. 2.0): is each point within +-M of the "
        "reference at 95%% confidence (needs --reference)",
    )
    p.add_argument("--summary-only", action="store_true", help="write table and plots, run nothing")


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from slime_async.config import ConfigError, load_config, split_cli_args
    from slime_async.launch.sweep import Sweep, parse_exclude, parse_grid

    files, overrides = split_cli_args(args.config)
    if not files:
        raise ConfigError("name at least one CONFIG.toml")
    try:
        grid = parse_grid(args.grid)
        sweep = Sweep(
            files,
            grid,
            args.seeds,
            Path(args.out),
            overrides,
            args.target_accuracy,
            args.metric,
            args.seed_base,
            args.jobs,
            parse_exclude(args.exclude),
            args.time_limit,
            args.reference,
            args.equivalence,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # Every point's config must load before the first one runs (a typo fails now, not later).
    for point in sweep.points():
        load_config(files, [*overrides, *point.overrides])
    if not args.summary_only:
        try:
            counts = sweep.run(log=lambda text: print(text, flush=True))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        print(f"[sweep] {counts}", flush=True)
    else:
        counts = {"failed": 0}
    summary = sweep.summarize()
    print((sweep.out / "summary.md").read_text(), flush=True)
    if summary["runs"]:
        from slime_async.commands.plot import find_runs, plot_runs

        for path in plot_runs(find_runs([sweep.out]), sweep.out / "plots", args.metric):
            print(path)
        if summary.get("paired"):
            from slime_async.launch.sweep_plot import plot_paired

            for path in plot_paired(summary, sweep.out / "plots"):
                print(path)
    return 1 if counts["failed"] else 0
