"""GSPO: PPO clipping on the sequence-level (length-normalised) likelihood ratio.

`gspo` takes the ratio against one "old" policy (mu or pi_prox, `ppo_old_policy`);
`decoupled_gspo` takes it against pi_prox and corrects for the sampler with the bounded
behaviour weight pi_prox / mu, as decoupled_ppo does for the token-level ratio.
"""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import masked, token_mask, version_lag
from slime_async.algos.api import LOSSES, LossInput, LossOutput
from slime_async.algos.importance import behavior_diagnostics, behavior_weights, proximal_logp
from slime_async.algos.metrics import TokenStats
from slime_async.algos.ppo import surrogate_output
from slime_async.config.algo import AlgoConfig


def sequence_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` GSPO's token-level form of the sequence ratio, each token's value s_i.

        s_i   = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)) )   over the mask
        s_it  = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))

    `logp` (with grad) and `old` are masked already. The 1/|y_i| is GSPO's length
    normalisation: it keeps s_i of a long sequence in the same range as a short one's, which
    is what makes the tiny clip range (3e-4 / 4e-4) meaningful at every length.
    """
    n = mask.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)  # [B, 1]
    log_s = ((logp.detach() - old).sum(-1, keepdim=True) / n).expand_as(logp)  # [B, T]
    return torch.exp(log_s + logp - logp.detach())


def _gspo_output(
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    stats: TokenStats,
    old: torch.Tensor,
    weight: torch.Tensor | None,
    prox: torch.Tensor | None,
) -> LossOutput:
    ratio = sequence_ratio(masked(inp.logp, mask), old, mask)
    clip = (cfg.gspo_eps_clip_low, cfg.gspo_eps_clip_high, None)
    return surrogate_output(inp, cfg, mask, stats, ratio, clip, weight, prox)


@LOSSES.register("gspo")
def gspo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Group Sequence Policy Optimization, in its token-level form.

        s_i   = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)) )
        s_it  = stopgrad(s_i) * pi_theta(y_it) / stopgrad(pi_theta(y_it))     (value s_i)
        l_it  = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_eps_low, 1 + gspo_eps_high))

    With a sequence-level advantage every token of y_i has the same clipped loss and the
    gradient is s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_it), GSPO's; per-token advantages
    are allowed (GSPO-token). pi_old follows `ppo_old_policy` (mu or pi_prox); neither corrects
    for stale samples (use decoupled_gspo). GSPO's paper averages over sequences: use
    aggregation = "seq_mean_token_mean" to match it exactly.
    """
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    prox = proximal_logp(inp, cfg, mask)
    behavior_diagnostics(inp, mask, prox, stats)
    old = masked(inp.behavior_logp.detach(), mask) if cfg.ppo_old_policy == "behavior" else prox
    return _gspo_output(inp, cfg, mask, stats, old, None, None)


@LOSSES.register("decoupled_gspo")
def decoupled_gspo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Decoupled GSPO: GSPO's sequence ratio against pi_prox, times the bounded behaviour weight.

        s_i   = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_prox(y_it)) )   (as in gspo)
        w_it  = bound(pi_prox / mu)       (importance.py: is_mode, is_low, is_high, is_level)
        l_it  = w_it * max(-A_it s_it, -A_it clip(s_it, 1 - gspo_eps_low, 1 + gspo_eps_high))

    The clip is a trust region around the learner's policy at the start of the batch (so it
    binds only as the mini-batches move pi_theta, not on the sampler's mismatch: against mu
    GSPO's +-4e-4 clip cuts a third of the tokens at a realistic mismatch), and w re-weights
    each token for the policy that sampled it. On a multi-token sequence whose reward depends on
    all its tokens only `is_level = "sequence"` (the product of the ratios) is an unbiased
    correction; the token-level default is the usual lower-variance approximation.
    """
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    prox = proximal_logp(inp, cfg, mask)
    behavior_diagnostics(inp, mask, prox, stats)
    weight = behavior_weights(inp, cfg, mask, prox, stats, cfg.is_mode)
    return _gspo_output(inp, cfg, mask, stats, prox, weight, prox)
