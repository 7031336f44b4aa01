"""The real buffer process with its write-ahead log on a real 2 MB filesystem (tmpfs, mounted by
the test: it needs root) that fills up: puts are refused by name, what the buffer holds is still
served, nothing acknowledged is lost, and puts are taken again once space returns."""

import asyncio
import contextlib
import os
import subprocess
import threading

import pytest

from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import wait_until
from tests.support.buffer_process import start_buffer, wal_buffer_config

pytestmark = pytest.mark.timeout(240)
KB = 1 << 10


@contextlib.contextmanager
def small_disk(path, size="2m"):
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_refuses_puts_by_name_serves_what_is_held_and_recovers(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (1200 * KB))  # someone else's file takes most of the disk
        cfg = wal_buffer_config(
            disk / "wal",
            wal_reserve_bytes=128 * KB,
            wal_low_space_bytes=1024 * KB,
            wal_segment_bytes=1 << 16,
            request_timeout_s=2.0,
            give_up_s=120.0,
        )
        log = tmp_path / "buffer.log"
        child = start_buffer(cfg, log)
        acked: list[str] = []
        stop = threading.Event()
        refused = []

        async def produce():
            async with ProducerClient(cfg, "gen0") as p:

                async def one(i):
                    g = synthetic_group(f"g{i}", 2, response_len=800, seed=i)  # ~21 KB
                    assert await p.put_group(g) == "ok"
                    acked.append(g[0].group_id)

                tasks = [asyncio.create_task(one(i)) for i in range(60)]  # ~1.2 MB in all
                while not all(t.done() for t in tasks) and not stop.is_set():
                    await asyncio.sleep(0.05)
                refused.append(p.disk_full_replies)
                await asyncio.gather(*tasks)

        thread = threading.Thread(target=lambda: asyncio.run(produce()))
        try:
            thread.start()
            with ConsumerClient(cfg, "learner") as c:
                wait_until(lambda: c.stats()["wal"]["disk_full"], 60, "the WAL disk to fill")
                s = c.stats()
                assert s["rejected"]["wal_disk_full"] >= 1 and child.alive()
                assert s["wal"]["low_space_warnings"] == 1
                # Every acknowledged put is held; refused ones were not stored at all.
                held = s["groups_ready"]
                assert held >= 1 and s["counts"]["puts"] == held
                wait_until(lambda: len(acked) == held, 30, "the acks of the stored puts")
                # What the buffer holds is still delivered while the disk is full.
                b = c.get_batch(num_groups=held, timeout_s=5)
                assert c.stats()["wal"]["disk_full"]
                c.commit(b.batch_id)  # and committed: its segments are deleted, space returns
                trained = [g[0].group_id for g in b.groups]
                filler.unlink()  # more space: the buffer takes puts again by itself
                wait_until(lambda: len(acked) == 60, 120, "every put to be acknowledged")
                thread.join(30)
                assert refused and refused[0] >= 1  # the producer was told and retried
                while len(trained) < 60:
                    b = c.get_batch(num_groups=1, timeout_s=10)
                    c.commit(b.batch_id)
                    trained += [g[0].group_id for g in b.groups]
                s = c.stats()
            # 60 stored = 60 trained + 0 dropped + 0 held; each exactly once.
            assert sorted(trained) == sorted(acked) and len(set(trained)) == 60
            assert s["dropped"] == {} and s["trajectories_held"] == 0 and not s["wal"]["disk_full"]
            assert child.stop() == 0
            text = log.read_text()
            assert "WAL disk full" in text and "has room again" in text and "Traceback" not in text
        finally:
            stop.set()
            if child.alive():
                child.stop()
            thread.join(30)


def test_a_restart_on_a_full_disk_starts_refuses_puts_and_serves_what_it_held(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        cfg = wal_buffer_config(disk / "wal", wal_reserve_bytes=128 * KB, give_up_s=60.0)
        child = start_buffer(cfg, tmp_path / "first.log")
        groups = [synthetic_group(f"g{i}", 2, response_len=200, seed=i) for i in range(5)]

        async def put_all():
            async with ProducerClient(cfg, "gen0") as p:
                return [await p.put_group(g) for g in groups]

        assert asyncio.run(put_all()) == ["ok"] * 5
        assert child.stop() == 0
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - 16 * KB))  # the disk is (nearly) full
        child = start_buffer(cfg, tmp_path / "second.log")  # it starts (its reserve kept)

        async def put_one():
            async with ProducerClient(cfg, "gen0") as p:
                task = asyncio.create_task(p.put_group(synthetic_group("late", 2, seed=9)))
                while not p.disk_full_replies:  # refused, retried with backoff, not stored
                    await asyncio.sleep(0.05)
                assert p.abandon_refused() == 1  # a stopping generator does not wait for it
                with pytest.raises(asyncio.CancelledError):
                    await task
                return p.disk_full_replies

        try:
            assert asyncio.run(put_one()) >= 1
            with ConsumerClient(cfg, "learner") as c:
                s = c.stats()
                assert s["wal"]["disk_full"] and s["groups_ready"] == 5
                assert s["rejected"]["wal_disk_full"] >= 1
                b = c.get_batch(num_groups=5, timeout_s=5)
                assert sorted(g[0].group_id for g in b.groups) == [f"g{i}" for i in range(5)]
                c.commit(b.batch_id)
        finally:
            assert child.stop() == 0
