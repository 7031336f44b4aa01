"""The real buffer process (`slime-async buffer`) restarted on a damaged write-ahead log: one
flipped byte in a record's body or header, a torn last record, the records of deliveries lost
under a learner that resumes past them. Nothing acknowledged is lost without the buffer saying
which records, where; by default it refuses to start."""

import asyncio
import contextlib
import subprocess

import pytest

from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.queue.wal import WriteAheadLog
from slime_async.queue.wal import format as F
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import python_module
from tests.support.buffer_process import start_buffer, wal_buffer_config

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def buffer(cfg, log):
    child = start_buffer(cfg, log)
    try:
        yield child
    finally:
        assert child.stop() == 0, child.tail()


def _start_refused(cfg) -> subprocess.CompletedProcess:
    """`slime-async buffer` on `cfg`, expected to refuse to start (it exits by itself)."""
    overrides = [
        f"buffer.{k}={v}" if not isinstance(v, str) else f'buffer.{k}="{v}"'
        for k, v in cfg.model_dump(exclude={"curve"}).items()
        if v is not None
    ]
    cmd = python_module("slime_async", "buffer", *overrides)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


async def _put_all(cfg, groups, producer="gen0"):
    async with ProducerClient(cfg, producer) as p:
        return [await p.put_group(g) for g in groups]


def _records(seg):
    """(offset, lsn, type, meta) of every record of segment `seg`."""
    scan = F.scan(seg.read_bytes(), last=True)
    return [(r.offset, r.lsn, r.rtype, WriteAheadLog._decode(r.body)[0]) for r in scan.records]


def _flip(seg, offset):
    data = bytearray(seg.read_bytes())
    data[offset] ^= 0x40
    seg.write_bytes(bytes(data))


def _stored(tmp_path, n_groups=10):
    """A log of `n_groups` acknowledged groups of 2 (gen0/g0...), 3 of them committed."""
    cfg = wal_buffer_config(tmp_path / "wal")
    with buffer(cfg, tmp_path / "first.log"):
        assert (
            asyncio.run(
                _put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(n_groups)])
            )
            == ["ok"] * n_groups
        )
        with ConsumerClient(cfg, "learner") as c:
            for _ in range(3):
                c.commit(c.get_batch(num_groups=1, timeout_s=5).batch_id)
    (seg,) = sorted((tmp_path / "wal").glob("wal-*.log"))
    return cfg, seg


def _held(cfg) -> set[str]:
    """Group ids the buffer holds, by taking every ready group (and committing nothing)."""
    with ConsumerClient(cfg, "reader") as c:
        b = c.get_batch(num_groups=c.stats()["groups_ready"], timeout_s=5)
        return {g[0].group_id for g in b.groups} if b else set()


def test_a_flipped_byte_in_a_put_refuses_the_start_naming_segment_and_offset(tmp_path):
    cfg, seg = _stored(tmp_path)
    puts = [r for r in _records(seg) if r[2] == F.PUT]
    victim = puts[6]  # g6: acknowledged, not committed
    _flip(seg, victim[0] + F.HEADER + 40)  # inside the body
    before = seg.read_bytes()
    end = victim[0] + F.HEADER + F.struct.unpack_from("<I", before, victim[0] + 4)[0]

    out = _start_refused(cfg)
    assert out.returncode == 2, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert seg.name in said and f"bytes {victim[0]}-" in said, said
    assert f"PUT record {victim[1]} fails its checksum" in said, said
    assert "wal_on_damage" in said and "PUT" in said.split("intact records after")[1], said
    assert seg.read_bytes() == before  # a refused start changes nothing on disk

    # The operator opts in: the buffer starts with everything else, and says what it lost.
    go_on = cfg.model_copy(update={"wal_on_damage": "continue"})
    with buffer(go_on, tmp_path / "continue.log"), ConsumerClient(go_on, "learner") as c:
        s = c.stats()
        assert s["counts"]["wal_damaged_regions"] == 1
        assert [d["where"].split(":")[0] for d in s["wal_damage"]] == [
            f"{seg.name} bytes {victim[0]}-{end} (PUT record {victim[1]} fails its checksum)"
        ]
        # 10 acknowledged = 3 trained + 0 dropped + 6 held + 1 lost (named above).
        assert s["counts"]["committed_groups"] == 3 and s["groups_ready"] == 6
    assert (tmp_path / "wal" / "damaged" / seg.name).read_bytes() == before  # kept aside
    assert "write-ahead log damaged" in (tmp_path / "continue.log").read_text()
    # The live log reads clean now (the damage is recorded in it), and the rest is all there.
    with buffer(cfg, tmp_path / "again.log"):
        assert _held(cfg) == {f"g{i}" for i in (3, 4, 5, 7, 8, 9)}
        with ConsumerClient(cfg, "learner") as c:
            assert len(c.stats()["wal_damage"]) == 1


def test_a_flipped_byte_in_a_header_costs_one_record_not_the_rest_of_the_segment(tmp_path):
    cfg, seg = _stored(tmp_path)
    puts = [r for r in _records(seg) if r[2] == F.PUT]
    _flip(seg, puts[4][0] + 5)  # the length of g4's record: it cannot be trusted any more
    out = _start_refused(cfg)
    assert out.returncode == 2 and seg.name in out.stdout, out.stdout + out.stderr
    assert f"1 record(s) lost (lsn {puts[4][1]}-{puts[4][1]})" in out.stdout, out.stdout
    go_on = cfg.model_copy(update={"wal_on_damage": "continue"})
    with buffer(go_on, tmp_path / "continue.log"):
        # Replay found the next record past the damage: g5..g9 are back, only g4 is lost.
        assert _held(go_on) == {f"g{i}" for i in (3, 5, 6, 7, 8, 9)}


def test_a_torn_tail_is_cut_off_counted_and_logged(tmp_path):
    cfg, seg = _stored(tmp_path)
    last = _records(seg)[-1]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 7)  # a crash in the middle of the last record: never acknowledged
    with buffer(cfg, tmp_path / "torn.log"), ConsumerClient(cfg, "learner") as c:
        s = c.stats()
        assert s["counts"]["wal_torn_tail_bytes"] == size - 7 - last[0]
        assert s["wal_damage"] == [] and s["groups_ready"] == 7
    assert seg.stat().st_size == last[0]  # cut back to the last intact record
    assert "torn tail" in (tmp_path / "torn.log").read_text()
    with buffer(cfg, tmp_path / "again.log"):  # no longer the last segment: still clean
        assert len(_held(cfg)) == 7


def test_a_learner_resuming_past_lost_deliveries_is_told_which_batches_are_gone(tmp_path):
    cfg = wal_buffer_config(tmp_path / "wal", wal_on_damage="continue")
    with buffer(cfg, tmp_path / "first.log"):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(8)]))
        with ConsumerClient(cfg, "learner") as c:
            batches = [c.get_batch(num_groups=1, timeout_s=5).batch_id for _ in range(5)]
            c.commit_through(batches[1])  # a checkpoint at batch 2; batches 3-5 in training
            cursor = c.cursor()
    assert batches == [1, 2, 3, 4, 5] and cursor == 5
    (seg,) = sorted((tmp_path / "wal").glob("wal-*.log"))
    delivers = [r for r in _records(seg) if r[2] == F.DELIVER and r[3]["batch"] >= 4]
    for offset, *_ in delivers:
        _flip(seg, offset + 9)  # the deliveries of batches 4 and 5
    with buffer(cfg, tmp_path / "continue.log"), ConsumerClient(cfg, "learner") as c:
        # The learner resumes from a checkpoint taken at batch 5 (as `run --resume` does).
        assert c.resume(cursor) == 1  # batch 3, still held, retired
        assert c.missing_batches == [[4, 5]]
        # Their groups (g3, g4) came back as ready: the buffer cannot tell them from g5-g7,
        # never delivered, so all five are counted as groups that may be delivered again.
        s = c.stats()
        assert s["counts"]["wal_groups_may_repeat"] == 5 and s["groups_ready"] == 5
        b = c.get_batch(num_groups=1, timeout_s=5)
        assert b.batch_id == 6  # batch ids the lost records used are never reused
        c.commit(b.batch_id)


def test_an_older_format_segment_is_refused_with_a_message(tmp_path):
    wal = tmp_path / "wal"
    wal.mkdir()
    (wal / "wal-00000001.log").write_bytes(b"\x10\x00\x00\x00" + b"\0" * 64)  # format 1
    cfg = wal_buffer_config(wal)
    out = _start_refused(cfg)
    assert out.returncode == 2 and "format 1" in out.stdout, out.stdout + out.stderr
