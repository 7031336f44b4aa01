"""Staleness between the buffer and the learner: the stale policy in the buffer, the
stats of dropped groups, and a restarted learner that never goes back in versions."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from slime_async.actors.learner.checkpoint import read_common
from slime_async.actors.learner.process import run_learner
from slime_async.config import BufferConfig, load_config
from slime_async.metrics import read_metrics
from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.queue.messages import AckStatus
from slime_async.queue.schema import encode_trajectory
from slime_async.queue.server import Buffer
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group


def _put(state: BufferState, seq: int, group) -> AckStatus:
    return state.put("p", seq, [encode_trajectory(t) for t in group], list(group))


@pytest.mark.parametrize("policy", ["drop", "mask", "keep"])
def test_only_the_drop_policy_drops_and_drops_are_described(policy):
    state = BufferState(BufferConfig(max_staleness=1, stale_policy=policy))
    old = synthetic_group("old", 2, response_len=40, version=0, seed=1)
    fresh = synthetic_group("fresh", 2, response_len=8, version=3, seed=2)
    assert _put(state, 1, old) is AckStatus.OK
    state.set_version(3, groups_per_step=1)  # "old" is now 3 versions old
    ack = _put(state, 2, fresh)
    assert ack is AckStatus.OK
    stats = state.stats()["dropped_stale"]
    assert stats["policy"] == policy
    if policy == "drop":
        assert state.stats()["dropped"] == {"stale": 1} and stats["groups"] == 1
        assert stats["trajectories"] == 2
        assert stats["mean_response_len"] == pytest.approx(
            sum(float(t.loss_mask.sum()) for t in old) / 2
        )
        assert stats["mean_reward"] == pytest.approx(sum(t.reward for t in old) / 2)
        # A put that is stale on arrival is answered STALE (the generator counts it as dropped).
        assert _put(state, 3, synthetic_group("late", 2, version=0, seed=3)) is AckStatus.STALE
    else:
        assert state.stats()["dropped"] == {} and stats["groups"] == 0
        assert len(state.ready) == 2  # both are left to the learner (mask or keep)


@contextlib.contextmanager
def _buffer(**kw):
    cfg = BufferConfig(
        producer_endpoint="tcp://127.0.0.1:*",
        consumer_endpoint="tcp://127.0.0.1:*",
        request_timeout_s=2.0,
        give_up_s=20.0,
        **kw,
    )
    buf = Buffer(cfg).start()
    try:
        yield cfg.model_copy(
            update={
                "producer_endpoint": buf.producer_endpoint,
                "consumer_endpoint": buf.consumer_endpoint,
            }
        )
    finally:
        buf.stop()


def test_restarted_learner_continues_under_a_fresh_version(tmp_path):
    """save_interval = 0: a restarted learner starts over from the model (version 0's weights)
    while the buffer holds tokens of version 5 (a dead learner's weights). It neither fails on
    tokens "ahead" of it nor names the model's weights 5: it continues as version 6, and versions
    1..5 are superseded on the run's line (the buffer keeps the line)."""

    from slime_async.models.toy import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "qwen3", seed=0)
    with _buffer(max_staleness=2) as bcfg:
        groups = [
            synthetic_group(f"g{i}", 2, prompt_len=4, response_len=6, version=5, seed=i)
            for i in range(2)
        ]
        for g in groups:
            for k, t in enumerate(g):
                t.reward = float(k)  # rewards differ within a group: a real gradient

        async def put_all():
            async with ProducerClient(bcfg, "p") as p:
                for g in groups:
                    assert await p.put_group(g) == "ok"

        asyncio.run(put_all())
        with ConsumerClient(bcfg, "learner") as c:
            c.set_version(5, groups_per_step=2)  # the learner's first life announced 5
        cfg = load_config(
            [],
            [
                f"learner.model_path='{model}'",
                "learner.groups_per_step=2",
                "learner.num_steps=1",
                "learner.save_interval=0",
                "learner.micro_batch_tokens=256",
                "generator.group_size=2",
                f"run.run_dir='{tmp_path / 'run'}'",
            ],
        )
        cfg = cfg.model_copy(update={"buffer": bcfg})
        assert run_learner(cfg, tmp_path / "run") == 0
        with ConsumerClient(bcfg, "learner2") as c:
            stats = c.stats()
    assert stats["lineage"] == [[0, 6]]  # version 6 names version 0's weights
    assert stats["version"] == 7  # one batch trained after the fresh version
    (rec,) = read_metrics(tmp_path / "run" / "metrics" / "learner.jsonl")
    assert rec["learner/fresh_version"] == 6 and rec["learner/resumed_from_version"] == 0
    assert rec["learner/line_position"] == 1  # one update from the model's weights
    # Every model token came from the dead learner's version 5: trained (stale_policy "keep"),
    # and counted as superseded, never as if it were 1 or 2 updates old.
    model_tokens = sum(int(t.loss_mask.sum()) for g in groups for t in g)
    assert rec["stale/superseded_tokens"] == rec["stale/over_bound_tokens"] == model_tokens
    assert "staleness/learner_max" not in rec  # no token on the line to measure
    # The checkpoint holds the line: a later restart from it knows what was left behind.
    common = read_common(tmp_path / "run" / "checkpoints" / "step_1")
    assert common["version"] == 7 and common["extra"]["lineage"] == [[0, 6]]
    assert stats["counts"]["committed_groups"] == 2
