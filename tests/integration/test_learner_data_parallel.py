"""The learner at data parallel 2: two gloo ranks under torchrun (tests/support/learner_worker.py),
each on its own unequal share, against one process on the joined batch.

- The DP-reduced gradients and the step's metrics equal one process's.
- More PPO mini-batches than a rank has rows: every rank runs every update in step.
- megatron-core's DistributedDataParallel (all-reduce, and the DistributedOptimizer's
  reduce-scatter, with and without overlap) reduces the gradients MasterAdamW's path computes.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_async.actors.learner.trainer import Learner
from tests.support import learner_worker
from tests.support.learner_worker import algo_cfg, capture_grads, learner_cfg, make_groups
from tests.support.learner_worker import learner_factory as learner_factory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return learner_worker.make_sharp_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


def test_dp2_on_different_data_equals_one_process_on_the_joined_batch(
    model_dir, tmp_path, learner_factory
):
    learner_worker.run_two_ranks("dp2", tmp_path, [str(model_dir)], timeout=180)
    dp2 = torch.load(tmp_path / "dp2.pt")

    learner = learner_factory(learner_cfg(str(model_dir)))
    grads = capture_grads(learner)
    metrics = learner.train_step(make_groups(100, 4))
    assert set(grads) == set(dp2["grads"])
    for name, g in grads.items():
        assert torch.allclose(dp2["grads"][name], g, rtol=1e-4, atol=1e-6), name
    assert any(g.abs().max() > 1e-3 for g in grads.values())
    for key in ("loss", "tokens", "sequences", "ratio"):
        assert math.isclose(dp2["metrics"][key], metrics[key], rel_tol=1e-5), key


def test_data_parallel_mini_batches_run_in_step_with_empty_local_shares(model_dir, tmp_path):
    """Every rank runs every mini-batch update (collectives in step) even where its own share
    is empty; the loss is divided by the mini-batch's totals over both ranks."""
    learner_worker.run_two_ranks("dp2_mb", tmp_path, [str(model_dir)], timeout=240)
    got = torch.load(tmp_path / "dp2_mb.pt")
    assert got["version"] == 2
    for m in got["metrics"]:
        assert m["learner/updates"] == 4 and m["sequences"] == 8


def test_megatron_ddp_at_dp2_sums_the_gradients_of_one_process_on_the_joined_batch(
    model_dir, tmp_path
):
    """megatron-core's DDP (buckets of 5,000 parameters; all-reduce, and the DistributedOptimizer's
    reduce-scatter; with and without overlapping the last micro-batch's backward; the linear
    layers adding their weight gradients into DDP's buffers themselves) on gloo at DP 2, each
    rank on its own unequal share: the reduced gradients equal MasterAdamW's path in one process
    on the joined batch."""
    learner_worker.run_two_ranks("dp2_ddp", tmp_path, [str(model_dir)], timeout=240)
    learner = Learner(learner_cfg(str(model_dir)), algo_cfg())
    try:
        grads = learner_worker.capture_grads(learner)
        metrics = learner.train_step(make_groups(100, 4))
    finally:
        learner.close()
    for sharded, overlap, fusion in learner_worker.DDP_ROUNDS:
        got = torch.load(tmp_path / f"dp2_ddp_{sharded}_{overlap}_{fusion}.pt")
        assert set(got["grads"]) == set(grads)
        for name, g in grads.items():
            ok = torch.allclose(got["grads"][name], g, rtol=1e-4, atol=1e-6)
            assert ok, (sharded, overlap, fusion, name)
        assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
