"""What a damaged write-ahead log cost the buffer, in its own terms: batches and groups.

The log (`wal/`) says where records could not be read and how many; replay places each such
region in the stream of records, so the buffer knows the newest batch id before it and the first
one delivered after it. The batches between (at most one per lost record) may have been
delivered in the lost records: the buffer no longer holds them, and says so to a learner that
resumes past them instead of refusing its commit. Groups held before the damage may have been
delivered in it too (their DELIVER record lost): they can be delivered again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_SHOWN = 4
"""Regions named one by one in a message; the rest are counted."""


class WalDamaged(RuntimeError):
    """The buffer refuses to start: its log lost records (`buffer.wal_on_damage = "refuse"`)."""


@dataclass
class Loss:
    """One unreadable region of the log, placed among the buffer's batches."""

    info: dict[str, Any]
    """The log's account: segment, start, end, what, lsn_from, lsn_to, records_lost, follows."""
    batch_before: int
    """The newest batch id the buffer knew when replay met the damage."""
    batch_after: int | None = None
    """The first batch id delivered after it (None: none)."""
    held_before: set[str] = field(default_factory=set)
    """Groups held when replay met it: their delivery may be among the lost records."""

    def batches(self) -> tuple[int, int] | None:
        """The batch ids the lost records may have delivered, [first, last], or None."""
        lo = self.batch_before + 1
        most = int(self.info.get("max_records_lost") or 1)
        hi = self.batch_after - 1 if self.batch_after is not None else self.batch_before + most
        return (lo, hi) if hi >= lo else None

    def where(self) -> str:
        i = self.info
        lost = i.get("records_lost")
        count = f"{lost} record(s)" if lost is not None else "an unknown number of records"
        lsns = f" (lsn {i['lsn_from']}-{i['lsn_to']})" if i.get("lsn_to") is not None else ""
        return f"{i['segment']} {i['what']}: {count} lost{lsns}"


def describe(losses: list[Loss], may_repeat: int, lost_groups: int) -> str:
    """One message about every region: where, how many records, what follows, what it costs."""
    parts = [loss.where() for loss in losses[:MAX_SHOWN]]
    if len(losses) > MAX_SHOWN:
        parts.append(f"and {len(losses) - MAX_SHOWN} more region(s)")
    follows: dict[str, int] = {}
    for name, n in (losses[0].info.get("follows") or {}).items():
        follows[name] = follows.get(name, 0) + n
    after = ", ".join(f"{n} {name}" for name, n in sorted(follows.items())) or "none"
    batches = [b for loss in losses if (b := loss.batches()) is not None]
    cost = [f"intact records after the first region: {after}"]
    if batches:
        cost.append(
            "batches the lost records may have delivered: "
            + ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in batches)
        )
    if lost_groups:
        cost.append(f"{lost_groups} group(s) named by later records are gone")
    if may_repeat:
        cost.append(f"{may_repeat} held group(s) may have been delivered in them (sent again)")
    return "; ".join(parts) + ". " + "; ".join(cost)
