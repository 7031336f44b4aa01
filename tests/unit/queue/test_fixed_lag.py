"""`buffer.fixed_lag = k`: every batch trained exactly k versions after the policy that
generated it, checked from what the learner trained, not from the buffer's own tags.

The tests here drive `BufferState`. The end-to-end check, which reads the learner's records of
a real `slime-async run`, is in tests/integration/test_staleness_sweep.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from slime_async.config import BufferConfig, ConfigError, load_config
from slime_async.queue.admission import FIXED_LAG_LATE, FIXED_LAG_SPANS
from slime_async.queue.messages import AckStatus
from slime_async.queue.schema import encode_trajectory
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group

G = 2  # groups per step


def _state(k: int) -> BufferState:
    state = BufferState(BufferConfig(fixed_lag=k, max_staleness=max(k, 1)))
    state.set_version(0, groups_per_step=G)
    return state


def _put(state: BufferState, seq: int, group) -> AckStatus:
    return state.put("p", seq, [encode_trajectory(t) for t in group], list(group))


def _delivered_versions(state: BufferState) -> set[int]:
    b = state.get("learner", "s", f"r{state.next_batch}", G, None)
    assert b is not None
    state.commit("learner", b.batch_id)
    return {g.oldest for g in b.groups}


def test_admission_grants_one_batch_per_version_and_k_plus_1_at_the_start():
    state = _state(2)
    assert state.admit("p", 100) == 3 * G  # versions 1 and 2 train on version 0's groups too
    assert state.admit("p", 100) == 0  # generation never runs further ahead
    state.set_version(1, G)
    assert state.admit("p", 100) == G
    assert state.admit("p", 1) == 0
    assert state.stats()["fixed_lag"] == {
        "k": 2,
        "version": 1,
        "target": 0,
        "quota": G,
        "granted": G,
        "arrived": 0,
    }


def test_delivery_takes_only_the_groups_of_version_minus_k():
    state = _state(2)
    seq = 0
    for v in range(5):  # at each version: the groups generated at it arrive, then a batch goes
        state.admit("p", 100)
        n = 3 * G if v == 0 else G
        for i in range(n):
            seq += 1
            assert _put(state, seq, synthetic_group(f"v{v}-{i}", 2, version=v, seed=seq)) == (
                AckStatus.OK
            )
        assert state.stats()["fixed_lag"]["arrived"] == n  # what the learner waits for
        assert _delivered_versions(state) == {max(v - 2, 0)}
        state.set_version(v + 1, G)
    assert state.stats()["dropped"] == {}


def test_late_and_version_spanning_groups_are_dropped_with_their_reason():
    state = _state(1)
    for i in range(2 * G):
        _put(state, i + 1, synthetic_group(f"a{i}", 2, version=0, seed=i))
    assert _delivered_versions(state) == {0}
    # Version 2: the target is 1, so the remaining version-0 groups can never train at lag 1.
    state.set_version(1, G)
    state.set_version(2, G)
    assert state.stats()["dropped"] == {FIXED_LAG_LATE: G}
    # A group whose tokens span versions 1 and 2 (a weight update during its rollout).
    group = synthetic_group("span", 2, version=1, seed=9)
    group[1].versions = np.where(np.arange(group[1].versions.size) < 5, 1, 2).astype(np.int32)
    assert _put(state, 10, group) is AckStatus.STALE  # the producer counts it as dropped
    assert state.stats()["dropped"] == {FIXED_LAG_LATE: G, FIXED_LAG_SPANS: 1}
    assert state.stats()["fixed_lag"]["arrived"] == 0


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["buffer.fixed_lag=2", "buffer.max_staleness=1"], "buffer.max_staleness >= 2"),
        (
            ["buffer.fixed_lag=1", "push.interval=2", "buffer.max_staleness=4"],
            "push.interval = 1",
        ),
        (["buffer.fixed_lag=1", "run.mode=sync"], "run.mode = 'sync'"),
    ],
)
def test_impossible_fixed_lag_configs_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ConfigError, match=r"buffer\.fixed_lag") as e:
        load_config([], overrides)
    assert needle in str(e.value)
