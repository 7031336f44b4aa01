"""The buffer's write-ahead log: segment files of checksummed, framed MessagePack records.

The framing is `format.py`: every record has a magic, a checksummed header with its length and
log sequence number (lsn), and a checksummed body `<u32 meta length><MessagePack meta><blob>...`:
trajectory blobs are written as received (the meta lists their lengths), never packed into
another buffer. Each segment starts with a SNAPSHOT record (the state that earlier, possibly
deleted, segments would otherwise carry: producer dedupe marks, next batch id, policy version),
so recovery may begin at any segment.

Appends are gathered in memory and written with one `writev` per event-loop turn (`sync`), so a
burst of puts costs one system call (and one fsync with `wal_sync = "fsync"`). The buffer calls
`sync` before it sends the acks of that turn; with `wal_sync = "none"` it writes after them.

Recovery (`replay`) reads every intact record and finds the next one past damage; what it could
not read is `self.damage` (segment, byte range, lost lsns, what follows), which the buffer refuses
to start with unless `buffer.wal_on_damage = "continue"` (`set_aside` then keeps each damaged
segment in `damaged/` and rewrites it with its intact records and a DAMAGE record where the lost
ones were). A torn tail of the last segment (a crash mid-write: never acknowledged) is cut off by
`open`, counted and logged.

A full disk (ENOSPC, EDQUOT) is a state, not a crash (`disk.py`): the failed write is cut back, its
records stay queued and are written once space returns; `full` tells the buffer to refuse puts.

Compaction: every segment holds a reference count of the live groups with data in it. Segments
are deleted from the oldest end only, once none of their groups is live: a commit or drop record
about a group always lies in the same or a later segment than the group's data, so deleting a
prefix never resurrects a retired group. Segments in `damaged/` are never deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgpack

from slime_async.queue.wal import format as F
from slime_async.queue.wal.disk import DiskSpace
from slime_async.queue.wal.format import (
    COMMIT,
    DAMAGE,
    DELIVER,
    DROP,
    LOST,
    PUT,
    SNAPSHOT,
    VERSION,
    WalFormatError,
)

__all__ = [
    "COMMIT",
    "DAMAGE",
    "DELIVER",
    "DROP",
    "LOST",
    "PUT",
    "SNAPSHOT",
    "VERSION",
    "WalFormatError",
    "WriteAheadLog",
]

log = logging.getLogger(__name__)

_META = F.struct.Struct("<I")
_NAME = re.compile(r"^wal-(\d{8})\.log$")
DAMAGED_DIR = "damaged"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_PUT_OVERHEAD = 64 << 10
"""Room kept per put beyond its payload: its header and meta, and a new segment's snapshot."""


def _close(info: dict[str, Any], next_lsn: int) -> None:
    """Damage at the end of a segment: the next intact record tells how many were lost."""
    info["lsn_to"] = next_lsn - 1
    if info["lsn_from"] is not None:
        info["records_lost"] = info["max_records_lost"] = next_lsn - info["lsn_from"]


class WriteAheadLog:
    """Append-only segments in `directory`; see the module docstring for the format."""

    def __init__(
        self,
        directory: str | Path,
        sync: Literal["none", "flush", "fsync"],
        segment_bytes: int,
        snapshot: Callable[[], dict[str, Any]],
        reserve_bytes: int = 0,
        low_space_bytes: int = 0,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sync_mode = sync
        self.segment_bytes = segment_bytes
        self._snapshot = snapshot
        self._refs: dict[int, int] = {}
        self._pending: list[bytes | memoryview] = []
        self._fd: int | None = None
        self._size = 0
        self._on_disk = 0  # bytes of the current segment known written
        self.segment = 0
        self.lsn = 0
        """The lsn the next record gets."""
        self.bytes_written = 0
        self.segments_deleted = 0
        self.damage: list[dict[str, Any]] = []
        """What replay could not read (see `_damage`), in log order."""
        self.torn: tuple[int, int, int] | None = None
        """(segment, offset, bytes) of the last segment's torn tail, cut off by `open`."""
        self.torn_bytes = 0
        self.disk = DiskSpace(self.dir, reserve_bytes, low_space_bytes)

    def _path(self, index: int) -> Path:
        return self.dir / f"wal-{index:08d}.log"

    def segments(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    # ---------------------------------------------------------------- recovery
    def replay(self) -> Iterator[tuple[int, dict[str, Any], list[bytes]]]:
        """Yield (type, meta, blobs) of every intact record, oldest first, and a (DAMAGE, info,
        []) where records could not be read (also in `self.damage`); `self.segment` follows.
        Reads only: WalFormatError for a segment of another format."""
        known = self.segments()
        last_lsn: int | None = None
        follows: list[Counter[str]] = []  # per damage: intact records after it, by type
        open_end: dict[str, Any] | None = None  # damage at a segment's end: lsn_to still unknown
        for index in known:
            self.segment = index
            self._refs.setdefault(index, 0)
            name = self._path(index).name
            raw = self._path(index).read_bytes()
            F.check_segment(raw, name)
            scan = F.scan(raw, last=index == known[-1])
            regions = list(scan.damage)
            for rec in scan.records:
                while regions and regions[0].start < rec.offset:
                    info = self._damage(name, regions.pop(0), last_lsn, follows)
                    yield DAMAGE, info, []
                    last_lsn = info["lsn_to"] if info["lsn_to"] is not None else last_lsn
                if open_end is not None:  # the first record after damage at a segment's end
                    _close(open_end, rec.lsn)
                    open_end = None
                elif last_lsn is not None and rec.lsn != last_lsn + 1 and rec.rtype != DAMAGE:
                    gap = F.Region(rec.offset, rec.offset, lsn_before=last_lsn, lsn_after=rec.lsn)
                    yield DAMAGE, self._damage(name, gap, last_lsn, follows, missing=True), []
                last_lsn = rec.lsn
                for c in follows:
                    c[F.NAMES.get(rec.rtype, str(rec.rtype))] += 1
                yield rec.rtype, *self._decode(rec.body)
            for region in regions:
                open_end = self._damage(name, region, last_lsn, follows)
                yield DAMAGE, open_end, []
            if scan.torn_at is not None:
                self.torn = (index, scan.torn_at, len(raw) - scan.torn_at)
        self.lsn = last_lsn + 1 if last_lsn is not None else 0
        for info, c in zip(self.damage, follows, strict=True):
            info["follows"] = dict(c)

    def _damage(
        self,
        name: str,
        region: F.Region,
        last_lsn: int | None,
        follows: list[Counter[str]],
        missing: bool = False,
    ) -> dict[str, Any]:
        """What one unreadable region (or a gap in the lsns) cost: lost lsns, where."""
        before = region.lsn_before if region.lsn_before is not None else last_lsn
        after = region.lsn_after
        lost = (after - before - 1) if before is not None and after is not None else None
        info = {
            "segment": name,
            "start": region.start,
            "end": region.end,
            "what": (
                f"records {before + 1}-{after - 1} missing before byte {region.start}"
                if missing and before is not None and after is not None
                else region.describe()
            ),
            "lsn_from": before + 1 if before is not None else None,
            "lsn_to": after - 1 if after is not None else None,
            "records_lost": lost,
            "max_records_lost": lost if lost is not None else max(1, region.end - region.start),
        }
        self.damage.append(info)
        follows.append(Counter())
        return info

    @staticmethod
    def _decode(body: memoryview) -> tuple[dict[str, Any], list[bytes]]:
        (meta_len,) = _META.unpack_from(body)
        meta = msgpack.unpackb(body[_META.size : _META.size + meta_len], raw=False)
        blobs, at = [], _META.size + meta_len
        for n in meta.get("n", ()):
            blobs.append(bytes(body[at : at + n]))
            at += n
        return meta, blobs

    def set_aside(self) -> list[Path]:
        """Keep every damaged segment in `damaged/` (never compacted) and rewrite it in place
        with its intact records and one DAMAGE record per lost region, so the live log reads
        clean again and still says what was lost. Returns the copies kept."""
        by_segment: dict[str, list[dict[str, Any]]] = {}
        for info in self.damage:
            by_segment.setdefault(info["segment"], []).append(info)
        aside = self.dir / DAMAGED_DIR
        aside.mkdir(exist_ok=True)
        kept = []
        for name, infos in by_segment.items():
            path = self.dir / name
            raw = path.read_bytes()
            scan = F.scan(raw, last=False)
            out: list[bytes | memoryview] = [F.segment_header()]
            todo = sorted(infos, key=lambda i: i["start"])
            for rec in scan.records:
                while todo and todo[0]["start"] <= rec.offset:
                    out += self._damage_record(todo.pop(0))
                out.append(memoryview(raw)[rec.offset : rec.offset + F.HEADER + len(rec.body)])
            for info in todo:
                out += self._damage_record(info)
            copy = aside / name
            n = 1
            while copy.exists():
                copy, n = aside / f"{name}.{n}", n + 1
            os.link(path, copy)  # the damaged bytes stay, under damaged/, before the rewrite
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.writelines(out)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            kept.append(copy)
            if self.torn is not None and self._path(self.torn[0]) == path:
                self.torn_bytes += self.torn[2]  # not copied into the rewrite
                self.torn = None
        self._fsync_dir(force=True)
        return kept

    def _damage_record(self, info: dict[str, Any]) -> list[bytes | memoryview]:
        """A DAMAGE record standing in for a lost region: its lsn is the last lost one, so the
        lsns run on without a gap (when nothing after the region survived: the next free one)."""
        lsn = info["lsn_to"] if info["lsn_to"] is not None else self.lsn
        if info["lsn_to"] is None:
            self.lsn += 1
        meta = {**{k: v for k, v in info.items() if k != "follows"}, "accepted": True}
        return self._frame(DAMAGE, lsn, meta, ())

    # ---------------------------------------------------------------- appending
    def open(self) -> None:
        """Cut off a torn tail, then start a fresh segment (an old tail is never appended to)."""
        if self.torn is not None:
            index, offset, nbytes = self.torn
            with open(self._path(index), "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
            self.torn_bytes += nbytes
            log.warning(
                "WAL %s: torn tail of %d B at byte %d cut off (a write cut short by a crash: "
                "never acknowledged)",
                self._path(index).name,
                nbytes,
                offset,
            )
            self.torn = None
        self.disk.make_reserve()
        self.disk.check()
        known = self.segments()
        self._roll(max(known, default=0) + 1)

    def _roll(self, index: int) -> None:
        if self._fd is not None:
            if not self._write_pending():
                return  # the disk is full: stay in this segment until its records are out
            os.close(self._fd)
            self._fd = None
        fd = os.open(self._path(index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fd, self.segment = fd, index
        self._refs.setdefault(index, 0)
        self._size = self._on_disk = os.fstat(fd).st_size
        if self._size == 0:
            self._pending.append(F.segment_header())
            self._size = F.SEGMENT_HEADER
        self.append(SNAPSHOT, self._snapshot())
        if self._write_pending():
            self._fsync_dir()

    def _frame(
        self, rtype: int, lsn: int, meta: dict[str, Any], blobs: Sequence
    ) -> list[bytes | memoryview]:
        if blobs:
            meta = {**meta, "n": [len(b) for b in blobs]}
        packed = msgpack.packb(meta, use_bin_type=True)
        parts = [_META.pack(len(packed)), packed, *(memoryview(b) for b in blobs)]
        return [F.record_header(rtype, lsn, parts), *parts]

    def append(self, rtype: int, meta: dict[str, Any], blobs: Sequence = ()) -> int:
        """Queue one record; return the segment it lands in. Durable after the next `sync`.

        `blobs` (buffers: bytes, memoryview, zmq.Frame) are kept by reference until written.
        """
        if self._size >= self.segment_bytes and rtype != SNAPSHOT:
            self._roll(self.segment + 1)
        chunks = self._frame(rtype, self.lsn, meta, blobs)
        self.lsn += 1
        self._pending.extend(chunks)
        nbytes = sum(memoryview(c).nbytes for c in chunks)
        self._size += nbytes
        self.disk.spent += nbytes
        return self.segment

    def room(self, nbytes: int) -> bool:
        """Whether a put of `nbytes` of payload fits on the disk now (see `disk.py`); False
        enters the full state."""
        return self.disk.room(nbytes + _PUT_OVERHEAD)

    def _write_pending(self) -> bool:
        """Write what is queued; False when the disk refused it (cut back, kept queued)."""
        if not self._pending or self._fd is None:
            return True
        # writev takes at most IOV_MAX (1024 on Linux) buffers per call.
        while self._pending:
            part = self._pending[:1024]
            want = sum(memoryview(c).nbytes for c in part)
            try:
                done = os.writev(self._fd, part)
                if done != want:  # a short write: finish it byte-exactly
                    os.write(self._fd, b"".join(part)[done:])
            except OSError as e:
                if e.errno not in DISK_FULL:
                    raise
                os.ftruncate(self._fd, self._on_disk)  # no half record stays behind
                if self.disk.refused(e):
                    continue  # the reserve was given back: try once more
                return False
            del self._pending[:1024]
            self._on_disk += want
            self.bytes_written += want
        return True

    @property
    def stuck(self) -> bool:
        """Records are queued that the disk refused: nothing that appends may be answered."""
        return bool(self._pending) and self.disk.full

    @property
    def full(self) -> bool:
        """The disk refused a write and has not yet given the space back: puts are refused."""
        return self.disk.full

    def sync(self) -> bool:
        """Write queued records (fsync them with `wal_sync = "fsync"`); True when all are."""
        had = bool(self._pending)
        if not self._write_pending():
            return False
        if had:
            self.disk.check()  # one statvfs: the low-space warning comes before the disk is full
        if had and self.sync_mode == "fsync" and self._fd is not None:
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                if e.errno not in DISK_FULL:
                    raise
                self.disk.refused(e)
                return False
        return True

    def check_space(self) -> None:
        """Warn below the low-space mark; leave the full state once space is back."""
        self.disk.check()

    def retain(self, segment: int) -> None:
        self._refs[segment] = self._refs.get(segment, 0) + 1

    def release(self, segment: int) -> None:
        self._refs[segment] -= 1

    def compact(self) -> None:
        """Delete the oldest segments while none of their groups is live (never the current)."""
        for index in sorted(self._refs):
            if index >= self.segment or self._refs[index] > 0:
                break
            self._path(index).unlink(missing_ok=True)
            del self._refs[index]
            self.segments_deleted += 1

    def _fsync_dir(self, force: bool = False) -> None:
        if force or self.sync_mode == "fsync":
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def stats(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "segments": len(self._refs),
            "bytes_written": self.bytes_written,
            "segments_deleted": self.segments_deleted,
            "torn_tail_bytes": self.torn_bytes,
            "damaged_regions": len(self.damage),
            "bytes_queued": sum(memoryview(c).nbytes for c in self._pending),
            **self.disk.stats(),
        }

    def close(self) -> None:
        if self._fd is not None:
            if not self.sync():
                log.error(
                    "WAL %s: %d B of records could not be written (disk full); they were never "
                    "acknowledged",
                    self.dir,
                    sum(memoryview(c).nbytes for c in self._pending),
                )
            os.close(self._fd)
            self._fd = None
