"""Disk space of the write-ahead log: a low-space warning, the full state, and a reserve.

A put is taken only when its record fits in the free space last seen (statvfs, read after each
write) minus what was queued since (`room`): otherwise the disk counts as full before any write
fails, and the put is refused. The reserve is a file of `buffer.wal_reserve_bytes` allocated at
start (`reserve` in the log's directory): when a write fails anyway with ENOSPC or EDQUOT (another
process filled the disk, a quota statvfs does not show), the log gives it back at once, so the
records already accepted in that turn, and the small DELIVER / COMMIT / VERSION records of
serving what the buffer holds, still find room while puts are refused. The full state ends by
itself once the reserve can be allocated again with at least as much space left beside it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESERVE = "reserve"
_MIN_FREE = 64 << 10
"""Free bytes needed to leave the full state without a reserve to allocate."""


class DiskSpace:
    """Free-space checks and the full state of the filesystem holding `directory`."""

    def __init__(self, directory: Path, reserve_bytes: int, low_space_bytes: int):
        self.dir = directory
        self.reserve_bytes = reserve_bytes
        self.low_space_bytes = low_space_bytes
        self.full = False
        self.since = 0.0
        self.error = ""
        """The last refusal, as the OS worded it."""
        self.full_events = 0
        self.low_space_warnings = 0
        self._warned = False
        self._has_reserve = False
        self._free_seen = 0
        self.spent = 0
        """Bytes queued for the log since `_free_seen` was read."""

    def free(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def make_reserve(self) -> bool:
        """Allocate the reserve file; False when the disk has no room for it."""
        if self._has_reserve or self.reserve_bytes <= 0:
            return True
        path = self.dir / RESERVE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            path.unlink(missing_ok=True)
            self.refused(e, quiet=True)
            return False
        self._has_reserve = True
        return True

    def room(self, nbytes: int) -> bool:
        """Whether a record of `nbytes` fits; entering the full state (logged) when not."""
        if self.full:
            return False
        if nbytes <= self._free_seen - self.spent:
            return True
        self.refused(OSError(28, f"a record of {nbytes} B does not fit"))
        return False

    def refused(self, e: OSError, quiet: bool = False) -> bool:
        """The disk refused a write: enter the full state (logged once per episode). True when
        the reserve was given back just now (the write is worth one more try)."""
        if not self.full:
            self.full, self.since, self.error = True, time.monotonic(), str(e)
            self.full_events += 1
            log.error(
                'WAL disk full at %s (%s, %d B free): puts are refused ("WAL disk full") until '
                "space returns; batches and commits of what is held are still served",
                self.dir,
                e.strerror or e,
                self._free_or_zero(),
            )
        elif not quiet:
            self.error = str(e)
        if self._has_reserve:
            (self.dir / RESERVE).unlink(missing_ok=True)
            self._has_reserve = False
            return True
        return False

    def _free_or_zero(self) -> int:
        try:
            return self.free()
        except OSError:
            return 0

    def check(self) -> None:
        """Warn once below the low-space mark; leave the full state when space came back."""
        free = self._free_seen = self._free_or_zero()
        self.spent = 0
        if self.low_space_bytes and free < self.low_space_bytes and not self._warned:
            self._warned = True
            self.low_space_warnings += 1
            log.warning(
                "WAL disk at %s: %d B free, below buffer.wal_low_space_bytes = %d; puts will be "
                "refused once it is full",
                self.dir,
                free,
                self.low_space_bytes,
            )
        elif free >= self.low_space_bytes * 1.1:
            self._warned = False
        if not self.full or free < max(2 * self.reserve_bytes, _MIN_FREE):
            return
        if self.make_reserve():
            log.info(
                "WAL disk at %s has room again (%d B free after %.0fs full): puts accepted",
                self.dir,
                self._free_or_zero(),
                time.monotonic() - self.since,
            )
            self.full = False
            self._free_seen, self.spent = self._free_or_zero(), 0

    def stats(self) -> dict[str, Any]:
        return {
            "disk_full": self.full,
            "disk_full_events": self.full_events,
            "low_space_warnings": self.low_space_warnings,
            "free_bytes": self._free_or_zero(),
        }
