"""Routed experts as grouped matrix multiplies: the math the learner and the embedded engine share.

A MoE layer's token-expert pairs are sorted by expert, so each expert's rows are one contiguous
block of a `[N, hidden]` matrix (`sort_by_expert`); one grouped GEMM then multiplies every block
by its expert's weight (`grouped_mm`) instead of one small GEMM per expert.

- `grouped_mm` runs torch's grouped GEMM (`torch.nn.functional.grouped_mm`, `torch._grouped_mm`
  before torch 2.10) on CUDA in bf16 (Hopper's grouped GEMM; the group
  boundaries stay on the device as int32 offsets, nothing is read back by the host), and an
  exact per-expert loop everywhere else (the CPU, fp32 on a GPU, shapes the kernel refuses):
  the same products a per-expert `F.linear` computes, which is what megatron's SequentialMLP and
  HF's expert loop do.
- `sort_by_expert` orders the `[T, k]` choices by expert with a stable sort and counts each
  expert's rows with a scatter-add (no `bincount`, no `nonzero`: both read a size back to the
  host).
- Weights are stored `[E, out, in]`, one `nn.Linear` weight per expert stacked (HF's fused
  `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, the learner's `weight1`/`weight2`).

The only host read left is in the fallback loop (the group sizes, `counts.tolist()`): on a CPU
it costs nothing (every op is synchronous there); on a GPU it is taken only off the bf16 path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch >= 2.10 names it torch.nn.functional.grouped_mm; torch._grouped_mm before (and still).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[T, k]` (expert of each token's j-th choice) -> (order `[T * k]`, counts `[E]`).

    `order` lists the flat pair indices (`t * k + j`) grouped by expert, ascending, tokens in
    order within an expert; `counts[e]` is the number of pairs routed to expert e (int64)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    return order, counts


def kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes x `[N, in]` and w `[E, out, in]`: CUDA, bf16, and rows
    16-byte aligned (in and out multiples of 8)."""
    return (
        _GROUPED_MM is not None
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x `[N, in]` with rows grouped by expert (`counts [E]` rows each, in expert order), w
    `[E, out, in]` -> `[N, out]`: row block e times `w[e].T`. Differentiable in x and w."""
    if kernel_fits(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        # The kernel's B operand is [E, in, out] column-major: w's transpose, no copy.
        return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    sizes = counts.tolist()
    parts = [F.linear(xe, w[e]) for e, xe in enumerate(torch.split(x, sizes)) if sizes[e]]
    if not parts:  # no token at all: keep w in the graph (its gradient is then zero)
        return x @ w[0].t() if w.shape[0] else x.new_zeros(x.shape[0], 0)
    return torch.cat(parts, 0)


def swiglu_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    counts: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert: `down(silu(gate(x)) * up(x) * probs)`.

    x `[N, H]`, w_gate_up `[E, 2I, H]` (gate rows, then up rows), w_down `[E, H, I]`, counts
    `[E]`; probs `[N]` scales the activation before the down projection (megatron's experts;
    None: the caller scales the output, as HF does)."""
    g, u = grouped_mm(x, w_gate_up, counts).chunk(2, dim=-1)
    act = F.silu(g) * u
    if probs is not None:
        act = (act * probs.unsqueeze(-1)).to(x.dtype)
    return grouped_mm(act, w_down, counts)
