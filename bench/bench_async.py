"""Asynchronous vs synchronous RL, same config, same seeds, same number of optimizer steps.

    python bench/bench_async.py                       # configs/quickstart.toml, 40 steps each
    python bench/bench_async.py --steps 20 configs/quickstart.toml learner.lr=1e-4

Runs `slime-async run` twice, one after the other in this command: `run.mode = "sync"` (generate a
batch, train, push, repeat: the on-policy baseline) and `run.mode = "async"` (generation never
waits for training, bounded by `buffer.max_staleness`). Prints wall-clock time of the training
span (learner ready -> last step), the speedup, generator idle % (no rollout in flight), learner
idle % (waiting for a batch), tokens/s and the reward (mean of the first and of the last 10 steps).

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
import time
from pathlib import Path

from slime_async.metrics import names as m

REPO = Path(__file__).resolve().parents[1]


def run_mode(mode: str, configs: list[str], overrides: list[str], steps: int, out: Path) -> dict:
    run_dir = out / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        sys.executable, "-m", "slime_async", "run", *configs,
        f"run.mode={mode}", f"run.run_dir={run_dir}", f"learner.num_steps={steps}",
        "run.progress=plain", "run.wandb=disabled", *overrides,
    ]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{mode} run failed with exit code {proc.returncode}")
    total = time.time() - t0
    return summarize(run_dir, total)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, total_s: float) -> dict:
    learner = _records(run_dir / "metrics" / "learner.jsonl")
    gens = [_records(p) for p in sorted((run_dir / "metrics").glob("generator*.jsonl"))]
    ready = (run_dir / "ready" / "learner").stat().st_mtime
    span = learner[-1]["time"] - ready
    last = learner[-10:]
    end = learner[-1]["time"]
    # Generator records inside the training span (after the learner's end they are all idle).
    gen_span = [r for g in gens for r in g if ready <= r["time"] <= end]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
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
    args = ap.parse_args()
    configs = [c for c in args.config if "=" not in c] or ["configs/quickstart.toml"]
    overrides = [c for c in args.config if "=" in c]
    out = (REPO / args.out).resolve()
    results = {}
    for mode in ("sync", "async"):
        print(f"running {mode} ({args.steps} steps) ...", flush=True)
        results[mode] = run_mode(mode, configs, overrides, args.steps, out)
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
        print(f"{label:44s} {fmt.format(vals[0]):>12s} {fmt.format(vals[1]):>12s}")
    print(f"\nspeedup (sync wall / async wall): {s['wall_s'] / a['wall_s']:.2f}x")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
