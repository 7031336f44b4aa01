"""The buffer's write-ahead log: segment files of checksummed MessagePack records.

A record is `<u32 body length><u32 crc32 of type+body><u8 type><body>`, the body being
`<u32 meta length><MessagePack meta><blob><blob>...`: trajectory blobs are written as received
(the meta lists their lengths), never packed into another buffer. Each segment starts with a
SNAPSHOT record (the state that earlier, possibly deleted, segments would otherwise carry:
producer dedupe marks, next batch id, policy version), so recovery may begin at any segment.

Appends are gathered in memory and written with one `writev` per event-loop turn (`sync`), so a
burst of puts costs one system call (and one fsync with `wal_sync = "fsync"`). The buffer calls
`sync` before it sends the acks of that turn; with `wal_sync = "none"` it writes after them.

Compaction: every segment holds a reference count of the live groups with data in it. Segments
are deleted from the oldest end only, once none of their groups is live: a commit or drop record
about a group always lies in the same or a later segment than the group's data, so deleting a
prefix never resurrects a retired group. A torn record at the tail (crash mid-write) ends replay.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgpack

log = logging.getLogger(__name__)

SNAPSHOT, PUT, DELIVER, COMMIT, DROP, VERSION = 1, 2, 3, 4, 5, 6
_HEADER = struct.Struct("<IIB")
_META = struct.Struct("<I")
_NAME = re.compile(r"^wal-(\d{8})\.log$")


class WriteAheadLog:
    """Append-only segments in `directory`; see the module docstring for the format."""

    def __init__(
        self,
        directory: str | Path,
        sync: Literal["none", "flush", "fsync"],
        segment_bytes: int,
        snapshot: Callable[[], dict[str, Any]],
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sync_mode = sync
        self.segment_bytes = segment_bytes
        self._snapshot = snapshot
        self._refs: dict[int, int] = {}
        self._pending: list[bytes] = []
        self._fd: int | None = None
        self._size = 0
        self.segment = 0
        self.bytes_written = 0
        self.segments_deleted = 0

    def _path(self, index: int) -> Path:
        return self.dir / f"wal-{index:08d}.log"

    def segments(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def replay(self) -> Iterator[tuple[int, dict[str, Any], list[bytes]]]:
        """Yield (type, meta, blobs) of every intact record, oldest first; `self.segment` follows."""
        for index in self.segments():
            self.segment = index
            self._refs.setdefault(index, 0)
            data = self._path(index).read_bytes()
            pos = 0
            while pos + _HEADER.size <= len(data):
                length, crc, rtype = _HEADER.unpack_from(data, pos)
                body = data[pos + _HEADER.size : pos + _HEADER.size + length]
                if len(body) < length or zlib.crc32(bytes([rtype]) + body) != crc:
                    break
                pos += _HEADER.size + length
                (meta_len,) = _META.unpack_from(body)
                meta = msgpack.unpackb(body[_META.size : _META.size + meta_len], raw=False)
                blobs, at = [], _META.size + meta_len
                for n in meta.get("n", ()):
                    blobs.append(body[at : at + n])
                    at += n
                yield rtype, meta, blobs
            if pos != len(data):
                log.warning("WAL %s: torn or corrupt record at byte %d ignored", index, pos)

    def open(self) -> None:
        """Start a fresh segment (after replay, the old tail is never appended to)."""
        known = self.segments()
        self._roll(max(known, default=0) + 1)

    def _roll(self, index: int) -> None:
        if self._fd is not None:
            self._write_pending()
            os.close(self._fd)
        self.segment = index
        self._refs.setdefault(index, 0)
        self._fd = os.open(self._path(index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        self.append(SNAPSHOT, self._snapshot())
        self._write_pending()
        self._fsync_dir()

    def append(self, rtype: int, meta: dict[str, Any], blobs: Sequence = ()) -> int:
        """Queue one record; return the segment it lands in. Durable after the next `sync`.

        `blobs` (buffers: bytes, memoryview, zmq.Frame) are kept by reference until written.
        """
        if self._size >= self.segment_bytes and rtype != SNAPSHOT:
            self._roll(self.segment + 1)
        if blobs:
            meta = {**meta, "n": [len(b) for b in blobs]}
        packed = msgpack.packb(meta, use_bin_type=True)
        parts = [_META.pack(len(packed)), packed, *(memoryview(b) for b in blobs)]
        crc = zlib.crc32(bytes([rtype]))
        length = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
            length += len(part)
        self._pending.append(_HEADER.pack(length, crc, rtype))
        self._pending.extend(parts)
        self._size += _HEADER.size + length
        return self.segment

    def _write_pending(self) -> None:
        if not self._pending or self._fd is None:
            return
        chunks, self._pending = self._pending, []
        # writev takes at most IOV_MAX (1024 on Linux) buffers per call.
        for i in range(0, len(chunks), 1024):
            part = chunks[i : i + 1024]
            want = sum(memoryview(c).nbytes for c in part)
            done = os.writev(self._fd, part)
            if done != want:  # a short write: finish it byte-exactly
                os.write(self._fd, b"".join(part)[done:])
            self.bytes_written += want

    def sync(self) -> None:
        """Write queued records; fsync them when `wal_sync = "fsync"`."""
        had = bool(self._pending)
        self._write_pending()
        if had and self.sync_mode == "fsync" and self._fd is not None:
            os.fdatasync(self._fd)

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

    def _fsync_dir(self) -> None:
        if self.sync_mode == "fsync":
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def stats(self) -> dict[str, int]:
        return {
            "segment": self.segment,
            "segments": len(self._refs),
            "bytes_written": self.bytes_written,
            "segments_deleted": self.segments_deleted,
        }

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
