"""The run's line of weights: which policy versions still name weights the learner descends
from, which name weights the run has left behind, and how many updates lie between two versions.

A learner restarted from a checkpoint at version c cannot take up the version numbers its dead
predecessor used after c (c+1 .. H: weights that no longer exist on the learner's path), and must
not reuse them for its own weights. It pushes the checkpoint's weights under a fresh version F,
greater than every version the run has used, and the run's line gets a break (c, F):

    versions  0 1 2 ... c | c+1 ... H ... F-1 | F F+1 ...
    line      0 1 2 ... c | superseded        | c c+1 ...     (F names c's weights)

A `Line` is the list of its breaks, oldest first: each `(cut, fresh)` has cut < fresh, and the
next break's cut is at or after this one's fresh (a later learner continues from a checkpoint of
the current segment). So every version names one set of weights, versions only go up, and:

- `superseded(v)`: v lies in a gap (cut, fresh) of some break: tokens of v come from weights the
  run left behind; they have no staleness on the current line.
- `position(v)`: the number of updates from version 0 to v along the line (v minus the gaps
  below it, each fresh version counting as its cut). Staleness is a difference of positions, so a
  break costs none: a token of c is 0 updates behind F.

The learner records the line in every checkpoint and announces it with its version; the buffer
keeps it in its write-ahead log, measures staleness with it and drops (or, with a stale policy
that keeps stale groups, counts) the groups that hold superseded tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

SUPERSEDED_POSITION = -(1 << 40)
"""`positions()` of a superseded version: every distance from it exceeds any bound."""


class LineError(ValueError):
    """A line (or a break of it) that cannot be right; the message names what is wrong."""


@dataclass(frozen=True)
class Line:
    """The breaks of the run's line of weights (see the module docstring); empty: no restart."""

    breaks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        floor = 0
        for cut, fresh in self.breaks:
            if not (isinstance(cut, int) and isinstance(fresh, int)):
                raise LineError(f"break {(cut, fresh)!r}: versions must be integers")
            if cut < floor or fresh <= cut:
                raise LineError(
                    f"break ({cut}, {fresh}): needs {floor} <= cut < fresh (breaks in order, "
                    "each cut at or after the previous fresh version)"
                )
            floor = fresh

    @classmethod
    def parse(cls, value: Iterable[Sequence[int]] | None) -> Line:
        """From the wire or a checkpoint: a list of [cut, fresh] pairs (None: no breaks)."""
        if value is None:
            return cls()
        try:
            pairs = tuple((int(c), int(f)) for c, f in value)
        except (TypeError, ValueError) as e:
            raise LineError(f"lineage {value!r}: expected a list of [cut, fresh] pairs") from e
        return cls(pairs)

    def to_list(self) -> list[list[int]]:
        return [[c, f] for c, f in self.breaks]

    @property
    def start(self) -> int:
        """The first version of the current segment (the last fresh version; 0 without breaks)."""
        return self.breaks[-1][1] if self.breaks else 0

    def superseded(self, version: int) -> bool:
        return any(cut < version < fresh for cut, fresh in self.breaks)

    def position(self, version: int) -> int:
        """Updates from version 0 to `version` along the line (LineError if superseded)."""
        if self.superseded(version):
            raise LineError(f"version {version} is superseded (not on the run's line)")
        return version - sum(fresh - cut for cut, fresh in self.breaks if fresh <= version)

    def distance(self, older: int, newer: int) -> int:
        """Updates from `older` to `newer`; for a superseded `older`, newer - older (its version
        gap: callers check `superseded` first, as the distance means nothing then)."""
        if self.superseded(older) or self.superseded(newer):
            return newer - older
        return self.position(newer) - self.position(older)

    def positions(self, versions: np.ndarray) -> np.ndarray:
        """`position` of each version (int64); superseded ones are SUPERSEDED_POSITION."""
        v = np.asarray(versions, dtype=np.int64)
        out = v.copy()
        gone = np.zeros(v.shape, dtype=bool)
        for cut, fresh in self.breaks:
            gone |= (v > cut) & (v < fresh)
            out -= np.where(v >= fresh, fresh - cut, 0)
        return np.where(gone, SUPERSEDED_POSITION, out)

    def version_at(self, position: int) -> int:
        """The newest version at `position` on the line (a fresh version rather than its cut)."""
        for k in range(len(self.breaks) - 1, -1, -1):
            cut, fresh = self.breaks[k]
            at = self.position(cut)
            if position >= at:
                return fresh + (position - at)
        return position

    def any_superseded(self, versions: np.ndarray) -> bool:
        v = np.asarray(versions)
        return any(bool(((v > cut) & (v < fresh)).any()) for cut, fresh in self.breaks)

    def may_hold_superseded(self, oldest: int | None, newest: int | None) -> bool:
        """Whether tokens with versions in [oldest, newest] may include a superseded one (the
        cheap test before looking at every token)."""
        if oldest is None or newest is None:
            return False
        return any(oldest < fresh and newest > cut for cut, fresh in self.breaks)

    def branch(self, cut: int, fresh: int) -> Line:
        """The line of a learner that continues from the weights of version `cut` (on this line)
        under the fresh version `fresh`: the breaks up to `cut`'s segment, then (cut, fresh)."""
        if self.superseded(cut):
            raise LineError(f"cannot continue from version {cut}: it is superseded")
        kept = tuple(b for b in self.breaks if b[1] <= cut)
        return Line((*kept, (cut, fresh)))

    def contains_line(self, other: Line) -> bool:
        """`other`'s breaks are the first breaks of this line (this line extends it)."""
        return self.breaks[: len(other.breaks)] == other.breaks


def plan_restart(
    checkpoint_version: int,
    checkpoint_line: Line,
    buffer_line: Line,
    used: int,
) -> tuple[int, Line]:
    """The version and line a learner starts with, holding the weights of `checkpoint_version`
    (its checkpoint's, or the base model's 0) while the run has used versions up to `used` (the
    buffer's announced and seen versions, the engines' served ones, the line's fresh versions).

    No version beyond the checkpoint's was used: continue as is. Otherwise continue the
    checkpoint's weights under `used + 1` on a line with the break (checkpoint_version, used + 1).
    The buffer's line is the run's record when it still holds the checkpoint's version on the
    same position (it may know later breaks the checkpoint predates); else the checkpoint's own.
    """
    line = checkpoint_line
    if not buffer_line.superseded(checkpoint_version) and buffer_line.contains_line(
        checkpoint_line
    ):
        line = buffer_line
    used = max(used, line.start)
    if used <= checkpoint_version:
        return checkpoint_version, line
    fresh = used + 1
    return fresh, line.branch(checkpoint_version, fresh)
