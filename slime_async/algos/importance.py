"""The proximal policy and importance weights between it and the engine's policy (TIS / MIS).

Three policies meet in an off-policy loss: mu, the engine's policy that sampled a token
(`behavior_logp`, possibly several versions old); pi_prox, the learner's policy at the start of
the step; pi_theta, the policy being optimised (`logp`, with grad). The weight pi_prox / mu
corrects for the sampler; how it is bounded decides the bias/variance trade-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slime_async.algos.aggregation import masked, version_lag
from slime_async.algos.api import LossInput
from slime_async.algos.metrics import TokenStats
from slime_async.config.algo import AlgoConfig


def proximal_logp(inp: LossInput, cfg: AlgoConfig, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` log pi_prox, detached.

    forward:      `inp.prox_logp`: the learner's no-grad forward pass at the start of the batch,
                  before its first mini-batch update (the PPO trust region is around it). When it
                  is not given, `logp.detach()`, which is pi_prox only on the batch's first
                  mini-batch: after an update it makes the ratio 1 and the clip inert.
    interpolate:  log pi_prox = log mu + alpha * (log pi_theta - log mu),
                  alpha = (v_prox - v_mu) / (v_theta - v_mu) = lag / (lag + 1),
                  with v_prox = current_version, v_theta = current_version + 1 (the policy this
                  step produces) and lag = current_version - the token's version (AReaL's
                  log-linear approximation; fresh tokens get pi_prox = mu).
    """
    if cfg.prox_source == "forward":
        prox = inp.prox_logp if inp.prox_logp is not None else inp.logp
        return masked(prox.detach(), mask)
    mu = masked(inp.behavior_logp, mask)
    return masked(interpolated_prox(mu, inp.logp, version_lag(inp)), mask)


def interpolated_prox(
    behavior_logp: torch.Tensor, logp: torch.Tensor, lag: torch.Tensor
) -> torch.Tensor:
    """`[B, T]` AReaL's log-linear pi_prox in this project's version numbering, detached.

        log pi_prox = log mu + alpha (log pi_theta - log mu),   alpha = k / (k + 1),

    k = the token's lag (current_version - its version; k < 0 counts as 0). pi_prox is the
    learner's policy at the start of the batch, version v = current_version; mu is version
    v - k; pi_theta is the policy this batch trains towards, version v + 1. So a fresh token
    (k = 0, sampled by pi_prox itself) gets mu, a token one version old is half-way, and
    alpha -> 1 for very old tokens, where pi_prox is much nearer pi_theta than mu.
    """
    k = lag.clamp(min=0).to(logp.dtype)
    alpha = k / (k + 1)
    mu = behavior_logp.detach()
    return mu + alpha * (logp.detach() - mu)


@dataclass
class ISWeights:
    weight: torch.Tensor
    """[B, T] detached importance weight; 0 where dropped or outside the mask."""
    dropped: torch.Tensor
    """[B, T] bool: tokens of the mask zeroed by the mask mode or the veto."""
    truncated: torch.Tensor | None = None
    """[B, T] bool: tokens of the mask whose weight the truncate mode clamped (None: other modes)."""


def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    mode: str,
    low: float,
    high: float | None,
    veto: float | None,
) -> ISWeights:
    """Bounded importance weights from a per-token `log_ratio: [B, T]` = log(pi / mu).

    level  token:      w_t = pi_t / mu_t
           sequence:   w_t = prod_s pi_s / mu_s                    (every token of the sequence)
           geometric:  w_t = exp(mean_s log(pi_s / mu_s))
    mode   none:       w
           truncate:   clamp(w, low, high)                         (TIS)
           mask:       w if low <= w <= high else 0                (MIS; per token or sequence)
    veto:  a sequence with any token pi_t / mu_t < veto gets w = 0 on every token.
    """
    lr = masked(log_ratio.detach(), mask)
    if level == "token":
        log_w = lr
    elif level == "sequence":
        log_w = lr.sum(-1, keepdim=True).expand_as(lr)
    elif level == "geometric":
        n = mask.sum(-1, keepdim=True).clamp(min=1).to(lr.dtype)
        log_w = (lr.sum(-1, keepdim=True) / n).expand_as(lr)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}")
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high is not None else math.inf
    dropped = torch.zeros_like(mask)
    truncated = None
    if mode == "truncate":
        truncated = ((log_w < log_low) | (log_w > log_high)) & mask
        log_w = log_w.clamp(log_low, log_high)
    elif mode == "mask":
        dropped = (log_w < log_low) | (log_w > log_high)
    elif mode != "none":
        raise ValueError(f"unknown importance-weight mode {mode!r}")
    if veto is not None:
        dropped = dropped | ((lr < math.log(veto)) & mask).any(-1, keepdim=True)
    dropped = dropped & mask
    weight = torch.where(dropped | ~mask, torch.zeros_like(log_w), torch.exp(log_w))
    return ISWeights(weight=weight, dropped=dropped, truncated=truncated)


def behavior_weights(
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    prox: torch.Tensor,
    stats: TokenStats,
    mode: str,
) -> torch.Tensor:
    """`[B, T]` weights pi_prox / mu bounded by `cfg.is_*` with `mode`; reports their metrics.

    Metrics: is_weight (mean, max, ESS), is_dropped_frac, and behav_kl, an estimate of
    KL(mu || pi_prox) = E_mu[r - 1 - log r] with r = pi_prox / mu (how far the sampler drifted).
    """
    log_ratio = masked(prox - inp.behavior_logp.detach(), mask)
    w = importance_weights(
        log_ratio,
        mask,
        level=cfg.is_level,
        mode=mode,
        low=cfg.is_low,
        high=cfg.is_high,
        veto=cfg.is_veto,
    )
    stats.weight("is_weight", w.weight)
    stats.mean("is_dropped_frac", w.dropped)
    if w.truncated is not None:
        stats.mean("is_truncated_frac", w.truncated)
    stats.mean("behav_kl", torch.exp(log_ratio) - 1 - log_ratio)
    return w.weight


def behavior_diagnostics(
    inp: LossInput, mask: torch.Tensor, prox: torch.Tensor, stats: TokenStats
) -> None:
    """Whole-answer diagnostics of the behaviour log-ratio log(pi_prox / mu), by lag.

        log_ratio_m2       (1/N) sum_t (log pi_prox(y_t) / mu(y_t))^2   (M2PO's M2, per token)
        seq_is_weight      W_i = prod_t pi_prox / mu over answer i; its normalised ESS
                           seq_is_weight_ess = (sum_i W_i)^2 / (n sum_i W_i^2), in [1/n, 1]
        seq_max_log_ratio  max_t |log pi_prox / mu| of each answer (mean over answers, and max)

    The token ESS (`is_weight_ess`) hides what a reward on the whole answer sees: at a token ESS
    of 0.84 over answers of ~30 tokens the answers' own weights can have an ESS of a few
    percent. Every built-in loss reports these, whatever its own weight.
    """
    lr = masked(prox - inp.behavior_logp.detach(), mask)  # [B, T]
    stats.mean("log_ratio_m2", lr * lr)
    stats.sequence_weight("seq_is_weight", lr.sum(-1))
    stats.per_sequence("seq_max_log_ratio", lr.abs().amax(-1), with_max=True)
