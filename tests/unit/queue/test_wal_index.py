"""The write-ahead log's index for `inspect`: equal to a full read, cached beside the log, brought
up to date when the log grows, rolls or is compacted, rebuilt when the cache is of another format.

`slime-async inspect` on top of it (token records, --top-grad): tests/unit/launch/test_inspect.py.
"""

from __future__ import annotations

import json

from slime_async.queue import wal as W
from slime_async.queue import wal_index
from slime_async.queue.groups import unscoped
from slime_async.queue.schema import decode_trajectory
from slime_async.testing.wal_runs import SyntheticRun, write_run_wal


def full_read(wal_dir):
    """What the log holds, by decoding every record (the index must agree)."""
    groups, steps, version = {}, {}, 0
    for rtype, meta, blobs in W.WriteAheadLog(wal_dir, "none", 1 << 62, snapshot=dict).replay():
        if rtype in (W.SNAPSHOT, W.VERSION):
            version = int(meta.get("version", version))
        elif rtype == W.PUT:
            for b in blobs:
                t = decode_trajectory(b)
                groups.setdefault(t.group_id, []).append(t)
        elif rtype == W.DELIVER and meta.get("g"):
            # the log holds group keys scoped to their producer; the index holds group ids
            steps.setdefault(meta["batch"], ([unscoped(k)[1] for k in meta["g"]], version))
    return groups, steps


def assert_matches(index, wal_dir):
    groups, steps = full_read(wal_dir)
    assert {b: (s.group_ids, s.version) for b, s in index.steps.items()} == steps
    assert set(index.groups) == set(groups)
    for gid, trajs in groups.items():
        g = index.groups[gid]
        assert g.n == len(trajs)
        assert g.model_tokens == sum(int(t.loss_mask.sum()) for t in trajs)
        assert abs(g.reward - sum(t.reward for t in trajs)) < 1e-9
        assert g.oldest == min(t.oldest_version() for t in trajs)


def test_index_equals_a_full_read_and_is_cached(tmp_path):
    # Uncommitted batches keep their segments: a log of several segments.
    wal_dir = write_run_wal(
        tmp_path / "wal",
        steps=40,
        groups_per_step=3,
        group_size=2,
        segment_bytes=1 << 16,
        commit=False,
    )
    n_segments = len(list(wal_dir.glob("wal-*.log")))
    assert n_segments > 2
    first = wal_index.load_index(wal_dir)
    assert first.segments_read == n_segments
    assert_matches(first, wal_dir)
    again = wal_index.load_index(wal_dir)
    assert again.segments_read == 0  # all from the cache beside the log
    assert again.steps == first.steps
    some = list(first.steps[5].group_ids)
    got = wal_index.read_groups(wal_dir, again, some)
    want, _ = full_read(wal_dir)
    for gid in some:
        assert [t.id for t in got[gid]] == [t.id for t in want[gid]]


def test_index_follows_a_growing_rolled_and_compacted_log(tmp_path):
    live = SyntheticRun(tmp_path / "wal", groups_per_step=2, group_size=2, segment_bytes=1 << 16)
    wal_dir = tmp_path / "wal"
    live.steps(3)
    assert len(wal_index.load_index(wal_dir).steps) == 3
    live.steps(2)  # the live buffer appends to its current segment
    grown = wal_index.load_index(wal_dir)
    assert grown.segments_read == 1 and sorted(grown.steps) == [1, 2, 3, 4, 5]
    assert_matches(grown, wal_dir)
    live.steps(80)  # rolls over segments; compaction deletes committed ones behind it
    assert not (wal_dir / "wal-00000001.log").exists()
    later = wal_index.load_index(wal_dir)
    assert_matches(later, wal_dir)
    assert min(later.steps) > 1 and max(later.steps) == 85
    live.close()


def test_a_cache_of_another_format_or_damaged_is_rebuilt(tmp_path):
    wal_dir = write_run_wal(tmp_path / "wal", steps=3, groups_per_step=2, group_size=2)
    wal_index.load_index(wal_dir)
    cache = wal_index.cache_path(wal_dir)
    data = json.loads(cache.read_text())
    data["format"] = wal_index.FORMAT + 1
    cache.write_text(json.dumps(data))
    assert wal_index.load_index(wal_dir).segments_read == 1
    cache.write_text("{ torn")
    rebuilt = wal_index.load_index(wal_dir)
    assert rebuilt.segments_read == 1
    assert_matches(rebuilt, wal_dir)
