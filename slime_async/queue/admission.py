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

    # ---------------------------------------------------------------- staleness
    def set_version(self, version: int, groups_per_step: int) -> bool:
        """The learner announced a version; True when it is a new one."""
        new = version != self.version
        self.version, self.groups_per_step = version, groups_per_step
        return new

    def staleness(self, oldest: int) -> int:
        """Versions between the learner's and a group's oldest model token (0 without any)."""
        return self.version - oldest if oldest != NO_VERSION else 0

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
        free = self.budget - held - self.outstanding
        n = max(0, min(want, free))
        self._grants[producer].n += n
        self._counts["granted"] += n
        return n

    def use(self, producer: str) -> None:
        """A new group of `producer` arrived: one of its grants (if any) is used up."""
        g = self._grants.get(producer)
        if g is not None and g.n > 0:
            g.n -= 1

    def void(self, producer: str) -> None:
        """`producer` restarted: grants of its earlier life are released (counted as expired),
        or they would count against the budget for ever (it heartbeats under the same id)."""
        g = self._grants.get(producer)
        if g is not None and g.n:
            self._counts["grants_expired"] += g.n
            g.n = 0

    def forget(self, producer: str) -> None:
        """`producer` is gone for good: release its grants (counted as expired) and its entry."""
        g = self._grants.pop(producer, None)
        if g is not None and g.n:
            self._counts["grants_expired"] += g.n

    def expire(self) -> None:
        """Release the grants of producers not heard from within `grant_timeout_s`."""
        horizon = time.monotonic() - self.grant_timeout_s
        for g in self._grants.values():
            if g.n and g.last_heard < horizon:
                self._counts["grants_expired"] += g.n
                g.n = 0
