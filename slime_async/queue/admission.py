"""The buffer's staleness policy: how many new groups producers may start, and which held groups
are too old to train on.

With the learner at version v (announced after its weights reached the engines), a group started
now is behind at most (max_staleness + 1) * groups_per_step - 1 others: the batch in training
(delivered, neither committed nor followed by a new version), then the buffered, pending and
granted ones. So it is trained at version <= v + max_staleness: the bound holds by construction,
and with max_staleness = 0 generation waits for each step (synchronous RL). A group that is late
anyway (a producer ignoring admission, a slow multi-turn rollout) is dropped once
`version - oldest model-token version > max_staleness`, unless already delivered.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from slime_async.config.buffer import BufferConfig
from slime_async.queue.lineage import Line

NO_VERSION = 1 << 62
"""A group's oldest version while it has no model token: it does not bound the staleness."""


@dataclass
class _Grants:
    n: int = 0
    last_heard: float = field(default_factory=time.monotonic)


class Admission:
    """The learner's clock (version, step size), the staleness budget, and grants per producer.

    Grants not used within `grant_timeout_s` of a producer's last message are released, so a
    producer that died does not hold the budget for ever.
    """

    def __init__(self, cfg: BufferConfig, counts: Counter[str]):
        self.max_staleness = cfg.max_staleness
        self.grant_timeout_s = cfg.grant_timeout_s
        self.version = 0
        self.groups_per_step = cfg.groups_per_step
        self._counts = counts  # the buffer's counters: "granted", "grants_expired"
        self._grants: dict[str, _Grants] = {}
        self.fixed = FixedLag(cfg.fixed_lag) if cfg.fixed_lag is not None else None
        """`buffer.fixed_lag`: grants per version, delivery of one version (None: off)."""
        self._line = Line()

    @property
    def line(self) -> Line:
        """The run's line of weights: staleness counts updates along it (`lineage.py`)."""
        return self._line

    @line.setter
    def line(self, line: Line) -> None:
        self._line = line
        if self.fixed is not None:
            self.fixed.line = line

    # ---------------------------------------------------------------- staleness
    def set_version(self, version: int, groups_per_step: int) -> bool:
        """The learner announced a version; True when it is a new one."""
        new = version != self.version
        self.version, self.groups_per_step = version, groups_per_step
        if self.fixed is not None:
            self.fixed.on_version(version)
        return new

    def staleness(self, oldest: int) -> int:
        """Updates between a group's oldest model token and the learner's version, along the
        run's line of weights (0 without a model token)."""
        return self.line.distance(oldest, self.version) if oldest != NO_VERSION else 0

    def is_stale(self, oldest: int) -> bool:
        return self.staleness(oldest) > self.max_staleness

    # ---------------------------------------------------------------- grants
    @property
    def budget(self) -> int:
        """Groups that may be in flight at once: held, in training, or granted."""
        return (self.max_staleness + 1) * self.groups_per_step

    @property
    def outstanding(self) -> int:
        return sum(g.n for g in self._grants.values())

    def heard_from(self, producer: str) -> None:
        """Any message from `producer` keeps its grants alive."""
        g = self._grants.get(producer)
        if g is None:
            self._grants[producer] = _Grants()
        else:
            g.last_heard = time.monotonic()

    def grant(self, producer: str, want: int, held: int) -> int:
        """How many of `want` new groups `producer` may start, `held` groups being in flight."""
        self.expire()
        self.heard_from(producer)
        if self.fixed is not None:  # one batch per version, whatever is held
            free = self.fixed.grantable(self.version, self.groups_per_step)
        else:
            free = self.budget - held - self.outstanding
        n = max(0, min(want, free))
        self._grants[producer].n += n
        if self.fixed is not None:
            self.fixed.granted[self.version] += n
        self._counts["granted"] += n
        return n

    def holds(self, producer: str) -> int:
        """Grants `producer` holds and has not used."""
        g = self._grants.get(producer)
        return g.n if g is not None else 0

    def use(self, producer: str) -> bool:
        """A new group of `producer` arrived: one of its grants (if any) is used up; False when
        it had none (the group came unasked)."""
        g = self._grants.get(producer)
        if g is not None and g.n > 0:
            g.n -= 1
            return True
        return False

    def void(self, producer: str) -> None:
        """`producer` restarted: grants of its earlier life are released (counted as expired),
        or they would count against the budget for ever (it heartbeats under the same id)."""
        g = self._grants.get(producer)
        if g is not None and g.n:
            self._counts["grants_expired"] += g.n
            self._release(g.n)
            g.n = 0

    def forget(self, producer: str) -> None:
        """`producer` is gone for good: release its grants (counted as expired) and its entry."""
        g = self._grants.pop(producer, None)
        if g is not None and g.n:
            self._counts["grants_expired"] += g.n
            self._release(g.n)

    def expire(self) -> None:
        """Release the grants of producers not heard from within `grant_timeout_s`."""
        horizon = time.monotonic() - self.grant_timeout_s
        for g in self._grants.values():
            if g.n and g.last_heard < horizon:
                self._counts["grants_expired"] += g.n
                self._release(g.n)
                g.n = 0

    def _release(self, n: int) -> None:
        if self.fixed is not None:
            self.fixed.release(self.version, n)


# ------------------------------------------------------------------------------- fixed lag
FIXED_LAG_LATE = "fixed_lag_late"
"""Drop reason: a group generated before version - fixed_lag (it could only be trained later)."""
FIXED_LAG_SPANS = "fixed_lag_spans_versions"
"""Drop reason: a group whose model tokens come from more than one policy version."""


class FixedLag:
    """`buffer.fixed_lag = k`: the batch trained at version v holds exactly the groups generated
    at version v - k.

    - Admission grants `groups_per_step` groups per announced version, `(k + 1) x groups_per_step`
      at the first one (the batches of the first k steps: their lag ramps 0..k-1, as no older
      policy exists; from step k + 1 on it is exactly k). Generation never runs further ahead.
    - Delivery at version v takes only ready groups whose tokens all come from `target(v)` =
      max(v - k, first version).
    - Groups older than the target can never be trained at lag k: dropped ("fixed_lag_late").
      A group whose model tokens span versions (a weight update during its rollout) is dropped
      at arrival ("fixed_lag_spans_versions"); the learner prevents both by holding each push
      until the groups of the version the engines serve have arrived (`stats()["arrived"]`).
    """

    def __init__(self, k: int):
        self.k = k
        self.first: int | None = None
        """The first version announced (the ramp's base)."""
        self.granted: Counter[int] = Counter()
        """Groups granted per version."""
        self.arrived: Counter[int] = Counter()
        """Complete groups that arrived per version (dropped ones not counted)."""
        self._span: dict[str, tuple[int, int]] = {}  # group id -> (oldest, newest) model token
        self._spanning: list[str] = []  # complete groups spanning versions, to be dropped
        self.line = Line()
        """The run's line of weights: the lag counts updates along it (a restart's break)."""

    def on_version(self, version: int) -> None:
        if self.first is None:
            self.first = version

    def _target_position(self, version: int) -> int:
        first = self.first if self.first is not None else 0
        base = 0 if self.line.superseded(first) else self.line.position(first)
        return max(self.line.position(version) - self.k, base)

    def target(self, version: int) -> int:
        """The version whose groups are trained at `version` (k updates back along the line)."""
        return self.line.version_at(self._target_position(version))

    def on_target(self, oldest: int, version: int) -> bool:
        """A group whose tokens come from `oldest` is trained at `version` (a version and the
        fresh one that names its weights after a restart both are)."""
        line = self.line
        return not line.superseded(oldest) and line.position(oldest) == self._target_position(
            version
        )

    def quota(self, version: int, groups_per_step: int) -> int:
        """Groups to generate at `version`: one batch, k + 1 at the first version."""
        first = version == (self.first if self.first is not None else 0)
        return groups_per_step * (self.k + 1 if first else 1)

    def grantable(self, version: int, groups_per_step: int) -> int:
        return max(0, self.quota(version, groups_per_step) - self.granted[version])

    def release(self, version: int, n: int) -> None:
        """`n` grants at `version` were never used (expired, voided): grant them again."""
        self.granted[version] = max(self.arrived[version], self.granted[version] - n)

    def observe(self, group_id: str, oldest: int | None, newest: int | None) -> None:
        """One trajectory of `group_id` arrived with these model-token versions."""
        if oldest is None or newest is None:
            return
        lo, hi = self._span.get(group_id, (oldest, newest))
        self._span[group_id] = (min(lo, oldest), max(hi, newest))

    def completed(self, group_id: str, version: int) -> None:
        """`group_id` is complete, its oldest model token at `version`: counted as arrived for
        that version, or queued for a drop when its tokens span versions (`take_spanning`)."""
        lo, hi = self._span.pop(group_id, (version, version))
        if lo != hi:
            self._spanning.append(group_id)
        else:
            self.arrived[version] += 1

    def take_spanning(self) -> list[str]:
        out, self._spanning = self._spanning, []
        return out

    def is_late(self, oldest: int, version: int) -> bool:
        line = self.line
        return line.superseded(oldest) or line.position(oldest) < self._target_position(version)

    def stats(self, version: int, groups_per_step: int) -> dict[str, int]:
        return {
            "k": self.k,
            "version": version,
            "target": self.target(version),
            "quota": self.quota(version, groups_per_step),
            "granted": self.granted[version],
            "arrived": self.arrived[version],
        }
