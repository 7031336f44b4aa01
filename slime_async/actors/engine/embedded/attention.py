"""Attention over the paged KV cache (kv_cache.py's layout `[num_blocks, B, Hkv, D]`).

- `paged_decode`: one query token per request against that request's own blocks only, up to its
  own length. On CUDA a Triton kernel of this project (one program per request and KV head: it
  walks the block table, online softmax in fp32, the GQA group's query heads together in one
  `tl.dot`); elsewhere, or when the kernel is unavailable, `gathered_attention` (reference).
  Why our own kernel: FlashInfer and flash-attn are not on the GPU image; FlexAttention needs a
  BlockMask rebuilt every step outside the CUDA graph; SDPA over gathered blocks copies every
  request's KV once more per layer and pads to the longest request. `bench_engine.py
  --attention` measures the kernel against SDPA over gathered blocks.
- `gathered_attention`: queries of several sequences (packed, no padding in the layer's matmuls)
  against their cached keys; K/V are gathered from the blocks into a padded batch and SDPA runs
  with a mask (key position <= query position, key inside the sequence). Used by prefill on a
  GPU (the new tokens of each prompt, after the prefix-index hit) and as the reference of the
  kernel; exact in fp32 against HF.
- The CPU path (`gather_plan` + `attend_gathered`, prefill and decode): the same math, but what
  every layer shares (the flat cache slots of each sequence's keys, the mask, the query rows) is
  built once per forward pass, and K/V rows are copied with `index_select` (contiguous rows),
  which on a CPU costs about a tenth of advanced indexing. On a small model a CPU step is
  dominated by per-op overhead, so ops per layer are what this path saves.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # the GPU image carries Triton; CPU machines need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store k, v: [T, Hkv, D] at flat cache slots [T] (block * B + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gathered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_rows: torch.Tensor,
    q_pos: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    tok_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] packed; q_rows, q_pos: [n, M] index into q and each query's position (pad
    rows: index 0, position 0); kv_slots: [n, L] flat slots of each sequence's keys (pad: 0);
    kv_len: [n]; tok_rows: [T] each packed token's row in the flattened [n * M] queries (None:
    q_rows is every row of q once, in order, no padding). Returns [T, H, D].

    The output is gathered back by `tok_rows`, never scattered by `q_rows`: a scatter would let
    the padding rows (index 0) overwrite token 0's output."""
    n, m = q_rows.shape
    qb = q[q_rows.reshape(-1)].view(n, m, *q.shape[1:]).transpose(1, 2)  # [n, H, M, D]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    L = kv_slots.shape[1]
    kb = flat_k[kv_slots.reshape(-1)].view(n, L, *flat_k.shape[1:]).transpose(1, 2)
    vb = flat_v[kv_slots.reshape(-1)].view(n, L, *flat_v.shape[1:]).transpose(1, 2)
    key_pos = torch.arange(L, device=q.device)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < kv_len[:, None, None]
    )
    o = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=mask[:, None], enable_gqa=True, scale=scale
    )
    o = o.transpose(1, 2).reshape(n * m, *q.shape[1:])
    return o if tok_rows is None else o[tok_rows]


class GatherPlan(NamedTuple):
    """What every layer's attention shares in one forward pass on the CPU path (built once)."""

    kv_idx: torch.Tensor
    """[n * L] flat cache slots of each sequence's keys 0..L-1 (padding: slot 0, masked)."""
    mask: torch.Tensor
    """[n, 1, M, L] bool: True where the query sees the key."""
    q_idx: torch.Tensor | None
    """[n * M] rows of the packed queries (padding: 0); None: the queries are [n] rows, M = 1."""
    tok_rows: torch.Tensor | None
    """[T] each packed token's row in the [n * M] output; None: the output is already [T]."""
    n: int
    m: int
    keys: int


def gather_plan(
    kv_slots: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: torch.Tensor,
    q_rows: torch.Tensor | None = None,
    tok_rows: torch.Tensor | None = None,
) -> GatherPlan:
    """kv_slots: [n, L]; q_pos: [n, M] each query's position; kv_len: [n]; q_rows, tok_rows as in
    `gathered_attention` (None for decode: one query per sequence, in order)."""
    n, L = kv_slots.shape
    key_pos = torch.arange(L, device=kv_slots.device)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < kv_len[:, None, None]
    )
    q_idx = None if q_rows is None else q_rows.reshape(-1)
    return GatherPlan(kv_slots.reshape(-1), mask[:, None], q_idx, tok_rows, n, q_pos.shape[1], L)


def attend_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
) -> torch.Tensor:
    """`gathered_attention` with a prebuilt plan (the CPU path): q [T, H, D] -> [T, H, D]."""
    H, D = q.shape[1:]
    qb = q if plan.q_idx is None else q.index_select(0, plan.q_idx)
    qb = qb.view(plan.n, plan.m, H, D).transpose(1, 2)  # [n, H, M, D]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    kb = flat_k.index_select(0, plan.kv_idx).view(plan.n, plan.keys, *flat_k.shape[1:])
    vb = flat_v.index_select(0, plan.kv_idx).view(plan.n, plan.keys, *flat_v.shape[1:])
    o = F.scaled_dot_product_attention(
        qb,
        kb.transpose(1, 2),
        vb.transpose(1, 2),
        attn_mask=plan.mask,
        enable_gqa=True,
        scale=scale,
    )
    o = o.transpose(1, 2).reshape(plan.n * plan.m, H, D)
    return o if plan.tok_rows is None else o.index_select(0, plan.tok_rows)


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_len: int | None = None,
) -> torch.Tensor:
    """paged_decode by gathering blocks (q: [n, H, D]); `max_len` bounds the keys read."""
    n = q.shape[0]
    bs = k_cache.shape[1]
    L = max_len if max_len is not None else block_tables.shape[1] * bs
    pos = torch.arange(L, device=q.device)
    slots = block_tables.long()[:, pos // bs] * bs + pos % bs  # [n, L]
    rows = torch.arange(n, device=q.device)[:, None]
    o = gathered_attention(
        q, k_cache, v_cache, rows, seq_lens.long()[:, None] - 1, slots, seq_lens.long(), scale
    )
    return o


if triton is not None:

    @triton.jit
    def _decode_block(
        q,
        K,
        V,
        BT,
        n,
        h,
        j,
        length,
        scale,
        m_i,
        l_i,
        acc,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_btn,
        D: tl.constexpr,
        BS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One block of one request's keys: the online-softmax update of (m, l, acc)."""
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        blk = tl.load(BT + n * stride_btn + j).to(tl.int64)
        tmask = (j * BS + t) < length
        offs = blk * stride_kb + h * stride_kh + t[:, None] * stride_kt + d[None, :]
        k = tl.load(K + offs, mask=tmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs, mask=tmask[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        Q,
        K,
        V,
        Out,
        BT,
        LENS,
        scale,
        stride_qn,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_on,
        stride_oh,
        stride_btn,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        IEEE: tl.constexpr,
        DYNAMIC: tl.constexpr,
        MAXB: tl.constexpr,
    ):
        n = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(LENS + n)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        heads = h * G + g
        q = tl.load(
            Q + n * stride_qn + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        if DYNAMIC:  # each program walks only its own blocks
            for j in range(0, tl.cdiv(length, BS)):
                m_i, l_i, acc = _decode_block(
                    q,
                    K,
                    V,
                    BT,
                    n,
                    h,
                    j,
                    length,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    stride_kb,
                    stride_kt,
                    stride_kh,
                    stride_btn,
                    D,
                    BS,
                    IEEE,
                )
        else:  # Triton's CPU interpreter: the table's width, the rest masked (same result)
            for j in tl.static_range(0, MAXB):
                m_i, l_i, acc = _decode_block(
                    q,
                    K,
                    V,
                    BT,
                    n,
                    h,
                    j,
                    length,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    stride_kb,
                    stride_kt,
                    stride_kh,
                    stride_btn,
                    D,
                    BS,
                    IEEE,
                )
        out = acc / l_i[:, None]
        tl.store(
            Out + n * stride_on + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=gmask[:, None],
        )


def triton_available(device: torch.device) -> bool:
    import os

    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [n, H, D]; block_tables: [n, MB] int32; seq_lens: [n] int32 (keys 0..len-1, the
    query's own key included). Returns [n, H, D]. Reads only each request's own blocks."""
    n, H, D = q.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(n, Hkv)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=D,
        BS=bs,
        IEEE=q.dtype == torch.float32,
        DYNAMIC=q.device.type == "cuda",
        MAXB=0 if q.device.type == "cuda" else block_tables.shape[1],
        num_warps=4,
    )
    return out
