"""Durability: the write-ahead log recovers every acknowledged, uncommitted trajectory (the buffer
in this process, restarted). The buffer process killed mid-stream:
tests/integration/test_queue_wal_sigkill.py."""

import asyncio
import contextlib

from slime_async.config import BufferConfig
from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.queue.server import Buffer
from slime_async.queue.wal import PUT, WriteAheadLog
from slime_async.testing.trajectories import synthetic_group
from tests.support.buffer_process import wal_buffer_config


@contextlib.contextmanager
def running(cfg: BufferConfig):
    buf = Buffer(cfg).start()
    try:
        yield buf
    finally:
        buf.stop()


async def _put_all(cfg, groups, producer="p0"):
    async with ProducerClient(cfg, producer) as p:
        return [await p.put_group(g) for g in groups]


def test_restart_recovers_acknowledged_uncommitted_and_forgets_committed(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal", max_staleness=1, stale_policy="drop")
    with running(cfg):
        groups = [synthetic_group(f"g{i}", 2, version=2 * (i >= 4), seed=i) for i in range(6)]
        asyncio.run(_put_all(cfg, groups))
        c = ConsumerClient(cfg, "learner")
        b1 = c.get_batch(num_groups=2, timeout_s=1)
        c.commit(b1.batch_id)
        b2 = c.get_batch(num_groups=1, timeout_s=1)  # delivered, not committed
        c.set_version(2, groups_per_step=4)  # drops g3 (version 0): 2 - 0 > 1
        assert c.stats()["dropped"] == {"stale": 1}
    with running(cfg) as buf:
        s = buf.stats()
        assert s["version"] == 2 and s["groups_per_step"] == 4
        assert s["groups_ready"] == 2 and s["batches_delivered_uncommitted"] == 1
        assert s["trajectories_held"] == 6
        # The same session carries on: it commits the batch it holds, and is not sent it again.
        c.commit(b2.batch_id)
        b3 = c.get_batch(num_groups=2, timeout_s=2)
        assert b3.batch_id > b2.batch_id
        assert {g[0].group_id for g in b3.groups} == {"g4", "g5"}
        c.close()
        # The producer's numbering survived: a resend of an old put is still a duplicate.
        assert asyncio.run(_hello(cfg, "p0")) == 6


async def _hello(cfg, producer):
    async with ProducerClient(cfg, producer) as p:
        return p._seq


def test_a_new_consumer_gets_the_batch_delivered_before_the_restart(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal")
    with running(cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(3)]))
        with ConsumerClient(cfg, "learner") as old:
            b = old.get_batch(num_groups=2, timeout_s=1)
    with running(cfg), ConsumerClient(cfg, "learner") as new:
        again = new.get_batch(num_groups=1, timeout_s=1)
        assert again.batch_id == b.batch_id
        assert [t.id for g in again.groups for t in g] == [t.id for g in b.groups for t in g]
        new.commit(again.batch_id)


def test_committed_segments_are_compacted(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal", wal_segment_bytes=1 << 16)
    with running(cfg) as buf:
        groups = [synthetic_group(f"g{i}", 4, response_len=400, seed=i) for i in range(40)]
        asyncio.run(_put_all(cfg, groups))
        assert buf.stats()["wal"]["segments"] >= 5
        with ConsumerClient(cfg, "learner") as c:
            for _ in range(39):
                c.commit(c.get_batch(num_groups=1, timeout_s=1).batch_id)
            assert c.stats()["wal"]["segments_deleted"] >= 4
    files = sorted((tmp_path / "wal").iterdir())
    assert len(files) <= 3  # the live group's segment, the tail, the fresh one
    with running(cfg) as buf:
        assert buf.stats()["groups_ready"] == 1  # g39 only


def test_torn_tail_is_ignored(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal")
    with running(cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(3)]))
    seg = sorted((tmp_path / "wal").iterdir())[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[:-7])  # a crash in the middle of the last record
    with running(cfg) as buf:
        assert buf.stats()["groups_ready"] == 2
    wal = WriteAheadLog(tmp_path / "wal", "flush", 1 << 20, dict)
    assert sum(1 for t, _, _ in wal.replay() if t == PUT) == 2
