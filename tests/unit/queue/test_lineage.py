"""The run's line of weights (`slime_async/queue/lineage.py`) and what the buffer does with it:
staleness counted along the line, groups with superseded tokens dropped (stale_policy "drop") or
kept and counted, the line kept across a buffer restart (WAL), refused when malformed or changed
by a live learner session. The whole runs (kills and resumes) are in
tests/integration/test_restart_versions.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from slime_async.config import BufferConfig
from slime_async.metrics import names as M
from slime_async.queue import wal as W
from slime_async.queue.groups import group_key
from slime_async.queue.lineage import SUPERSEDED_POSITION, Line, LineError, plan_restart
from slime_async.queue.messages import AckStatus
from slime_async.queue.schema import SchemaError, encode_trajectory
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group

G = 2


def test_a_break_supersedes_the_versions_between_and_costs_no_update():
    line = Line(((3, 7),))  # continued from version 3's weights as version 7
    assert [line.superseded(v) for v in range(9)] == [False] * 4 + [True] * 3 + [False] * 2
    assert line.position(3) == line.position(7) == 3
    assert line.distance(2, 8) == 2  # 2 -> 3, then 7 (3's weights) -> 8
    assert line.distance(3, 7) == 0
    assert list(line.positions(np.array([0, 3, 5, 7, 9]))) == [0, 3, SUPERSEDED_POSITION, 3, 5]
    assert line.start == 7


def test_a_second_restart_from_an_earlier_segment_drops_the_later_break():
    line = Line(((3, 7),))
    # The second learner died before its first checkpoint: the third continues from 3 again.
    again = line.branch(3, 12)
    assert again == Line(((3, 12),))
    assert all(again.superseded(v) for v in range(4, 12))  # 7.. were the second learner's
    # From a checkpoint of the second learner (version 9): its segment is kept up to 9.
    later = line.branch(9, 12)
    assert later == Line(((3, 7), (9, 12)))
    assert later.position(12) == later.position(9) == 5
    with pytest.raises(LineError, match="superseded"):
        line.branch(5, 12)


def test_malformed_lines_are_refused_naming_the_break():
    with pytest.raises(LineError, match=r"break \(5, 5\)"):
        Line(((5, 5),))
    with pytest.raises(LineError, match=r"break \(4, 9\)"):
        Line(((3, 7), (4, 9)))  # the second cut lies in the first gap
    with pytest.raises(LineError, match="pairs"):
        Line.parse([[1, 2, 3]])


def test_plan_restart():
    empty = Line()
    # Nothing used past the checkpoint: continue as is.
    assert plan_restart(4, empty, empty, 4) == (4, empty)
    # The dead learner reached 6 after the checkpoint at 4: fresh version 7.
    assert plan_restart(4, empty, empty, 6) == (7, Line(((4, 7),)))
    # The buffer knows a later break the checkpoint predates: its line is the run's record.
    assert plan_restart(4, empty, Line(((4, 7),)), 9) == (10, Line(((4, 10),)))
    # A buffer that lost its state (empty line, version 0): the checkpoint's own line.
    ckpt = Line(((4, 7),))
    assert plan_restart(8, ckpt, empty, 0) == (8, ckpt)
    # The buffer's line was written after the checkpoint's version was superseded: the checkpoint's.
    assert plan_restart(8, ckpt, Line(((4, 7), (7, 10))), 11) == (12, Line(((4, 7), (8, 12))))


def _state(policy: str = "drop", wal_dir=None, segment_bytes: int = 1 << 20) -> BufferState:
    state = BufferState(BufferConfig(max_staleness=2, stale_policy=policy))
    if wal_dir is not None:
        state.attach_wal(W.WriteAheadLog(wal_dir, "flush", segment_bytes, state.snapshot))
    return state


def _key(gid: str) -> str:
    """The buffer's key of producer "p"'s group `gid` (keys are scoped to their producer)."""
    return group_key("p", gid)


def _put(state: BufferState, seq: int, gid: str, version: int) -> AckStatus:
    group = synthetic_group(gid, 2, prompt_len=3, response_len=4, version=version, seed=seq)
    return state.put("p", seq, [encode_trajectory(t) for t in group], list(group))


def test_superseded_groups_are_dropped_by_reason_when_the_line_arrives():
    state = _state("drop")
    state.set_version(5, G)
    assert _put(state, 1, "g-ok", 4) == AckStatus.OK  # version 4 stays on the line
    assert _put(state, 2, "g-gone", 5) == AckStatus.OK  # the dead learner's version 5
    # The restarted learner continues from version 4's weights as version 7.
    state.set_version(7, G, [[4, 7]])
    assert state.dropped == {M.BUF_SUPERSEDED: 1}
    assert state.dropped_trajectories[M.BUF_SUPERSEDED] == 2
    assert [g.group_id for g in state.ready] == [_key("g-ok")]
    assert state.staleness(state.ready.get(_key("g-ok"))) == 0  # 7 names 4's weights
    # A late put of a superseded version is stored, then dropped at once (and said so).
    assert _put(state, 3, "g-late", 6) == AckStatus.STALE
    assert state.dropped[M.BUF_SUPERSEDED] == 2
    stats = state.stats()
    assert stats["lineage"] == [[4, 7]] and stats["versions_used"] == 7


def test_with_keep_superseded_groups_are_trained_and_counted():
    state = _state("keep")
    state.set_version(5, G)
    _put(state, 1, "g-gone", 5)
    state.set_version(7, G, [[4, 7]])
    assert state.stats()["groups_superseded_held"] == 1
    assert not state.dropped
    batch = state.get("learner", "s", "r1", 1, None)
    assert [g.group_id for g in batch.groups] == [_key("g-gone")]
    assert state.counts[M.BUF_SUPERSEDED_DELIVERED] == 1


def test_groups_on_the_line_at_the_bound_go_before_superseded_ones():
    """Superseded versions are numbered below the fresh ones: oldest first, they went out first
    and a group on the line crossed the bound meanwhile (seen in a learner killed mid-push)."""
    state = _state("keep")
    state.set_version(5, G)
    _put(state, 1, "g-gone", 5)
    state.set_version(7, G, [[4, 7]])
    _put(state, 2, "g-line", 7)
    _put(state, 3, "g-fresh", 8)
    state.set_version(9, G, [[4, 7]])
    assert state.staleness(state.ready.get(_key("g-line"))) == 2  # at the bound
    batch = state.get("learner", "s", "r1", 1, None)
    assert [g.group_id for g in batch.groups] == [_key("g-line")]
    # Nothing at the bound: the usual order (the superseded group is the oldest).
    batch = state.get("learner", "s", "r2", 2, None)
    assert [g.group_id for g in batch.groups] == [_key("g-gone"), _key("g-fresh")]
    assert state.counts[M.BUF_SUPERSEDED_DELIVERED] == 1


def test_a_group_in_flight_across_the_restart_counts_by_its_tokens_on_the_line():
    """Members generated before and after the learner's restart: the group holds superseded
    tokens and tokens of the fresh version, whose bound still holds."""
    state = _state("keep")
    state.set_version(5, G)
    _put(state, 1, "g-gone", 4)  # version 4 stays on the line
    state.set_version(7, G, [[4, 7]])  # version 4 stays on the line, 5 and 6 are superseded
    old = synthetic_group("g-mixed", 2, prompt_len=3, response_len=4, version=5, seed=2)
    new = synthetic_group("g-mixed", 2, prompt_len=3, response_len=4, version=7, seed=2)
    mixed = [old[0], new[1]]
    state.put("p", 2, [encode_trajectory(t) for t in mixed], mixed)
    assert _key("g-mixed") in state.superseded
    state.set_version(9, G, [[4, 7]])  # its version-7 tokens are 2 updates old: the bound
    _put(state, 3, "g-new", 9)
    at_bound = [g.group_id for g in state._at_the_bound()]
    assert at_bound == [_key("g-gone"), _key("g-mixed")]  # both 2 updates old, by arrival
    batch = state.get("learner", "s", "r1", 2, None)
    assert [g.group_id for g in batch.groups] == at_bound


def test_without_superseded_groups_the_order_is_unchanged():
    state = _state("keep")
    state.set_version(3, G)
    for seq, (gid, v) in enumerate([("a", 1), ("b", 0), ("c", 2)]):
        _put(state, seq, gid, v)
    batch = state.get("learner", "s", "r1", 2, None)
    assert [g.group_id for g in batch.groups] == [_key("b"), _key("a")]


@pytest.mark.parametrize("segment_bytes", [1 << 20, 1024])  # replayed records; a snapshot
def test_the_line_and_the_versions_used_survive_a_buffer_restart(tmp_path, segment_bytes):
    first = _state("keep", tmp_path, segment_bytes)
    first.set_version(5, G)
    _put(first, 1, "g-gone", 6)  # a token one past the announced version (pushed, not yet told)
    assert first.stats()["versions_used"] == 6
    first.set_version(8, G, [[4, 8]])
    first.wal.close()
    again = _state("keep", tmp_path, segment_bytes)
    assert again.line == Line(((4, 8),))
    assert again.stats()["versions_used"] == 8
    assert again.superseded == {_key("g-gone")}
    # Its clock is the log's until a learner speaks again: engines may have restarted from the
    # base model, a learner may redo batches; so no grants until then (counted).
    assert again.admit("gen", 4) == 0
    assert again.counts[M.BUF_ADMISSION_AWAITING_LEARNER] == 1
    again.set_version(8, G, [[4, 8]])
    assert again.admit("gen", 4) == 4


def test_a_line_is_checked_on_announcement():
    state = _state("keep")
    state.set_version(5, G)
    with pytest.raises(SchemaError, match=r"lineage.*live"):
        state.check_version(8, G, rewind_ok=False, lineage=[(4, 8)])
    with pytest.raises(SchemaError, match=r"lineage.*break \(4, 4\)"):
        state.check_version(8, G, rewind_ok=True, lineage=[(4, 4)])
    with pytest.raises(SchemaError, match=r"version.*not on the announced line"):
        state.check_version(6, G, rewind_ok=True, lineage=[(4, 8)])
    state.check_version(8, G, rewind_ok=True, lineage=[(4, 8)])  # a new session may


def test_a_snapshot_carries_the_line():
    """Compaction keeps only a snapshot of what deleted segments said: the line is in it."""
    state = _state("keep")
    state.set_version(8, G, [[4, 8]])
    again = _state("keep")
    again._replay(W.SNAPSHOT, state.snapshot(), [])
    assert again.line == Line(((4, 8),)) and again.version == 8
    assert again.stats()["versions_used"] == 8


def test_fixed_lag_counts_its_lag_along_the_line():
    """buffer.fixed_lag = 1 across a restart that continued version 2's weights as 6: version 2's
    groups are those of the weights 6 names (trained at 7, one update later; here also at 6, the
    ramp's first version); the dead learner's version 3 is superseded, its groups late."""
    state = BufferState(BufferConfig(fixed_lag=1, max_staleness=1))
    state.set_version(2, G)
    assert _put(state, 0, "a-v2", 2) == _put(state, 1, "b-v2", 2) == AckStatus.OK
    state.set_version(3, G)  # the dead learner's last version
    assert _put(state, 2, "a-v3", 3) == AckStatus.OK
    state.set_version(6, G, [[2, 6]])
    assert state.dropped == {"fixed_lag_late": 1}  # a-v3: superseded
    state.set_version(7, G)
    assert state.stats()["fixed_lag"]["target"] == 6  # one update back: 6, which names 2's weights
    batch = state.get("learner", "s", "r1", G, None)
    assert batch is not None and {g.group_id for g in batch.groups} == {_key("a-v2"), _key("b-v2")}


def test_a_restarted_learners_redelivered_batches_count_against_admission():
    """The batches a dead learner had not committed are trained again first: a group started now
    waits behind them, so they hold admission's budget ((2 + 1) x 2 groups) until trained."""
    state = _state("keep")
    state.set_version(3, G)
    for seq in range(4):
        _put(state, seq, f"g{seq}", 3)
    for rid in ("r1", "r2"):  # the dead learner's session got two batches, committed neither
        assert state.get("learner", "dead", rid, G, None) is not None
    state.set_version(4, G)  # its last announcement: it had trained both
    state.touch_session("learner", "new")  # the restarted learner's session announces
    state.set_version(6, G, [[3, 6]])
    assert state.admit("gen", 100) == 6 - 4  # two batches of two groups come back first
    again = state.get("learner", "new", "n1", G, None)
    assert again.batch_id == 1
    assert state.admit("gen", 100) == 0  # batch 1 in training again, batch 2 still to come
