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

import functools
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
    kernel: bool | None = None,
) -> None:
    """Store k, v: [T, Hkv, D] at flat cache slots [T] (block * B + offset). `kernel` (None: on
    CUDA with Triton, same dtypes): one Triton kernel stores both, reading k and v where they are
    (strided views of the q|k|v output included); otherwise two index copies."""
    if kernel is None:
        kernel = triton is not None and k.device.type == "cuda"
        kernel = kernel and k.dtype == v.dtype == k_cache.dtype
    if not kernel:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    T, hkv, d = k.shape
    if T == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        D=d, WIDTH=hkv * d, WP=triton.next_power_of_2(hkv * d),
    )  # fmt: skip


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


def varlen_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_packed: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """Causal prefill attention through torch's variable-length flash kernel (CUDA): q [T, H, D]
    packed, each sequence's new tokens in turn (`cu_q` [n + 1], int32); each sequence's keys,
    its cached prefix then its new tokens, gathered from the cache at `kv_packed` [sum of key
    counts] (`cu_k` [n + 1]) into contiguous [Tk, Hkv, D]. The kernel aligns causality to each
    sequence's last key: new token j of m sees its sequence's keys up to L - m + j, its own
    position. One kernel for every sequence, where `gathered_attention` pads them to a rectangle
    and SDPA takes its math path (a mask with grouped heads). Returns [T, H, D]."""
    from slime_async.models.attention import varlen_accepts, varlen_kernel

    has_scale = varlen_accepts("scale")
    k = k_cache.view(-1, *k_cache.shape[2:])[kv_packed]
    v = v_cache.view(-1, *v_cache.shape[2:])[kv_packed]
    kw: dict = {"scale": scale} if has_scale else {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if varlen_accepts("enable_gqa"):
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if not has_scale and scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_kernel()(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


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
    def _store_kv_kernel(
        Kin, Vin, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
        D: tl.constexpr, WIDTH: tl.constexpr, WP: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        e = tl.arange(0, WP)
        emask = e < WIDTH
        slot = tl.load(SLOTS + t).to(tl.int64)
        h, d = e // D, e % D
        k = tl.load(Kin + t * stride_kt + h * stride_kh + d, mask=emask)
        v = tl.load(Vin + t * stride_vt + h * stride_vh + d, mask=emask)
        tl.store(KC + slot * WIDTH + e, k, mask=emask)
        tl.store(VC + slot * WIDTH + e, v, mask=emask)

    @triton.jit
    def _decode_tile(
        q,
        K,
        V,
        BT,
        n,
        h,
        j,
        first,
        length,
        valid,
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
        TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Keys j*TILE .. j*TILE+TILE-1 of request n (TILE / BS blocks, their ids read from its
        block table at once), those in [first, length): the online-softmax update of (m, l,
        acc)."""
        d = tl.arange(0, D)
        tok = j * TILE + tl.arange(0, TILE)
        # (a where, not `& valid`: Triton's interpreter makes a bool tensor & a bool scalar int32)
        tmask = tl.where(valid, (tok < length) & (tok >= first), False)
        blk = tl.load(BT + n * stride_btn + tok // BS, mask=tmask, other=0).to(tl.int64)
        offs = blk * stride_kb + (tok % BS) * stride_kt + h * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # No key seen yet (a masked tile first: the interpreter's path): 0, not exp(-inf + inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, Out, PartM, PartL, PartAcc, BT, LENS, START, PreM, PreL, PreAcc, scale,
        stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_on, stride_oh, stride_btn,
        H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        TILE: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, DYNAMIC: tl.constexpr,
        MAXT: tl.constexpr, PREFIX: tl.constexpr,
    ):  # fmt: skip
        """Program (request n, KV head h, split s): the GQA group's query heads against the
        tiles [s * per, (s + 1) * per) of the request's keys. One split: the output; several:
        each split's (max, sum, weighted values) for `_combine_splits`. PREFIX: a request with
        START > 0 reads only its keys from START on; the shared prompt's before them were done
        by `shared_prefix`'s kernel, whose (max, sum, weighted values) one split merges here."""
        n = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(LENS + n)
        first = 0
        if PREFIX:
            first = tl.load(START + n)
        tiles = tl.cdiv(length, TILE)
        t_first = first // TILE
        per = tl.cdiv(tiles - t_first, SPLITS)
        t0 = t_first + sp * per
        t1 = tl.minimum(t0 + per, tiles)
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
        if DYNAMIC:  # each program walks only its own tiles
            for j in range(t0, t1):
                m_i, l_i, acc = _decode_tile(
                    q, K, V, BT, n, h, j, first, length, True, scale, m_i, l_i, acc,
                    stride_kb, stride_kt, stride_kh, stride_btn, D, BS, TILE, IEEE,
                )  # fmt: skip
        else:  # Triton's CPU interpreter: every tile of the table, the others masked
            for j in tl.static_range(0, MAXT):
                m_i, l_i, acc = _decode_tile(
                    q, K, V, BT, n, h, j, first, length, (j >= t0) & (j < t1), scale, m_i, l_i,
                    acc, stride_kb, stride_kt, stride_kh, stride_btn, D, BS, TILE, IEEE,
                )  # fmt: skip
        if SPLITS == 1:
            if PREFIX:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if first > 0:
                    pre = n * H + heads
                    pm = tl.load(PreM + pre, mask=gmask, other=float("-inf"))
                    top = tl.maximum(m_i, pm)
                    top = tl.where(top == float("-inf"), 0.0, top)
                    a = tl.exp(m_i - top)
                    b = tl.exp(pm - top)
                    pl = tl.load(PreL + pre, mask=gmask, other=0.0)
                    pacc = tl.load(PreAcc + pre[:, None] * D + d[None, :], mask=gmask[:, None],
                                   other=0.0)  # fmt: skip
                    l_i = l_i * a + pl * b
                    acc = acc * a[:, None] + pacc * b[:, None]
            out = acc / l_i[:, None]
            tl.store(
                Out + n * stride_on + heads[:, None] * stride_oh + d[None, :],
                out.to(Out.dtype.element_ty),
                mask=gmask[:, None],
            )
        else:  # an empty split stores max -inf and sum 0: it weighs nothing in the combine
            row = (n * H + heads) * SPLITS + sp
            tl.store(PartM + row, m_i, mask=gmask)
            tl.store(PartL + row, l_i, mask=gmask)
            tl.store(PartAcc + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _combine_splits(
        PartM, PartL, PartAcc, Out, START, PreM, PreL, PreAcc, stride_on, stride_oh,
        H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
        PREFIX: tl.constexpr,
    ):  # fmt: skip
        """Program (request n, query head): the splits' partial softmaxes (and, PREFIX with
        START > 0, the shared prompt's) rescaled to their common max and summed."""
        n = tl.program_id(0)
        hq = tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        smask = s < SPLITS
        row = (n * H + hq) * SPLITS + s
        m = tl.load(PartM + row, mask=smask, other=float("-inf"))
        l = tl.load(PartL + row, mask=smask, other=0.0)  # noqa: E741
        acc = tl.load(PartAcc + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        top = tl.max(m, 0)
        if PREFIX:
            use = tl.load(START + n) > 0
            pm = tl.where(use, tl.load(PreM + n * H + hq), float("-inf"))
            top = tl.maximum(top, pm)
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(l * w, 0)
        if PREFIX:
            wp = tl.where(pm > float("-inf"), tl.exp(pm - top), 0.0)
            num += tl.where(use, tl.load(PreAcc + (n * H + hq) * D + d), 0.0) * wp
            den += tl.where(use, tl.load(PreL + n * H + hq), 0.0) * wp
        tl.store(Out + n * stride_on + hq * stride_oh + d, (num / den).to(Out.dtype.element_ty))


def triton_available(device: torch.device) -> bool:
    import os

    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


DECODE_TILE = 64
"""Keys a decode program reads per iteration (several blocks' ids at once: more bytes in flight
than one 16-token block at a time)."""


def decode_tile(block_size: int) -> int:
    """DECODE_TILE rounded to whole blocks (at least one)."""
    return max(block_size, DECODE_TILE // block_size * block_size)


class Prefix(NamedTuple):
    """Keys of each request attended to elsewhere (`shared_prefix`): its own keys begin at
    start [n] (int32; 0: none before); the softmax over the keys before, as max m [n, H], sum
    total [n, H] and weighted values acc [n, H, D] (fp32), is merged into its output."""

    start: torch.Tensor
    m: torch.Tensor
    total: torch.Tensor
    acc: torch.Tensor


MAX_SPLITS = 16


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(n: int, kv_heads: int, device: torch.device) -> int:
    """How many splits of the keys each (request, KV head) gets: enough programs to fill the GPU
    about twice when the batch alone cannot (one request: up to MAX_SPLITS; 256 requests: 1).
    Fixed by the batch size only, so a CUDA graph captured for a bucket keeps it."""
    if device.type != "cuda":
        return 1
    want = -(-2 * _multiprocessors(device) // max(1, n * kv_heads))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want) if want > 1 else 1))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    prefix: Prefix | None = None,
) -> torch.Tensor:
    """q: [n, H, D]; block_tables: [n, MB] int32; seq_lens: [n] int32 (keys 0..len-1, the
    query's own key included). Returns [n, H, D]. Reads only each request's own blocks, from
    `prefix.start` on when given (the softmax over the keys before merged in).

    `splits` (None: `decode_splits`): each request's keys are cut into that many ranges, each
    run by its own program, then combined (flash-decoding): a few requests then still fill the
    GPU. The tile is DECODE_TILE keys (a multiple of the block size)."""
    n, H, D = q.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hkv
    tile = decode_tile(bs)
    splits = splits or decode_splits(n, Hkv, q.device)
    q = q.contiguous()
    out = torch.empty_like(q)
    if splits > 1:
        part_m = torch.empty((n, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((n, H, splits, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    cuda = q.device.type == "cuda"
    pre = prefix or Prefix(seq_lens, out, out, out)  # unused without
    _paged_decode_kernel[(n, Hkv, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_m,
        part_l,
        part_acc,
        block_tables,
        seq_lens,
        pre.start,
        pre.m,
        pre.total,
        pre.acc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        H=H,
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=D,
        BS=bs,
        TILE=tile,
        SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        DYNAMIC=cuda,
        MAXT=0 if cuda else -(-block_tables.shape[1] * bs // tile),
        PREFIX=prefix is not None,
        num_warps=4,
    )
    if splits > 1:
        _combine_splits[(n, H)](
            part_m, part_l, part_acc, out, pre.start, pre.m, pre.total, pre.acc,
            out.stride(0), out.stride(1),
            H=H, D=D, SPLITS=splits, SP=max(2, triton.next_power_of_2(splits)),
            PREFIX=prefix is not None,
        )  # fmt: skip
    return out
