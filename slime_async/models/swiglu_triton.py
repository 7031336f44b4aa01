"""The learner's SwiGLU, forward and backward, as two Triton kernels that touch each byte once.

What megatron's SwiGLU fusion computes (`megatron.core.fusions.fused_bias_swiglu`: `swiglu`
and `swiglu_back`, torch.compile'd by megatron), for y = [a, b] split in halves along its last
dimension:

- `_forward`, program (row block, column block): out = silu(a) * b, reading a and b once and
  writing out once;
- `_backward`, program (row block, column block): with g the gradient of out,
  da = g * sig(a) * (1 + a * (1 - sig(a))) * b and db = g * silu(a), reading a, b and g once and
  writing both halves of dy = [da, db] once.

Both in fp32, rounded once to y's dtype. Why: megatron's backward builds
`torch.cat((da, db), -1)`; inductor makes that one kernel
(`triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_0`) whose every output element works
out which half it belongs to and loads a, b and g for it: 277 us a layer on an H200 at the
0.51B Qwen3 shape (8 x 1,024 tokens, ffn 3,072), 5-7x what its bytes need (reads y [T, 2F] and
g [T, F], writes dy [T, 2F], bf16), 7.8 ms of a 91.6 ms learner step over 28 layers. Here the
programs tile [rows, F]: each loads its tile of a, b (and g) and stores the tile's outputs,
contiguous and vectorised along the columns.

`swiglu(y)` is the autograd function on any `[..., 2F]` tensor whose last dimension is
contiguous; `megatron_swiglu` has the signature of megatron's `bias_swiglu_impl` (what
`fused_ops.install_swiglu` puts in megatron's MLP) and hands megatron's own function what these
kernels do not do (a bias, FP8 input storage, CPU offloading). `available(device)` says where
the kernels run: CUDA with Triton, or Triton's CPU interpreter when `TRITON_INTERPRET=1` was set
before it was imported (the tests use it).
"""

from __future__ import annotations

import os

import torch

try:  # the GPU image carries Triton; CPU machines need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

TILE = 4096
"""Elements of [rows, F] per program (BLOCK_R x BLOCK_F): 16 a thread in each of a, b (and g)
at 8 warps."""


if triton is not None:

    @triton.jit
    def _forward(
        Y, OUT, stride_y, stride_o, R, F,
        BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows < R)[:, None] & (cols < F)[None, :]
        y_at = Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
        a = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_at + F, mask=mask, other=0.0).to(tl.float32)
        out = a * (1.0 / (1.0 + tl.exp(-a))) * b  # silu(a) = a * sig(a), as the backward
        o_at = OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(o_at, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(
        G, Y, DY, stride_g, stride_y, stride_d, R, F,
        BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows < R)[:, None] & (cols < F)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        y_at = Y + r64 * stride_y + cols[None, :]
        a = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_at + F, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-a))
        # megatron's swiglu_back, term by term: g * sig * (1 + a * (1 - sig)) * b, g * silu(a)
        da = g * sig * (1.0 + a * (1.0 - sig)) * b
        db = g * (a * sig)
        d_at = DY + r64 * stride_d + cols[None, :]
        tl.store(d_at, da.to(DY.dtype.element_ty), mask=mask)
        tl.store(d_at + F, db.to(DY.dtype.element_ty), mask=mask)


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device` (CUDA with Triton, or Triton's CPU
    interpreter when TRITON_INTERPRET=1 was set before it was imported)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _blocks(f: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_F) for half-width `f`: the largest power of two from 1,024 down to 128
    that divides f (no masked-off tail where one does: 1,024 at 3,072, 512 at 9,728 and 1,536),
    or f's own power of two when f is smaller; rows fill the tile."""
    block_f = 1024
    while block_f > 128 and f % block_f:
        block_f //= 2
    block_f = min(block_f, triton.next_power_of_2(f))
    return TILE // block_f, block_f


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as [rows, width] with a contiguous last dimension (a view where one is possible)."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


def forward(y: torch.Tensor) -> torch.Tensor:
    """silu(a) * b of y = [a, b] ([..., 2F] -> [..., F], y's dtype)."""
    two_f = y.shape[-1]
    if two_f % 2:
        raise ValueError(f"SwiGLU needs an even last dimension, got {tuple(y.shape)}")
    f = two_f // 2
    y2 = _rows(y, two_f)
    r = y2.shape[0]
    out = torch.empty((r, f), dtype=y.dtype, device=y.device)
    if r and f:
        br, bf = _blocks(f)
        _forward[(triton.cdiv(r, br), triton.cdiv(f, bf))](
            y2, out, y2.stride(0), out.stride(0), r, f, BLOCK_R=br, BLOCK_F=bf, num_warps=8
        )
    return out.view(*y.shape[:-1], f)


def backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dy = [da, db] of `forward(y)` given its gradient g ([..., F]; dy: [..., 2F], y's dtype)."""
    two_f = y.shape[-1]
    f = two_f // 2
    y2, g2 = _rows(y, two_f), _rows(g, f)
    r = y2.shape[0]
    dy = torch.empty((r, two_f), dtype=y.dtype, device=y.device)
    if r and f:
        br, bf = _blocks(f)
        _backward[(triton.cdiv(r, br), triton.cdiv(f, bf))](
            g2, y2, dy, g2.stride(0), y2.stride(0), dy.stride(0), r, f,
            BLOCK_R=br, BLOCK_F=bf, num_warps=8,
        )  # fmt: skip
    return dy.view(y.shape)


class SwiGLU(torch.autograd.Function):
    """silu(a) * b of y = [a, b], y kept for the backward pass (as megatron's SwiGLUFunction)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return forward(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return backward(g, y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of y: [..., 2F] -> [..., F] through the kernels, differentiable in y."""
    return SwiGLU.apply(y)


def megatron_swiglu(
    input: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
) -> torch.Tensor:
    """megatron's `bias_swiglu_impl` (same signature, same result): these kernels where there is
    no bias and neither FP8 storage of the input nor its CPU offloading is asked for (the
    learner's layers), megatron's own compiled fusion otherwise."""
    if bias is None and not fp8_input_store and not cpu_offload_input:
        return SwiGLU.apply(input)
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)
