"""The learner's RL batch: log-probs at each trajectory's temperature, PPO mini-batches
against pi_prox from a forward pass at the start of the batch, AReaL's interpolated pi_prox, the
stale-token policy, and the KL reference that is always the initial model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.trainer import Learner, interpolated_prox_logp
from slime_async.config import AlgoConfig
from tests.support import learner_worker
from tests.support.learner_worker import SEQS, algo_cfg, learner_cfg, make_groups, make_sharp_model
from tests.support.learner_worker import learner_factory as learner_factory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


# ---------------------------------------------------------------- temperature per trajectory


def test_rows_at_different_temperatures_in_one_micro_batch_equal_the_per_row_reference(
    model_dir, learner_factory
):
    """fp32 on CPU: log_softmax(logits / T_i) over the full vocabulary, row by row (HF logits)."""
    from transformers import AutoModelForCausalLM

    temps = [0.7, 1.0, 1.3]
    learner = learner_factory(learner_cfg(str(model_dir), micro_batch_tokens=4096))
    together = learner.compute_logprobs(SEQS, temperatures=temps)  # one micro-batch
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq, t, (lp, _) in zip(SEQS, temps, together, strict=True):
        alone = learner.compute_logprobs([seq], temperatures=[t])[0][0]
        assert torch.allclose(lp, alone, atol=1e-6)
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, :-1].float()
        ref = torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        assert (lp - ref).abs().max().item() <= 1e-5, t
    # Different temperatures really give different values (the test can see a mix-up).
    other = learner.compute_logprobs(SEQS[:1], temperatures=[1.3])[0][0]
    assert (together[0][0] - other).abs().max() > 1e-2


def _on_policy_groups(learner, temps_by_traj):
    """make_groups whose behaviour log-probs are the learner's own at each trajectory's
    temperature (model tokens), with `Trajectory.temperature` set to it (None: the run's)."""
    groups = make_groups(3, 2)
    for t, temp in zip((t for g in groups for t in g), temps_by_traj, strict=True):
        seq = list(t.prompt_ids) + list(t.response_ids)
        at = 1.0 if temp is None else temp
        lp = learner.compute_logprobs([seq], temperatures=[at])[0][0].numpy()
        t.logprobs = np.where(t.loss_mask > 0, lp[len(t.prompt_ids) - 1 :], 0.0).astype(np.float32)
        t.temperature = temp
    return groups


def test_training_scores_each_trajectory_at_its_own_temperature(model_dir, learner_factory):
    """Behaviour log-probs taken at the trajectory's temperature give ratio 1 exactly at the
    same weights, though the run's temperature is another one."""
    learner = learner_factory(learner_cfg(str(model_dir)), algo_cfg(), temperature=1.0)
    groups = _on_policy_groups(learner, [0.7, None, 1.3, 0.5])
    m = learner.train_step(groups)
    assert m["ratio"] == pytest.approx(1.0, abs=1e-5)
    # The same log-probs with the temperature forgotten: the ratio is off.
    forgotten = _on_policy_groups(learner, [0.7, None, 1.3, 0.5])
    for t in (t for g in forgotten for t in g):
        t.temperature = None
    assert abs(learner.train_step(forgotten)["ratio"] - 1.0) > 1e-3


# ---------------------------------------------------------------- PPO mini-batches, pi_prox


def test_prox_is_the_policy_at_the_start_of_the_batch_across_mini_batches(
    model_dir, learner_factory
):
    """Fails if pi_prox were mu, or logp.detach(), or if the loop made one update only."""
    algo = algo_cfg(
        loss="tests.support.learner_worker:prox_probe_loss", mini_batches=2, ppo_epochs=2
    )
    learner = learner_factory(learner_cfg(str(model_dir), micro_batch_tokens=4096), algo)
    learner_worker.PROX_CALLS.clear()
    m = learner.train_step(make_groups(11, 3))
    calls = learner_worker.PROX_CALLS
    assert len(calls) == 4  # one micro-batch per mini-batch here: 2 epochs x 2 mini-batches
    assert m["learner/updates"] == 4 and learner.version == 1 and learner.step == 1

    def gap(a, b, c):
        return float(((a - b).abs() * c["mask"]).max())

    first = calls[0]
    assert gap(first["prox"], first["logp"], first) < 1e-5  # no update yet: pi_prox = pi_theta
    for c in calls:
        assert gap(c["prox"], c["mu"], c) > 0.1  # not mu
    for c in calls[1:]:
        assert gap(c["prox"], c["logp"], c) > 1e-4  # updates happened before this mini-batch
    # The second epoch sees the same pi_prox on the same rows, and a policy that moved on.
    for a, b in ((calls[0], calls[2]), (calls[1], calls[3])):
        assert torch.equal(a["prox"], b["prox"])
        assert gap(a["logp"], b["logp"], a) > 1e-4


def test_mini_batches_make_the_clip_active(model_dir, learner_factory):
    """decoupled_ppo at the shipped clip: with one update per batch the ratio pi/pi_prox is 1
    and nothing is clipped; with several, later mini-batches are clipped."""
    fracs = {}
    for n in (1, 4):
        algo = AlgoConfig(advantage="grpo", loss="decoupled_ppo", mini_batches=n)
        learner = learner_factory(learner_cfg(str(model_dir), lr=1e-2), algo)
        fracs[n] = [
            learner.train_step(make_groups(s, 4, group_size=4))["clip_frac"] for s in (1, 2)
        ]
        learner.close()
    assert fracs[1] == [0.0, 0.0]
    assert all(f > 0 for f in fracs[4]), fracs


def test_interpolated_prox_gives_mu_only_to_fresh_tokens():
    """The learner's version v is pi_prox (the weights that sampled version-v tokens); a token k
    versions old is k / (k + 1) of the way from mu to pi_theta (version v + 1)."""
    mu = torch.full((1, 5), -2.0)
    theta = torch.full((1, 5), -1.0)
    versions = torch.tensor([[10, 9, 8, 7, 11]])  # lags 0, 1, 2, 3 and one from a newer version
    got = interpolated_prox_logp(mu, theta, versions, current_version=10)
    alpha = torch.tensor([[0.0, 0.5, 2 / 3, 3 / 4, 0.0]])
    assert torch.allclose(got, mu + alpha * (theta - mu))


def test_interpolated_prox_of_lag_one_tokens_is_nearer_the_exact_prox_than_mu(
    model_dir, learner_factory
):
    """Tokens one version old: the interpolation must not fall back to mu (naive PPO)."""
    algo = AlgoConfig(
        advantage="grpo", loss="decoupled_ppo", prox_source="interpolate", mini_batches=2
    )
    learner = learner_factory(learner_cfg(str(model_dir), prox_compare_interval=1), algo)
    learner.version = 3
    groups = make_groups(5, 3, group_size=2)
    for g in groups:
        for t in g:
            t.versions = np.full(len(t.response_ids), 2, dtype=np.int32)  # 1 version old
    m = learner.train_step(groups)
    assert m["prox/interp_abs_err"] < 0.9 * m["prox/behavior_abs_err"], m


def test_interpolate_option_trains_and_reports_its_error_against_the_forward(
    model_dir, learner_factory
):
    algo = AlgoConfig(
        advantage="grpo", loss="decoupled_ppo", prox_source="interpolate", mini_batches=2
    )
    learner = learner_factory(learner_cfg(str(model_dir), prox_compare_interval=2), algo)
    learner.version = 3
    groups = make_groups(4, 3, group_size=2)
    for g in groups:
        for t in g:
            t.versions = np.full(len(t.response_ids), 1, dtype=np.int32)  # 2 versions old
    m1 = learner.train_step(groups)
    assert m1["prox/interp_abs_err"] > 0 and m1["prox/behavior_abs_err"] > 0
    # Half-way from mu to pi_theta: closer to the exact pi_prox than mu itself in update 1.
    assert m1["prox/interp_abs_err"] < m1["prox/behavior_abs_err"]
    m2 = learner.train_step(groups)  # batch 2: no exact forward (interval 2), no comparison
    assert "prox/interp_abs_err" not in m2
    assert learner.version == 5


# ---------------------------------------------------------------- stale tokens


def _stale_groups():
    """Two groups delivered at buffer version 5: one whose early tokens are version 1 (4 old),
    one all fresh (version 5)."""
    groups = make_groups(21, 2)
    old, fresh = groups
    for t in old:
        r = len(t.response_ids)
        t.versions = np.where(np.arange(r) < r // 2, 1, 5).astype(np.int32)
    for t in fresh:
        t.versions = np.full(len(t.response_ids), 5, dtype=np.int32)
    return [TrainGroup(old.trajectories, staleness=4), TrainGroup(fresh.trajectories, 0)]


@pytest.mark.parametrize("policy", ["mask", "keep"])
def test_stale_policy_masks_only_tokens_older_than_the_bound(model_dir, learner_factory, policy):
    groups = _stale_groups()
    want = sum(int(((t.versions == 1) & (t.loss_mask > 0)).sum()) for t in groups[0].trajectories)
    grads = []
    for garbage in (False, True):
        if garbage:  # what sits under a masked token must not matter
            for t in groups[0]:
                t.logprobs = np.where(t.versions == 1, -30.0, t.logprobs).astype(np.float32)
        learner = learner_factory(learner_cfg(str(model_dir)), max_staleness=2, stale_policy=policy)
        learner.version = 5
        grads.append(learner_worker.capture_grads(learner))
        m = learner.train_step(groups)
        learner.close()
        assert m["stale/over_bound_tokens"] == want > 0
    if policy == "mask":
        assert m["stale/masked_tokens"] == want and m["stale/masked_groups"] == 1
        old, fresh = groups[0].trajectories, groups[1].trajectories
        assert m["stale/masked_groups_reward"] == pytest.approx(np.mean([t.reward for t in old]))
        assert m["stale/kept_groups_reward"] == pytest.approx(np.mean([t.reward for t in fresh]))
        assert m["stale/masked_groups_response_len"] == pytest.approx(
            np.mean([t.loss_mask.sum() for t in old])
        )
        for name, g in grads[0].items():
            assert torch.equal(g, grads[1][name]), name
    else:
        assert "stale/masked_tokens" not in m
        assert any(not torch.equal(g, grads[1][n]) for n, g in grads[0].items())


def test_staleness_counts_updates_along_the_line_and_superseded_tokens_are_over(
    model_dir, learner_factory
):
    """After a restart that continued version 2's weights as 6, at version 8: a token of version
    2 is 2 updates old (within the bound, kept though 6 versions back), one of the dead learner's
    version 4 is superseded (beyond any bound: masked, and counted as such)."""
    from slime_async.queue.lineage import Line

    groups = make_groups(21, 2)
    mixed, fresh = groups
    for t in mixed:
        r = len(t.response_ids)
        t.versions = np.where(np.arange(r) < r // 2, 2, 4).astype(np.int32)
    for t in fresh:
        t.versions = np.full(len(t.response_ids), 7, dtype=np.int32)
    train = [TrainGroup(mixed.trajectories, staleness=2), TrainGroup(fresh.trajectories, 1)]
    gone = sum(int(((t.versions == 4) & (t.loss_mask > 0)).sum()) for t in mixed)
    learner = learner_factory(learner_cfg(str(model_dir)), max_staleness=2, stale_policy="mask")
    learner.line = Line(((2, 6),))
    learner.version = 8
    m = learner.train_step(train)
    learner.close()
    assert m["stale/superseded_tokens"] == m["stale/over_bound_tokens"] == gone > 0
    assert m["stale/masked_tokens"] == gone and m["stale/masked_groups"] == 1


# ---------------------------------------------------------------- KL reference


def test_resume_without_model_path_refuses_a_trained_checkpoint_as_kl_reference(
    model_dir, tmp_path, learner_factory
):
    algo = algo_cfg(kl_coef=0.1)
    first = learner_factory(learner_cfg(str(model_dir)), algo)
    first.save_checkpoint(tmp_path / "step0", extra={})
    first.train_step(make_groups(1, 2))
    first.save_checkpoint(tmp_path / "step1", extra={})
    first.close()
    # A step-0 checkpoint is the initial model: it may be the reference.
    ok = learner_factory(learner_cfg(None, load=str(tmp_path / "step0")), algo)
    assert ok.ref_model is not None
    ok.close()
    with pytest.raises(ValueError, match=r"learner\.model_path"):
        Learner(learner_cfg(None, load=str(tmp_path / "step1")), algo)
    # With model_path the reference is model_path's weights, whatever the checkpoint.
    resumed = learner_factory(
        learner_cfg(str(model_dir), load=str(tmp_path / "step1")),
        algo_cfg(loss="tests.support.learner_worker:ref_probe_loss", kl_coef=0.1),
    )
    assert resumed.train_step(make_groups(2, 2))["ref_gap_max"] > 0


def test_vcpo_scales_each_update_by_the_sqrt_of_its_answers_ess(model_dir, learner_factory):
    """Same batch, same start: vcpo's step is tis's with the learning rate times sqrt(ESS) of the
    answers' weights pi_prox / mu, which are far from 1 here (mu = the engine's log-probs of
    make_groups, unrelated to the model)."""
    moved = {}
    for loss in ("tis", "vcpo"):
        algo = AlgoConfig(advantage="grpo", loss=loss, mini_batches=1)
        learner = learner_factory(learner_cfg(str(model_dir), lr=1e-3), algo)
        before = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
        m = learner.train_step(make_groups(3, 3, group_size=2))
        after = dict(learner.model.named_parameters())
        moved[loss] = sum(float((after[k].detach() - before[k]).abs().sum()) for k in before)
        moved[loss + "_m"] = m
        learner.close()
    scale = moved["vcpo_m"]["lr_ess_scale"]
    assert 0 < scale < 0.9 and "lr_ess_scale" not in moved["tis_m"]
    assert scale == pytest.approx(moved["vcpo_m"]["seq_is_weight_ess"] ** 0.5, rel=1e-6)
    # AdamW's first step moves each weight by about lr: the scaled run moves by about scale x
    assert moved["vcpo"] == pytest.approx(scale * moved["tis"], rel=0.05)
