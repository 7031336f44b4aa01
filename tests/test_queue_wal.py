"""Durability: the write-ahead log recovers every acknowledged, uncommitted trajectory; the
buffer process survives SIGKILL mid-stream with nothing acknowledged lost and nothing repeated."""

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from slime_async.config import BufferConfig
from slime_async.queue.client import ConsumerClient, ProducerClient, ping
from slime_async.queue.server import Buffer
from slime_async.queue.wal import PUT, WriteAheadLog
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import Child, free_port, python_module, wait_until


def _cfg(wal_dir: Path, **overrides) -> BufferConfig:
    return BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        wal_dir=str(wal_dir),
        request_timeout_s=1.0,
        give_up_s=30.0,
        **overrides,
    )


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
    cfg = _cfg(tmp_path / "wal", max_staleness=1, stale_policy="drop")
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
    cfg = _cfg(tmp_path / "wal")
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
    cfg = _cfg(tmp_path / "wal", wal_segment_bytes=1 << 16)
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
    cfg = _cfg(tmp_path / "wal")
    with running(cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(3)]))
    seg = sorted((tmp_path / "wal").iterdir())[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[:-7])  # a crash in the middle of the last record
    with running(cfg) as buf:
        assert buf.stats()["groups_ready"] == 2
    wal = WriteAheadLog(tmp_path / "wal", "flush", 1 << 20, dict)
    assert sum(1 for t, _, _ in wal.replay() if t == PUT) == 2


def _buffer_child(cfg: BufferConfig, log: Path) -> Child:
    overrides = [
        f"buffer.{k}={v}" if not isinstance(v, str) else f'buffer.{k}="{v}"'
        for k, v in cfg.model_dump(exclude={"curve"}).items()
        if v is not None
    ]
    child = Child("buffer", python_module("slime_async", "buffer", *overrides), log_path=log)
    wait_until(lambda: ping(cfg.consumer_endpoint, cfg) is not None, 60, "the buffer", child=child)
    return child


@pytest.mark.timeout(180)
def test_sigkill_mid_stream_loses_nothing_acknowledged_and_repeats_nothing(tmp_path):
    cfg = _cfg(tmp_path / "wal", wal_sync="flush", wal_segment_bytes=1 << 16)
    num_groups, kills = 120, 2
    acked: list[str] = []
    producer_error: list[BaseException] = []

    async def produce():
        async with ProducerClient(cfg, "gen") as p:
            sem = asyncio.Semaphore(8)  # puts in flight at once, as a generator would have

            async def one(i):
                async with sem:
                    g = synthetic_group(f"g{i}", 3, response_len=64, seed=i)
                    await p.put_group(g)
                    acked.append(g[0].group_id)
                    await asyncio.sleep(0.02)  # stream over a few seconds

            await asyncio.gather(*(one(i) for i in range(num_groups)))

    def producer_thread():
        try:
            asyncio.run(produce())
        except BaseException as e:
            producer_error.append(e)

    child = _buffer_child(cfg, tmp_path / "buffer.log")
    acked_at_kill: list[int] = []
    seen: list[str] = []  # trajectory ids of committed batches, with repeats if any
    try:
        thread = threading.Thread(target=producer_thread)
        thread.start()
        c = ConsumerClient(cfg, "learner")
        killed, deadline = 0, time.monotonic() + 150
        while time.monotonic() < deadline:
            done = not thread.is_alive()
            if done and len(seen) == 3 * len(acked):
                break
            b = c.get_batch(num_groups=2, timeout_s=0.2) or c.get_batch(num_groups=1, timeout_s=0.2)
            if b is None:
                continue
            c.commit(b.batch_id)
            seen.extend(t.id for g in b.groups for t in g)
            if killed < kills and len(seen) >= 3 * num_groups * (killed + 1) // (kills + 1):
                child.kill()  # SIGKILL, mid-stream: puts and gets are in flight
                acked_at_kill.append(len(acked))
                killed += 1
                child.stop()
                child = _buffer_child(cfg, tmp_path / "buffer.log")
        thread.join(60)
        assert not producer_error, producer_error
        assert killed == kills
        assert max(acked_at_kill) < num_groups, "the producer had finished before the kill"
        assert len(acked) == num_groups
        assert len(seen) == len(set(seen)), "a committed trajectory was delivered twice"
        want = {f"g{i}/{j}" for i in range(num_groups) for j in range(3)}
        assert set(seen) == want, f"lost: {sorted(want - set(seen))[:5]}"
        s = c.stats()
        assert s["trajectories_held"] == 0 and s["batches_delivered_uncommitted"] == 0
        c.close()
        assert child.stop() == 0  # SIGTERM: a clean shutdown
    finally:
        child.stop()
    assert "Traceback" not in (tmp_path / "buffer.log").read_text()
    assert os.listdir(tmp_path / "wal")
