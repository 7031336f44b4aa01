"""The learner's training step: stop-and-resume, SFT, the version counter, bad input.

DP equivalence (two torchrun ranks) is in tests/integration/test_learner_data_parallel.py."""

from __future__ import annotations

import math

import numpy as np
import psutil
import pytest
import torch

from slime_async.actors.learner.optim import lr_at
from slime_async.actors.learner.trainer import Learner
from slime_async.config import AlgoConfig
from slime_async.utils.plugins import PluginError
from tests.support.learner_worker import (
    algo_cfg,
    capture_grads,
    learner_cfg,
    make_groups,
    make_sharp_model,
)
from tests.support.learner_worker import learner_factory as learner_factory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: fp32 masters are saved too
def test_stop_and_resume_gives_the_uninterrupted_loss_sequence(
    model_dir, tmp_path, learner_factory, dtype
):
    cfg = learner_cfg(str(model_dir), lr_warmup_steps=2, lr_decay_steps=4, min_lr=1e-4, dtype=dtype)
    batches = [make_groups(seed, 3) for seed in range(4)]

    straight = learner_factory(cfg)
    want = [straight.train_step(b)["loss"] for b in batches]
    assert straight.version == straight.step == 4
    straight.close()

    first = learner_factory(cfg)
    got = [first.train_step(b)["loss"] for b in batches[:2]]
    before = set(psutil.Process().children(recursive=True))
    first.save_checkpoint(tmp_path / "ckpt", extra={"buffer_cursor": {"committed": 41}})
    first.close()
    # The save ran in this process and left no process behind (megatron's writer would start a
    # spawned multiprocessing Manager for its results: a fresh interpreter importing torch).
    started = set(psutil.Process().children(recursive=True)) - before
    assert not started, [" ".join(p.cmdline()) for p in started]

    resumed = learner_factory(cfg.model_copy(update={"load": str(tmp_path / "ckpt")}))
    assert resumed.loaded_extra == {"buffer_cursor": {"committed": 41}}
    assert (resumed.step, resumed.version) == (2, 2)
    got += [resumed.train_step(b)["loss"] for b in batches[2:]]
    assert got == want, (got, want)
    assert len(set(want)) == 4


def test_checkpoint_directory_is_never_overwritten(model_dir, tmp_path, learner_factory):
    learner = learner_factory(learner_cfg(str(model_dir)))
    learner.save_checkpoint(tmp_path / "ckpt", extra={})
    with pytest.raises(FileExistsError, match="exists already"):
        learner.save_checkpoint(tmp_path / "ckpt", extra={})
    assert not (tmp_path / "ckpt.partial").exists()


def test_sft_steps_lower_the_loss_and_count_versions(model_dir, learner_factory):
    learner = learner_factory(learner_cfg(str(model_dir), lr=3e-3, micro_batch_tokens=16))
    examples = [([2, 10 + i], [20 + i, 30 + i, 40 + i, 1]) for i in range(6)]
    losses = [learner.sft_step(examples)["loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert learner.version == 8
    # loss is the token mean of -log p over the targets.
    logps = learner.compute_logprobs([p + t for p, t in examples])
    nll = -torch.cat([lp[len(p) - 1 :] for (lp, _), (p, _) in zip(logps, examples, strict=True)])
    after = learner.sft_step(examples)
    assert math.isclose(after["loss"], nll.mean().item(), rel_tol=1e-4)
    assert after["nll"] == pytest.approx(after["loss"], rel=1e-6)


def test_lr_schedule_warms_up_then_decays():
    cfg = learner_cfg(None, lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=4)
    lrs = [lr_at(s, cfg) for s in range(8)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[4] == pytest.approx(0.55) and lrs[6] == lrs[7] == pytest.approx(0.1)


def test_env_tokens_get_no_gradient(model_dir, learner_factory):
    """Changing what sits under loss_mask == 0 (behaviour log-probs of env tokens) changes nothing."""
    grads = []
    for garbage in (False, True):
        groups = make_groups(5, 2)
        if garbage:
            for t in (t for g in groups for t in g):
                t.logprobs = np.where(t.loss_mask == 0, 50.0, t.logprobs).astype(np.float32)
        learner = learner_factory(learner_cfg(str(model_dir)))
        grads.append(capture_grads(learner))
        learner.train_step(groups)
        learner.close()
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_zero_gradient_batch_moves_nothing_and_keeps_the_version(model_dir, learner_factory):
    """Equal rewards give zero advantages: no Adam update (its momentum would still move the
    weights), no version bump, and the skip is counted with its reason."""
    learner = learner_factory(learner_cfg(str(model_dir)), algo_cfg(mini_batches=2))
    learner.train_step(make_groups(1, 2))  # a real step first: Adam has momentum now
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    groups = make_groups(5, 1, group_size=2)
    for t in groups[0]:
        t.reward = 0.5  # centred advantages are all 0
    metrics = learner.train_step(groups)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert metrics["tokens"] == sum(int(t.loss_mask.sum()) for t in groups[0])
    assert metrics["learner/skipped_updates/zero_gradient"] == 2
    assert metrics["learner/updates"] == 0 and metrics["learner/batch_skipped"] == 1
    assert (learner.step, learner.version) == (2, 1)
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_with_one_version_a_batch_a_zero_gradient_batch_still_makes_a_version(
    model_dir, learner_factory
):
    """buffer.fixed_lag trains the batch generated at v - k at version v: a batch that moved
    nothing must still make a version (same weights), or the batch of the next version, whose
    groups the buffer holds for a version that never comes, is never delivered (a run stopped
    so: lag 8, every reward 0)."""
    learner = learner_factory(
        learner_cfg(str(model_dir)), algo_cfg(mini_batches=2), version_per_batch=True
    )
    learner.train_step(make_groups(1, 2))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    groups = make_groups(5, 1, group_size=2)
    for t in groups[0]:
        t.reward = 0.5
    metrics = learner.train_step(groups)
    assert metrics["learner/updates"] == 0 and metrics["learner/batch_skipped"] == 1
    assert (learner.step, learner.version) == (2, 2)  # a version, with the same weights
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_non_finite_gradient_is_skipped_without_a_version(model_dir, learner_factory):
    learner = learner_factory(learner_cfg(str(model_dir)))
    groups = make_groups(6, 2)
    bad = groups[0].trajectories[0]
    bad.logprobs = np.where(bad.loss_mask > 0, -1e30, 0.0).astype(np.float32)  # ratio = inf
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    metrics = learner.train_step(groups)
    assert metrics["learner/skipped_updates/non_finite"] == 1
    assert metrics["learner/batch_skipped"] == 1
    assert (learner.step, learner.version) == (1, 0)
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", np.zeros(2, dtype=np.float32), "logprobs has 2 entries"),
        ("response_ids", np.array([], dtype=np.int32), "must be non-empty"),
        ("prompt_ids", np.array([5, 999], dtype=np.int32), "token id out of range"),
    ],
)
def test_bad_trajectories_are_named(model_dir, learner_factory, field, value, message):
    learner = learner_factory(learner_cfg(str(model_dir)))
    groups = make_groups(9, 2)
    bad = groups[1].trajectories[0]
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=message) as err:
        learner.train_step(groups)
    assert bad.id in str(err.value)
    assert learner.version == 0  # nothing was applied


def test_unknown_loss_fails_at_construction(model_dir):
    with pytest.raises(PluginError, match="no_such_loss"):
        Learner(learner_cfg(str(model_dir)), AlgoConfig(loss="no_such_loss"))


def test_kl_reference_is_the_frozen_starting_policy(model_dir, learner_factory):
    algo = algo_cfg(loss="tests.support.learner_worker:ref_probe_loss", kl_coef=0.1)
    learner = learner_factory(learner_cfg(str(model_dir)), algo)
    gaps = [learner.train_step(make_groups(seed, 2))["ref_gap_max"] for seed in range(3)]
    assert gaps[0] == 0.0  # step 1: the policy is still the reference
    assert 0 < gaps[1] < gaps[2]  # then it moves away while the reference stays put
