"""The learner's per-token record of a step: what `slime-async inspect` shows per token.

Checked against the test loss's own gradient: d loss / d logp = -ratio * advantage * mask / N.
"""

from __future__ import annotations

import numpy as np
import pytest

from slime_async.actors.learner import token_record
from slime_async.actors.learner.trainer import Learner
from tests.support.learner_worker import algo_cfg, learner_cfg, make_groups, make_sharp_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("m") / "model", "qwen3")


def test_record_holds_each_tokens_logprobs_advantage_and_loss_gradient(model, tmp_path):
    learner = Learner(learner_cfg(str(model), token_record_interval=2), algo_cfg(), 1.0)
    try:
        groups = make_groups(3, 3)
        learner.train_step(make_groups(1, 3))
        assert learner.take_token_record() is None  # step 1: not a recorded step
        before = {
            t.id: lp
            for t, (lp, _) in zip(
                [t for g in groups for t in g],
                learner.compute_logprobs(
                    [list(t.prompt_ids) + list(t.response_ids) for g in groups for t in g]
                ),
                strict=True,
            )
        }
        metrics = learner.train_step(groups)
        rec = learner.take_token_record()
        assert learner.take_token_record() is None  # handed over once
    finally:
        learner.close()
    trajs = {t.id: t for g in groups for t in g}
    assert sorted(map(str, rec["ids"])) == sorted(trajs)
    assert rec["grad_norms"].tolist() == pytest.approx([metrics["grad_norm"]], rel=1e-5)
    n_tokens = sum(int(t.loss_mask.sum()) for t in trajs.values())
    for tid, v in token_record.per_trajectory(rec).items():
        t = trajs[tid]
        p = len(t.prompt_ids)
        np.testing.assert_array_equal(v["behavior_logp"], t.logprobs)
        np.testing.assert_array_equal(v["loss_mask"], t.loss_mask)
        # One update: the loss saw the weights of the batch's start (pi_prox = pi_theta).
        np.testing.assert_allclose(v["logp"], before[tid][p - 1 :], atol=1e-5)
        np.testing.assert_allclose(v["prox_logp"], v["logp"], atol=1e-6)
        adv = float(t.reward) - np.mean(
            [float(u.reward) for u in trajs.values() if u.group_id == t.group_id]
        )
        np.testing.assert_allclose(v["advantage"], adv, atol=1e-6)
        want = -np.exp(v["logp"] - t.logprobs) * adv * t.loss_mask / n_tokens
        np.testing.assert_allclose(v["grad"], want, rtol=1e-4, atol=1e-9)
        assert (v["grad"][t.loss_mask == 0] == 0).all()

    path = token_record.write(tmp_path, 2, 2, rec, keep=0)
    token_record.write(tmp_path, 4, 4, rec, keep=0)
    token_record.write(tmp_path, 6, 6, rec, keep=2)  # keeps the newest two
    assert token_record.recorded_steps(tmp_path) == [4, 6] and not path.exists()
    back = token_record.read(tmp_path, 6)
    assert int(back["step"]) == 6 and back["ids"].tolist() == rec["ids"].tolist()
    np.testing.assert_array_equal(back["grad"], rec["grad"])
    assert token_record.read(tmp_path, 5) is None


def test_record_over_two_updates_of_several_micro_batches_keeps_each_updates_values(model):
    """Two passes over the batch (`ppo_epochs` 2), each in several micro-batches (24 tokens): the
    record holds the first update's log-probs as pi_prox, the second's as logp, and the sum of
    both updates' loss gradients; one gradient norm per update."""
    learner = Learner(learner_cfg(str(model), token_record_interval=1), algo_cfg(ppo_epochs=2))
    try:
        groups = make_groups(5, 3)
        trajs = {t.id: t for g in groups for t in g}
        seqs = [list(t.prompt_ids) + list(t.response_ids) for t in trajs.values()]
        before = dict(zip(trajs, (lp for lp, _ in learner.compute_logprobs(seqs)), strict=True))
        metrics = learner.train_step(groups)
        rec = learner.take_token_record()
    finally:
        learner.close()
    assert metrics["learner/updates"] == 2 and len(rec["grad_norms"]) == 2
    n_tokens = sum(int(t.loss_mask.sum()) for t in trajs.values())
    moved = 0.0
    for tid, v in token_record.per_trajectory(rec).items():
        t = trajs[tid]
        first = before[tid][len(t.prompt_ids) - 1 :].numpy()
        np.testing.assert_allclose(v["prox_logp"], first, atol=1e-5)
        moved = max(moved, float(np.abs(v["logp"] - first).max()))
        adv = float(v["advantage"][0])
        want = sum(
            -np.exp(lp - t.logprobs) * adv * t.loss_mask / n_tokens for lp in (first, v["logp"])
        )
        np.testing.assert_allclose(v["grad"], want, rtol=1e-4, atol=1e-8)
    assert moved > 1e-4  # the second update saw other weights than the first
