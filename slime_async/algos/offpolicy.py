"""Corrections aimed at large lags: m2po, dppo, seq_mask, cispo, vcpo, mu_band.

Notation as in ppo.py, per token t of answer i (tensors `[B, T]`): mu the engine's policy that
sampled the token (possibly many versions old), pi_prox the learner's policy at the start of the
batch, pi_theta the policy being trained, A the advantage, k the token's lag. Each docstring
gives its loss's formula and its source; each loss reports the shared behaviour diagnostics
(`importance.behavior_diagnostics`) and its own mask or cap as a metric, so a run shows how
often the correction acted.
"""

from __future__ import annotations

import torch

from slime_async.algos.aggregation import aggregate, masked, token_mask, version_lag
from slime_async.algos.api import LOSSES, LossInput, LossOutput
from slime_async.algos.importance import behavior_diagnostics, behavior_weights, proximal_logp
from slime_async.algos.kl import add_regularizers
from slime_async.algos.metrics import TokenStats
from slime_async.algos.ppo import surrogate_output
from slime_async.config.algo import AlgoConfig


def _start(inp: LossInput, cfg: AlgoConfig) -> tuple[torch.Tensor, TokenStats, torch.Tensor]:
    """(mask, stats, pi_prox) with the behaviour diagnostics recorded."""
    mask = token_mask(inp)
    stats = TokenStats(mask, version_lag(inp))
    prox = proximal_logp(inp, cfg, mask)
    behavior_diagnostics(inp, mask, prox, stats)
    return mask, stats, prox


def _finish(
    pg: torch.Tensor,
    inp: LossInput,
    cfg: AlgoConfig,
    mask: torch.Tensor,
    stats: TokenStats,
    weight: torch.Tensor | None,
    prox: torch.Tensor | None,
) -> LossOutput:
    stats.count()
    stats.mean("pg_loss", pg)
    per_token = add_regularizers(pg, inp, cfg, mask, stats, weight, prox)
    return LossOutput(loss=aggregate(per_token, mask, inp, cfg), metrics=stats.raw())


def second_moment_mask(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """`[B, T]` bool: the tokens M2PO keeps, given `log_ratio: [B, T]` and `mask: [B, T]`.

    Per answer (row): its tokens are dropped in order of decreasing (log r)^2, as few as
    possible, until the mean (log r)^2 of its remaining tokens is at most `tau` (none dropped if
    it already is; all of them if even its smallest one is above `tau`)."""
    q = torch.where(mask, log_ratio.detach() ** 2, torch.full_like(log_ratio, -1.0))  # [B, T]
    sorted_q, order = torch.sort(q, dim=-1, descending=True, stable=True)
    valid = sorted_q >= 0  # a row's tokens come first, largest first
    n = mask.sum(-1, keepdim=True).to(q.dtype)  # [B, 1]
    kept_q = torch.where(valid, sorted_q, torch.zeros_like(sorted_q))
    total = kept_q.sum(-1, keepdim=True)
    after = torch.arange(1, q.shape[-1] + 1, device=q.device, dtype=q.dtype)  # dropped count
    remaining = n - after  # [B, T]
    m2_after = (total - kept_q.cumsum(-1)) / remaining.clamp(min=1)
    ok = (m2_after <= tau) & (remaining > 0) & valid
    first_ok = torch.where(ok.any(-1), ok.float().argmax(-1) + 1, n[:, 0].long())  # [B]
    drop = torch.where(total[:, 0] / n[:, 0].clamp(min=1) <= tau, 0, first_ok)  # [B]
    dropped_sorted = torch.arange(q.shape[-1], device=q.device)[None, :] < drop[:, None]
    dropped = torch.zeros_like(mask).scatter(1, order, dropped_sorted & valid)
    return mask & ~dropped


@LOSSES.register("m2po")
def m2po(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """M2PO: importance-weighted policy gradient, tokens masked to bound the second moment.

        r_t  = pi_theta(y_t) / mu(y_t)
        keep = second_moment_mask(log r, tau = m2po_tau): in each answer, drop its tokens of
               largest (log r_t)^2 until (1/N_kept) sum_kept (log r_t)^2 <= tau
        l_t  = -keep_t * A_t * r_t                     (gradient keep A r grad log pi_theta)

    No ratio clip: the mask on the second moment of the log-ratio is the trust region, and it
    lets most of a very stale batch train where a clip against mu would cut it (Second-Moment
    Trust Policy Optimization: Zheng, Zhao and Chen, "Prosperity before Collapse: How Far Can
    Off-Policy RL Reach with Stale Data on LLMs?", 2025; tau_M2 = 0.04 there). The paper bounds
    the M2 of the whole batch; here each answer's is bounded, which is the same at every
    micro-batch split and data-parallel size (a batch-level mask would depend on how the learner
    splits the batch) and stricter: no answer can hide a far-off token behind many near ones.
    Metrics: m2po_masked_frac, m2po_m2 (before the mask).
    """
    mask, stats, _ = _start(inp, cfg)
    log_r = masked(inp.logp - inp.behavior_logp.detach(), mask)
    keep = second_moment_mask(log_r, mask, cfg.m2po_tau)
    ratio = torch.exp(log_r)
    pg = torch.where(keep, -masked(inp.advantages, mask) * ratio, torch.zeros_like(ratio))
    stats.weight("ratio", ratio)
    stats.mean("m2po_masked_frac", mask & ~keep)
    stats.mean("m2po_m2", log_r.detach() ** 2)
    return _finish(pg, inp, cfg, mask, stats, None, None)


@LOSSES.register("dppo")
def dppo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """DPPO with a squared log-ratio penalty (prime-rl's default loss), IS weight truncated.

        r_t    = pi_theta(y_t) / mu(y_t),   d_t = pi_theta(y_t) - mu(y_t)   (probabilities)
        masked = (A_t > 0 and d_t > dppo_mask_high) or (A_t < 0 and d_t < -dppo_mask_low)
        l_t    = -(1 - masked_t) A_t r_t sg(min(1, C / r_t)) + dppo_kl_tau (log r_t)^2

    The mask is a trust region in probability (total variation) instead of ratio space: a rare
    token may move far in ratio, a likely one not far in probability, and only the direction
    the advantage pushes is cut (DPPO-Binary-TV, arXiv:2602.04879). The penalty
    tau (log r)^2 on every token pulls pi_theta back towards the sampler (Kimi K2.5's,
    arXiv:2602.02276; prime-rl uses both, tau = 1e-3). C = `is_high` truncates the importance
    weight: the policy term's gradient is min(r, C) A grad log pi_theta (None: untruncated, as
    prime-rl ships it). Metrics: dppo_masked_frac, is_truncated_frac.
    """
    mask, stats, _ = _start(inp, cfg)
    adv = masked(inp.advantages, mask)
    mu = masked(inp.behavior_logp.detach(), mask)
    logp = masked(inp.logp, mask)
    log_r = logp - mu
    diff = logp.detach().exp() - mu.exp()
    cut = torch.where(adv > 0, diff > cfg.dppo_mask_high, (adv < 0) & (diff < -cfg.dppo_mask_low))
    keep = mask & ~cut
    ratio = torch.exp(log_r)
    weight = ratio
    if cfg.is_high is not None:
        weight = ratio * (cfg.is_high / ratio.detach()).clamp(max=1.0)
        stats.mean("is_truncated_frac", ratio.detach() > cfg.is_high)
    pg = torch.where(keep, -adv * weight, torch.zeros_like(weight))
    penalty = cfg.dppo_kl_tau * log_r * log_r
    stats.weight("ratio", ratio)
    stats.mean("dppo_masked_frac", mask & cut)
    stats.mean("dppo_penalty", penalty)
    return _finish(pg + penalty, inp, cfg, mask, stats, None, None)


@LOSSES.register("seq_mask")
def seq_mask(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """Off-policy sequence masking on top of tis: whole answers that moved too far are left out.

        D_i   = (1/|y_i|) sum_t log(mu(y_it) / pi_theta(y_it))     (a KL(mu || pi_theta) estimate)
        M_i   = 0 if mean_t A_it < 0 and D_i > seq_mask_delta, else 1
        l_it  = M_i * w_it * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),
                r = pi_theta / pi_prox,  w = clamp(pi_prox / mu, is_low, is_high)

    A negative answer sampled by a policy the learner has since left teaches mostly noise
    (pushing down tokens the current policy would not produce), so it is dropped whole, never
    down-weighted token by token (DeepSeek-V3.2's off-policy sequence masking,
    arXiv:2512.02556). Answers with a positive advantage always train. Metric: seq_masked_frac.
    """
    mask, stats, prox = _start(inp, cfg)
    weight = behavior_weights(inp, cfg, mask, prox, stats, "truncate")
    n = mask.sum(-1).clamp(min=1).to(inp.logp.dtype)  # [B]
    drift = masked(inp.behavior_logp.detach() - inp.logp.detach(), mask).sum(-1) / n  # [B]
    negative = masked(inp.advantages, mask).sum(-1) < 0
    drop = negative & (drift > cfg.seq_mask_delta)  # [B]
    stats.per_sequence("seq_masked_frac", drop.to(inp.logp.dtype))
    weight = torch.where(drop[:, None], torch.zeros_like(weight), weight)
    ratio = torch.exp(masked(inp.logp - prox, mask))
    clip = (cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip_c)
    return surrogate_output(inp, cfg, mask, stats, ratio, clip, weight, prox)


@LOSSES.register("cispo")
def cispo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """CISPO against pi_prox: the clipped ratio is a stop-gradient weight, no token loses its
    gradient, and the behaviour weight corrects for mu.

        r_t = pi_theta / pi_prox,   c_t = clamp(sg(r_t), 1 - cispo_eps_low, 1 + cispo_eps_high)
        w_t = bound(pi_prox / mu)   (is_mode, is_low, is_high, is_level as decoupled_ppo)
        l_t = -w_t c_t A_t log pi_theta(y_t)              (gradient -w c A grad log pi_theta)

    PPO's clip zeroes the gradient of a token whose ratio left the trust region, which on stale
    data is often the rare, informative one; CISPO keeps every token and bounds only its weight
    (MiniMax-M1, arXiv:2506.13585, with the ratio against the sampler; here against the
    learner's pi_prox, so that w, not the clip, carries the sampler's drift). Metric: clip_frac
    (tokens whose weight the clamp cut).
    """
    mask, stats, prox = _start(inp, cfg)
    weight = behavior_weights(inp, cfg, mask, prox, stats, cfg.is_mode)
    ratio = torch.exp(masked(inp.logp.detach() - prox, mask))
    low = 0.0 if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
    high = 1.0 + cfg.cispo_eps_high
    clipped = ratio.clamp(low, high)
    pg = -weight * clipped * masked(inp.advantages, mask) * masked(inp.logp, mask)
    stats.weight("ratio", ratio)
    stats.mean("clip_frac", (ratio < low) | (ratio > high))
    return _finish(pg, inp, cfg, mask, stats, weight, prox)


@LOSSES.register("vcpo")
def vcpo(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """tis with VCPO's effective-sample-size step size: each update's learning rate is scaled by
    the square root of the normalised ESS of its answers' behaviour weights.

        l_t   = tis's (w = clamp(pi_prox / mu, is_low, is_high), PPO clip against pi_prox)
        W_i   = prod_t pi_prox(y_it) / mu(y_it),   ESS = (sum_i W_i)^2 / (n sum_i W_i^2)
        lr    = lr_schedule * sqrt(ESS)                 (over the update's answers, all ranks)

    When a few answers carry most of the weight the gradient estimate rests on few samples, and
    AdamW's step should shrink like the square root of the sample size (Huang et al., "Stable
    Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv:2602.17616). The scale is a
    learning rate, not a loss factor (AdamW divides a constant factor out): the learner reads
    the update's `seq_is_weight` sums (`Algorithm.ess_scaled_lr`) and reports the scale as
    `lr_ess_scale`. VCPO's second part, its closed-form baseline, is not built.
    """
    mask, stats, prox = _start(inp, cfg)
    weight = behavior_weights(inp, cfg, mask, prox, stats, "truncate")
    ratio = torch.exp(masked(inp.logp - prox, mask))
    clip = (cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip_c)
    return surrogate_output(inp, cfg, mask, stats, ratio, clip, weight, prox)


vcpo.ess_scaled_lr = True  # type: ignore[attr-defined]


@LOSSES.register("mu_band")
def mu_band(inp: LossInput, cfg: AlgoConfig) -> LossOutput:
    """PPO clip around mu with a trust band that widens with the token's lag.

        r_t  = pi_theta / mu,   e_k = 1 + band_growth * k   (k = the token's lag)
        l_t  = max(-A r, -A clip(r, 1 - eps_low e_k, 1 + eps_high e_k))      (lower end >= 0)

    Naive PPO clips every token within [1 - eps, 1 + eps] of the sampler, however many versions
    ago it ran: at lag k the learner's policy has legitimately moved up to about k trust regions
    away, and a fixed band cuts most stale tokens. Anchored at mu (no behaviour weight to blow
    up), the band grows linearly with k, so fresh tokens keep PPO's region and stale ones get
    room for the k versions they missed. Metrics: clip_frac, ratio_outside (outside the band).
    """
    mask, stats, _ = _start(inp, cfg)
    lag = version_lag(inp).clamp(min=0).to(inp.logp.dtype)
    widen = 1.0 + cfg.band_growth * lag
    low = (1.0 - cfg.eps_clip_low * widen).clamp(min=0.0)
    high = 1.0 + cfg.eps_clip_high * widen
    ratio = torch.exp(masked(inp.logp - inp.behavior_logp.detach(), mask))
    adv = masked(inp.advantages, mask)
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.minimum(torch.maximum(ratio, low), high)
    pg = torch.maximum(unclipped, clipped_loss)
    stats.weight("ratio", ratio)
    stats.mean("clip_frac", clipped_loss > unclipped)
    stats.mean("ratio_outside", (ratio < low) | (ratio > high))
    return _finish(pg, inp, cfg, mask, stats, None, None)
