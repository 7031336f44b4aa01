"""AIPO: truncated-importance-weighted REINFORCE, no trust region, ratio against mu directly."""

from __future__ import annotations

from slime_async.algos.aggregation import aggregate, masked, token_mask, version_lag
from slime_async.algos.api import LOSSES, LossInput, LossOutput
from slime_async.algos.importance import behavior_diagnostics, importance_weights, proximal_logp
from slime_async.algos.kl import add_regularizers
from slime_async.algos.metrics import TokenStats
from slime_async.config.algo import AlgoConfig


@LOSSES.register("aipo")
def aipo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """l = -stopgrad(min(pi_theta / mu, rho)) * A * log pi_theta,  rho = `is_high`.

    Its gradient, -min(pi_theta/mu, rho) A grad log pi_theta, is the importance-sampled policy
    gradient with the weight truncated at rho (unbiased where pi_theta/mu <= rho). The weight
    follows `is_mode` / `is_level` / `is_low` / `is_veto` like the other losses (the formula
    above is the default token-level truncation).
    """
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    behavior_diagnostics(inp, mask, proximal_logp(inp, cfg, mask), stats)
    w = importance_weights(
        inp.logp.detach() - inp.behavior_logp.detach(),
        mask,
        level=cfg.is_level,
        mode=cfg.is_mode,
        low=cfg.is_low,
        high=cfg.is_high,
        veto=cfg.is_veto,
    )
    # Padding may hold inf: mask before multiplying, or its gradient turns into nan.
    pg = -w.weight * masked(inp.advantages, mask) * masked(inp.logp, mask)
    stats.count()
    stats.weight("is_weight", w.weight)
    stats.mean("is_dropped_frac", w.dropped)
    stats.mean("pg_loss", pg)
    per_token = add_regularizers(pg, inp, cfg, mask, stats, w.weight, None)
    return LossOutput(loss=aggregate(per_token, mask, inp, cfg), metrics=stats.raw())
