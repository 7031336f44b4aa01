"""What the buffer stores: groups of trajectories, delivered batches, the ready queue in delivery
order, each producer's ledger of sequence numbers, and the rules a put must follow."""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from slime_async.queue.admission import NO_VERSION
from slime_async.queue.schema import Summary


class PutRejected(ValueError):
    """A request that can never be accepted (bad input); the message names the problem."""


def group_key(producer: str, group_id: str) -> str:
    """A group's key in the buffer: its id scoped to the producer that sent it, so a client
    that reuses another producer's group id opens a group of its own (the length prefix keeps
    the key unambiguous whatever characters the ids hold)."""
    return f"{len(producer)}:{producer}:{group_id}"


def unscoped(key: str) -> tuple[str, str]:
    """(producer, group id) of a group key."""
    n, _, rest = key.partition(":")
    return rest[: int(n)], rest[int(n) + 1 :]


def shown(key: str) -> str:
    """A group key as a person reads it: the group id, and its producer."""
    producer, group_id = unscoped(key)
    return f"{group_id!r} of producer {producer!r}"


def scoped(producer: str, trajs: list[Summary]) -> list[Summary]:
    """The summaries of a put by `producer` with their group ids turned into group keys."""
    return [replace(t, group_id=group_key(producer, t.group_id)) for t in trajs]


@dataclass
class Group:
    group_id: str
    """The group's key (`group_key`): its id scoped to its producer."""
    size: int
    blobs: list = field(default_factory=list)
    """Encoded trajectories as received (zmq.Frame, or bytes after recovery): forwarded as is."""
    traj_ids: set[str] = field(default_factory=set)
    nbytes: int = 0
    ntokens: int = 0
    oldest: int = NO_VERSION
    arrival: int = 0
    """Order of completion (ties in delivery order)."""
    segments: set[int] = field(default_factory=set)
    last_put: float = field(default_factory=time.monotonic)
    """When its last member arrived (incomplete groups expire after `group_timeout_s`)."""
    producer: str = ""
    granted: bool = False
    """Opened with one of its producer's grants (see `BufferState.admit` for what it costs)."""


@dataclass
class Delivered:
    batch_id: int
    consumer: str
    session: str
    groups: list[Group]


SEQ_WINDOW = 1 << 16
"""Most accepted sequence numbers remembered above a gap (a refused put leaves one)."""


@dataclass
class ProducerLedger:
    """The put sequence numbers the buffer accepted from one producer (deduplication). A refused
    put leaves a gap (its number stays free); at most SEQ_WINDOW numbers are kept above one."""

    done_below: int = 0
    """Every sequence number below this was accepted."""
    done: set[int] = field(default_factory=set)
    """Accepted sequence numbers at or above `done_below` (out-of-order after a busy reply)."""

    def seen(self, seq: int) -> bool:
        return seq < self.done_below or seq in self.done

    def mark(self, seq: int) -> None:
        self.done.add(seq)
        if len(self.done) > SEQ_WINDOW:
            self.done_below = min(self.done)
        while self.done_below in self.done:
            self.done.remove(self.done_below)
            self.done_below += 1

    def restart(self) -> int:
        """A new session continues above every number seen: close every gap below it."""
        self.done_below, self.done = self.next_seq, set()
        return self.done_below

    @property
    def next_seq(self) -> int:
        """Where a (re)started producer continues, so it never reuses an accepted number."""
        return max(self.done_below, max(self.done, default=-1) + 1)


class RecentIds:
    """The last `size` ids added, for membership tests (memory stays bounded)."""

    def __init__(self, size: int):
        self.size = size
        self._order: deque[str] = deque()
        self._set: set[str] = set()

    def add(self, gid: str) -> None:
        self._order.append(gid)
        self._set.add(gid)
        if len(self._order) > self.size:
            self._set.discard(self._order.popleft())

    def __contains__(self, gid: object) -> bool:
        return gid in self._set


class ReadyGroups:
    """Complete groups waiting for delivery, oldest (or freshest) policy version first."""

    def __init__(self, order: Literal["oldest_first", "freshest_first"]):
        self._groups: dict[str, Group] = {}
        # Delivery order without sorting per request: (key, key, group_id), removed lazily.
        self._order: list[tuple[int, int, str]] = []
        self._sign = 1 if order == "oldest_first" else -1
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, gid: object) -> bool:
        return gid in self._groups

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups.values())

    def get(self, gid: str) -> Group | None:
        return self._groups.get(gid)

    def add(self, g: Group) -> None:
        self._groups[g.group_id] = g
        self.tokens += g.ntokens
        heapq.heappush(self._order, (self._sign * g.oldest, self._sign * g.arrival, g.group_id))

    def pop(self, gid: str) -> Group | None:
        g = self._groups.pop(gid, None)
        if g is not None:
            self.tokens -= g.ntokens
        return g

    def choose(
        self, num_groups: int | None, num_tokens: int | None, first: Sequence[Group] = ()
    ) -> list[Group]:
        """The next groups to deliver, or [] when not enough are ready: exactly `num_groups`, or
        whole groups up to `num_tokens` (one group alone may exceed it); `first` (ready groups)
        ahead of the delivery order. The chosen groups leave the delivery order now: `pop` them."""
        if num_groups is not None and num_tokens is None and len(self._groups) < num_groups:
            return []
        if num_tokens is not None and num_groups is None and self.tokens < num_tokens:
            return []
        chosen: list[Group] = []
        popped: list[tuple[int, int, str]] = []
        tokens = 0
        taken: set[str] = set()
        for g in first:
            if num_groups is not None and len(chosen) >= num_groups:
                break
            if num_tokens is not None and chosen and tokens + g.ntokens > num_tokens:
                break
            chosen.append(g)
            taken.add(g.group_id)
            tokens += g.ntokens
        full = num_tokens is not None and bool(chosen) and len(chosen) < len(first)
        while self._order and not full and (num_groups is None or len(chosen) < num_groups):
            entry = self._order[0]
            g = self._groups.get(entry[2])
            if g is None or g.arrival != self._sign * entry[1]:
                heapq.heappop(self._order)  # delivered or dropped since it was queued
                continue
            if g.group_id in taken:  # chosen ahead of the order
                popped.append(heapq.heappop(self._order))
                continue
            if num_tokens is not None and chosen and tokens + g.ntokens > num_tokens:
                break  # the token budget is full
            popped.append(heapq.heappop(self._order))
            chosen.append(g)
            tokens += g.ntokens
        # Exactly num_groups, or the token budget filled (one group alone may exceed it).
        if (num_groups is not None and len(chosen) == num_groups) or (
            num_tokens is not None and (tokens >= num_tokens or len(chosen) < len(self._groups))
        ):
            return chosen
        for entry in popped:  # not enough yet: leave them queued
            heapq.heappush(self._order, entry)
        return []


def check_put(
    trajs: list[Summary],
    pending: dict[str, Group],
    ready: ReadyGroups,
    capacity_trajectories: int,
) -> dict[str, int]:
    """The groups a put starts (key -> size); `trajs` are scoped (`scoped`). PutRejected when
    it can never be stored: a size
    that disagrees with its group's, a group already complete, a trajectory id given twice,
    more trajectories than the group's size, a group larger than the whole buffer."""
    new_groups: dict[str, int] = {}
    for t in trajs:
        g = pending.get(t.group_id)
        size = g.size if g else new_groups.setdefault(t.group_id, t.group_size)
        if t.group_size != size:
            raise PutRejected(
                f"group_size: trajectory {t.id!r} says {t.group_size}, "
                f"group {shown(t.group_id)} has size {size}"
            )
        if t.group_id in ready:
            raise PutRejected(f"group_id: group {shown(t.group_id)} is already complete")
        if g and t.id in g.traj_ids:
            raise PutRejected(f"id: trajectory {t.id!r} is already in group {shown(t.group_id)}")
    ids = [t.id for t in trajs]
    if len(set(ids)) != len(ids):
        raise PutRejected("id: the same trajectory id appears twice in one message")
    for gid, n in Counter(t.group_id for t in trajs).items():
        g = pending.get(gid)
        have, size = (len(g.blobs), g.size) if g else (0, new_groups[gid])
        if have + n > size:
            raise PutRejected(
                f"group_size: group {shown(gid)} would hold {have + n} trajectories, size is {size}"
            )
    for gid, size in new_groups.items():
        if size > capacity_trajectories:
            raise PutRejected(
                f"group_size: group {shown(gid)} of {size} exceeds capacity_trajectories "
                f"{capacity_trajectories}"
            )
    return new_groups
