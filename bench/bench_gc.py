"""The embedded engine's garbage-collection pauses with and without the start-up freeze.

Each side runs in a fresh interpreter of its own: an `EmbeddedEngine` (model, scheduler,
tokenizer; no HTTP) serves `--rounds` rounds of `--batch` concurrent requests of `--new-tokens`
each (greedy, ignore_eos), and `GcWatch` times every collection while it serves. The baseline
serves without `gc.freeze`; the other side freezes after start-up, as `slime-async engine`
does. A full (generation-2) collection walks
every object the collector tracks while every request in flight waits, so the rounds' slowest
wall time shows a stall beside their median; CPython starts one only when enough objects have
survived since the last, so the last column times one full collection forced after the rounds:
the stall each side pays whenever one comes.

    python bench/bench_gc.py                                   # tiny model on CPU
    python bench/bench_gc.py --model qwen3-0.5b --device cuda --dtype bfloat16 --batch 256
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SIDES = ("baseline", "frozen")


def serve(args: argparse.Namespace) -> dict:
    """One side, in this process: the engine built, frozen or not, then the timed rounds."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import make_model, prompts_for

    from slime_async.actors.engine.embedded.sampling import SamplingParams
    from slime_async.actors.engine.embedded.scheduler import Request
    from slime_async.actors.engine.embedded.server import EmbeddedEngine
    from slime_async.config import EngineConfig
    from slime_async.utils.gc_watch import GcWatch, freeze

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory(prefix="bench_gc_") as tmp:
        model_dir = make_model(Path(tmp) / Path(args.model).name, args.model, dtype)
        cfg = EngineConfig(
            model_path=str(model_dir),
            embedded={
                "device": args.device,
                "dtype": args.dtype,
                "max_running_requests": args.batch,
                "max_context_len": max(256, args.prompt_len + args.new_tokens),
                "torch_threads": 1 if args.device == "cpu" else 0,
            },
        )
        engine = EmbeddedEngine(cfg)
        frozen = freeze("bench_gc") if args.side == "frozen" else 0
        sched = engine.scheduler
        sched.start()
        watch = GcWatch(f"bench_gc {args.side}", warn_s=1e9).install()  # counted, not logged
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        prompts = prompts_for(args.batch, args.prompt_len, engine.runner.vocab_size)
        rounds = []
        try:
            for r in range(args.rounds):
                left, done = [args.batch], threading.Event()

                def on_done(_req, left=left, done=done) -> None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    sched.submit(
                        Request(rid=f"{r}-{i}", input_ids=p, params=params, on_done=on_done)
                    )
                if not done.wait(600):
                    raise TimeoutError(f"round {r}: {left[0]} of {args.batch} requests unfinished")
                rounds.append(time.perf_counter() - t0)
        finally:
            watch.close()
            sched.stop()
        # What a full collection costs on this side now: the stall whenever CPython starts one.
        t0 = time.perf_counter()
        gc.collect()
        full_s = time.perf_counter() - t0
    return {
        "side": args.side,
        "rounds_s": rounds,
        "frozen_objects": frozen,
        "forced_full_collection_s": full_s,
        **watch.stats(),
    }


def run_side(side: str, argv: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--side", side],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if out.returncode != 0:
        sys.exit(f"the {side} side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe(res: dict) -> str:
    rounds = res["rounds_s"]
    return (
        f"| {res['side']} | {res['gc_collections'][2]} | {res['gc_seconds'][2]:.3f} | "
        f"{res['gc_longest_s']:.3f} | {sum(res['gc_seconds']):.3f} | {res['frozen_objects']} | "
        f"{statistics.median(rounds):.3f} | {max(rounds):.3f} | "
        f"{res['forced_full_collection_s']:.3f} |"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", help="as bench_engine.py: tiny, qwen3-0.5b, ...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=256, help="concurrent requests a round")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--json", help="also write both sides' results here")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    for name in ("batch", "prompt_len", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")
    if args.side:  # a side's own process
        print(json.dumps(serve(args)))
        return
    argv = sys.argv[1:]
    results = [run_side(side, argv) for side in SIDES]
    print(
        f"{args.model}, {args.device} {args.dtype}: {args.rounds} rounds of {args.batch} "
        f"requests (prompt {args.prompt_len}, {args.new_tokens} new tokens), each side in its "
        "own process\n"
        "| side | full collections | their s | longest s | all collections s | objects frozen "
        "| round median s | round max s | a full collection now, s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for res in results:
        print(describe(res))
    if args.json:
        Path(args.json).write_text(json.dumps({"sides": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
