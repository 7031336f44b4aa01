"""Asynchronous vs synchronous RL, same config, same seeds, same number of optimizer steps.

    python bench/bench_async.py                       # configs/quickstart.toml, 40 steps each
    python bench/bench_async.py --steps 20 configs/quickstart.toml learner.lr=1e-4
    python bench/bench_async.py --steps 80 --eval-interval 10 --metric eval/accuracy_sampled
    python bench/bench_async.py --steps 12 configs/gpu_two_h200.toml   # no eval.data: evaluation off

Runs `slime-async run` twice, one after the other in this command (`--parallel`: both at once, on
a machine with cores for both): `run.mode = "sync"` (generate a
batch, train, push, repeat: the on-policy baseline) and `run.mode = "async"` (generation never
waits for training, bounded by `buffer.max_staleness`). Prints wall-clock time of the training
span (learner ready -> last step), the speedup, generator idle % (no rollout in flight), learner
idle % (waiting for a batch), tokens/s and the reward (mean of the first and of the last 10 steps).

Equal work, not time per step: both runs evaluate the policy every `--eval-interval`
versions on the held-out set (pinned evaluation, `eval.interval`), and the comparison is
(a) the wall-clock each needs to first make a version whose evaluation reaches sync's final
accuracy (the "time to accuracy" ratio, AReaL's 2.77x; a version's time is the end of the step
that made it, not of its evaluation, which runs beside training), (b) the same to a fixed share
of sync's gain (`--gain-fraction`, default 0.9: the accuracy 90% of the way from version 0 to
sync's final; near a ceiling, sync's final accuracy is within sampling noise of the versions
before it, and "never reached" says little), and (c) trained tokens per second (the async run
may train shorter responses than the sync one in the same number of steps). All printed as ratios.

`--summarize` prints the same from the two run directories already under `--out` (a bench cut
short by a time limit after both runs wrote their records), without running anything.

On the 2-core CPU machine each role runs with one torch thread, so the engine and the learner
each own a core, as engines and trainers own their GPUs in a disaggregated cluster: a synchronous
run leaves one of them idle at any time; an asynchronous one keeps both busy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from slime_async.metrics import names as m

REPO = Path(__file__).resolve().parents[1]


def start_mode(mode: str, configs: list[str], overrides: list[str], steps: int, out: Path):
    """Start one `slime-async run` of `mode`; its console goes to <out>/<mode>.out."""
    run_dir = out / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "slime_async",
        "run",
        *configs,
        f"run.mode={mode}",
        f"run.run_dir={run_dir}",
        f"learner.num_steps={steps}",
        "run.progress=plain",
        "run.wandb=disabled",
        *overrides,
    ]
    with open(out / f"{mode}.out", "w") as console:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=console, stderr=subprocess.STDOUT)
    t0, ended = time.time(), []
    # the end time as it happens (with --parallel the other run may be waited on first)
    waiter = threading.Thread(target=lambda: (proc.wait(), ended.append(time.time())))
    waiter.start()
    return proc, t0, waiter, ended


def finish_mode(mode: str, started, out: Path, metric: str) -> dict:
    proc, t0, waiter, ended = started
    waiter.join()
    code = proc.returncode
    total = ended[0] - t0
    if code != 0:
        sys.stderr.write((out / f"{mode}.out").read_text()[-4000:])
        raise SystemExit(f"{mode} run failed with exit code {code}")
    return summarize(out / mode, total, metric)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, total_s: float, metric: str = m.EVAL_ACC_SAMPLED) -> dict:
    learner = _records(run_dir / "metrics" / "learner.jsonl")
    gens = [_records(p) for p in sorted((run_dir / "metrics").glob("generator*.jsonl"))]
    ready = (run_dir / "ready" / "learner").stat().st_mtime
    span = learner[-1]["time"] - ready
    last = learner[-10:]
    end = learner[-1]["time"]
    # Generator records inside the training span (after the learner's end they are all idle).
    gen_span = [r for g in gens for r in g if ready <= r["time"] <= end]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    evals = [r for r in _records(run_dir / "metrics" / "eval.jsonl") if metric in r]
    made = {0: ready}  # when each version came to be: the end of the step that made it
    for r in learner:
        if m.VERSION in r:
            made.setdefault(int(r[m.VERSION]), r["time"])
    return {
        # (version, seconds from the learner's start to the step that made the version,
        # accuracy) of each pinned evaluation: the version's time, not its evaluation's end, so
        # the evaluation's own length (it runs beside training) does not count
        "eval_curve": [
            (r["step"], made.get(r["step"], r["time"]) - ready, r[metric]) for r in evals
        ],
        "eval_done_s": [r["time"] - ready for r in evals],
        "steps": len(learner),
        "wall_s": span,
        "total_s": total_s,
        "final_reward": mean([r[m.REWARD] for r in last]),
        "first_reward": mean([r[m.REWARD] for r in learner[:10]]),
        "learner_idle_pct": 100.0 * sum(r[m.LEARNER_WAIT_S] for r in learner) / span,
        "generator_idle_pct": mean([r.get(m.GENERATOR_IDLE_PCT, 0.0) for r in gen_span]),
        "train_tokens": sum(r.get(m.TOKENS, 0.0) for r in learner),
        "staleness_max": max(r.get(m.STALENESS_MAX, 0) for r in learner),
        "response_len_mean": mean([r[m.RESPONSE_LEN] for r in learner]),
        "response_len_max": max(r[m.RESPONSE_LEN_MAX] for r in learner),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="*", default=[], help="TOML files and key=value overrides")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per mode")
    ap.add_argument("--out", default="runs/bench_async", help="where the two runs go")
    ap.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="pinned evaluation every N versions (default: 10 when the config has eval.data, "
        "else 0 with a note; 0: off)",
    )
    ap.add_argument("--metric", default=m.EVAL_ACC_SAMPLED, help="evaluation metric compared")
    ap.add_argument(
        "--gain-fraction",
        type=float,
        default=0.9,
        help="also time each run to this share of sync's gain in accuracy (default 0.9)",
    )
    ap.add_argument(
        "--summarize",
        action="store_true",
        help="run nothing: summarize the sync/ and async/ run directories under --out",
    )
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="run both modes at once (a machine with cores for both; default: one after the other)",
    )
    args = ap.parse_args()
    configs = [c for c in args.config if "=" not in c] or ["configs/quickstart.toml"]
    overrides = [c for c in args.config if "=" in c]
    overrides.append(f"eval.interval={eval_interval(configs, overrides, args.eval_interval)}")
    out = (REPO / args.out).resolve()
    results = {}
    started = {}
    for mode in ("sync", "async") if not args.summarize else ():
        print(f"running {mode} ({args.steps} steps) ...", flush=True)
        started[mode] = start_mode(mode, configs, overrides, args.steps, out)
        if not args.parallel:
            results[mode] = finish_mode(mode, started[mode], out, args.metric)
    for mode in ("sync", "async"):
        if mode not in results:
            results[mode] = (
                summarize(out / mode, float("nan"), args.metric)
                if args.summarize
                else finish_mode(mode, started[mode], out, args.metric)
            )
    s, a = results["sync"], results["async"]
    rows = [
        ("wall-clock s (learner ready -> last step)", "wall_s", "{:.1f}"),
        ("whole command s (incl. start-up)", "total_s", "{:.1f}"),
        ("train tokens/s", None, "{:.0f}"),
        ("generator idle %", "generator_idle_pct", "{:.1f}"),
        ("learner idle %", "learner_idle_pct", "{:.1f}"),
        ("reward, first 10 steps", "first_reward", "{:.3f}"),
        ("reward, last 10 steps", "final_reward", "{:.3f}"),
        ("max staleness", "staleness_max", "{}"),
        ("response length mean / max", None, "{}"),
    ]
    print(f"\n{'':44s} {'sync':>12s} {'async':>12s}")
    for label, key, fmt in rows:
        if label.startswith("train tokens"):
            vals = [r["train_tokens"] / r["wall_s"] for r in (s, a)]
        elif label.startswith("response"):
            vals = [f"{r['response_len_mean']:.0f} / {r['response_len_max']:.0f}" for r in (s, a)]
            print(f"{label:44s} {vals[0]:>12s} {vals[1]:>12s}")
            continue
        else:
            vals = [r[key] for r in (s, a)]
        shown = ["-" if v != v else fmt.format(v) for v in vals]  # NaN: not measured
        print(f"{label:44s} {shown[0]:>12s} {shown[1]:>12s}")
    print(f"\nspeedup (sync wall / async wall): {s['wall_s'] / a['wall_s']:.2f}x")
    tok_s = [r["train_tokens"] / r["wall_s"] for r in (s, a)]
    print(
        f"trained tokens/s, async / sync: {tok_s[1] / tok_s[0]:.2f}x "
        f"({tok_s[1]:.0f} / {tok_s[0]:.0f})"
    )
    results["time_to_accuracy"] = tta = time_to_accuracy(s, a, args.gain_fraction)
    for line in tta["lines"]:
        print(line)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    return 0


def eval_interval(configs: list[str], overrides: list[str], asked: int | None) -> int:
    """The pinned-evaluation interval both runs use: the one asked for, else 10 when the config
    has held-out data (`eval.data`), else 0 with a note (a throughput config such as
    configs/gpu_two_h200.toml has none, and `eval.interval > 0` without it is refused)."""
    from slime_async.config import load_config

    has_data = load_config([REPO / c for c in configs], overrides).eval.data is not None
    if asked is None:
        if not has_data:
            print(
                "note: the config has no eval.data: evaluation off (eval.interval=0); the "
                "comparison is wall-clock and trained tokens/s, not time to accuracy",
                flush=True,
            )
        return 10 if has_data else 0
    return asked


def _first_reach(curve: list, target: float) -> float | None:
    return next((t for _v, t, acc in curve if acc >= target), None)


def _reach_line(what: str, target: float, ts: float | None, ta: float | None) -> str:
    if ta is None:
        return f"async never reached {what} {100 * target:.1f}%"
    return (
        f"time to {what} {100 * target:.1f}%: sync {ts:.0f} s, async {ta:.0f} s: "
        f"{ts / max(ta, 1e-9):.2f}x"
    )


def time_to_accuracy(s: dict, a: dict, gain_fraction: float = 0.9) -> dict:
    """Seconds (since the learner was ready) until each run first reaches sync's final
    evaluation accuracy, and until each first reaches `gain_fraction` of sync's gain (from its
    first evaluation to its last), with the ratios."""
    if not s["eval_curve"] or not a["eval_curve"]:
        return {"lines": ["time to accuracy: no evaluation records (eval.interval)"]}
    first, target = s["eval_curve"][0][2], s["eval_curve"][-1][2]
    ts, ta = _first_reach(s["eval_curve"], target), _first_reach(a["eval_curve"], target)
    share = first + gain_fraction * (target - first)
    ts_g, ta_g = _first_reach(s["eval_curve"], share), _first_reach(a["eval_curve"], share)
    curves = [
        ", ".join(f"v{v} {100 * acc:.1f}% @{t:.0f}s" for v, t, acc in r["eval_curve"])
        for r in (s, a)
    ]
    lines = [f"evaluation, sync:  {curves[0]}", f"evaluation, async: {curves[1]}"]
    lines.append(_reach_line("sync's final accuracy", target, ts, ta))
    lines.append(_reach_line(f"{100 * gain_fraction:.0f}% of sync's gain", share, ts_g, ta_g))
    return {
        "target": target,
        "sync_s": ts,
        "async_s": ta,
        "gain_fraction": gain_fraction,
        "gain_target": share,
        "gain_sync_s": ts_g,
        "gain_async_s": ta_g,
        "lines": lines,
    }


if __name__ == "__main__":
    raise SystemExit(main())
