"""The sampler's unfiltered draws as two Triton kernels: one pass over a step's logits.

What `sampling.greedy_pick` and `sampling.temperature_pick` compute, for every row of a decode
step at once (no top-k/top-p, no seed):

- `_pick_chunks`, program (row, chunk of CHUNK columns): the chunk's max of x = logits / T (fp32),
  its sum of exp(x - max), its first argmax and, when drawing, its best x + Gumbel noise and where
  (the noise from Triton's Philox generator, `tl.rand`, keyed by a per-step seed and the element's
  index: never written to memory).
- `_pick_rows`, program (row): the chunks combined: logsumexp, the greedy token (the first
  maximum, as torch.argmax), the drawn token (Gumbel-max: argmax of x + g, a draw from
  softmax(x)), and the token's log-prob x[token] - logsumexp.
- `thresholds`, for top-k/top-p (`filtered_pick`): the lowest kept value of x,
  `sampling.filter_thresholds` without a sort. The logits' fp32 bits map to integer keys in the
  same order (bf16's 2^16 values: 16-bit keys; x = logits / T keeps their order). A search over
  a row's keys tests NP pivots a pass (tokens at or above each pivot: their count for top-k,
  their mass exp(x - max) for top-p) and keeps the interval between the last pivot that holds
  k tokens / top_p of the mass and the first that does not: 6 passes find the exact boundary
  among a bf16 row's keys at 8 pivots. Each pass is one kernel of programs (row, CHUNK
  columns), every program first adding up the row's sums of the previous pass in the same
  order (so every program narrows the interval alike; no atomics, the same thresholds every
  run). The first kernel then races only the tokens with x >= that value.

Why: the eager torch version writes the scaled logits, the noise and a log-softmax out in fp32
and reads them back (a dozen passes over [rows, V]); torch.compile'd with dynamic batch sizes
it reduced each long row in one program. Here every pass reads the logits (bf16) once. With
top-p the eager version sorts every row (6.5 ms at 256 x 151,936 on an H100); a search of one
program a row (all passes in it) took 2.4 ms at 256 x 151,936 on an H200, waiting on its own
loads with most SMs idle.
The per-step seed is drawn from the scheduler's device generator (`torch.randint` on the device:
no host sync), so an engine's draws follow its seed as before.
"""

from __future__ import annotations

import functools

import torch

try:  # the GPU image carries Triton; CPU machines need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

CHUNK = 4096
"""Columns of one row per program, of the draw's first kernel and of the threshold search's
kernels (38 programs a row at Qwen's 151,936)."""

SEARCH_SUB = 512
"""Columns a search pass adds into its [pivots, SEARCH_SUB] tile at a time."""

SEARCH_WARPS = 4
"""Warps of a search kernel's program."""

PIVOTS = 8
"""Keys the threshold search tests per pass over a row: the interval shrinks 9x a pass, so a
row of bf16 logits (2^16 keys) needs 6 passes, of fp32 logits 11 (`search_passes`). On an H100
at 151,936 bf16, top_p 0.95, a search took 0.77 ms at 256 rows and 1.35 at 512 with these
settings; 4 pivots 0.74-0.86 / 1.25-1.54 over the column blocks and tile widths tried, 2
pivots 0.78-0.86 / 1.34-1.49 (`bench_sampling.py --pivots 2,4,8` times them)."""


if triton is not None:

    @triton.jit
    def _pick_chunks(
        LOGITS, stride_l, INV_T, SEED, THR, PM, PS, PA, PB, PI, V, C,
        CHUNK: tl.constexpr, SAMPLE: tl.constexpr, FILTER: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        valid = cols < V
        base = row.to(tl.int64) * stride_l
        x = tl.load(LOGITS + base + cols, mask=valid, other=float("-inf"))
        x = x.to(tl.float32) * tl.load(INV_T + row)
        m = tl.max(x, 0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)  # a chunk of banned (-inf) columns only
        out = row * C + c
        tl.store(PM + out, m)
        tl.store(PS + out, tl.sum(tl.exp(x - m_ref), 0))
        tl.store(PA + out, c * CHUNK + tl.argmax(x, 0))
        if SAMPLE:
            u = tl.rand(tl.load(SEED), row * V + cols)
            u = tl.minimum(tl.maximum(u, 1.0e-12), 1.0 - 1.0e-7)
            y = x - tl.log(-tl.log(u))  # + Gumbel(0, 1); -inf stays -inf
            if FILTER:  # top-k/top-p: only x >= the row's threshold races
                y = tl.where(x >= tl.load(THR + row), y, float("-inf"))
            tl.store(PB + out, tl.max(y, 0))
            tl.store(PI + out, c * CHUNK + tl.argmax(y, 0))

    @triton.jit
    def _merge(pm, ps):
        """A row's chunks combined: their max m, m where finite (else 0: every column banned),
        and sum exp(x - that) from each chunk's max and sum exp(x - its max)."""
        m = tl.max(pm, 0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(pm == float("-inf"), 0.0, tl.exp(pm - m_ref))
        return m, m_ref, tl.sum(ps * w, 0)

    @triton.jit
    def _pick_rows(
        LOGITS, stride_l, INV_T, GREEDY, PM, PS, PA, PB, PI, TOK, LP, C,
        CP: tl.constexpr, SAMPLE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        c = tl.arange(0, CP)
        cm = c < C
        m = tl.load(PM + row * C + c, mask=cm, other=float("-inf"))
        _top, top_ref, z = _merge(m, tl.load(PS + row * C + c, mask=cm, other=0.0))
        lse = top_ref + tl.log(z)
        tok = tl.load(PA + row * C + tl.argmax(m, 0))  # the first maximum's chunk, then column
        if SAMPLE:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if tl.load(GREEDY + row) == 0:
                b = tl.load(PB + row * C + c, mask=cm, other=float("-inf"))
                tok = tl.load(PI + row * C + tl.argmax(b, 0))
        x = tl.load(LOGITS + row.to(tl.int64) * stride_l + tok).to(tl.float32)
        x = x * tl.load(INV_T + row)
        tl.store(TOK + row, tok.to(tl.int64))
        tl.store(LP + row, x - lse)

    @triton.jit
    def _key(x):
        """fp32 -> int32 in the same order: the bits, a negative float's magnitude bits flipped
        (its own inverse)."""
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _value(key, SHIFT: tl.constexpr):
        """The fp32 value of a logit's key (`_key(raw) >> SHIFT`): the dropped low bits were
        zeros of a positive float's bits, ones of a negative one's key."""
        k = key.to(tl.int32) << SHIFT
        if SHIFT > 0:
            k = k | tl.where(key < 0, (1 << SHIFT) - 1, 0)
        return _key(k).to(tl.float32, bitcast=True)

    @triton.jit
    def _columns(LOGITS, stride_l, INV_T, row, s, V, SPLIT: tl.constexpr, SHIFT: tl.constexpr):
        """One program's columns of a row: valid, x = logits * inv_t (fp32), the logits' keys."""
        cols = s * SPLIT + tl.arange(0, SPLIT)
        valid = cols < V
        raw = tl.load(LOGITS + row.to(tl.int64) * stride_l + cols, mask=valid, other=float("-inf"))
        raw = raw.to(tl.float32)
        return valid, raw * tl.load(INV_T + row), _key(raw) >> SHIFT

    @triton.jit
    def _search_stats(
        LOGITS, stride_l, INV_T, SM, SZ, SLO, SHI, V, S,
        SPLIT: tl.constexpr, SHIFT: tl.constexpr,
    ):  # fmt: skip
        """Program (row, split): the split's max of x, sum of exp(x - that max), key range."""
        row = tl.program_id(0)
        s = tl.program_id(1)
        valid, x, key = _columns(LOGITS, stride_l, INV_T, row, s, V, SPLIT, SHIFT)
        m = tl.max(x, 0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        out = row * S + s
        tl.store(SM + out, m)
        tl.store(SZ + out, tl.sum(tl.exp(x - m_ref), 0))
        tl.store(SLO + out, tl.min(tl.where(valid, key, 2**31 - 1), 0))
        tl.store(SHI + out, tl.max(tl.where(valid, key, -(2**31)), 0))

    @triton.jit
    def _search_init(
        SM, SZ, SLO, SHI, TOP_K, TOP_P, M, NEED, TK, MODE, TOP, LO, HI, V, S,
        SP: tl.constexpr,
    ):  # fmt: skip
        """Program (row): the row's max, mass and key range from its splits; what the search
        looks for (MODE 1: the k-th largest key, by count; 2: top-p of the whole row, by mass;
        0: nothing) in [LO, HI] (the lowest key qualifies)."""
        row = tl.program_id(0)
        c = tl.arange(0, SP)
        cm = c < S
        pm = tl.load(SM + row * S + c, mask=cm, other=float("-inf"))
        m, _m_ref, z = _merge(pm, tl.load(SZ + row * S + c, mask=cm, other=0.0))
        lo = tl.min(tl.load(SLO + row * S + c, mask=cm, other=2**31 - 1), 0).to(tl.int64)
        hi = tl.max(tl.load(SHI + row * S + c, mask=cm, other=-(2**31)), 0).to(tl.int64)
        k = tl.load(TOP_K + row)
        p = tl.load(TOP_P + row)
        mode = tl.where(k < V, 1, tl.where(p < 1.0, 2, 0))
        tl.store(M + row, m)
        tl.store(NEED + row, tl.where(k < V, k.to(tl.float32), p * z))
        tl.store(TK + row, lo.to(tl.int32))
        tl.store(MODE + row, mode)
        tl.store(TOP + row, hi)
        tl.store(LO + row, lo)
        tl.store(HI + row, tl.where(mode == 0, lo, hi))

    @triton.jit
    def _advance(LO, HI, PART, NEED, row, S, SP: tl.constexpr, NP: tl.constexpr,
                 APPLY: tl.constexpr):  # fmt: skip
        """A row's interval [lo, hi] after its last pass: the splits' sums at each of NP pivots
        (PART [rows, S, NP]) added up in split order (the same in every program), the interval
        narrowed to between the last pivot that holds what the row needs and the first that
        does not. APPLY False: no pass yet."""
        lo = tl.load(LO + row)
        hi = tl.load(HI + row)
        if APPLY:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if lo < hi:
                s = tl.arange(0, SP)
                j = tl.arange(0, NP)
                part = tl.load(
                    PART + (row * S + s[:, None]) * NP + j[None, :],
                    mask=(s < S)[:, None],
                    other=0.0,
                )
                ok = tl.sum(part, 0) >= tl.load(NEED + row)
                piv = lo + (hi - lo + NP) // (NP + 1) * (j + 1)
                new_lo = tl.maximum(lo, tl.max(tl.where(ok, piv, lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(ok, hi, piv - 1), 0))
                lo = new_lo
        return lo, hi

    @triton.jit
    def _search_pass(
        LOGITS, stride_l, INV_T, M, NEED, TK, MODE, LO, HI, PART, LO_OUT, HI_OUT, PART_OUT, V, S,
        SPLIT: tl.constexpr, SUB: tl.constexpr, SHIFT: tl.constexpr, SP: tl.constexpr,
        NP: tl.constexpr, APPLY: tl.constexpr,
    ):  # fmt: skip
        """Program (row, split): the row's interval after its last pass (kept by split 0 for
        the next), then this split's count (MODE 1) or mass exp(x - max) among keys >= TK
        (MODE 2) of the tokens at or above each of NP pivots evenly inside it: SUB columns at a
        time added into an [NP, SUB] tile, reduced once at the end (a block reduction for each
        pivot cost more than reading the columns: 1.2 ms against 0.77 at 256 x 151,936)."""
        row = tl.program_id(0)
        s = tl.program_id(1)
        lo, hi = _advance(LO, HI, PART, NEED, row, S, SP, NP, APPLY)
        if s == 0:
            tl.store(LO_OUT + row, lo)
            tl.store(HI_OUT + row, hi)
        if lo < hi:
            count = tl.load(MODE + row) == 1
            tk = tl.load(TK + row)
            m = tl.load(M + row)
            step = (hi - lo + NP) // (NP + 1)  # >= 1; the last pivots may pass hi (they fail)
            piv = lo + step * (tl.arange(0, NP).to(tl.int64) + 1)
            acc = tl.zeros([NP, SUB], dtype=tl.float32)
            for c in tl.static_range(SPLIT // SUB):
                valid, x, key = _columns(
                    LOGITS, stride_l, INV_T, row, s * (SPLIT // SUB) + c, V, SUB, SHIFT
                )
                if count:
                    w = tl.where(valid, 1.0, 0.0)
                else:
                    w = tl.where(valid & (key >= tk), tl.exp(x - m), 0.0)
                acc += tl.where(key[None, :] >= piv[:, None], w[None, :], 0.0)
            tl.store(PART_OUT + (row * S + s) * NP + tl.arange(0, NP), tl.sum(acc, 1))

    @triton.jit
    def _search_mass(
        LOGITS, stride_l, INV_T, TOP_P, M, NEED, MODE, LO, HI, PART, ZP, V, S,
        SPLIT: tl.constexpr, SHIFT: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr,
    ):  # fmt: skip
        """Program (row, split), rows with top-k and top-p: the split's mass exp(x - max) of
        the top-k tokens (keys >= the finished count search's)."""
        row = tl.program_id(0)
        s = tl.program_id(1)
        if (tl.load(MODE + row) == 1) & (tl.load(TOP_P + row) < 1.0):
            lo, _hi = _advance(LO, HI, PART, NEED, row, S, SP, NP, True)  # lo == hi: top-k's
            valid, x, key = _columns(LOGITS, stride_l, INV_T, row, s, V, SPLIT, SHIFT)
            w = tl.where(valid & (key >= lo), tl.exp(x - tl.load(M + row)), 0.0)
            tl.store(ZP + row * S + s, tl.sum(w, 0))

    @triton.jit
    def _search_switch(
        TOP_P, M, NEED, TK, MODE, TOP, LO, HI, PART, ZP, LO_OUT, HI_OUT, S,
        SP: tl.constexpr, NP: tl.constexpr,
    ):  # fmt: skip
        """Program (row): rows with top-k and top-p turn from the count to the mass search, from
        the k-th largest key (it qualifies) up to the row's top, needing top_p of the top-k's
        mass; the other rows' intervals carried on."""
        row = tl.program_id(0)
        lo, hi = _advance(LO, HI, PART, NEED, row, S, SP, NP, True)
        p = tl.load(TOP_P + row)
        if (tl.load(MODE + row) == 1) & (p < 1.0):
            c = tl.arange(0, SP)
            z = tl.sum(tl.load(ZP + row * S + c, mask=c < S, other=0.0), 0)
            tl.store(NEED + row, p * z)
            tl.store(TK + row, lo.to(tl.int32))
            tl.store(MODE + row, 2)
            hi = tl.load(TOP + row)
        tl.store(LO_OUT + row, lo)
        tl.store(HI_OUT + row, hi)

    @triton.jit
    def _search_done(
        INV_T, TOP_K, TOP_P, NEED, LO, HI, PART, THR, V, S,
        SP: tl.constexpr, NP: tl.constexpr, SHIFT: tl.constexpr,
    ):  # fmt: skip
        """Program (row): the threshold, x of the key found (-inf where nothing restricts)."""
        row = tl.program_id(0)
        lo, _hi = _advance(LO, HI, PART, NEED, row, S, SP, NP, True)  # lo == hi now
        thr = _value(lo, SHIFT) * tl.load(INV_T + row)
        free = (tl.load(TOP_K + row) >= V) & (tl.load(TOP_P + row) >= 1.0)
        tl.store(THR + row, tl.where(free, float("-inf"), thr))


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device` (CUDA with Triton, or Triton's CPU
    interpreter when TRITON_INTERPRET=1 was set before it was imported)."""
    import os

    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _run(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    greedy: torch.Tensor | None,
    seed: torch.Tensor | None,
    thr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    dev = logits.device
    tok = torch.empty(n, dtype=torch.long, device=dev)
    lp = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tok, lp
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    part_m = torch.empty((n, chunks), dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    part_a = torch.empty((n, chunks), dtype=torch.int32, device=dev)
    sample = seed is not None
    part_b = torch.empty_like(part_m) if sample else part_m
    part_i = torch.empty_like(part_a) if sample else part_a
    greedy_i8 = greedy.to(torch.int8) if sample else part_a
    _pick_chunks[(n, chunks)](
        logits, logits.stride(0), inv_t, seed if sample else inv_t,
        inv_t if thr is None else thr,
        part_m, part_s, part_a, part_b, part_i, vocab, chunks,
        CHUNK=CHUNK, SAMPLE=sample, FILTER=thr is not None, num_warps=8,
    )  # fmt: skip
    _pick_rows[(n,)](
        logits, logits.stride(0), inv_t, greedy_i8,
        part_m, part_s, part_a, part_b, part_i, tok, lp, chunks,
        CP=max(2, triton.next_power_of_2(chunks)), SAMPLE=sample,
    )  # fmt: skip
    return tok, lp


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.greedy_pick` in two kernels: (first argmax, its log_softmax value)."""
    ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    return _run(logits, ones, None, None)


def temperature_pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.temperature_pick` in two kernels, the draw by Gumbel-max with noise from a seed
    drawn from `generator` on the device (`temperature` of greedy rows is 1)."""
    return _run(logits, temperature.reciprocal(), greedy, _step_seed(generator, logits.device))


def _step_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The Philox seed of one step's draw, drawn on the device (no host sync)."""
    return torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device, dtype=torch.int64)


SHIFTS = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}
"""Low bits of a logit's fp32 bits that are zero in its dtype: the search's keys drop them (a
bf16 row has 2^16 keys, not 2^32; x = logits * inv_t keeps their order, inv_t > 0)."""


def search_passes(pivots: int, key_bits: int) -> int:
    """Passes of the threshold search that narrow any interval of 2^key_bits keys to one
    key at `pivots` keys a pass (the largest of the NP + 1 pieces a pass leaves)."""
    d, passes = 2**key_bits - 1, 0
    while d:
        step = (d + pivots) // (pivots + 1)
        d, passes = max(step - 1, d - pivots * step), passes + 1
    return passes


def thresholds(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    pivots: int = PIVOTS,
    two_stage: bool | None = None,
) -> torch.Tensor:
    """`sampling.filter_thresholds` of x = logits * inv_t without a sort ([n] fp32, -inf where
    neither filter restricts), for every row at once: a pass of programs (row, CHUNK columns)
    for the rows' max, mass and key range, then `search_passes` passes that each count (top-k)
    or weigh (top-p) the tokens at or above `pivots` (a power of 2) keys of each row's interval
    (`bench_sampling.py --pivots` times the choices). Rows with both filters search again for
    top-p among the top-k: `two_stage` says whether any row has both (None: read from top_k
    and top_p, a device sync; False where a row has both would give that row top-k alone)."""
    if pivots < 2 or pivots & (pivots - 1):
        raise ValueError(f"pivots must be a power of 2 >= 2, got {pivots}")
    n, vocab = logits.shape
    dev = logits.device
    thr = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return thr
    if logits.dtype not in SHIFTS:
        logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    shift = SHIFTS[logits.dtype]
    top_k, top_p = top_k.to(torch.int32), top_p.float()
    if two_stage is None:
        two_stage = bool(((top_k < vocab) & (top_p < 1.0)).any())
    splits = triton.cdiv(vocab, CHUNK)
    sp = max(2, triton.next_power_of_2(splits))
    f32 = functools.partial(torch.empty, dtype=torch.float32, device=dev)
    i32 = functools.partial(torch.empty, dtype=torch.int32, device=dev)
    i64 = functools.partial(torch.empty, dtype=torch.int64, device=dev)
    s_m, s_z, s_lo, s_hi = f32(n, splits), f32(n, splits), i32(n, splits), i32(n, splits)
    m, need, tk, mode, top = f32(n), f32(n), i32(n), i32(n), i64(n)
    lo, hi, part = i64(2, n), i64(2, n), f32(2, n, splits, pivots)
    common = {"SP": sp, "NP": pivots}
    _search_stats[(n, splits)](
        logits, logits.stride(0), inv_t, s_m, s_z, s_lo, s_hi, vocab, splits,
        SPLIT=CHUNK, SHIFT=shift, num_warps=SEARCH_WARPS,
    )  # fmt: skip
    _search_init[(n,)](
        s_m, s_z, s_lo, s_hi, top_k, top_p, m, need, tk, mode, top, lo[0], hi[0], vocab, splits,
        SP=sp,
    )  # fmt: skip
    at, applied = 0, False
    passes = search_passes(pivots, 32 - shift)

    def search() -> None:
        nonlocal at, applied
        for _ in range(passes):
            _search_pass[(n, splits)](
                logits, logits.stride(0), inv_t, m, need, tk, mode, lo[at], hi[at], part[at],
                lo[1 - at], hi[1 - at], part[1 - at], vocab, splits,
                SPLIT=CHUNK, SUB=SEARCH_SUB, SHIFT=shift, APPLY=applied,
                num_warps=SEARCH_WARPS, **common,
            )  # fmt: skip
            at, applied = 1 - at, True

    search()
    if two_stage:  # top-p among the top-k: its mass, then the search again from the k-th key
        z_part = f32(n, splits)
        _search_mass[(n, splits)](
            logits, logits.stride(0), inv_t, top_p, m, need, mode, lo[at], hi[at], part[at],
            z_part, vocab, splits, SPLIT=CHUNK, SHIFT=shift, num_warps=SEARCH_WARPS,
            **common,
        )  # fmt: skip
        _search_switch[(n,)](
            top_p, m, need, tk, mode, top, lo[at], hi[at], part[at], z_part,
            lo[1 - at], hi[1 - at], splits, **common,
        )  # fmt: skip
        at, applied = 1 - at, False
        search()
    _search_done[(n,)](
        inv_t, top_k, top_p, need, lo[at], hi[at], part[at], thr, vocab, splits,
        SHIFT=shift, **common,
    )  # fmt: skip
    return thr


def filtered_pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
    two_stage: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.filtered_pick` as kernels: the rows' thresholds (`thresholds`; `two_stage`:
    whether any row has both top-k and top-p, None to read it on the device), then the
    Gumbel-max race of `temperature_pick` among the tokens at or above them."""
    inv_t = temperature.reciprocal()
    thr = thresholds(logits, inv_t, top_k, top_p, two_stage=two_stage)
    return _run(logits, inv_t, greedy, _step_seed(generator, logits.device), thr)
