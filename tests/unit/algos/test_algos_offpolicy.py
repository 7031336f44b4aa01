"""The high-lag corrections on a bandit where the weights DO reach the caps, so the losses differ.

A 4-arm bandit: pi_prox = softmax(THETA), a sampler mu = softmax(THETA_FAR) far enough that one
arm's weight pi_prox / mu is 2.78 (above the cap of 2), and pi_theta = softmax(THETA_MOVED), which
moved far enough from pi_prox that PPO's clip binds on another arm (ratio 0.68, A < 0). With one token per arm and each advantage
scaled by K mu(a), a token-mean loss is the exact expectation over a ~ mu of the per-token loss
(the per-token losses below are positively homogeneous in A): no Monte-Carlo noise, so every
gradient is compared with its closed form to 1e-9, and the corrections are shown to differ where
the caps bind. The sequence-level ones (seq_mask) and the batch-level one (m2po) are checked on
explicit batches instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_async.algos import LOSSES, LossInput, finalize_metrics
from slime_async.algos.build import lr_scale_from
from slime_async.algos.offpolicy import second_moment_mask
from slime_async.algos.ppo import clipped_surrogate
from slime_async.config import AlgoConfig

D = torch.float64
K = 4
REWARD = torch.tensor([1.0, 0.0, 0.6, 0.2], dtype=D)
BASELINE = 0.4
ADV = REWARD - BASELINE  # [K]: + - + -
THETA = torch.tensor([0.5, -0.3, 0.2, 0.0], dtype=D)  # pi_prox
THETA_FAR = torch.tensor([-0.5, 0.8, 0.2, -0.4], dtype=D)  # mu: arm 0's weight is 2.78
THETA_MOVED = torch.tensor([0.6, -0.7, 0.3, -0.1], dtype=D)  # pi_theta / pi_prox: 0.68 .. 1.11
LAG = 4


def exact_batch(theta=THETA_MOVED, mu_theta=THETA_FAR, prox_theta=THETA, lag=LAG):
    """One token per arm, A scaled by K mu(a): token_mean = E_{a ~ mu}. Returns (input, theta
    leaf, mu probabilities)."""
    th = theta.clone().requires_grad_()
    mu = mu_theta.log_softmax(0)
    logp = th.log_softmax(0)[:, None]  # [K, 1]
    inp = LossInput(
        logp=logp,
        behavior_logp=mu[:, None],
        advantages=(ADV * K * mu.exp())[:, None],
        loss_mask=torch.ones(K, 1, dtype=D),
        versions=torch.full((K, 1), 10 - lag),
        current_version=10,
        token_denominator=float(K),
        seq_denominator=float(K),
        prox_logp=prox_theta.log_softmax(0)[:, None],
    )
    return inp, th, mu.exp()


def grad_of(name, **overrides):
    inp, th, _ = exact_batch()
    cfg = AlgoConfig(loss=name, **overrides)
    out = LOSSES.resolve(name)(inp, cfg)
    (g,) = torch.autograd.grad(out.loss, th)
    return g, finalize_metrics(out.metrics)


def closed_form(per_arm_loss):
    """grad_theta sum_a mu(a) l_a(theta) for a function of log pi_theta [K] -> [K]."""
    th = THETA_MOVED.clone().requires_grad_()
    mu = THETA_FAR.softmax(0)
    (g,) = torch.autograd.grad((mu * per_arm_loss(th.log_softmax(0))).sum(), th)
    return g


PROX = THETA.log_softmax(0)
MU = THETA_FAR.log_softmax(0)
W = (PROX - MU).exp()  # pi_prox / mu: [2.78, 0.34, 1.02, 1.53]


def test_the_bandit_reaches_the_caps():
    assert float(W.max()) > 2.0  # the weight cap of 2 binds on arm 0
    ratio = (THETA_MOVED.log_softmax(0) - PROX).exp()
    assert float(ratio[1]) < 0.8 and ADV[1] < 0  # the PPO clip binds on arm 1
    assert 0.8 < float(ratio[0]) < 1.2  # and not on arm 0, whose weight the cap cuts


# ------------------------------------------------------------------ the old losses, beyond the cap


def _ppo_terms(lp, weight):
    loss, _, _ = clipped_surrogate((lp - PROX).exp(), ADV, 0.2, 0.2, None)
    return weight * loss


def test_beyond_the_cap_tis_mis_and_unbounded_decoupled_ppo_are_three_objectives():
    unbounded, _ = grad_of("decoupled_ppo", is_mode="none")
    tis, m_tis = grad_of("tis")
    mis, m_mis = grad_of("mis")
    # E_mu[w l] = E_prox[l]: the unbounded weight gives the on-policy objective exactly
    on_policy = closed_form(lambda lp: _ppo_terms(lp, W))
    assert torch.allclose(unbounded, on_policy, atol=1e-9)
    # truncated: E_mu[min(w, 2) l]; masked: E_mu[1{w <= 2} w l] (arm 0 dropped)
    assert torch.allclose(tis, closed_form(lambda lp: _ppo_terms(lp, W.clamp(max=2.0))), atol=1e-9)
    assert torch.allclose(mis, closed_form(lambda lp: _ppo_terms(lp, W * (W <= 2.0))), atol=1e-9)
    assert m_tis["is_truncated_frac"] == 0.25 and m_mis["is_dropped_frac"] == 0.25
    for a, b in ((unbounded, tis), (unbounded, mis), (tis, mis)):
        assert float((a - b).abs().max()) > 1e-2  # no longer one gradient


# ------------------------------------------------------------------ cispo


def test_cispo_keeps_the_gradient_of_tokens_the_clip_cuts():
    g, m = grad_of("cispo", cispo_eps_high=0.1)
    ratio = (THETA_MOVED.log_softmax(0) - PROX).exp()
    c = ratio.clamp(max=1.1)
    w = W.clamp(max=2.0)
    assert torch.allclose(g, closed_form(lambda lp: -w * c * ADV * lp), atol=1e-9)
    assert m["clip_frac"] == 0.5  # arms 0 and 2: ratio 1.11 > 1.1
    # PPO's clip zeroes arm 1's gradient (A < 0, ratio 0.68 < 0.8); CISPO keeps it
    one = torch.eye(K, dtype=D)[1]
    assert float(closed_form(lambda lp: _ppo_terms(lp, W.clamp(max=2.0)) * one).abs().max()) == 0
    arm1 = closed_form(lambda lp: -(w * c * ADV * lp) * one)
    assert float(arm1.abs().max()) > 0.01
    tis, _ = grad_of("tis")
    assert float((g - tis).abs().max()) > 1e-2


def test_cispo_lower_bound_when_set():
    g, _ = grad_of("cispo", cispo_eps_low=0.1)
    ratio = (THETA_MOVED.log_softmax(0) - PROX).exp()
    c = ratio.clamp(0.9, 1.28)
    w = W.clamp(max=2.0)
    assert torch.allclose(g, closed_form(lambda lp: -w * c * ADV * lp), atol=1e-9)


# ------------------------------------------------------------------ mu_band


def test_mu_band_widens_the_clip_around_mu_with_the_lag():
    def band(lp, width):
        loss, _, _ = clipped_surrogate((lp - MU).exp(), ADV, 0.2 * width, 0.2 * width, None)
        return loss

    g, m = grad_of("mu_band", band_growth=1.0)
    width = 1 + 1.0 * LAG  # the band [0, 2] around mu: arm 1 (ratio 0.23, A < 0) now trains
    assert torch.allclose(g, closed_form(lambda lp: band(lp, width)), atol=1e-9)
    naive, m_naive = grad_of("ppo_clip")
    assert torch.allclose(naive, closed_form(lambda lp: band(lp, 1.0)), atol=1e-9)
    assert m_naive["clip_frac"] > m["clip_frac"]  # the wider band cuts fewer stale tokens
    assert float((g - naive).abs().max()) > 1e-2
    # with no growth the band is naive PPO's
    flat, _ = grad_of("mu_band", band_growth=0.0)
    assert torch.allclose(flat, naive, atol=1e-12)


# ------------------------------------------------------------------ dppo


def test_dppo_masks_by_probability_difference_in_the_advantage_direction():
    inp, th, mu = exact_batch()
    cfg = AlgoConfig(loss="dppo", dppo_mask_low=0.05, dppo_mask_high=0.05)
    out = LOSSES.resolve("dppo")(inp, cfg)
    (g,) = torch.autograd.grad(out.loss, th)
    m = finalize_metrics(out.metrics)
    p_theta = THETA_MOVED.softmax(0)
    diff = p_theta - mu
    cut = torch.where(ADV > 0, diff > 0.05, diff < -0.05)
    assert 0 < int(cut.sum()) < K and m["dppo_masked_frac"] == float(cut.double().mean())
    ratio = (THETA_MOVED.log_softmax(0) - MU).exp()
    assert float(ratio.max()) > 2.0 and m["is_truncated_frac"] > 0  # the IS cap binds
    tau = cfg.dppo_kl_tau

    def per_arm(lp):
        r = (lp - MU).exp()
        capped = r * (2.0 / r.detach()).clamp(max=1.0)
        pg = torch.where(cut, torch.zeros_like(r), -ADV * capped)
        # the penalty is not scaled by A: one token per arm weighs 1 / K, not mu(a)
        return pg + tau * (lp - MU) ** 2 / (K * THETA_FAR.softmax(0))

    assert torch.allclose(g, closed_form(per_arm), atol=1e-9)
    # a cap arm 3 (kept, ratio 1.39) reaches: truncation changes the gradient
    capped, m_capped = grad_of("dppo", dppo_mask_low=0.05, dppo_mask_high=0.05, is_high=1.2)
    assert m_capped["is_truncated_frac"] == 0.5
    untruncated, _ = grad_of("dppo", dppo_mask_low=0.05, dppo_mask_high=0.05, is_high=None)
    assert float((capped - untruncated).abs().max()) > 1e-3


# ------------------------------------------------------------------ m2po


def test_second_moment_mask_drops_the_fewest_largest_tokens():
    log_r = torch.tensor([[0.05, -0.6, 0.1], [0.3, 0.0, -0.02]], dtype=D)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    keep = second_moment_mask(log_r, mask, tau=0.01)
    q = log_r**2
    for b in range(2):  # each answer's own M2 is bounded
        assert float(q[b][keep[b]].mean()) <= 0.01
    dropped = mask & ~keep
    assert dropped.tolist() == [[False, True, False], [True, False, False]]
    # keeping the smallest dropped token of an answer back would break its bound
    assert float(q[0][[0, 1, 2]].mean()) > 0.01 and float(q[1][[0, 1]].mean()) > 0.01
    assert bool(second_moment_mask(log_r, mask, tau=1.0).equal(mask))  # under the bound: all kept
    # an answer whose every token is above the bound is dropped whole; padding is never kept
    far = second_moment_mask(torch.tensor([[0.5, -0.4, 9.0]], dtype=D), mask[1:], tau=0.01)
    assert far.tolist() == [[False, False, False]]


def test_m2po_is_importance_weighted_pg_on_the_kept_tokens():
    inp, th, _ = exact_batch()
    cfg = AlgoConfig(loss="m2po", m2po_tau=0.1)
    out = LOSSES.resolve("m2po")(inp, cfg)
    (g,) = torch.autograd.grad(out.loss, th)
    m = finalize_metrics(out.metrics)
    log_r = THETA_MOVED.log_softmax(0) - MU
    keep = second_moment_mask(log_r[:, None], torch.ones(K, 1, dtype=torch.bool), 0.1)[:, 0]
    assert 0 < int((~keep).sum()) < K and m["m2po_masked_frac"] == float((~keep).double().mean())
    assert m["m2po_m2"] == pytest.approx(float((log_r**2).mean()))
    assert torch.allclose(g, closed_form(lambda lp: -(keep * ADV * (lp - MU).exp())), atol=1e-9)
    loose, _ = grad_of("m2po", m2po_tau=10.0)  # nothing masked: plain IS policy gradient
    assert torch.allclose(loose, closed_form(lambda lp: -ADV * (lp - MU).exp()), atol=1e-9)
    assert float((g - loose).abs().max()) > 1e-2


# ------------------------------------------------------------------ seq_mask


def _sequences():
    """4 answers x 3 tokens: answer 1 and 3 negative; answer 1 sampled far from pi_theta."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 3, generator=g, dtype=D) - 0.5).requires_grad_()
    mu = logp.detach().clone()
    mu[1] = logp.detach()[1] + 0.4  # mean log(mu / pi_theta) = 0.4 > delta
    mu[3] = logp.detach()[3] + 0.01  # close
    mu[0] = logp.detach()[0] + 0.5  # far, but positive: trains
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=D)[:, None].expand(4, 3).clone()
    return LossInput(
        logp=logp,
        behavior_logp=mu,
        advantages=adv,
        loss_mask=torch.ones(4, 3, dtype=D),
        versions=torch.full((4, 3), 6),
        current_version=8,
        token_denominator=12.0,
        seq_denominator=4.0,
        prox_logp=logp.detach() + 0.05,
    )


def test_seq_mask_drops_only_far_negative_answers_whole():
    inp = _sequences()
    out = LOSSES.resolve("seq_mask")(inp, AlgoConfig(loss="seq_mask", seq_mask_delta=0.1))
    (g,) = torch.autograd.grad(out.loss, inp.logp)
    inp2 = _sequences()
    ref = LOSSES.resolve("tis")(inp2, AlgoConfig(loss="tis"))
    (g_tis,) = torch.autograd.grad(ref.loss, inp2.logp)
    assert torch.all(g[1] == 0) and float(g_tis[1].abs().max()) > 0
    keep = [0, 2, 3]
    assert torch.allclose(g[keep], g_tis[keep], atol=1e-12)
    assert finalize_metrics(out.metrics)["seq_masked_frac"] == 0.25


# ------------------------------------------------------------------ vcpo


def test_vcpo_trains_tis_with_an_ess_scaled_step():
    from slime_async.algos import build_algorithm

    inp = _sequences()
    out = LOSSES.resolve("vcpo")(inp, AlgoConfig(loss="vcpo"))
    (g,) = torch.autograd.grad(out.loss, inp.logp)
    inp2 = _sequences()
    (g_tis,) = torch.autograd.grad(LOSSES.resolve("tis")(inp2, AlgoConfig()).loss, inp2.logp)
    assert torch.equal(g, g_tis)  # the objective is tis's: the step size is what differs
    assert build_algorithm(AlgoConfig(loss="vcpo")).ess_scaled_lr
    assert not build_algorithm(AlgoConfig(loss="tis")).ess_scaled_lr
    # the answers' weights W_i = prod_t pi_prox / mu and the scale sqrt(ESS) from the raw sums
    w = (inp.prox_logp - inp.behavior_logp).sum(-1).exp()
    ess = float(w.sum() ** 2 / (4 * (w**2).sum()))
    raw = out.metrics
    sums = [raw["seq_is_weight|sum"], raw["seq_is_weight|n"], raw["seq_is_weight|sq"]]
    assert lr_scale_from(sums) == pytest.approx(math.sqrt(ess)) and ess < 0.9
    assert lr_scale_from([0.0, 0.0, 0.0]) == 1.0


# ------------------------------------------------------------------ diagnostics, every loss


@pytest.mark.parametrize(
    "name",
    [
        "ppo_clip",
        "decoupled_ppo",
        "tis",
        "mis",
        "aipo",
        "gspo",
        "decoupled_gspo",
        "m2po",
        "dppo",
        "seq_mask",
        "cispo",
        "vcpo",
        "mu_band",
    ],
)
def test_every_loss_reports_the_whole_answer_diagnostics_by_lag(name):
    inp = _sequences()
    m = finalize_metrics(LOSSES.resolve(name)(inp, AlgoConfig(loss=name)).metrics)
    lr = inp.prox_logp - inp.behavior_logp  # [4, 3]
    w = lr.sum(-1).exp()
    assert m["log_ratio_m2"] == pytest.approx(float((lr**2).mean()))
    assert m["seq_is_weight_ess"] == pytest.approx(float(w.sum() ** 2 / (4 * (w**2).sum())))
    assert m["seq_max_log_ratio"] == pytest.approx(float(lr.abs().amax(-1).mean()))
    assert m["seq_max_log_ratio_max"] == pytest.approx(float(lr.abs().max()))
    assert m["seq_is_weight_ess/lag_2"] == m["seq_is_weight_ess"]  # every answer is 2 behind
