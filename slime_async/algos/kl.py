"""KL penalty against a reference policy and the entropy bonus, shared by every built-in loss."""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import masked
from slime_async.algos.api import LossInput
from slime_async.algos.metrics import TokenStats
from slime_async.config.algo import AlgoConfig


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi; all `[B, T]`.

    With log r = ref_logp - logp:
        k1 = -log r                 (unbiased, high variance, can be negative)
        k2 = (log r)^2 / 2          (biased, low variance; its gradient is the true KL's)
        k3 = r - 1 - log r          (unbiased, non-negative, low variance; Schulman's k3)
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}: expected k1, k2 or k3")


def add_regularizers(
    per_token: torch.Tensor,
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    stats: TokenStats,
) -> torch.Tensor:
    """`per_token + kl_coef * KL_est(pi || ref) - entropy_coef * H`, all `[B, T]`.

    The KL terms are reported as kl_ref_k1/k2/k3 whenever `inp.ref_logp` is given, the entropy
    whenever `inp.entropy` is; each is required when its coefficient is positive.
    """
    if cfg.kl_coef > 0 and inp.ref_logp is None:
        raise ValueError("algo.kl_coef > 0 but LossInput.ref_logp is None: compute it")
    if cfg.entropy_coef > 0 and inp.entropy is None:
        raise ValueError("algo.entropy_coef > 0 but LossInput.entropy is None: compute it")
    if inp.ref_logp is not None:
        # Padding may hold any value: mask the log-ratio before exp.
        logp = masked(inp.logp, mask)
        ref = masked(inp.ref_logp, mask)
        for kind in ("k1", "k2", "k3"):
            stats.mean(f"kl_ref_{kind}", kl_estimate(logp.detach(), ref, kind))
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl_estimate(logp, ref, cfg.kl_estimator)
    if inp.entropy is not None:
        stats.mean("entropy", inp.entropy)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * inp.entropy
    return per_token
