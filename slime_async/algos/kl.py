"""KL penalty against a reference policy and the entropy bonus, shared by every built-in loss.

What a KL penalty in the loss must get right is its gradient. Per token, at a fixed context,
with pi = pi_theta and ref the reference (initial) policy,

    KL(pi || ref) = sum_y pi(y) log(pi(y) / ref(y)),
    grad KL       = sum_y pi(y) (log pi(y) - log ref(y)) grad log pi(y)   (sum_y grad pi(y) = 0)
                  = E_{y ~ pi}[ log(pi(y) / ref(y)) grad log pi(y) ].

So a per-token term is right when its gradient is (log pi - log ref) grad log pi on a token
sampled from pi. With log r = log ref - log pi the three estimators of the value,

    k1 = -log r                 grad = grad log pi                 E_pi[.] = 0          (no pull)
    k2 = (log r)^2 / 2          grad = -log r grad log pi          E_pi[.] = grad KL(pi||ref)
    k3 = r - 1 - log r          grad = (1 - r) grad log pi         E_pi[.] = -sum_y ref grad log pi
                                                                             = grad KL(ref||pi),

differ: used directly as losses only k2 pulls towards ref the right way. Here every estimator
keeps its value (reported, and added to the loss) and gets k2's gradient by a stop-gradient
construction (sg = detach):

    kl_t = sg(k(y_t)) + sg(log pi(y_t) - log ref(y_t)) * (log pi(y_t) - sg(log pi(y_t))),

whose value is k and whose gradient is (log pi - log ref) grad log pi. (This is the
"straight-through" or "k3+" form of the literature; the GRPO paper's k3 loss pulls towards the
mass of ref, the reverse KL.)

Stale tokens were sampled from mu, not pi: E_mu[(pi/mu) f] = E_pi[f]. The term is weighted like
the policy loss: by the loss's bounded behaviour weight w = bound(pi_prox / mu) (detached) and
the ratio rho = pi_theta / pi_prox (detached: its gradient is not the KL's), so

    per-token penalty = w * sg(rho) * kl_t,     gradient w rho (log pi - log ref) grad log pi,

an unbiased estimate of grad KL(pi_theta || ref) wherever the bound does not bind. Losses without
a behaviour weight (ppo_clip, gspo against an "old" policy) use w = rho = 1; aipo, whose weight
is already min(pi_theta / mu, rho_max), uses its weight and rho = 1.
"""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import masked
from slime_async.algos.api import LossInput
from slime_async.algos.metrics import TokenStats
from slime_async.config.algo import AlgoConfig


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of the value of KL(pi || ref) from tokens sampled from pi; `[B, T]`.

    With log r = ref_logp - logp:
        k1 = -log r                 (unbiased, high variance, can be negative)
        k2 = (log r)^2 / 2          (biased, low variance)
        k3 = r - 1 - log r          (unbiased, non-negative, low variance; Schulman's k3)
    Only the value: as a loss use `kl_penalty`, which gives each the gradient of KL(pi || ref).
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}: expected k1, k2 or k3")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str,
    weight: torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, T]` per-token KL penalty: value w * rho * k, gradient w * rho * (log pi - log ref).

    `logp` (with grad) = log pi_theta, `ref_logp` the reference's; `weight` the detached
    behaviour weight w (None: 1); `prox_logp` log pi_prox for rho = pi_theta / pi_prox
    (None: rho = 1). See the module docstring for the derivation. All inputs masked already.
    """
    lp = logp.detach()
    log_ratio = lp - ref_logp.detach()
    term = kl_estimate(lp, ref_logp.detach(), kind) + log_ratio * (logp - lp)
    scale = torch.ones_like(lp) if prox_logp is None else torch.exp(lp - prox_logp.detach())
    if weight is not None:
        scale = scale * weight.detach()
    return scale * term


def add_regularizers(
    per_token: torch.Tensor,
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    stats: TokenStats,
    weight: torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """`per_token + kl_coef * kl_penalty(...) - entropy_coef * H`, all `[B, T]`.

    `weight` / `prox_logp`: the loss's behaviour weight and pi_prox, which importance-weight the
    KL term on stale tokens like the policy term (`kl_penalty`). The KL values are reported as
    kl_ref_k1/k2/k3 (plain token means over the batch's tokens) whenever `inp.ref_logp` is
    given, and the weighted penalty as kl_ref_loss when `kl_coef > 0`; the entropy whenever
    `inp.entropy` is. Each input is required when its coefficient is positive.
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
            prox = None if prox_logp is None else masked(prox_logp, mask)
            kl = kl_penalty(logp, ref, cfg.kl_estimator, weight, prox)
            stats.mean("kl_ref_loss", kl)
            per_token = per_token + cfg.kl_coef * kl
    if inp.entropy is not None:
        stats.mean("entropy", inp.entropy)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * inp.entropy
    return per_token
