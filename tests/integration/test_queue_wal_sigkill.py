"""The buffer process (`slime-async buffer`) SIGKILLed twice mid-stream, with puts and gets in
flight: restarted on its write-ahead log, it loses nothing acknowledged and repeats nothing. The
log's own recovery, in one process: tests/unit/queue/test_queue_wal.py."""

import asyncio
import os
import threading
import time

import pytest

from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.testing.trajectories import synthetic_group
from tests.support.buffer_process import start_buffer, wal_buffer_config


@pytest.mark.timeout(180)
def test_sigkill_mid_stream_loses_nothing_acknowledged_and_repeats_nothing(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal", wal_sync="flush", wal_segment_bytes=1 << 16)
    num_groups, kills, window = 120, 2, 16
    acked: list[str] = []
    producer_error: list[BaseException] = []

    async def produce():
        async with ProducerClient(cfg, "gen") as p:
            sem = asyncio.Semaphore(8)  # puts in flight at once, as a generator would have

            async def one(i):
                # Stay at most `window` groups ahead of the consumer, so both kills land while
                # puts are still in flight however slow the machine is.
                while i - len(seen) // 3 > window:
                    await asyncio.sleep(0.01)
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

    child = start_buffer(cfg, tmp_path / "buffer.log")
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
                child = start_buffer(cfg, tmp_path / "buffer.log")
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
