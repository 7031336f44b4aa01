"""Fused Triton kernels for one chunk of `ChunkedLogprobs` (GPU; `learner.logprob_kernel`).

The torch path of `logprobs.py` turns each `[c, V / tp]` chunk of bf16 logits into fp32 and
then runs about ten elementwise passes over it (scale by 1/T, gather, max, subtract, exp, sum,
entropy terms; and as many again in the backward pass), each a full read and write of a
`[c, V / tp]` fp32 tensor: on the H200 at 8 x 1,024 tokens and a 152k vocabulary those passes
are most of the gap between the torch path's RL step and a plain megatron-core step. Here one program per row
streams the row's bf16 logits once:

- `row_stats(z, labels, temperature, with_entropy)` -> `[4, c]` fp32: the row max `m` of
  `s = z / T`, `sum exp(s - m)`, the target's `s` (0 where the label is not in this rank's
  slice, label -1), and `sum exp(s - m) * (s - m)` (only with entropy): the same statistics the
  torch path keeps, combined over TP ranks by the same code. Online softmax: each block of
  columns rescales the running sums to the new maximum.
- `grad_in_place(z, ...)` overwrites the chunk's logits with the gradient of the loss with
  respect to them, in z's dtype: `(g_logp (1[v = label] - p_v) - g_ent p_v (log p_v + H)) / T`,
  the torch path's formula, read once and written once.

Only imported on a CUDA device where Triton imports (`available()`); the CPU keeps the exact
fp32 torch path. `TRITON_INTERPRET=1` runs these kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per iteration: 16 fp32 values per thread at 8 warps


@triton.jit
def _row_stats_kernel(
    z_ptr,
    stride,
    labels_ptr,
    temp_ptr,
    out_ptr,
    n_rows,
    V: tl.constexpr,
    WITH_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride
    t = tl.load(temp_ptr + row)
    label = tl.load(labels_ptr + row)
    m = float("-inf")
    s0 = 0.0  # sum exp(s - m)
    s1 = 0.0  # sum exp(s - m) * s
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        s = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf)
        e = tl.exp(s - m_new)  # 0 on masked columns
        s0 = s0 * alpha + tl.sum(e, axis=0)
        if WITH_ENT:
            s1 = s1 * alpha + tl.sum(tl.where(inside, e * s, 0.0), axis=0)
        m = m_new
    lab = tl.maximum(label, 0)
    tgt = tl.load(z_row + lab).to(tl.float32) / t
    tgt = tl.where(label >= 0, tgt, 0.0)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n_rows + row, s0)
    tl.store(out_ptr + 2 * n_rows + row, tgt)
    if WITH_ENT:
        tl.store(out_ptr + 3 * n_rows + row, s1 - m * s0)  # sum exp(s - m) * (s - m)
    else:
        tl.store(out_ptr + 3 * n_rows + row, 0.0)


@triton.jit
def _grad_kernel(
    z_ptr,
    stride,
    labels_ptr,
    temp_ptr,
    lse_ptr,
    ent_ptr,
    g_logp_ptr,
    g_ent_ptr,
    V: tl.constexpr,
    WITH_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride
    t = tl.load(temp_ptr + row)
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(g_logp_ptr + row)
    label = tl.load(labels_ptr + row)
    if WITH_ENT:
        h = tl.load(ent_ptr + row)
        g_ent = tl.load(g_ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        logp = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32) / t - lse
        p = tl.exp(logp)
        g = -g_logp * p
        if WITH_ENT:
            g = g - g_ent * p * (logp + h)
        g = tl.where(cols == label, g + g_logp, g) / t
        tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=inside)


def row_stats(
    z: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor, with_entropy: bool
) -> torch.Tensor:
    """z: [c, V_local] logits; labels: [c] local ids, -1 outside this slice; temperature: [c]
    fp32. Returns [4, c] fp32: max, sum exp, target, sum exp * (s - max) (see the module)."""
    z = z.contiguous()
    c, v = z.shape
    out = torch.empty(4, c, dtype=torch.float32, device=z.device)
    if c:
        _row_stats_kernel[(c,)](
            z,
            z.stride(0),
            labels.contiguous(),
            temperature.contiguous(),
            out,
            c,
            v,
            WITH_ENT=with_entropy,
            BLOCK_V=_block(v),
            num_warps=8,
        )
    return out


def grad_in_place(
    z: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    """Overwrite the contiguous logits `z: [c, V_local]` with d loss / d z (z's dtype); returns z.
    All other inputs `[c]` fp32 (labels: local ids, -1 outside); `g_ent` None: no entropy term."""
    assert z.is_contiguous()
    c, v = z.shape
    if c:
        ent = g_ent is not None
        _grad_kernel[(c,)](
            z,
            z.stride(0),
            labels.contiguous(),
            temperature.contiguous(),
            lse.contiguous(),
            entropy.contiguous(),
            g_logp.contiguous(),
            (g_ent if ent else g_logp).contiguous(),
            v,
            WITH_ENT=ent,
            BLOCK_V=_block(v),
            num_warps=8,
        )
    return z


def _block(v: int) -> int:
    return min(BLOCK, triton.next_power_of_2(max(v, 16)))
