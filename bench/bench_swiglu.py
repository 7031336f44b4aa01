"""megatron's SwiGLU fusion against the learner's Triton SwiGLU kernels, forward and backward.

megatron's `bias_swiglu_impl(y, None)` is torch.compile'd by megatron (its backward builds
`torch.cat((da, db), -1)`); the kernels of slime_async/models/swiglu_triton.py are what the
learner runs with `learner.swiglu_kernel` "auto" on a GPU. Each pass is printed beside the
memory-bandwidth floor of its bytes: per token the forward reads 2F and writes F elements, the
backward reads 3F (y and the output's gradient) and writes 2F, 2 bytes each in bf16.

    python bench/bench_swiglu.py                                   # 8,192 tokens, F 3,072 and 9,728
    python bench/bench_swiglu.py --tokens 16384 --ffn 3072 --hbm-tbps 3.35   # an H100's floor
    TRITON_INTERPRET=1 python bench/bench_swiglu.py --device cpu --tokens 64 --ffn 128 --reps 2

Rows: the forward alone, the backward alone (megatron's `swiglu_back` and `swiglu_triton.backward`
on the same gradient) and both through autograd (`torch.autograd.grad`, host overhead included).
Median over `--reps` timings after two warm-ups (compiling included in the warm-ups), with
[min, max]; each timing is `--inner` calls between two synchronisations, divided by their
number. `--hbm-tbps` (default 4.8, an H200) sets the floor. The two give equal results (within
one bf16 step) before timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import spread_ms, timed


def _rows(tokens: int, f: int, dev: torch.device, args) -> list[str]:
    """The table's rows of one half width F."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, swiglu_back

    from slime_async.models import swiglu_triton

    gen = torch.Generator(device=dev).manual_seed(0)
    y = (2 * torch.randn(tokens, 2 * f, generator=gen, device=dev)).to(torch.bfloat16)
    g = torch.randn(tokens, f, generator=gen, device=dev).to(torch.bfloat16)
    y.requires_grad_()
    impls = {
        "megatron (torch.compile'd)": (lambda t: bias_swiglu_impl(t, None), swiglu_back),
        "Triton (swiglu_triton)": (swiglu_triton.swiglu, swiglu_triton.backward),
    }
    outs = [(fwd(y).detach(), bwd(g, y.detach())) for fwd, bwd in impls.values()]
    for a, b in zip(*outs, strict=True):
        if not torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-5):
            raise SystemExit(f"F {f}: the Triton SwiGLU differs from megatron's")
    element_bytes = 2 * tokens * f
    floors = {"forward": 3 * element_bytes, "backward": 5 * element_bytes}
    floors["forward + backward"] = floors["forward"] + floors["backward"]
    cuda = dev.type == "cuda"
    rows = []
    for name, (fwd, bwd) in impls.items():
        passes = {
            "forward": lambda fwd=fwd: fwd(y),
            "backward": lambda bwd=bwd: bwd(g, y.detach()),
            "forward + backward": lambda fwd=fwd: torch.autograd.grad(fwd(y), y, g),
        }
        for pass_, fn in passes.items():
            ts = timed(fn, args.reps, cuda, args.inner)
            floor = floors[pass_] / (args.hbm_tbps * 1e12)
            rows.append(
                f"| {f} | {name} | {pass_} | {spread_ms(ts, 4)} | {floor * 1e3:.4f} "
                f"| {statistics.median(ts) / floor:.2f}x |"
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of y (8 x 1,024 in the bench)")
    ap.add_argument(
        "--ffn", default="3072,9728", help="half widths F of y [T, 2F], comma-separated"
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10, help="calls per timing")
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    args = ap.parse_args()
    dev = torch.device(args.device)
    from slime_async import megatron_compat
    from slime_async.models import swiglu_triton

    if not swiglu_triton.available(dev):
        raise SystemExit(f"the Triton kernels do not run on {dev} (CUDA, or TRITON_INTERPRET=1)")
    megatron_compat.apply()
    print(f"SwiGLU of y [{args.tokens}, 2F] in bf16 on {dev}, floor at {args.hbm_tbps} TB/s")
    print("| F | SwiGLU | pass | median ms [min, max] | floor ms (bytes once) | x floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for f in (int(v) for v in args.ffn.split(",")):
        for row in _rows(args.tokens, f, dev, args):
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
