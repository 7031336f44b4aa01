"""The write-ahead log's on-disk format (version 2) and the scan that reads a segment back.

A segment opens with `SEGMENT_MAGIC` and the format version. Each record then is

    <4 B RECORD_MAGIC><u32 body length><u64 lsn><u8 type><u32 crc32 of body><u32 crc32 of the 21 B before>
    <body: u32 meta length, MessagePack meta, blobs...>

The record's own checksum covers its header, so a flipped bit in a length is caught before the
length is trusted, and the magic lets a reader find the next record after damage: it scans for
the magic and takes the first header whose checksum holds (Kafka's batch CRC and SQLite's page
checks follow the same idea: never trust a length that is not checked). Log sequence numbers
(`lsn`) run on across segments, so a reader also knows how many records a damaged region held.

`scan` classifies what is not an intact record:
- a torn tail: the last segment ends inside a record (a crash mid-write), or in zeros (space
  allocated but never written): records that were never acknowledged, cut off by `truncate`;
- damage: anything else (a bad checksum, garbage between records, a record whose bytes are all
  there but do not check out). Acknowledged data may be in it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

FORMAT_VERSION = 2
SEGMENT_MAGIC = b"SAWAL\r\n\x1a"
"""Starts every segment (the CR LF and ^Z catch a file mangled by a text-mode copy)."""
_SEGMENT = struct.Struct("<8sI")
SEGMENT_HEADER = _SEGMENT.size
RECORD_MAGIC = b"\xa7WR\x5c"
_HEAD = struct.Struct("<4sIQBI")  # magic, body length, lsn, type, body crc
_CHECK = struct.Struct("<I")  # crc of the fields above
HEADER = _HEAD.size + _CHECK.size

SNAPSHOT, PUT, DELIVER, COMMIT, DROP, VERSION, DAMAGE, LOST = 1, 2, 3, 4, 5, 6, 7, 8
NAMES = {
    SNAPSHOT: "SNAPSHOT",
    PUT: "PUT",
    DELIVER: "DELIVER",
    COMMIT: "COMMIT",
    DROP: "DROP",
    VERSION: "VERSION",
    DAMAGE: "DAMAGE",
    LOST: "LOST",
}


class WalFormatError(RuntimeError):
    """A segment this version cannot read (another format version, or not a segment at all)."""


def segment_header() -> bytes:
    return _SEGMENT.pack(SEGMENT_MAGIC, FORMAT_VERSION)


def record_header(rtype: int, lsn: int, parts: Sequence) -> bytes:
    """The header of a record whose body is `parts` (buffers), written in front of them."""
    crc, length = 0, 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        length += memoryview(part).nbytes
    head = _HEAD.pack(RECORD_MAGIC, length, lsn, rtype, crc)
    return head + _CHECK.pack(zlib.crc32(head))


@dataclass
class Record:
    offset: int
    lsn: int
    rtype: int
    body: memoryview


@dataclass
class Region:
    """Bytes `start`..`end` of a segment that hold no intact record."""

    start: int
    end: int
    records: list[tuple[int, int]] = field(default_factory=list)
    """(lsn, type) of records whose header checked out but whose body did not."""
    lsn_before: int | None = None
    """The last intact record before the region (None: none in this segment)."""
    lsn_after: int | None = None
    """The first intact record after it (None: none in this segment)."""

    def describe(self) -> str:
        what = ", ".join(f"{NAMES.get(t, t)} record {lsn}" for lsn, t in self.records)
        return f"bytes {self.start}-{self.end}" + (f" ({what} fails its checksum)" if what else "")


@dataclass
class Scan:
    records: list[Record]
    damage: list[Region]
    torn_at: int | None
    """Where a torn tail starts (None: the segment ends with an intact record)."""


def check_segment(data: bytes | memoryview, name: str) -> None:
    """WalFormatError unless `data` starts like a segment of this format version."""
    if len(data) < SEGMENT_HEADER:
        if bytes(data) == segment_header()[: len(data)]:
            return  # a segment torn before its header was whole: empty
        raise WalFormatError(f"{name}: not a write-ahead log segment of this format")
    magic, version = _SEGMENT.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        raise WalFormatError(
            f"{name}: written in write-ahead log format 1 by an older slime_async, or not a "
            f"segment at all; this version reads format {FORMAT_VERSION} only. Let the older "
            "version's run finish (the learner commits, the log empties), or move the directory "
            "away to start without it"
        )
    if version != FORMAT_VERSION:
        raise WalFormatError(
            f"{name}: write-ahead log format {version}; this version reads {FORMAT_VERSION}"
        )


def _header(data: memoryview, pos: int) -> tuple[int, int, int, int] | None:
    """(length, lsn, type, body crc) of a header whose checksum holds at `pos`, else None."""
    if pos + HEADER > len(data) or data[pos : pos + 4] != RECORD_MAGIC:
        return None
    (check,) = _CHECK.unpack_from(data, pos + _HEAD.size)
    if zlib.crc32(data[pos : pos + _HEAD.size]) != check:
        return None
    _, length, lsn, rtype, crc = _HEAD.unpack_from(data, pos)
    return length, lsn, rtype, crc


def _torn(data: memoryview, pos: int) -> bool:
    """The bytes from `pos` on are the start of one record cut off, or zeros."""
    rest = data[pos:]
    if not any(rest):
        return True
    if len(rest) < HEADER:
        n = min(len(rest), len(RECORD_MAGIC))
        return rest[:n] == RECORD_MAGIC[:n]
    h = _header(data, pos)
    return h is not None and pos + HEADER + h[0] > len(data)


def _resync(data: memoryview, start: int, raw: bytes) -> int | None:
    """The offset of the next header whose checksum holds, from `start` on."""
    at = raw.find(RECORD_MAGIC, start)
    while at != -1:
        if _header(data, at) is not None:
            return at
        at = raw.find(RECORD_MAGIC, at + 1)
    return None


def scan(raw: bytes, last: bool) -> Scan:
    """Every intact record of segment bytes `raw` (checked by `check_segment`), and what is not
    one: damage, or (in the `last` segment only) a torn tail."""
    data = memoryview(raw)
    out = Scan([], [], None)
    pos = SEGMENT_HEADER
    region: Region | None = None
    last_lsn: int | None = None
    while pos < len(data):
        h = _header(data, pos)
        if h is not None and pos + HEADER + h[0] <= len(data):
            length, lsn, rtype, crc = h
            body = data[pos + HEADER : pos + HEADER + length]
            end = pos + HEADER + length
            if zlib.crc32(body) == crc:
                if region is not None:
                    region.lsn_after = lsn
                    out.damage.append(region)
                    region = None
                out.records.append(Record(pos, lsn, rtype, body))
                last_lsn = lsn
            else:  # the header holds, the body does not: skip exactly this record
                region = region or Region(pos, end, lsn_before=last_lsn)
                region.end = end
                region.records.append((lsn, rtype))
            pos = end
            continue
        if last and region is None and _torn(data, pos) and _resync(data, pos + 1, raw) is None:
            out.torn_at = pos
            break
        nxt = _resync(data, pos + 1, raw)
        region = region or Region(pos, pos, lsn_before=last_lsn)
        region.end = nxt if nxt is not None else len(data)
        if nxt is None:
            break
        pos = nxt
    if region is not None:
        out.damage.append(region)
    return out
