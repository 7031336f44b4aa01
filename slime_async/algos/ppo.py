"""PPO-family losses: ppo_clip (naive on stale data), decoupled_ppo (AReaL), tis, mis.

Notation for all of them, per token t of a trajectory (all tensors `[B, T]`):
mu = behaviour (engine) policy, pi_prox = proximal policy, pi_theta = current policy (grad),
A = advantage. Each loss returns `aggregate(l_t)` (aggregation.py) of its per-token l_t plus
the KL / entropy terms (kl.py), and raw metrics (metrics.py), overall and per version lag.
"""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import aggregate, masked, token_mask, version_lag
from slime_async.algos.api import LOSSES, LossInput, LossOutput
from slime_async.algos.importance import behavior_diagnostics, behavior_weights, proximal_logp
from slime_async.algos.kl import add_regularizers
from slime_async.algos.metrics import TokenStats
from slime_async.config.algo import AlgoConfig


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate as a per-token loss; returns (l, clipped, dual_clipped), `[B, T]`.

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        dual clip (c > 1), for A < 0 only:  l = min(l, -c A)

    `clipped` marks tokens whose gradient the clip cut; `dual_clipped` those the dual clip cut.
    """
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
    return loss, clipped, dual


def surrogate_output(
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    stats: TokenStats,
    ratio: torch.Tensor,
    clip: tuple[float, float, float | None],
    weight: torch.Tensor | None,
    prox: torch.Tensor | None,
) -> LossOutput:
    """The clipped surrogate of `ratio` (masked already), weighted by the behaviour weight when
    given, with its statistics, the KL/entropy terms and the aggregation: the tail every
    PPO-shaped loss shares (ppo_clip, decoupled_ppo, gspo, decoupled_gspo).
    `clip` = (eps_low, eps_high, dual_clip_c)."""
    eps_low, eps_high, dual_c = clip
    pg, clipped, dual = clipped_surrogate(
        ratio, masked(inp.advantages, mask), eps_low, eps_high, dual_c
    )
    if weight is not None:
        pg = weight * pg
    stats.count()
    stats.weight("ratio", ratio)
    stats.mean("clip_frac", clipped)
    # outside the trust region whatever the advantage's sign (the clip cuts about half of them)
    stats.mean("ratio_outside", (ratio < 1 - eps_low) | (ratio > 1 + eps_high))
    if dual_c is not None:
        stats.mean("dual_clip_frac", dual)
    stats.mean("pg_loss", pg)
    per_token = add_regularizers(pg, inp, cfg, mask, stats, weight, prox)
    return LossOutput(loss=aggregate(per_token, mask, inp, cfg), metrics=stats.raw())


def _token_clip(cfg: AlgoConfig) -> tuple[float, float, float | None]:
    return cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip_c


@LOSSES.register("ppo_clip")
def ppo_clip(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """PPO clip with the ratio against an "old" policy and no other correction.

        r = pi_theta / pi_old,  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) [dual clip]

    pi_old = mu (`ppo_old_policy = "behavior"`: the naive objective on stale data, which AReaL
    measured falling from 42.0 to 23.3 on AIME24 at staleness 4) or pi_prox ("prox": slime's
    recomputed old log-probs, which ignores the sampler's policy altogether).
    """
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    prox = proximal_logp(inp, cfg, mask)
    behavior_diagnostics(inp, mask, prox, stats)
    old = inp.behavior_logp.detach() if cfg.ppo_old_policy == "behavior" else prox
    ratio = torch.exp(masked(inp.logp - old, mask))
    return surrogate_output(inp, cfg, mask, stats, ratio, _token_clip(cfg), None, None)


def _decoupled(inp: LossInput, cfg: AlgoConfig, mode: str) -> LossOutput:
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    prox = proximal_logp(inp, cfg, mask)
    behavior_diagnostics(inp, mask, prox, stats)
    weight = behavior_weights(inp, cfg, mask, prox, stats, mode)
    ratio = torch.exp(masked(inp.logp - prox, mask))
    return surrogate_output(inp, cfg, mask, stats, ratio, _token_clip(cfg), weight, prox)


@LOSSES.register("decoupled_ppo")
def decoupled_ppo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Decoupled PPO (AReaL): clip against pi_prox, correct for mu with a behaviour weight.

        r = pi_theta / pi_prox,   w = bound(pi_prox / mu)   (importance.py; `is_*` settings)
        l = w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))   [dual clip]

    The clip keeps the update within a trust region of the current policy (not of a stale
    one), while w re-weights each token for the policy that actually sampled it. The bound
    is `is_mode` (none / truncate / mask) at `is_level` (token / sequence / geometric).
    """
    return _decoupled(inp, cfg, cfg.is_mode)


@LOSSES.register("tis")
def tis(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Truncated importance sampling: decoupled_ppo with w = clamp(pi_prox / mu, is_low, is_high).

    At `is_level` token, sequence (product of ratios) or geometric mean; `is_veto` zeroes a
    sequence holding a token with pi_prox / mu below it.
    """
    return _decoupled(inp, cfg, "truncate")


@LOSSES.register("mis")
def mis(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Masked importance sampling: decoupled_ppo with w = pi_prox / mu where
    is_low <= w <= is_high and 0 elsewhere (the token, or at sequence/geometric level the whole
    sequence, is dropped rather than down-weighted: no bias from truncation, less data).
    """
    return _decoupled(inp, cfg, "mask")
