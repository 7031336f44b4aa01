"""Sampling parameters (SGLang's names) and the sampler of the embedded engine.

The token is drawn from the filtered distribution; the log-prob reported for it is SGLang
0.5.23's: `log_softmax(logits / T)[token]` over the FULL vocabulary, taken BEFORE top-k/top-p
filtering (the learner computes exactly that at the trajectory's temperature and never filters):

- temperature T > 0: the draw is from p = softmax(logits / T), restricted to the top-k tokens
  (k <= 0: all), renormalised, then restricted to the smallest prefix (by descending probability)
  whose mass reaches top_p (the token that crosses top_p is kept), renormalised.
  logprob = `log_softmax(logits / T)[token]` (unfiltered).
  Both restrictions are thresholds on x = logits / T (`filter_thresholds`): top-k keeps x >= the
  k-th largest value, top-p keeps x >= the value of the token that crosses top_p. Tokens tied
  with the boundary token are all kept (a sort would keep an arbitrary few of them), so the kept
  set is a function of the logits alone and a GPU can find it without sorting the vocabulary.
- temperature 0 (greedy, T < 1e-5 as in SGLang, which samples it as T = 1 with top_k = 1):
  token = argmax(logits) and logprob = `log_softmax(logits)[token]` (T = 1.0).

`sampling_seed` (SGLang's per-request seed): a request that sets it draws its token by Gumbel-max
with noise hashed from (seed, position, token column), SGLang 0.5.23's `multinomial_with_seed`
(`srt/layers/sampler.py`, the hash `kernels/ops/sampling/murmur_hash.py`: MurmurHash3 x86 32 of
the 16 bytes seed low, seed high, position, column, hash seed 0; u = hash / (2^32 - 1), noise
-log(-log u) in float64, clamped as SGLang clamps it). Position is that of the last token already
in the sequence (the prompt's last at the first draw), as SGLang passes it. So the same request
with the same seed gives the same tokens whatever else runs, a draw depends on no generator
state (a retracted request's recomputed steps draw with the same noise), and every seeded row
of a batch is drawn at once. With top-k/top-p the columns are the ranks in descending order, as SGLang's sorted
path hashes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from slime_async.utils.device import to_device

GREEDY_TEMPERATURE = 1e-5

# SGLang sampling_params that the embedded engine accepts only at their default (no-op) value:
# a request that asks for the feature gets a 400 naming it instead of a silently different result.
_UNSUPPORTED_DEFAULTS: dict[str, object] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
}


@dataclass(frozen=True)
class SamplingParams:
    """One request's `sampling_params`, validated (field names are SGLang's)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, raw: object, vocab_size: int) -> SamplingParams:
        """Validate a request's `sampling_params` dict; ValueError names the bad field."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError("sampling_params must be a JSON object")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for key, value in raw.items():
            if key == "n":  # parallel samples: the server expands the request (one prefill)
                continue
            if key in _UNSUPPORTED_DEFAULTS:
                if value is not None and value != _UNSUPPORTED_DEFAULTS[key]:
                    raise ValueError(
                        f"sampling_params.{key}={value!r} is not supported by the embedded engine"
                    )
                continue
            if key not in known:
                raise ValueError(f"unknown sampling_params field {key!r}")
            if value is not None:
                kwargs[key] = value
        try:
            p = cls(**kwargs)._normalised()
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad sampling_params: {e}") from None
        if p.max_new_tokens < 0:  # 0 is SGLang's prompt scoring (with logprob_start_len)
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
        if p.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
        if p.min_new_tokens < 0:
            raise ValueError("sampling_params.min_new_tokens must be >= 0")
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids outside the vocabulary: {bad}")
        return p

    def _normalised(self) -> SamplingParams:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        return SamplingParams(
            max_new_tokens=_as_int(self.max_new_tokens, "max_new_tokens"),
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=_as_int(self.top_k, "top_k"),
            min_new_tokens=_as_int(self.min_new_tokens, "min_new_tokens"),
            stop=tuple(str(s) for s in stop),
            stop_token_ids=tuple(_as_int(t, "stop_token_ids") for t in self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=bool(self.skip_special_tokens),
            no_stop_trim=bool(self.no_stop_trim),
            spaces_between_special_tokens=bool(self.spaces_between_special_tokens),
            sampling_seed=(
                None if self.sampling_seed is None else _as_int(self.sampling_seed, "sampling_seed")
            ),
        )


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One 4-byte block into MurmurHash3's state (int64 tensors holding uint32 values; the
    products wrap modulo 2^64, whose low 32 bits are the uint32 products)."""
    k = _rotl32((k * 0xCC9E2D51) & _M32, 15)
    h = _rotl32(h ^ ((k * 0x1B873593) & _M32), 13)
    return (h * 5 + 0xE6546B64) & _M32


def _murmur_final(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[n, m] uint32 values (in int64): MurmurHash3 x86 32 (hash seed 0) of the 16 bytes seed low
    word, seed high word, position, column of each row's seed and position and each column, as
    SGLang's `murmur_hash32` computes it."""
    seed, positions, cols = seed.long(), positions.long(), cols.long()
    h = _murmur_mix(torch.zeros_like(seed), seed & _M32)
    h = _murmur_mix(h, (seed >> 32) & _M32)
    h = _murmur_mix(h, positions & _M32)
    return _murmur_last_block(h, _column_keys(cols))


def _column_keys(cols: torch.Tensor) -> torch.Tensor:
    """The column's block as `_murmur_mix` scrambles it before it meets the state."""
    return (_rotl32(((cols & _M32) * 0xCC9E2D51) & _M32, 15) * 0x1B873593) & _M32


def _murmur_last_block(h: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n, m]: each row's state mixed with each column's scrambled block, then finalised."""
    h = _rotl32(h[:, None] ^ keys[None, :], 13)
    return _murmur_final(((h * 5 + 0xE6546B64) & _M32) ^ 16)


def seeded_argmax(
    logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Each row's Gumbel-max draw from `logprobs` ([n, m], -inf where a column may not be drawn)
    with the noise of (seed, position, column): SGLang's `multinomial_with_seed`."""
    cols = torch.arange(logprobs.shape[-1], device=logprobs.device)
    u = murmur_hash32(seed, positions, cols).double() / _M32
    noise = u.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0**-32)).neg_()
    noise = noise.log_().neg_()  # -log(-log u)
    return (noise + logprobs.double()).argmax(-1)


SeededDraw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`seeded_argmax`'s signature (the engine's runner may pass a compiled copy)."""


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy: (argmax, its `log_softmax` value) from logits of any float dtype,
    upcast to fp32 inside (compiled on a GPU, one pass over the logits instead of a float copy,
    a log_softmax written out and an argmax)."""
    x = logits.float()
    tok = x.argmax(-1)
    return tok, x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)


def temperature_pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows at their temperature, unfiltered: the draw from softmax(logits / T) by the
    exponential race `argmax(p / q)` with q ~ Exp(1) drawn from `generator` (as torch.multinomial
    draws one sample), taken as `argmax(logits / T - log q)`; greedy rows (`greedy`, their
    temperature 1) take q = 1, i.e. the argmax, in the same pass. Returns (tokens,
    log_softmax(logits / T) of each)."""
    return _race(logits.float() / temperature[:, None], greedy, generator, None)


def _race(
    x: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None,
    thr: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race over x = logits / T (only x >= `thr` when given), greedy rows with
    q = 1; (tokens, log_softmax(x) of each)."""
    noise = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    noise.exponential_(generator=generator)
    q = torch.where(greedy[:, None], 1.0, noise.clamp_min(torch.finfo(torch.float32).tiny))
    race = x - q.log()
    if thr is not None:
        race = race.masked_fill(x < thr[:, None], float("-inf"))
    tok = race.argmax(-1)
    return tok, x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)


def filter_thresholds(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    sorted_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's lowest kept value of x = logits / T ([n, V] fp32) under top-k (`top_k` [n],
    1..V; V: no limit) then top-p (`top_p` [n]) on the renormalised top-k; -inf where neither
    restricts. The keep rule is `x >= threshold`: top-k's threshold is the k-th largest value,
    top-p's the largest value v whose tokens x >= v (within top-k) hold at least top_p of the
    top-k mass, i.e. the value of the token whose cumulative mass crosses top_p. One sort of the
    rows (or `sorted_x`, x sorted descending): the reference the GPU kernel
    (pick_kernels.filtered_pick) is checked against."""
    vocab = x.shape[-1]
    s = x.sort(-1, descending=True).values if sorted_x is None else sorted_x
    tk = s.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [n, 1]
    e = torch.where(s >= tk, (s - s[:, :1]).exp(), 0.0)
    cum = e.cumsum(-1)
    crossed = cum >= top_p[:, None] * cum[:, -1:]  # the last column always crosses (p <= 1)
    tp = s.gather(1, crossed.to(torch.uint8).argmax(-1, keepdim=True))  # the first crossing
    thr = torch.maximum(tk, tp)[:, 0]
    free = (top_k >= vocab) & (top_p >= 1.0)
    return thr.masked_fill(free, float("-inf"))


def thresholds_hold(
    x: torch.Tensor,
    thr: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    tol: float = 1e-4,
) -> torch.Tensor:
    """[n] bool: whether each row's `thr` is what `filter_thresholds` gives up to the order of
    fp32 sums. -inf where neither filter restricts; else a value of the row, at or above the
    k-th largest (equal to it without top-p); with top-p, the tokens x >= thr hold at least
    top_p - tol of the top-k mass and those x > thr less than top_p + tol. (Two summation
    orders may put a boundary whose mass is within rounding of top_p one value apart; every
    other difference fails.)"""
    vocab = x.shape[-1]
    xd, t = x.double(), thr.double()[:, None]
    s = xd.sort(-1, descending=True).values
    tk = s.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
    e = torch.where(xd >= tk, (xd - s[:, :1]).exp(), 0.0)
    z = e.sum(-1)
    at_or_above = torch.where(xd >= t, e, 0.0).sum(-1) / z
    above = torch.where(xd > t, e, 0.0).sum(-1) / z
    p = top_p.double()
    nucleus = (at_or_above >= p - tol) & (above < p + tol)
    ok = (xd == t).any(-1) & (t >= tk)[:, 0] & torch.where(top_p < 1.0, nucleus, (t == tk)[:, 0])
    free = (top_k >= vocab) & (top_p >= 1.0)
    return torch.where(free, torch.isneginf(thr), ok)


def filtered_pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
    two_stage: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`temperature_pick` restricted by top-k/top-p (`top_k` [n] 1..V, V: none; `top_p` [n]):
    the exponential race among the tokens with x >= `filter_thresholds`; greedy rows take the
    argmax (which every filter keeps). Log-probs unfiltered, as `temperature_pick`'s.
    `two_stage` (whether any row has both filters) is the kernels' hint; one sort serves all."""
    x = logits.float() / temperature[:, None]
    return _race(x, greedy, generator, filter_thresholds(x, top_k, top_p))


class Picks(NamedTuple):
    """The unseeded draws of `sample`: these eager ones, or on a GPU the Triton kernels of
    pick_kernels.py (the same math in a few passes over the logits, no sort)."""

    greedy: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = greedy_pick
    temperature: Callable[..., tuple[torch.Tensor, torch.Tensor]] = temperature_pick
    filtered: Callable[..., tuple[torch.Tensor, torch.Tensor]] = filtered_pick


EAGER_PICKS = Picks()

SEEDED_ELEMENTS_AT_ONCE = 64 * 151_936
"""Noise entries (rows x vocabulary) hashed together: 64 rows at Qwen's 151,936-token vocabulary
(the noise is int64 and float64: 156 MB), every row of a step at a small one (each chunk costs
some 40 kernel launches, so few large chunks beat many small ones)."""


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    seeded: list[tuple[int, int, int]] | None = None,
    seeded_draw: SeededDraw = seeded_argmax,
    picks: Picks = EAGER_PICKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens [n] int64, logprobs [n] float32).

    logits: [n, V]; temperature, top_p: [n] float32; top_k: [n] int64 (<= 0: no limit); the
    parameters may live on the host (they are read there to pick the code path). `seeded`:
    (row, sampling_seed, position) of each row of a request with a seed, drawn by the seeded
    Gumbel-max (module docstring, `seeded_draw`: `seeded_argmax` or a compiled copy of it); the
    other rows draw with `generator`.
    Each row's logprob is `log_softmax(logits / T)` of its token, unfiltered (module docstring).
    Logits may be in the model's dtype (bf16): every computation upcasts them to fp32.

    Without seeds, the batch goes through `picks` (on a GPU Triton kernels over the logits, no
    sort): all greedy, the exponential race of `temperature_pick`, or with top-k/top-p that race
    among the tokens `filter_thresholds` keeps (`filtered_pick`).
    """
    vocab = logits.shape[-1]
    # The per-row parameters are decided on the host (no device sync); only the math runs there.
    temperature, top_k, top_p = temperature.cpu(), top_k.cpu(), top_p.cpu()
    greedy_host = temperature < GREEDY_TEMPERATURE
    if bool(greedy_host.all()):
        return picks.greedy(logits)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    restrict = bool((k < vocab).any() or (top_p < 1.0).any())
    dev = logits.device
    greedy = to_device(greedy_host, dev)
    temp = to_device(torch.where(greedy_host, torch.ones_like(temperature), temperature), dev)
    if not seeded:
        if not restrict:
            return picks.temperature(logits, temp, greedy, generator)
        both = bool(((k < vocab) & (top_p < 1.0)).any())
        return picks.filtered(
            logits, temp, greedy, to_device(k, dev), to_device(top_p, dev), generator, both
        )

    logits = logits.float()
    greedy_tok = logits.argmax(-1)
    raw_logp = torch.log_softmax(logits, -1).gather(1, greedy_tok[:, None])[:, 0]
    k, top_p = to_device(k, dev), to_device(top_p, dev)
    scaled = logits / temp[:, None]
    report = torch.log_softmax(scaled, -1)  # [n, V]: what SGLang returns, before any filtering
    draw = scaled
    sorted_logits = order = None
    if restrict:
        # Seeded rows hash ranks, so this path sorts; the kept set is the thresholds' (a prefix
        # of the sorted row: top-k, then the top-p nucleus of the renormalised top-k).
        sorted_logits, order = scaled.sort(-1, descending=True)
        thr = filter_thresholds(scaled, k, top_p, sorted_logits)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thr[:, None], float("-inf"))
        draw = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = torch.softmax(draw, -1)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    # (row, seed, position) of every seeded row: one copy to the device for the step
    table = to_device(torch.tensor(seeded, dtype=torch.long), dev) if seeded else None
    at_once = max(1, SEEDED_ELEMENTS_AT_ONCE // vocab)
    for at in range(0, len(seeded or ()), at_once):
        rows, seeds, positions = table[at : at + at_once].unbind(1)  # type: ignore[index]
        # SGLang hashes the filtered distribution's columns: ranks when sorted, else token ids
        # (unfiltered, the draw's log-probs are the reported ones)
        logp = report[rows] if sorted_logits is None else torch.log_softmax(sorted_logits[rows], -1)
        picked = seeded_draw(logp, seeds, positions)
        if order is not None:
            picked = order[rows].gather(1, picked[:, None])[:, 0]
        tok = tok.index_copy(0, rows, picked)
    tok_logp = report.gather(1, tok[:, None])[:, 0]
    return torch.where(greedy, greedy_tok, tok), torch.where(greedy, raw_logp, tok_logp)
