"""Sampling parameters (SGLang's names) and the sampler of the embedded engine.

The token is drawn from the filtered distribution; the log-prob reported for it is SGLang
0.5.23's: `log_softmax(logits / T)[token]` over the FULL vocabulary, taken BEFORE top-k/top-p
filtering (the learner computes exactly that at the trajectory's temperature and never filters):

- temperature T > 0: the draw is from p = softmax(logits / T), restricted to the top-k tokens
  (k <= 0: all), renormalised, then restricted to the smallest prefix (by descending probability)
  whose mass reaches top_p (the token that crosses top_p is kept), renormalised.
  logprob = `log_softmax(logits / T)[token]` (unfiltered).
- temperature 0 (greedy, T < 1e-5 as in SGLang, which samples it as T = 1 with top_k = 1):
  token = argmax(logits) and logprob = `log_softmax(logits)[token]` (T = 1.0).

`sampling_seed` (SGLang's per-request seed): a request that sets it draws from its own generator
seeded with it, so the same request with the same seed gives the same tokens whatever else runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

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


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    row_generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens [n] int64, logprobs [n] float32).

    logits: [n, V]; temperature, top_p: [n] float32; top_k: [n] int64 (<= 0: no limit); the
    parameters may live on the host (they are read there to pick the code path). A row whose
    `row_generators` entry is set draws with that generator (a request's sampling_seed).
    Each row's logprob is `log_softmax(logits / T)` of its token, unfiltered (module docstring).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    # The per-row parameters are decided on the host (no device sync); only the math runs there.
    temperature, top_k, top_p = temperature.cpu(), top_k.cpu(), top_p.cpu()
    greedy_host = temperature < GREEDY_TEMPERATURE
    greedy_tok = logits.argmax(-1)
    raw_logp = torch.log_softmax(logits, -1).gather(1, greedy_tok[:, None])[:, 0]
    if bool(greedy_host.all()):
        return greedy_tok, raw_logp

    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    restrict = bool((k < vocab).any() or (top_p < 1.0).any())
    dev = logits.device
    greedy = greedy_host.to(dev)
    temp = torch.where(greedy_host, torch.ones_like(temperature), temperature).to(dev)
    k, top_p = k.to(dev), top_p.to(dev)
    scaled = logits / temp[:, None]
    report = torch.log_softmax(scaled, -1)  # [n, V]: what SGLang returns, before any filtering
    draw = scaled
    if restrict:
        # Restrict in sorted order: first top-k, then the top-p nucleus of the renormalised top-k.
        sorted_logits, order = scaled.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=dev)
        drop = ranks[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, -1)
        mass_before = probs.cumsum(-1) - probs
        drop = drop | (mass_before >= top_p[:, None])
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        draw = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = torch.softmax(draw, -1)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    for i, g in enumerate(row_generators or ()):
        if g is not None:  # its own stream: independent of the batch it happens to run in
            tok[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    tok_logp = report.gather(1, tok[:, None])[:, 0]
    return torch.where(greedy, greedy_tok, tok), torch.where(greedy, raw_logp, tok_logp)
