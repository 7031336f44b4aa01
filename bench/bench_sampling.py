"""The embedded engine's token draw, one decode step's worth: unseeded rows against seeded rows
(SGLang's seeded Gumbel-max, what a request with `sampling_seed` and every pinned evaluation
pays), eager and compiled (on a GPU the runner compiles the seeded draw and runs the
unfiltered picks as the Triton kernels of pick_kernels.py over the graph's bf16 logits; the
same picks torch.compile'd for comparison), each beside the memory-bandwidth floor of reading
the step's float32 logits once. `--temperature 0` times the greedy draw. With `--top-p` < 1 the
unseeded eager rows sort every row while the kernels search for each row's threshold
(pick_kernels.filtered_pick); that search alone is timed at each of `--pivots` keys a pass, for
top-p and for top-k 50 with top-p (two searches).

    python bench/bench_sampling.py --device cuda                     # 256 rows, vocab 64 and 151,936
    python bench/bench_sampling.py --device cpu --rows 64 --vocab 64,32000 --reps 3
    python bench/bench_sampling.py --device cuda --vocab 151936 --top-p 0.95 --pivots 8,16,32

Median over `--reps` timed draws after two warm-ups (compiling included in the warm-ups), with
[min, max]; `--hbm-tbps` (default 4.8, an H200) sets the floor. The draws of each variant are
checked equal before timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import spread_ms, timed

from slime_async.actors.engine.embedded import pick_kernels
from slime_async.actors.engine.embedded.sampling import (
    Picks,
    greedy_pick,
    sample,
    seeded_argmax,
    temperature_pick,
    thresholds_hold,
)


def _rows(vocab: int, n: int, dev: torch.device, args, compiled) -> list[str]:
    """The table's rows of one vocabulary size."""
    cuda = dev.type == "cuda"
    logits = torch.randn(n, vocab, device=dev) * 4
    params = (
        torch.full((n,), args.temperature),
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), args.top_p),
    )
    seeded = [(r, 1000 + r, 40 + r % 7) for r in range(n)]
    variants = {
        "unseeded": lambda: sample(logits, *params),
        "seeded, eager": lambda: sample(logits, *params, seeded=seeded),
    }
    if cuda:  # the runner compiles the seeded draw and the picks on a GPU only
        half = logits.bfloat16()
        variants["unseeded, torch.compile'd picks, bf16 logits"] = lambda: sample(
            half, *params, picks=compiled[1]
        )
        kernels = Picks(
            pick_kernels.greedy_pick, pick_kernels.temperature_pick, pick_kernels.filtered_pick
        )
        variants["unseeded, pick kernels (the engine's), bf16 logits"] = lambda: sample(
            half, *params, picks=kernels
        )
        variants["seeded, compiled"] = lambda: sample(
            logits, *params, seeded=seeded, seeded_draw=compiled[0]
        )
        if args.temperature > 0 and not torch.equal(
            variants["seeded, compiled"]()[0], variants["seeded, eager"]()[0]
        ):
            raise SystemExit(f"vocab {vocab}: the compiled seeded draw differs from eager")
        if args.top_p < 1.0:  # the top-p kernel alone, at each pivot count
            inv_t = torch.full((n,), 1.0 / max(args.temperature, 1e-5), device=dev)
            k_dev = torch.full((n,), vocab, device=dev)
            p_dev = torch.full((n,), args.top_p, device=dev)
            x = half.float() * inv_t[:, None]
            k50 = torch.full((n,), min(50, vocab), device=dev)
            for piv in (int(v) for v in args.pivots.split(",")):
                passes = pick_kernels.search_passes(piv, 16)
                for name, k, both in (("top-p", k_dev, False), ("top-k 50 + top-p", k50, True)):
                    thr = pick_kernels.thresholds(half, inv_t, k, p_dev, piv, two_stage=both)
                    if not thresholds_hold(x, thr, k, p_dev).all():
                        raise SystemExit(f"vocab {vocab}: {name} thresholds at {piv} pivots wrong")
                    variants[
                        f"{name} thresholds alone, {piv} pivots a pass "
                        f"({passes * (1 + both)} passes)"
                    ] = lambda piv=piv, k=k, both=both: pick_kernels.thresholds(
                        half, inv_t, k, p_dev, piv, two_stage=both
                    )
    floor_ms = n * vocab * 4 / (args.hbm_tbps * 1e12) * 1e3
    rows, base = [], None
    for name, fn in variants.items():
        ts = timed(fn, args.reps, cuda)
        med = statistics.median(ts)
        base = base or med
        rows.append(f"| {vocab} | {name} | {spread_ms(ts)} | {med / base:.2f}x | {floor_ms:.4f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=256, help="rows in the step (running requests)")
    ap.add_argument("--vocab", default="64,151936", help="vocabulary sizes, comma-separated")
    ap.add_argument("--top-p", type=float, default=1.0, help="top_p of every row (1.0: off)")
    ap.add_argument("--temperature", type=float, default=1.0, help="of every row (0: greedy)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument(
        "--pivots",
        default="8,16,32",
        help="with --top-p < 1 on a GPU: pivot counts (powers of 2) of the top-p threshold "
        "kernel to time alone (the engine uses pick_kernels.PIVOTS)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    n = args.rows
    compiled = (
        torch.compile(seeded_argmax, dynamic=True),
        Picks(
            torch.compile(greedy_pick, dynamic=True), torch.compile(temperature_pick, dynamic=True)
        ),
    )
    print(
        f"one step's draw, {n} rows, temperature {args.temperature}, top_p {args.top_p}, on {dev}"
    )
    print("| vocab | draw | median ms [min, max] | x unseeded | floor ms (logits read once) |")
    print("| --- | --- | --- | --- | --- |")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for row in _rows(vocab, n, dev, args, compiled):
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
