"""Decode attention over a prompt that several running requests share: its keys read once.

Why: the n samples of a GRPO group share their prompt's KV blocks (prefix sharing: the same
block ids in every sample's table), but a decode step of one program per request reads each
request's keys on its own, the prompt's n times over. At the GRPO bench's shape (64 prompts of
256 tokens x 8 samples, 512 running) the prompt is half of the keys a step reads on average,
and the keys are nearly all of the step's bytes (some 30 GB against 1.2 GB of weights). On an
H100 reading it once took 9% off that step's device time (the rows of a group run side by side,
so the L2 cache already served many of the repeated reads) and 41% with 1,024-token prompts
(docs/benchmarks/2026-12-07-h100-grpo.md).

- `find_groups` (host, numpy, every step): rows whose block tables begin with the same blocks,
  in groups of at most `group_max` rows, and how many tokens of full blocks they share (never
  the newest key of any of them: every row keeps at least its own key to itself).
- `_prefix_kernel`, program (group, KV head): the query heads of all the group's rows (up to
  group_max x the GQA group, one `tl.dot` tile) against the shared keys, read once: each
  row's (max, sum, weighted values) of the prefix. The decode kernel then reads each row's
  keys from the end of its group's prefix on, and merges the two softmaxes.

The result is the same attention, summed in another order (as the splits of flash-decoding):
`attention.paged_decode(..., prefix=prefix_partials(...))`; a CUDA graph of the decode step captures the group buffers as static
inputs (`cuda_graphs.DecodeGraphs`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from slime_async.actors.engine.embedded import attention

try:  # the GPU image carries Triton; CPU machines need not
    import triton
    import triton.language as tl

    from slime_async.actors.engine.embedded.attention import _decode_tile
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

GROUP_MAX = 8
"""Rows of one group (more sharing one prompt are cut into groups of this many): 8 rows x a
GQA group of 2 query heads fill one 16-row `tl.dot` tile."""


class Groups(NamedTuple):
    """What `find_groups` finds (host arrays)."""

    rows: np.ndarray
    """[k, group_max] int32: each group's rows (indices into the step's batch), -1 padded."""
    tokens: np.ndarray
    """[k] int32: the keys the group's rows share (whole blocks), > 0."""
    start: np.ndarray
    """[m] int32: where each row's own keys begin (its group's tokens; 0 outside a group)."""


class SharedPrefix(NamedTuple):
    """A step's groups on the device, as `prefix_partials` takes them. `rows` may have more
    groups than found (a CUDA graph's static buffer): a group with tokens 0 is empty."""

    rows: torch.Tensor
    tokens: torch.Tensor
    start: torch.Tensor


def group_size(heads: int, kv_heads: int) -> int:
    """Rows a group may hold: GROUP_MAX, fewer where the GQA group is wide (a tile of at most
    64 query heads)."""
    return max(2, min(GROUP_MAX, 64 // max(1, heads // kv_heads)))


def find_groups(
    block_tables: np.ndarray, lens: np.ndarray, block_size: int, group_max: int = GROUP_MAX
) -> Groups:
    """Groups of rows sharing their first blocks. block_tables [m, MB] (int), lens [m] (each
    row's keys, its newest included). Rows are grouped by their first block, in batch order,
    those sharing most blocks with the run's first row first, cut into groups of `group_max`;
    a group shares the leading blocks all its rows have equal to the run's first row's, and
    only blocks wholly before every row's newest key. Groups of one row, or sharing no block,
    are left out."""
    m = block_tables.shape[0]
    start = np.zeros(m, dtype=np.int32)
    none = Groups(np.zeros((0, group_max), np.int32), np.zeros(0, np.int32), start)
    if m < 2:
        return none
    full = (lens.astype(np.int64) - 1) // block_size  # blocks wholly before the newest key
    width = int(full.max())
    if width <= 0:
        return none
    order = np.argsort(block_tables[:, 0], kind="stable")
    firsts = block_tables[order, 0]
    new_run = np.r_[True, firsts[1:] != firsts[:-1]]
    if new_run.all():  # no two rows begin alike (the cheap answer of most batches)
        return none
    bt = block_tables[order, :width]
    run_start = np.flatnonzero(new_run)
    run_len = np.diff(np.r_[run_start, m])
    pos = np.arange(m) - np.repeat(run_start, run_len)  # place inside its run
    leader = np.repeat(run_start, run_len)
    same = bt == bt[leader]
    equal = np.where(same.all(1), width, same.argmin(1))  # leading blocks equal to the leader's
    shared = np.minimum(equal, full[order])
    # inside a run, the rows sharing most first (a row that parts early groups with its like)
    resort = np.lexsort((np.arange(m), -shared, leader))
    order, shared = order[resort], shared[resort]
    # Groups: runs cut every group_max rows (a group's first row is then its run's leader or a
    # row equal to it over the shared blocks; the minimum below holds for every member).
    cut = new_run | (pos % group_max == 0)
    g_start = np.flatnonzero(cut)
    g_len = np.diff(np.r_[g_start, m])
    g_shared = np.minimum.reduceat(shared, g_start)
    keep = (g_len >= 2) & (g_shared > 0)
    if not keep.any():
        return none
    group_of = np.repeat(np.arange(len(g_start)), g_len)
    slot = pos % group_max
    index = np.cumsum(keep) - 1  # a kept group's place in the output
    member = keep[group_of]
    rows = np.full((int(keep.sum()), group_max), -1, dtype=np.int32)
    rows[index[group_of[member]], slot[member]] = order[member]
    tokens = (g_shared[keep] * block_size).astype(np.int32)
    start[order[member]] = g_shared[group_of[member]] * block_size
    return Groups(rows, tokens, start)


if triton is not None:

    @triton.jit
    def _prefix_kernel(
        Q, K, V, PreM, PreL, PreAcc, BT, ROWS, TOKENS, scale,
        stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_btn,
        H: tl.constexpr, G: tl.constexpr, GM: tl.constexpr, MP: tl.constexpr, D: tl.constexpr,
        BS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, DYNAMIC: tl.constexpr,
        MAXT: tl.constexpr,
    ):  # fmt: skip
        """Program (group, KV head h): the query heads h*G .. h*G+G-1 of the group's rows, one
        tile of MP rows (row r, head g at r * G + g), against the group's shared keys (its
        first row's blocks); each row's (max, sum, weighted values) stored at [row, head]."""
        gi = tl.program_id(0)
        h = tl.program_id(1)
        count = tl.load(TOKENS + gi)
        if count > 0:
            i = tl.arange(0, MP)
            d = tl.arange(0, D)
            member = i // G
            rows = tl.load(ROWS + gi * GM + member, mask=member < GM, other=-1)
            live = rows >= 0
            heads = h * G + i % G
            q = tl.load(
                Q + rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=live[:, None],
                other=0.0,
            )
            lead = tl.load(ROWS + gi * GM)
            m_i = tl.full([MP], float("-inf"), tl.float32)
            l_i = tl.zeros([MP], tl.float32)
            acc = tl.zeros([MP, D], tl.float32)
            if DYNAMIC:
                for j in range(0, tl.cdiv(count, TILE)):
                    m_i, l_i, acc = _decode_tile(
                        q, K, V, BT, lead, h, j, 0, count, True, scale, m_i, l_i, acc,
                        stride_kb, stride_kt, stride_kh, stride_btn, D, BS, TILE, IEEE,
                    )  # fmt: skip
            else:  # Triton's CPU interpreter: every tile of the table, the others masked
                for j in tl.static_range(0, MAXT):
                    m_i, l_i, acc = _decode_tile(
                        q, K, V, BT, lead, h, j, 0, count, True, scale, m_i, l_i,
                        acc, stride_kb, stride_kt, stride_kh, stride_btn, D, BS, TILE, IEEE,
                    )  # fmt: skip
            out = rows * H + heads
            tl.store(PreM + out, m_i, mask=live)
            tl.store(PreL + out, l_i, mask=live)
            tl.store(PreAcc + out[:, None] * D + d[None, :], acc, mask=live[:, None])


def prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    shared: SharedPrefix,
    scale: float,
) -> attention.Prefix:
    """`_prefix_kernel`'s softmax of every grouped row over its group's shared keys, as
    `attention.paged_decode(..., prefix=...)` merges it into each row's own keys (rows outside
    a group: start 0, their partials unwritten and unread)."""
    n, H, D = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // hkv
    gm = shared.rows.shape[1]
    q = q.contiguous()
    pre_m = torch.empty((n, H), dtype=torch.float32, device=q.device)
    pre_l = torch.empty_like(pre_m)
    pre_acc = torch.empty((n, H, D), dtype=torch.float32, device=q.device)
    cuda = q.device.type == "cuda"
    tile = attention.decode_tile(bs)
    _prefix_kernel[(shared.rows.shape[0], hkv)](
        q, k_cache, v_cache, pre_m, pre_l, pre_acc, block_tables, shared.rows, shared.tokens,
        scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        H=H, G=G, GM=gm, MP=max(16, triton.next_power_of_2(gm * G)), D=D, BS=bs, TILE=tile,
        IEEE=q.dtype == torch.float32, DYNAMIC=cuda,
        MAXT=0 if cuda else -(-block_tables.shape[1] * bs // tile), num_warps=4,
    )  # fmt: skip
    return attention.Prefix(shared.start, pre_m, pre_l, pre_acc)
