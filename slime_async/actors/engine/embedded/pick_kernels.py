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
- `_thresholds`, program (row), for top-k/top-p (`filtered_pick`): the lowest kept value of x,
  `sampling.filter_thresholds` without a sort. x's fp32 bits map to integer keys in the same
  order; a search over the keys tests NP pivots a pass (tokens at or above each pivot: their
  count for top-k, their mass exp(x - max) for top-p) and keeps the interval between the last
  pivot that holds k tokens / top_p of the mass and the first that does not, so ~8 passes over
  the row find the exact boundary value among 2^32 keys. The first kernel then races only the
  tokens with x >= that value.

Why: the eager torch version writes the scaled logits, the noise and a log-softmax out in fp32
and reads them back (a dozen passes over [rows, V]); torch.compile'd with dynamic batch sizes
it reduced each long row in one program. Here every pass reads the logits (bf16) once. With
top-p the eager version sorts every row (6.5 ms at 256 x 151,936 on an H100).
The per-step seed is drawn from the scheduler's device generator (`torch.randint` on the device:
no host sync), so an engine's draws follow its seed as before.
"""

from __future__ import annotations

import torch

try:  # the GPU image carries Triton; CPU machines need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

CHUNK = 4096
"""Columns of one row per program of the first kernel (37 programs a row at Qwen's 151,936)."""

PIVOTS = 8
"""Keys the threshold search tests per pass over a row: the interval shrinks 9x a pass (about
eleven passes). On an H200 at 256 x 151,936, top_p 0.95, 4 and 8 pivots took 2.41 ms a search,
16 took 3.23 and 32 took 3.43 (`bench_sampling.py --pivots 4,8,16,32`): the compare-adds of a
pass, not the passes over the row, bound it."""

BLOCK = 1024
"""Columns per iteration of the threshold search (a [PIVOTS, BLOCK] comparison)."""


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
    def _pick_rows(
        LOGITS, stride_l, INV_T, GREEDY, PM, PS, PA, PB, PI, TOK, LP, C,
        CP: tl.constexpr, SAMPLE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        c = tl.arange(0, CP)
        cm = c < C
        m = tl.load(PM + row * C + c, mask=cm, other=float("-inf"))
        s = tl.load(PS + row * C + c, mask=cm, other=0.0)
        top = tl.max(m, 0)
        top_ref = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top_ref))
        lse = top_ref + tl.log(tl.sum(s * w, 0))
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
    def _search(LOGITS, base, inv_t, V, lo, hi, m, tk, need, COUNT: tl.constexpr,
                BLOCK: tl.constexpr, NP: tl.constexpr):  # fmt: skip
        """The largest key in [lo, hi] whose tokens at or above it (among key >= tk) number at
        least `need` (COUNT) or hold at least `need` of exp(x - m); lo must qualify, hi + 1 not."""
        j = tl.arange(0, NP).to(tl.int64)
        while lo < hi:
            step = (hi - lo + NP) // (NP + 1)  # >= 1; the last pivot may pass hi (it fails)
            piv = (lo + step * (j + 1)).to(tl.int32)
            acc = tl.zeros([NP], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                valid = cols < V
                x = tl.load(LOGITS + base + cols, mask=valid, other=float("-inf"))
                x = x.to(tl.float32) * inv_t
                key = _key(x)
                if COUNT:
                    w = tl.where(valid, 1.0, 0.0)
                else:
                    w = tl.where(valid & (key >= tk), tl.exp(x - m), 0.0)
                acc += tl.sum(tl.where(key[None, :] >= piv[:, None], w[None, :], 0.0), 1)
            ok = acc >= need
            piv = piv.to(tl.int64)
            lo = tl.maximum(lo, tl.max(tl.where(ok, piv, lo), 0))
            hi = tl.minimum(hi, tl.min(tl.where(ok, hi, piv - 1), 0))
        return lo

    @triton.jit
    def _thresholds(
        LOGITS, stride_l, INV_T, TOP_K, TOP_P, THR, V,
        BLOCK: tl.constexpr, NP: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = row.to(tl.int64) * stride_l
        inv_t = tl.load(INV_T + row)
        k = tl.load(TOP_K + row)
        p = tl.load(TOP_P + row)
        thr = tl.full([], float("-inf"), tl.float32)
        if (k < V) | (p < 1.0):
            m = tl.full([], float("-inf"), tl.float32)
            lo = tl.full([], 2**31 - 1, tl.int64)
            hi = tl.full([], -(2**31), tl.int64)
            for start in range(0, V, BLOCK):  # the row's max and its keys' range
                cols = start + tl.arange(0, BLOCK)
                valid = cols < V
                x = tl.load(LOGITS + base + cols, mask=valid, other=float("-inf"))
                x = x.to(tl.float32) * inv_t
                key = _key(x).to(tl.int64)
                m = tl.maximum(m, tl.max(x, 0))
                lo = tl.minimum(lo, tl.min(tl.where(valid, key, 2**31 - 1), 0))
                hi = tl.maximum(hi, tl.max(tl.where(valid, key, -(2**31)), 0))
            top = hi
            if k < V:  # top-k: the k-th largest value's key
                lo = _search(LOGITS, base, inv_t, V, lo, hi, m, lo, k.to(tl.float32),
                             True, BLOCK, NP)  # fmt: skip
            if p < 1.0:  # top-p of the renormalised top-k
                tk = lo.to(tl.int32)
                z = tl.zeros([], tl.float32)
                for start in range(0, V, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    valid = cols < V
                    x = tl.load(LOGITS + base + cols, mask=valid, other=float("-inf"))
                    x = x.to(tl.float32) * inv_t
                    z += tl.sum(tl.where(valid & (_key(x) >= tk), tl.exp(x - m), 0.0), 0)
                lo = _search(LOGITS, base, inv_t, V, lo, top, m, tk, p * z, False, BLOCK, NP)
            b = lo.to(tl.int32)
            thr = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        tl.store(THR + row, thr)


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


def thresholds(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    pivots: int = PIVOTS,
) -> torch.Tensor:
    """`sampling.filter_thresholds` of x = logits * inv_t without a sort ([n] fp32, -inf where
    neither filter restricts): one program a row (`_thresholds`), `pivots` (a power of 2) keys
    tested a pass (`bench_sampling.py --pivots` times the choices)."""
    if pivots < 2 or pivots & (pivots - 1):
        raise ValueError(f"pivots must be a power of 2 >= 2, got {pivots}")
    n, vocab = logits.shape
    thr = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return thr
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _thresholds[(n,)](
        logits, logits.stride(0), inv_t, top_k.to(torch.int32), top_p.float(), thr, vocab,
        BLOCK=BLOCK, NP=pivots, num_warps=8,
    )  # fmt: skip
    return thr


def filtered_pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.filtered_pick` in three kernels: the rows' thresholds, then the Gumbel-max race
    of `temperature_pick` among the tokens at or above them."""
    inv_t = temperature.reciprocal()
    thr = thresholds(logits, inv_t, top_k, top_p)
    return _run(logits, inv_t, greedy, _step_seed(generator, logits.device), thr)
