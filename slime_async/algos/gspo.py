"""GSPO: PPO clipping on the sequence-level (length-normalised) likelihood ratio."""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import aggregate, masked, token_mask, version_lag
from slime_async.algos.api import LOSSES, LossInput, LossOutput
from slime_async.algos.importance import proximal_logp
from slime_async.algos.kl import add_regularizers
from slime_async.algos.metrics import TokenStats
from slime_async.algos.ppo import clipped_surrogate
from slime_async.config.algo import AlgoConfig


@LOSSES.register("gspo")
def gspo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Group Sequence Policy Optimization, in its token-level form.

        s_i   = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)) )
        s_it  = stopgrad(s_i) * pi_theta(y_it) / stopgrad(pi_theta(y_it))     (value s_i)
        l_it  = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_eps_low, 1 + gspo_eps_high))

    With a sequence-level advantage every token of y_i has the same clipped loss and the
    gradient is s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_it), GSPO's; per-token advantages
    are allowed (GSPO-token). pi_old follows `ppo_old_policy` (mu or pi_prox). GSPO's paper
    averages over sequences: use aggregation = "seq_mean_token_mean" to match it exactly.
    """
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    if cfg.ppo_old_policy == "behavior":
        old = masked(inp.behavior_logp.detach(), mask)
    else:
        old = proximal_logp(inp, cfg, mask)
    logp = masked(inp.logp, mask)
    n = mask.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)  # [B, 1]
    log_s = ((logp.detach() - old).sum(-1, keepdim=True) / n).expand_as(logp)  # [B, T]
    ratio = torch.exp(log_s + logp - logp.detach())
    pg, clipped, _ = clipped_surrogate(
        ratio, masked(inp.advantages, mask), cfg.gspo_eps_clip_low, cfg.gspo_eps_clip_high, None
    )
    stats.count()
    stats.weight("ratio", ratio)
    stats.mean("clip_frac", clipped)
    stats.mean("pg_loss", pg)
    per_token = add_regularizers(pg, inp, cfg, mask, stats)
    return LossOutput(loss=aggregate(per_token, mask, inp, cfg), metrics=stats.raw())
