"""The learner process's pieces that need no model: checkpoint discovery, batch metrics, and the
training loop's waits (a stand-in learner; with buffer.fixed_lag a real `BufferState`)."""

import logging
import time

import numpy as np
import pytest

from slime_async.actors.learner import process
from slime_async.actors.learner.process import batch_metrics, latest_checkpoint, train_groups
from slime_async.config import BufferConfig, load_config
from slime_async.metrics import names as M
from slime_async.queue.client import Batch
from slime_async.queue.lineage import Line
from slime_async.queue.schema import decode_trajectory, encode_trajectory
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.gc_watch import GcWatch


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


class _Rollouts:
    """A real `BufferState` behind the learner's consumer calls, with a generator beside it on
    a clock of those calls: every call is one tick; the generator starts the groups admission
    grants at the version the engines serve, and each rollout takes `ticks` ticks. A rollout
    during which the engines' version changed carries tokens of both versions, as a real one
    does (its second half is made by the new weights)."""

    def __init__(self, k: int, groups_per_step: int, ticks: int):
        self.state = BufferState(BufferConfig(fixed_lag=k, max_staleness=k))
        self.state.set_version(0, groups_per_step)
        self.gps, self.ticks, self.now, self.seq = groups_per_step, ticks, 0, 0
        self.engines = 0  # the version the engines serve
        self.inflight: list[tuple[str, int, int]] = []  # (group id, start version, done at)

    def tick(self) -> None:
        self.now += 1
        for _ in range(self.state.admit("gen0", 100)):
            gid = f"gen0/g{self.seq + len(self.inflight)}"
            self.inflight.append((gid, self.engines, self.now + self.ticks))
        while self.inflight and self.inflight[0][2] <= self.now:
            gid, start, _ = self.inflight.pop(0)
            group = synthetic_group(gid, 2, response_len=8, version=start)
            for t in group:
                t.versions[t.versions.size // 2 :] = self.engines
            self.seq += 1
            self.state.put("gen0", self.seq, [encode_trajectory(t) for t in group], group)

    # ----- what the learner calls (ConsumerClient's and _Rank0's methods)
    def poll_batch(self) -> Batch | None:
        self.tick()
        b = self.state.get("learner", "s", f"r{self.now}", self.gps, None)
        if b is None:
            return None
        groups = [[decode_trajectory(blob) for blob in g.blobs] for g in b.groups]
        return Batch(b.batch_id, groups, [self.state.staleness(g) for g in b.groups])

    def stats(self) -> dict:
        self.tick()
        return self.state.stats()

    def set_version(self, version: int, groups_per_step: int, lineage=None) -> None:
        self.state.set_version(version, groups_per_step, lineage)

    def commit(self, batch_id: int) -> None:
        self.state.commit("learner", batch_id)

    def commit_through(self, batch_id: int) -> None:
        self.state.commit("learner", batch_id, through=True)


def test_fixed_lag_holds_every_push_the_last_one_too_until_the_served_versions_groups_arrived(
    monkeypatch,
):
    """buffer.fixed_lag: no rollout crosses a weight update. The learner holds each push until
    the groups of the version the engines serve have arrived, the last push too: the groups of
    the last served version are never trained at a lag, but one still running when the weights
    change spans two versions and the buffer drops it (the staleness sweep's `dropped_share`
    was not 0 once in a while under load, when the last push was not held)."""
    k, gps, steps = 1, 2, 3
    cfg = load_config(
        [],
        [
            f"buffer.fixed_lag={k}",
            f"buffer.max_staleness={k}",
            f"learner.num_steps={steps}",
            f"learner.groups_per_step={gps}",
        ],
    )
    buffer = _Rollouts(k, gps, ticks=3)
    pushes, records = [], []

    class Learner:
        step, version, line = 0, 0, Line()

        def train_step(self, groups):
            assert len(groups) == gps
            self.step += 1
            self.version += 1
            return {}

        def take_token_record(self):
            return None

    class Rank0:
        consumer = buffer
        pusher = eval_pending = run_dir = None
        next_record: dict = {}
        metrics = type("Metrics", (), {"log": lambda self, step, r: records.append(r)})()

        def poll_batch(self):
            return buffer.poll_batch()

    def push(learner, rank0, bucket_bytes):
        fl = buffer.state.stats()["fixed_lag"]  # a look that lets no time pass
        pushes.append((learner.version, fl["version"], fl["arrived"], fl["quota"]))
        buffer.engines = learner.version
        return 0.0

    monkeypatch.setattr(process, "_push", push)
    monkeypatch.setattr(process, "_scatter_groups", lambda learner, groups: groups)
    assert process._train(cfg, Learner(), Rank0(), None, True, GcWatch("test")) == 0
    # Every push, the last one (version 3) too, came once all the groups of the version it
    # replaced had arrived: (k + 1) x gps at the first version, gps at the others.
    assert pushes == [(1, 0, 4, 4), (2, 1, 2, 2), (3, 2, 2, 2)]
    assert all(M.FIXED_LAG_WAIT_S in r for r in records)
    assert all(r[M.LEARNER_GC_S] == 0.0 and r[M.LEARNER_GC_LONG] == 0.0 for r in records)
    while buffer.inflight:  # the run is over: the rollouts still running finish (at version 3)
        buffer.tick()
    assert buffer.state.stats()["dropped"] == {}
    assert [r[M.BUFFER_DROPPED_ALL] for r in records] == [0.0] * steps


def test_a_fixed_lag_hold_past_its_timeout_names_the_version_and_asks_about_the_generators():
    """The last push is held too, so generators that stopped early (their data done) would stop
    the run at fixed_lag_timeout_s: the error says what to look at."""
    cfg = load_config(
        [], ["buffer.fixed_lag=2", "buffer.max_staleness=2", "buffer.fixed_lag_timeout_s=0.05"]
    )
    fixed_lag = {"k": 2, "version": 7, "target": 5, "quota": 2, "granted": 2, "arrived": 1}

    class Rank0:
        eval_pending = None
        consumer = type("C", (), {"stats": lambda self: {"fixed_lag": fixed_lag}})()

    with pytest.raises(RuntimeError, match=r"1 of the 2 groups of version 7 .*num_epochs"):
        process._hold_push(cfg, Rank0(), 7)
    fixed_lag["arrived"] = 2  # all here: no wait
    assert process._hold_push(cfg, Rank0(), 7)[M.FIXED_LAG_WAIT_S] < 0.05
