"""Unbiasedness on toy bandits with a known behaviour policy mu != pi.

Actions are sampled from mu; each loss's autograd gradient is a Monte-Carlo estimate of -grad J
under pi. The importance-corrected losses must match the exact on-policy gradient within 4
standard errors (computed from the per-sample gradient terms); the uncorrected one must miss it
by more than 10. Fixed seeds: the outcome is deterministic.
"""

import pytest
import torch

from slime_async.algos import LOSSES, LossInput
from slime_async.config import AlgoConfig

N = 20_000
REWARD = torch.tensor([1.0, 0.0, 0.6, 0.2], dtype=torch.float64)
THETA = torch.tensor([0.5, -0.3, 0.2, 0.0], dtype=torch.float64)  # pi = softmax(THETA)
THETA_MU = torch.tensor([-0.5, 0.8, 0.2, -0.4], dtype=torch.float64)  # the sampler
BASELINE = 0.4  # a constant baseline keeps every estimator unbiased

UNBOUNDED = dict(is_mode="none", is_high=None)
CORRECTED = {
    "decoupled_ppo": dict(UNBOUNDED),
    "tis": dict(is_high=None),
    "mis": dict(is_high=None),
    "aipo": dict(UNBOUNDED),
    # pi_theta / mu itself is the IS weight once the clip can never bind.
    "ppo_clip": dict(eps_clip_low=1.0, eps_clip_high=1e9),
    "gspo": dict(gspo_eps_clip_low=1.0, gspo_eps_clip_high=1e9),
}


def estimate(name, theta, logp_of, actions, adv, **cfg):
    """The loss's gradient w.r.t. the logits: an estimate of -grad J (sum over sequences / N)."""
    theta = theta.clone().requires_grad_()
    logp, behavior = logp_of(theta, actions)  # [N, T] each
    inp = LossInput(
        logp=logp,
        behavior_logp=behavior,
        advantages=adv.reshape(-1, 1).expand_as(logp),
        loss_mask=torch.ones_like(logp),
        versions=torch.full(logp.shape, 3),
        current_version=4,
        token_denominator=float(logp.numel()),
        seq_denominator=float(logp.shape[0]),
    )
    # sum over tokens / N: the per-sequence policy gradient averaged over sequences.
    settings = dict(aggregation="seq_mean_token_sum_norm", aggregation_constant=1.0)
    out = LOSSES.resolve(name)(inp, AlgoConfig(**settings, **cfg))
    (g,) = torch.autograd.grad(out.loss, theta)
    return -g


def z_scores(est, exact, per_sample):
    """|est - exact| in standard errors, per component (flattened)."""
    se = per_sample.std(0) / per_sample.shape[0] ** 0.5
    return ((est - exact).reshape(-1).abs() / se).reshape(-1)


def one_step():
    pi, mu = THETA.softmax(0), THETA_MU.softmax(0)
    g = torch.Generator().manual_seed(0)
    actions = torch.multinomial(mu, N, replacement=True, generator=g)  # [N]
    adv = REWARD[actions] - BASELINE
    exact = (pi * REWARD)[:, None].mul(torch.eye(4, dtype=torch.float64) - pi).sum(0)

    def logp_of(theta, a):
        return theta.log_softmax(0)[a][:, None], mu.log()[a][:, None]

    score = torch.eye(4, dtype=torch.float64)[actions] - pi  # grad log pi(a) per sample
    weight = (pi / mu)[actions]
    return actions, adv, exact, logp_of, score, weight


@pytest.mark.parametrize("name", sorted(CORRECTED))
def test_importance_corrected_gradient_is_unbiased(name):
    actions, adv, exact, logp_of, score, weight = one_step()
    est = estimate(name, THETA, logp_of, actions, adv, **CORRECTED[name])
    z = z_scores(est, exact, (weight * adv)[:, None] * score)
    assert z.max() < 4, (name, est, exact, z)


def test_uncorrected_gradient_is_biased():
    actions, adv, exact, logp_of, score, _ = one_step()
    # ratio against pi_prox = pi_theta: the plain policy gradient on mu's samples.
    est = estimate("ppo_clip", THETA, logp_of, actions, adv, ppo_old_policy="prox")
    z = z_scores(est, exact, adv[:, None] * score)
    assert z.max() > 10, (est, exact, z)
    # Sanity of the yardstick: that estimate does match E_mu[A grad log pi].
    mu = THETA_MU.softmax(0)
    pi = THETA.softmax(0)
    biased = (mu * (REWARD - BASELINE))[:, None].mul(torch.eye(4, dtype=torch.float64) - pi).sum(0)
    assert z_scores(est, biased, adv[:, None] * score).max() < 4


def test_sequence_level_weight_is_unbiased_for_a_sequence_reward():
    # Two tokens, each from its own 3-way softmax; reward 1 when both tokens agree.
    theta = torch.tensor([[1.0, 0.2, -0.5], [0.8, 0.0, -0.3]], dtype=torch.float64)
    theta_mu = torch.tensor([[-0.5, 0.1, 0.6], [-0.4, 0.2, 0.7]], dtype=torch.float64)
    pi, mu = theta.softmax(-1), theta_mu.softmax(-1)  # [2, 3]
    reward = torch.eye(3, dtype=torch.float64)  # [a1, a2]
    g = torch.Generator().manual_seed(1)
    actions = torch.stack([torch.multinomial(mu[t], N, True, generator=g) for t in (0, 1)], 1)
    adv = reward[actions[:, 0], actions[:, 1]] - 0.3
    joint = pi[0][:, None] * pi[1][None, :]  # [3, 3]
    eye = torch.eye(3, dtype=torch.float64)
    exact = torch.stack(
        [
            ((joint * reward).sum(1)[:, None] * (eye - pi[0])).sum(0),
            ((joint * reward).sum(0)[:, None] * (eye - pi[1])).sum(0),
        ]
    )

    def logp_of(th, a):
        lp = th.log_softmax(-1)
        return (
            torch.stack([lp[0][a[:, 0]], lp[1][a[:, 1]]], 1),
            torch.stack([mu[0].log()[a[:, 0]], mu[1].log()[a[:, 1]]], 1),
        )

    score = torch.cat([eye[actions[:, 0]] - pi[0], eye[actions[:, 1]] - pi[1]], 1)  # [N, 6]
    ratio = torch.stack([(pi[t] / mu[t])[actions[:, t]] for t in (0, 1)], 1)  # [N, 2]
    seq_w = ratio.prod(1)
    est = estimate("decoupled_ppo", theta, logp_of, actions, adv, is_level="sequence", **UNBOUNDED)
    assert z_scores(est, exact, (seq_w * adv)[:, None] * score).max() < 4
    # Per-token weights correct each token's own sampler but not the other token's: biased.
    est_tok = estimate("decoupled_ppo", theta, logp_of, actions, adv, is_level="token", **UNBOUNDED)
    tok_terms = torch.cat(
        [(ratio[:, t] * adv)[:, None] * score[:, 3 * t : 3 * t + 3] for t in (0, 1)], 1
    )
    assert z_scores(est_tok, exact, tok_terms).max() > 10
