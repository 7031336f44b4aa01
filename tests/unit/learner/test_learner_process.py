"""The learner process's pieces that need no model: checkpoint discovery and batch metrics."""

import time

import numpy as np

from slime_async.actors.learner.process import batch_metrics, latest_checkpoint, train_groups
from slime_async.queue.client import Batch
from slime_async.testing.trajectories import synthetic_group


def _ckpt(path):
    path.mkdir(parents=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # no common.pt: 0.19
    return path


def test_latest_complete_checkpoint_wins_and_partial_ones_are_ignored(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    _ckpt(tmp_path / "step_3")
    _ckpt(tmp_path / "step_12")
    (tmp_path / "step_15.partial").mkdir()  # a save interrupted mid-way
    (tmp_path / "step_20").mkdir()  # not a checkpoint (no metadata)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_12"
    assert latest_checkpoint(tmp_path / "step_3") == tmp_path / "step_3"  # given directly


def test_batch_metrics_counts_accuracy_lengths_and_staleness():
    groups = [synthetic_group("a", 2, response_len=8), synthetic_group("b", 2, response_len=8)]
    m = batch_metrics(train_groups(Batch(batch_id=1, groups=groups, staleness=[0, 2])))
    # synthetic rewards alternate 0, 1 and name a "correct" part
    assert m["reward"] == 0.5 and m["accuracy"] == 0.5
    assert m["trajectories"] == 4
    mask_len = int(groups[0][0].loss_mask.sum())
    assert m["response_len/mean"] == mask_len
    assert m["staleness/mean"] == 1.0 and m["staleness/max"] == 2
    assert m["staleness/hist"] == {"values": [0, 2], "counts": [2, 2]}
    assert np.isfinite(m["response_len/max"])


def test_an_engine_back_while_the_learner_waits_gets_the_weights_at_once(monkeypatch):
    """An engine restarted while the buffer is empty: the generator leaves it out until it serves
    the learner's version, so the learner must push to it while waiting for data (found as a run
    that stopped on the simulated Ray cluster: the push came only after a step that never came)."""
    from slime_async.actors.learner import process

    batch = Batch(batch_id=1, groups=[synthetic_group("a", 2)], staleness=[0])
    polls = iter([None, None, batch])
    wants = iter([False, True, False])  # the engine is back during the second wait
    pushes = []

    class Pusher:
        def resync_needed(self):
            return next(wants)

    class Rank0:
        pusher = Pusher()

        def poll_batch(self):
            return next(polls)

    learner = type("L", (), {"version": 3})()

    def push(lr, r0, bucket_bytes):
        pushes.append(lr.version)
        time.sleep(0.05)
        return 0.05

    monkeypatch.setattr(process, "_push", push)
    got, waited, push_s, resyncs = process._next_batch(learner, Rank0(), True, 1 << 20)
    assert got is batch and pushes == [3] and resyncs == 1 and push_s == 0.05
    assert 0 <= waited < 1  # the push is not counted as waiting


def test_a_long_wait_for_a_batch_says_what_the_buffer_holds_and_fixed_lag_stops_it(
    monkeypatch, caplog
):
    """Every wait names what it waits on: past WAIT_LOG_S the learner logs the buffer's counts;
    with buffer.fixed_lag, past fixed_lag_timeout_s it stops (no batch of v - k will come)."""
    import logging

    import pytest

    from slime_async.actors.learner import process
    from slime_async.config import load_config

    monkeypatch.setattr(process, "WAIT_LOG_S", 0.05)
    stats = {"groups_ready": 0, "groups_pending": 2, "grants_outstanding": 0, "producers": 1}

    def rank0_of(*overrides):
        class Rank0:
            cfg = load_config([], list(overrides))
            pusher = None
            consumer = type("C", (), {"stats": lambda self: stats | {"fixed_lag": {"v": 35}}})()

            def poll_batch(self):
                time.sleep(0.02)
                return None

        return Rank0()

    learner = type("L", (), {"version": 35})()
    fixed = rank0_of(
        "buffer.fixed_lag=8", "buffer.max_staleness=8", "buffer.fixed_lag_timeout_s=0.1"
    )
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="version 27 within"):
        process._next_batch(learner, fixed, False, 1 << 20)
    assert "for a batch of" in caplog.text and "2 pending" in caplog.text
    assert "buffer.fixed_lag = 8" in caplog.text
    # without fixed_lag: logged again and again, never raised (generators may be slow)
    caplog.clear()
    plain = rank0_of()
    calls = iter(range(30))
    plain.poll_batch = lambda: (
        (time.sleep(0.01), None)[1]
        if next(calls) < 29
        else Batch(batch_id=1, groups=[synthetic_group("a", 2)], staleness=[0])
    )
    got, *_ = process._next_batch(learner, plain, False, 1 << 20)
    assert got is not None and caplog.text.count("for a batch of") >= 2
    assert "fixed_lag" not in caplog.text
