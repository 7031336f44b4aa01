"""Per-token loss terms -> this micro-batch's share of the step's scalar loss.

The denominators are step-global (`LossInput.token_denominator`, `.seq_denominator`), so the
shares of all micro-batches and ranks add up to the step's loss and the learner sums gradients.
Each row of a micro-batch is one whole trajectory (sequence-level terms need all its tokens).
"""

from __future__ import annotations

import torch

from slime_async.algos.api import LossInput
from slime_async.config.algo import AlgoConfig


def token_mask(inp: LossInput) -> torch.Tensor:
    """`[B, T]` bool: the tokens trained on (model tokens, not padding or env tokens)."""
    return inp.loss_mask > 0


def version_lag(inp: LossInput) -> torch.Tensor:
    """`[B, T]` long: how many versions behind the learner each token's policy is."""
    return inp.current_version - inp.versions.long()


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with the tokens outside `mask` set to 0 (never multiplied: padding may hold inf)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, inp: LossInput, cfg: AlgoConfig):
    """Reduce `per_token: [B, T]` over the tokens in `mask: [B, T]` (bool) to a scalar.

    token_mean:               sum_{b,t} l_bt / N_tokens
    seq_mean_token_mean:      sum_b (sum_t l_bt / |y_b|) / N_seqs
    seq_mean_token_sum_norm:  sum_{b,t} l_bt / (N_seqs * C)       (Dr.GRPO, C a constant)

    N_tokens and N_seqs are the step's totals. token_mean is the default: every trained token
    weighs the same whatever the length of its response, so long (often wrong or overlong)
    responses are not under-weighted as in the sequence mean (DAPO's token-level loss), and the
    gradient scale does not hang on a hand-set constant as in Dr.GRPO's.
    """
    x = masked(per_token, mask)
    if cfg.aggregation == "token_mean":
        return x.sum() / inp.token_denominator
    if cfg.aggregation == "seq_mean_token_mean":
        lengths = mask.sum(-1).clamp(min=1).to(x.dtype)  # [B]
        return (x.sum(-1) / lengths).sum() / inp.seq_denominator
    if cfg.aggregation == "seq_mean_token_sum_norm":
        return x.sum() / (inp.seq_denominator * cfg.aggregation_constant)
    raise ValueError(f"unknown aggregation {cfg.aggregation!r}")
