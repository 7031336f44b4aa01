"""Policy losses: hand-computed values, analytic gradients, on-policy limits, masking, metrics."""

import math

import pytest
import torch

from slime_async.algos import LOSSES, LossInput, finalize_metrics, reduce_metrics
from slime_async.algos.importance import importance_weights
from slime_async.algos.kl import kl_estimate
from slime_async.config import AlgoConfig

OFF_POLICY = ["decoupled_ppo", "tis", "mis"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def make_input(logp, behavior, adv, mask=None, versions=None, current=5, **extra):
    logp = torch.as_tensor(logp, dtype=torch.float64).clone().requires_grad_()
    behavior = torch.as_tensor(behavior, dtype=torch.float64)
    adv = torch.as_tensor(adv, dtype=torch.float64)
    mask = torch.ones_like(logp) if mask is None else torch.as_tensor(mask, dtype=torch.float64)
    if versions is None:
        versions = torch.full(logp.shape, current, dtype=torch.int32)
    return LossInput(
        logp=logp,
        behavior_logp=behavior,
        advantages=adv,
        loss_mask=mask,
        versions=torch.as_tensor(versions, dtype=torch.int32),
        current_version=current,
        token_denominator=float(mask.sum()),
        seq_denominator=float(logp.shape[0]),
        **extra,
    )


def run(name, inp, **cfg):
    out = LOSSES.resolve(name)(inp, AlgoConfig(**cfg))
    (grad,) = torch.autograd.grad(out.loss, inp.logp)
    return out.loss.item(), grad, finalize_metrics(out.metrics)


def log(*xs):
    return [math.log(x) for x in xs]


# ----------------------------------------------------------------------------- hand values


def test_ppo_clip_hand_values():
    # ratios 0.5, 1, 1.5 against mu; A = 1, -1, 1; eps 0.2.
    # l = max(-0.5, -0.8) = -0.5 ; max(1, 1) = 1 ; max(-1.5, -1.2) = -1.2 (clipped).
    inp = make_input([log(0.5, 1.0, 1.5)], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 1.0]])
    loss, grad, m = run("ppo_clip", inp)
    assert loss == pytest.approx((-0.5 + 1 - 1.2) / 3)
    # d l / d logp = -A r where not clipped, 0 where clipped.
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0, 0.0]], dtype=torch.float64) / 3)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.5)
    assert m["tokens"] == 3 and m["tokens/lag_0"] == 3


def test_ppo_dual_clip_bounds_negative_advantages():
    # r = 5, A = -1: max(5, 1.2) = 5, dual clip c = 3 caps it at 3 with zero gradient.
    inp = make_input([log(5.0, 0.5)], [[0.0, 0.0]], [[-1.0, -1.0]])
    loss, grad, m = run("ppo_clip", inp, dual_clip_c=3.0)
    # second token: r = 0.5, A = -1: max(0.5, 0.8) = 0.8 (clipped), under the dual bound.
    assert loss == pytest.approx((3.0 + 0.8) / 2)
    torch.testing.assert_close(grad, torch.zeros(1, 2, dtype=torch.float64))
    assert m["dual_clip_frac"] == pytest.approx(0.5) and m["clip_frac"] == pytest.approx(0.5)
    loss_plain, _, _ = run("ppo_clip", inp)
    assert loss_plain == pytest.approx((5.0 + 0.8) / 2)


def test_decoupled_ppo_hand_values_truncate_and_mask():
    # pi_theta = pi_prox (ratio 1); pi_prox / mu = 3 and 0.5; A = 1, 2; is_high 2.
    prox = torch.tensor([log(0.3, 0.2)], dtype=torch.float64)
    inp = make_input(prox, prox - torch.tensor([log(3.0, 0.5)]), [[1.0, 2.0]], prox_logp=prox)
    loss, grad, m = run("decoupled_ppo", inp, is_high=2.0)
    # w = min(3, 2) = 2, 0.5: l = 2 * -1 = -2, 0.5 * -2 = -1.
    assert loss == pytest.approx((-2 - 1) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -1.0]], dtype=torch.float64) / 2)
    assert m["is_weight"] == pytest.approx(1.25) and m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_weight_ess"] == pytest.approx(2.5**2 / (2 * (4 + 0.25)))
    assert run("tis", inp, is_high=2.0)[0] == pytest.approx(loss)
    # mis drops the token whose weight is above 2 instead of truncating it.
    loss_mis, _, m_mis = run("mis", inp, is_high=2.0)
    assert loss_mis == pytest.approx(-1 / 2) and m_mis["is_dropped_frac"] == pytest.approx(0.5)
    # no bound: the raw weight 3.
    assert run("decoupled_ppo", inp, is_mode="none")[0] == pytest.approx((-3 - 1) / 2)


def test_decoupled_ppo_clips_against_prox_not_mu():
    # pi_theta / pi_prox = 1.5 is clipped at 1.2 whatever mu; w = pi_prox / mu = 1.5.
    prox = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    inp = make_input(prox + math.log(1.5), prox - math.log(1.5), [[1.0]], prox_logp=prox)
    loss, grad, m = run("decoupled_ppo", inp)
    assert loss == pytest.approx(-1.5 * 1.2)
    assert grad.item() == 0.0 and m["clip_frac"] == 1.0
    assert m["behav_kl"] == pytest.approx(1.5 - 1 - math.log(1.5))


def test_importance_weight_levels_and_veto():
    lr = torch.tensor([log(2.0, 0.75, 1.0), log(1.0, 1e-5, 1.0)], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    kw = dict(mode="none", low=0.0, high=None, veto=None)
    tok = importance_weights(lr, mask, level="token", **kw).weight
    torch.testing.assert_close(tok[0], torch.tensor([2.0, 0.75, 0.0], dtype=torch.float64))
    seq = importance_weights(lr, mask, level="sequence", **kw).weight
    torch.testing.assert_close(seq[0], torch.tensor([1.5, 1.5, 0.0], dtype=torch.float64))
    geo = importance_weights(lr, mask, level="geometric", **kw).weight
    g = math.sqrt(1.5)
    torch.testing.assert_close(geo[0], torch.tensor([g, g, 0.0], dtype=torch.float64))
    # Sequence-level mask drops the whole sequence; truncation clamps every token to [0.8, 1.6].
    masked = importance_weights(
        lr, mask, level="sequence", mode="mask", low=0.8, high=1.6, veto=None
    )
    assert masked.weight[1].abs().sum() == 0 and masked.dropped[1].all()
    assert masked.weight[0, :2].tolist() == pytest.approx([1.5, 1.5])
    trunc = importance_weights(
        lr, mask, level="token", mode="truncate", low=0.8, high=1.6, veto=None
    )
    assert trunc.weight[0].tolist() == pytest.approx([1.6, 0.8, 0.0])
    # A token at 1e-5 < veto 1e-4 vetoes its sequence; the other sequence is untouched.
    veto = importance_weights(lr, mask, level="token", mode="none", low=0, high=None, veto=1e-4)
    assert veto.weight[1].abs().sum() == 0 and veto.dropped[1].all()
    torch.testing.assert_close(veto.weight[0], tok[0])


def test_aipo_hand_values():
    # pi_theta / mu = 2, rho = 1.5: l = -1.5 * A * log pi_theta; gradient -1.5 * A.
    inp = make_input([log(0.5, 0.5)], [log(0.25, 0.5)], [[1.0, -2.0]])
    loss, grad, m = run("aipo", inp, is_high=1.5)
    expect = (-1.5 * 1.0 * math.log(0.5) + -1.0 * -2.0 * math.log(0.5)) / 2
    assert loss == pytest.approx(expect)
    torch.testing.assert_close(grad, torch.tensor([[-1.5, 2.0]], dtype=torch.float64) / 2)
    assert m["is_weight_max"] == pytest.approx(1.5)


def test_gspo_hand_values():
    # Sequence 0: log ratios log 2, log 0.5 -> s = 1 (inside the clip); sequence 1: 0.1, 0.1 ->
    # s = e^0.1, clipped at 1 + 4e-4 with zero gradient. A = 1 everywhere, token mean over 4.
    mu = torch.tensor([log(0.2, 0.4), log(0.3, 0.3)], dtype=torch.float64)
    logp = mu + torch.tensor([log(2.0, 0.5), [0.1, 0.1]], dtype=torch.float64)
    inp = make_input(logp, mu, torch.ones(2, 2))
    loss, grad, m = run("gspo", inp)
    assert loss == pytest.approx((-1 - 1 - 1.0004 - 1.0004) / 4)
    torch.testing.assert_close(
        grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]], dtype=torch.float64)
    )
    assert m["clip_frac"] == pytest.approx(0.5)


def test_kl_estimators_and_penalty():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(0.25 / 0.5) = -log 2.
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    base = make_input([log(0.5)], [log(0.5)], [[1.0]])
    with_kl = make_input([log(0.5)], [log(0.5)], [[1.0]], ref_logp=ref.double().reshape(1, 1))
    loss0 = run("ppo_clip", base)[0]
    loss1, _, m = run("ppo_clip", with_kl, kl_coef=0.1, kl_estimator="k3")
    assert loss1 == pytest.approx(loss0 + 0.1 * (0.5 - 1 + math.log(2)))
    assert m["kl_ref_k1"] == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="ref_logp"):
        run("ppo_clip", base, kl_coef=0.1)


def test_entropy_bonus():
    ent = torch.tensor([[0.7, 0.3]], dtype=torch.float64, requires_grad=True)
    inp = make_input([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], entropy=ent)
    out = LOSSES.resolve("ppo_clip")(inp, AlgoConfig(entropy_coef=0.5))
    assert out.loss.item() == pytest.approx(-0.5 * 0.5)
    (g,) = torch.autograd.grad(out.loss, ent)
    torch.testing.assert_close(g, torch.full((1, 2), -0.25, dtype=torch.float64))


def test_aggregations_hand_values():
    # Two sequences of 1 and 3 tokens, per-token losses -A (ratio 1): -1 and -2, -2, -2.
    mask = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    inp = make_input(torch.zeros(2, 3), torch.zeros(2, 3), [[1.0, 0, 0], [2.0, 2, 2]], mask)
    assert run("ppo_clip", inp)[0] == pytest.approx(-7 / 4)
    assert run("ppo_clip", inp, aggregation="seq_mean_token_mean")[0] == pytest.approx(-3 / 2)
    loss = run("ppo_clip", inp, aggregation="seq_mean_token_sum_norm", aggregation_constant=10)[0]
    assert loss == pytest.approx(-7 / (2 * 10))


# ------------------------------------------------------------------- gradients and limits


def random_input(seed, b=4, t=6, max_lag=3, current=7, **extra):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    behavior = logp + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    versions = current - torch.randint(0, max_lag + 1, (b, t), generator=g)
    return make_input(logp, behavior, adv, mask, versions, current, **extra)


@pytest.mark.parametrize("dual", [None, 1.5])
def test_ppo_autograd_equals_analytic_gradient(dual):
    inp = random_input(0, b=6, t=8)
    _, grad, _ = run("ppo_clip", inp, eps_clip_low=0.1, eps_clip_high=0.3, dual_clip_c=dual)
    lp, mu, a, m = inp.logp.detach(), inp.behavior_logp, inp.advantages, inp.loss_mask
    r = torch.exp(lp - mu)
    # d/dlogp max(-A r, -A clip(r)) = -A r where the unclipped term is the max, else 0.
    active = ~((a > 0) & (r > 1.3)) & ~((a < 0) & (r < 0.9))
    if dual is not None:
        active &= ~((a < 0) & (-a * r > -a * dual))
    expect = torch.where(active, -a * r, torch.zeros_like(r)) * m / m.sum()
    assert active.any() and (~active & (m > 0)).any()  # both regimes are exercised
    if dual is not None:
        assert ((a < 0) & (r > dual) & (m > 0)).any()  # and the dual clip
    torch.testing.assert_close(grad, expect)


@pytest.mark.parametrize("name", [*OFF_POLICY, "aipo"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("prox_source", ["forward", "interpolate"])
def test_staleness_zero_equal_logps_reduce_to_on_policy(name, level, prox_source):
    # mu = pi_prox = pi_theta and every token fresh: each loss is the on-policy PPO objective.
    inp = random_input(1, max_lag=0)
    inp.behavior_logp = inp.logp.detach().clone()
    ref_loss, ref_grad, _ = run("ppo_clip", inp)
    loss, grad, m = run(name, inp, is_level=level, prox_source=prox_source, is_veto=1e-4)
    torch.testing.assert_close(grad, ref_grad)  # -A grad log pi / N for all of them
    if name != "aipo":  # aipo's value is -A log pi (same gradient, different constant)
        assert loss == pytest.approx(ref_loss)
    assert m["is_weight"] == pytest.approx(1.0) and m["is_dropped_frac"] == 0.0


@pytest.mark.parametrize("name", OFF_POLICY)
def test_fresh_data_with_moved_policy_is_ppo_against_mu(name):
    # Staleness 0, pi_prox = mu but pi_theta has moved: the decoupled losses are ppo_clip.
    inp = random_input(2, max_lag=0)
    inp.prox_logp = inp.behavior_logp.clone()
    expect = run("ppo_clip", inp)
    got = run(name, inp, is_mode="none", prox_source="forward")
    assert got[0] == pytest.approx(expect[0])
    torch.testing.assert_close(got[1], expect[1])
    # And the interpolated pi_prox of fresh tokens is mu itself.
    inp.prox_logp = None
    got = run(name, inp, is_mode="none", prox_source="interpolate")
    assert got[0] == pytest.approx(expect[0])


def test_gspo_on_policy_gradient_is_the_sequence_mean_policy_gradient():
    inp = random_input(3, max_lag=0)
    inp.behavior_logp = inp.logp.detach().clone()
    agg = "seq_mean_token_mean"
    torch.testing.assert_close(
        run("gspo", inp, aggregation=agg)[1], run("ppo_clip", inp, aggregation=agg)[1]
    )


def test_interpolated_prox_is_log_linear_in_versions():
    # lag 3: alpha = 3/4, log pi_prox = log mu + 3/4 (log pi_theta - log mu); w = pi_prox / mu.
    inp = make_input([[math.log(0.8)]], [[math.log(0.2)]], [[1.0]], versions=[[4]], current=7)
    _, _, m = run("decoupled_ppo", inp, prox_source="interpolate", is_mode="none")
    assert m["is_weight"] == pytest.approx(4.0**0.75)
    assert m["ratio"] == pytest.approx(4.0**0.25)  # pi_theta / pi_prox


# --------------------------------------------------------------- masking, splitting, metrics


@pytest.mark.parametrize("name", sorted(LOSSES.names()))
def test_padding_values_never_leak(name):
    clean = random_input(4, ref_logp=None)
    clean.ref_logp = clean.behavior_logp - 0.1
    dirty = random_input(4)
    dirty.ref_logp = clean.ref_logp.clone()
    pad = dirty.loss_mask == 0
    for field in ("behavior_logp", "ref_logp"):
        getattr(dirty, field)[pad] = -math.inf
    dirty.advantages[pad] = math.nan
    cfg = dict(kl_coef=0.1, is_level="sequence")
    a, b = run(name, clean, **cfg), run(name, dirty, **cfg)
    assert math.isfinite(b[0]) and torch.isfinite(b[1]).all()
    assert a[0] == pytest.approx(b[0])
    torch.testing.assert_close(a[1], b[1])


def split(inp, rows):
    return LossInput(
        logp=inp.logp[rows],
        behavior_logp=inp.behavior_logp[rows],
        advantages=inp.advantages[rows],
        loss_mask=inp.loss_mask[rows],
        versions=inp.versions[rows],
        current_version=inp.current_version,
        token_denominator=inp.token_denominator,
        seq_denominator=inp.seq_denominator,
        ref_logp=None if inp.ref_logp is None else inp.ref_logp[rows],
    )


@pytest.mark.parametrize("name", sorted(LOSSES.names()))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_sum_to_the_full_batch(name, aggregation):
    full = random_input(5, b=5)
    full.ref_logp = full.behavior_logp - 0.2
    cfg = AlgoConfig(aggregation=aggregation, kl_coef=0.05, dual_clip_c=2.0)
    fn = LOSSES.resolve(name)
    whole = fn(full, cfg)
    (g_whole,) = torch.autograd.grad(whole.loss, full.logp)
    parts = [fn(split(full, rows), cfg) for rows in (slice(0, 2), slice(2, 5))]
    (g_parts,) = torch.autograd.grad(sum(p.loss for p in parts), full.logp)
    assert sum(p.loss.item() for p in parts) == pytest.approx(whole.loss.item())
    torch.testing.assert_close(g_parts, g_whole)
    merged = reduce_metrics([p.metrics for p in parts])
    expect = finalize_metrics(whole.metrics)
    assert merged.keys() == expect.keys()
    for key, value in expect.items():
        assert merged[key] == pytest.approx(value), key


def test_metrics_break_down_by_version_lag():
    # Lags 0, 0, 2 with behaviour weights 1, 2, 4 (truncation off).
    prox = torch.tensor([[math.log(0.5)] * 3], dtype=torch.float64)
    mu = prox - torch.tensor([log(1.0, 2.0, 4.0)], dtype=torch.float64)
    inp = make_input(prox, mu, [[1.0, 1.0, 1.0]], versions=[[9, 9, 7]], current=9, prox_logp=prox)
    _, _, m = run("decoupled_ppo", inp, is_mode="none")
    assert m["tokens/lag_0"] == 2 and m["tokens/lag_2"] == 1 and "tokens/lag_1" not in m
    assert m["is_weight/lag_0"] == pytest.approx(1.5) and m["is_weight_max/lag_0"] == pytest.approx(
        2.0
    )
    assert m["is_weight_ess/lag_0"] == pytest.approx(9 / (2 * 5))
    assert m["is_weight/lag_2"] == pytest.approx(4.0) and m["is_weight_ess/lag_2"] == pytest.approx(
        1.0
    )
    assert m["is_weight"] == pytest.approx(7 / 3) and m["is_weight_max"] == pytest.approx(4.0)
    assert m["behav_kl/lag_0"] == pytest.approx((0 + (2 - 1 - math.log(2))) / 2)


def test_token_version_ahead_of_learner_is_an_error():
    inp = make_input([[0.0]], [[0.0]], [[1.0]], versions=[[6]], current=5)
    with pytest.raises(ValueError, match="ahead of the learner"):
        run("ppo_clip", inp)


@pytest.mark.parametrize("name", sorted(LOSSES.names()))
def test_micro_batch_without_trained_tokens(name):
    # A micro-batch of env tokens only: zero loss and gradient, metrics that merge cleanly.
    inp = make_input(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3))
    inp.token_denominator = 4.0
    loss, grad, m = run(name, inp)
    assert loss == 0.0 and grad.abs().sum() == 0
    assert m == {"tokens": 0.0}


# ------------------------------------------------------------------------ KL gradients

K = 5
_g = torch.Generator().manual_seed(11)
THETA_KL = torch.randn(K, generator=_g, dtype=torch.float64)
REF_KL = THETA_KL + 0.8 * torch.randn(K, generator=_g, dtype=torch.float64)
# pi_prox and mu near pi_theta: every weight pi_prox / mu and pi_theta / mu is inside (0.5, 2),
# so the default truncation at 2 does not bind and the weighted estimate is exact.
PROX_KL = THETA_KL + 0.25 * torch.randn(K, generator=_g, dtype=torch.float64)
MU_KL = PROX_KL + 0.25 * torch.randn(K, generator=_g, dtype=torch.float64)
KL_LOSSES = ["decoupled_ppo", "tis", "mis", "decoupled_gspo", "aipo"]


def expected_kl_gradient(name, theta, mu_logits, prox_logits, kind, **cfg):
    """sum_a mu(a) grad_theta l(a): the exact expectation over the sampler of the loss's
    gradient with advantage 0 (so only the KL term), kl_coef = 1; no Monte Carlo."""
    theta = theta.clone().requires_grad_()
    logp = theta.log_softmax(0)
    mu = mu_logits.log_softmax(0)
    prox = prox_logits.log_softmax(0)
    ref = REF_KL.log_softmax(0)
    total = 0.0
    for a in range(K):
        inp = LossInput(
            logp=logp[a].reshape(1, 1),
            behavior_logp=mu[a].reshape(1, 1),
            advantages=torch.zeros(1, 1, dtype=torch.float64),
            loss_mask=torch.ones(1, 1, dtype=torch.float64),
            versions=torch.full((1, 1), 3),
            current_version=5,
            token_denominator=1.0,
            seq_denominator=1.0,
            prox_logp=prox[a].reshape(1, 1).detach(),
            ref_logp=ref[a].reshape(1, 1),
        )
        out = LOSSES.resolve(name)(inp, AlgoConfig(kl_coef=1.0, kl_estimator=kind, **cfg))
        total = total + mu[a].exp().detach() * out.loss
    (g,) = torch.autograd.grad(total, theta)
    return g, float(total.detach())


def kl_gradient(theta, p_first=True):
    """grad_theta KL(pi || ref) (p_first) or KL(ref || pi), by autograd of the exact sum."""
    theta = theta.clone().requires_grad_()
    lp, ref = theta.log_softmax(0), REF_KL.log_softmax(0)
    kl = (lp.exp() * (lp - ref)).sum() if p_first else (ref.exp() * (ref - lp)).sum()
    (g,) = torch.autograd.grad(kl, theta)
    return g, kl.item()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", *KL_LOSSES])
def test_kl_penalty_has_the_gradient_of_kl_pi_ref_on_policy(name, kind):
    # Sampled from pi_theta = pi_prox = mu: E[grad] = grad KL(pi || ref) exactly, every kind.
    # (Old code: k1's expected gradient was 0, k3's that of KL(ref || pi).)
    target, kl = kl_gradient(THETA_KL)
    got, value = expected_kl_gradient(name, THETA_KL, THETA_KL, THETA_KL, kind)
    torch.testing.assert_close(got, target, rtol=1e-10, atol=1e-12)
    if kind != "k2":  # k1 and k3 are unbiased estimates of the value too
        assert value == pytest.approx(kl, rel=1e-10)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", KL_LOSSES)
def test_kl_penalty_is_importance_weighted_on_stale_tokens(name, kind):
    # Sampled from mu != pi_prox != pi_theta, at the shipped bounds (truncation at 2, inactive
    # here): sum_a mu(a) grad l(a) = grad KL(pi_theta || ref) for every weighted loss.
    target, kl = kl_gradient(THETA_KL)
    got, value = expected_kl_gradient(name, THETA_KL, MU_KL, PROX_KL, kind)
    torch.testing.assert_close(got, target, rtol=1e-10, atol=1e-12)
    if kind != "k2":
        assert value == pytest.approx(kl, rel=1e-10)
    # Without the weight (w = rho = 1, as ppo_clip does) the same samples are biased.
    unweighted, _ = expected_kl_gradient("ppo_clip", THETA_KL, MU_KL, PROX_KL, kind)
    assert (unweighted - target).abs().max() > 1e-3


def test_raw_k1_and_k3_losses_had_the_wrong_gradient():
    # The yardstick of the two tests above: autograd of the bare estimators, on-policy.
    def bare(kind):
        theta = THETA_KL.clone().requires_grad_()
        lp, ref = theta.log_softmax(0), REF_KL.log_softmax(0)
        (g,) = torch.autograd.grad((lp.exp().detach() * kl_estimate(lp, ref, kind)).sum(), theta)
        return g

    g1, g3 = bare("k1"), bare("k3")
    torch.testing.assert_close(g1, torch.zeros(K, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(g3, kl_gradient(THETA_KL, p_first=False)[0])
    assert (g3 - kl_gradient(THETA_KL)[0]).abs().max() > 1e-2


def test_kl_penalty_value_gradient_and_metric_by_hand():
    # One token: log pi = log 0.5, log ref = log 0.25, pi_prox / mu = 1.5, pi_theta / pi_prox = 1.
    lp, ref = math.log(0.5), math.log(0.25)
    inp = make_input(
        [[lp]], [[lp - math.log(1.5)]], [[0.0]], prox_logp=torch.tensor([[lp]], dtype=torch.float64)
    )
    inp.ref_logp = torch.tensor([[ref]], dtype=torch.float64)
    loss, grad, m = run("decoupled_ppo", inp, kl_coef=0.1, kl_estimator="k3")
    k3 = 0.5 - 1 + math.log(2)
    assert loss == pytest.approx(0.1 * 1.5 * k3)
    assert grad.item() == pytest.approx(0.1 * 1.5 * math.log(2))  # w (log pi - log ref)
    assert m["kl_ref_loss"] == pytest.approx(1.5 * k3) and m["kl_ref_k3"] == pytest.approx(k3)


# ------------------------------------------------------------------------ GSPO


def gspo_case(seed=14):
    """Three sequences of 2, 3 and 5 tokens; log-ratios around 1e-3 so the 3e-4/4e-4 clip binds
    on some sequences and not on others."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 5
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate((2, 3, 5)):
        mask[i, :n] = 1
    prox = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    logp = prox + 1e-3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mu = prox - 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [0.5]], dtype=torch.float64).expand(b, t).clone()
    return make_input(logp, mu, adv, mask, prox_logp=prox)


def gspo_exact_loss(logp, old, w, adv, mask, eps_low=3e-4, eps_high=4e-4, normalise=True):
    """GSPO written out at sequence level, for autograd: (1/N_seq) sum_i mean_t of
    w_it * max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t log(pi_theta / pi_old))."""
    m = mask > 0
    n = m.sum(-1)
    log_s = torch.where(m, logp - old, 0.0).sum(-1) / (n if normalise else 1)  # [B]
    s = log_s.exp()
    a = adv[:, 0]
    seq = torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high))  # [B]
    per_token = torch.where(m, w * seq[:, None], 0.0)
    return (per_token.sum(-1) / n).sum() / logp.shape[0], s


@pytest.mark.parametrize("name", ["gspo", "decoupled_gspo"])
def test_gspo_gradient_is_the_length_normalised_sequence_objective(name):
    # aggregation seq_mean_token_mean is GSPO's own; with a sequence-level behaviour weight
    # (constant per sequence) the loss's gradient is autograd of the exact sequence objective.
    # Drop the 1/|y_i| in s_i and both the value and the gradient change.
    inp = gspo_case()
    old = inp.prox_logp if name == "decoupled_gspo" else inp.behavior_logp
    cfg = dict(aggregation="seq_mean_token_mean", ppo_old_policy="prox", is_level="sequence")
    cfg["is_mode"] = "none"
    loss, grad, m = run(name, inp, **cfg)
    logp = inp.logp.detach().clone().requires_grad_()
    if name == "decoupled_gspo":
        w = torch.where(inp.loss_mask > 0, inp.prox_logp - inp.behavior_logp, 0.0).sum(-1).exp()
        w = w[:, None].expand_as(logp)
    else:
        old = inp.prox_logp  # ppo_old_policy = prox
        w = torch.ones_like(logp)
    exact, s = gspo_exact_loss(logp, old, w, inp.advantages, inp.loss_mask)
    (g_exact,) = torch.autograd.grad(exact, logp)
    assert loss == pytest.approx(exact.item(), rel=1e-12)
    torch.testing.assert_close(grad, g_exact, rtol=1e-10, atol=1e-14)
    # Both regimes are exercised: the clip cuts the gradient of two sequences, not the third.
    a = inp.advantages[:, 0]
    cut = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    assert cut.tolist() == [True, True, False], s
    assert m["clip_frac"] == pytest.approx(5 / 10)  # the tokens of the 2- and 3-token ones
    # The test sees the normalisation: without it the value and the gradient differ.
    unnormalised, _ = gspo_exact_loss(logp, old, w, inp.advantages, inp.loss_mask, normalise=False)
    (g_unnormalised,) = torch.autograd.grad(unnormalised, logp)
    assert abs(unnormalised.item() - loss) > 1e-6
    assert (g_unnormalised - grad).abs().max() > 1e-6


def test_decoupled_gspo_token_weights_by_hand():
    # Sequence of 2 tokens, log-ratio to pi_prox 1e-4 and 3e-4 (s = e^2e-4, inside the clip);
    # pi_prox / mu = 3 and 0.5, truncated at 2: w = 2, 0.5. A = 1, token mean over 2 tokens.
    prox = torch.tensor([log(0.3, 0.2)], dtype=torch.float64)
    logp = prox + torch.tensor([[1e-4, 3e-4]], dtype=torch.float64)
    mu = prox - torch.tensor([log(3.0, 0.5)], dtype=torch.float64)
    inp = make_input(logp, mu, [[1.0, 1.0]], prox_logp=prox)
    loss, grad, m = run("decoupled_gspo", inp)
    s = math.exp(2e-4)
    assert loss == pytest.approx(-(2 + 0.5) * s / 2)
    torch.testing.assert_close(grad, torch.tensor([[-2 * s, -0.5 * s]], dtype=torch.float64) / 2)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["clip_frac"] == 0.0
    assert m["ratio"] == pytest.approx(s)
    # Against mu instead (gspo's default) the same tokens are far outside the tiny clip.
    _, _, m_mu = run("gspo", inp)
    assert m_mu["clip_frac"] == 1.0


def test_decoupled_gspo_with_fresh_samples_is_gspo_against_prox():
    inp = gspo_case(8)
    inp.behavior_logp = inp.prox_logp.clone()  # mu = pi_prox: weights 1
    a = run("decoupled_gspo", inp)
    b = run("gspo", inp, ppo_old_policy="prox")
    assert a[0] == pytest.approx(b[0])
    torch.testing.assert_close(a[1], b[1])


def test_ratio_outside_counts_both_sides_of_the_trust_region():
    """ratio_outside (the metric of naive PPO's failure against a far-away mu): the share
    of tokens whose ratio left [1 - eps, 1 + eps], whichever the advantage's sign, by lag."""
    # ratios 0.5, 1, 1.5 against mu; A = 1, -1, 1: the clip cuts only the third token's gradient
    inp = make_input([log(0.5, 1.0, 1.5)], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 1.0]])
    _, _, m = run("ppo_clip", inp)
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["ratio_outside"] == pytest.approx(2 / 3)
    assert m["ratio_outside/lag_0"] == pytest.approx(2 / 3)
