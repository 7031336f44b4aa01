"""What the buffer holds and decides, without sockets: groups, staleness, admission, batches.

Every change goes through the write-ahead log first (when one is configured) and is applied by
the same `_apply_*` methods that recovery replays, so a restarted buffer rebuilds exactly the
acknowledged state. Lifecycle of a group:

    put (partial) -> pending --complete--> ready --get--> delivered --commit--> gone
                        \\________________________\\--stale--> dropped (counted by reason)

Delivered groups are never dropped for staleness: the consumer has them (and may be training).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_async.config.buffer import BufferConfig
from slime_async.queue import wal as W
from slime_async.queue.schema import Trajectory, decode_trajectory

_NO_VERSION = 1 << 62  # a trajectory without model tokens does not bound its group's staleness
_RECENT_DROPS = 65536  # how many dropped group ids are remembered to discard late members


class PutRejected(ValueError):
    """A put that can never be accepted (bad input); the message names the problem."""


@dataclass
class Group:
    group_id: str
    size: int
    blobs: list = field(default_factory=list)
    """Encoded trajectories as received (zmq.Frame, or bytes after recovery): forwarded as is."""
    traj_ids: set[str] = field(default_factory=set)
    nbytes: int = 0
    ntokens: int = 0
    oldest: int = _NO_VERSION
    arrival: int = 0
    """Order of completion (ties in delivery order)."""
    segments: set[int] = field(default_factory=set)


@dataclass
class Delivered:
    batch_id: int
    consumer: str
    session: str
    groups: list[Group]


@dataclass
class Producer:
    done_below: int = 0
    """Every sequence number below this was accepted."""
    done: set[int] = field(default_factory=set)
    """Accepted sequence numbers at or above `done_below` (out-of-order after a busy reply)."""
    grants: int = 0
    last_seen: float = field(default_factory=time.monotonic)

    def seen(self, seq: int) -> bool:
        return seq < self.done_below or seq in self.done

    def mark(self, seq: int) -> None:
        self.done.add(seq)
        while self.done_below in self.done:
            self.done.remove(self.done_below)
            self.done_below += 1


class BufferState:
    """Groups, batches and counters of one buffer; single-threaded (the server's loop)."""

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.version = 0
        self.groups_per_step = cfg.groups_per_step
        self.pending: dict[str, Group] = {}
        self.ready: dict[str, Group] = {}
        # Delivery order without sorting per request: (key, key, group_id), removed lazily.
        self._order: list[tuple[int, int, str]] = []
        self.ready_tokens = 0
        self._sign = 1 if cfg.order == "oldest_first" else -1
        self.delivered: dict[int, Delivered] = {}
        self.sessions: dict[str, str] = {}
        self.redeliver: dict[str, list[int]] = {}
        self.last_get: dict[str, tuple[str, int]] = {}
        self.producers: dict[str, Producer] = {}
        self.next_batch = 1
        # Batches delivered since the learner last announced a new version and not committed:
        # it is training on them, so they still count against the staleness budget.
        self.in_training: dict[int, int] = {}  # batch id -> groups
        # Group ids delivered recently: a producer that re-pushes one (it crashed between the
        # ack and saving its cursor) is answered "duplicate" instead of training on it twice.
        self._recent_done: deque[str] = deque()
        self._recent_done_set: set[str] = set()
        self.held_trajectories = 0
        self.held_bytes = 0
        self._arrivals = 0
        self._recent_drops: deque[str] = deque()
        self._recent_drop_set: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.dropped_trajectories: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.wal: W.WriteAheadLog | None = None
        self._replaying = False

    # ---------------------------------------------------------------- durability
    def attach_wal(self, wal: W.WriteAheadLog) -> None:
        """Replay `wal` into this (empty) state, then log new changes to it."""
        self.wal = wal
        self._replaying = True
        try:
            for rtype, rec, blobs in wal.replay():
                self._replay(rtype, rec, blobs)
        finally:
            self._replaying = False
        wal.open()
        wal.compact()

    def snapshot(self) -> dict[str, Any]:
        return {
            "producers": {p: [s.done_below, sorted(s.done)] for p, s in self.producers.items()},
            "next_batch": self.next_batch,
            "version": self.version,
            "groups_per_step": self.groups_per_step,
        }

    def _replay(self, rtype: int, rec: dict[str, Any], blobs: list[bytes]) -> None:
        if rtype == W.SNAPSHOT:
            for p, (below, done) in rec["producers"].items():
                st = self.producers.setdefault(p, Producer())
                st.done_below = max(st.done_below, below)
                st.done.update(done)
                st.done = {s for s in st.done if s >= st.done_below}
            self.next_batch = max(self.next_batch, rec["next_batch"])
            self.version, self.groups_per_step = rec["version"], rec["groups_per_step"]
        elif rtype == W.PUT:
            trajs = [decode_trajectory(b, copy=False) for b in blobs]
            self._apply_put(rec["p"], rec["s"], blobs, trajs)
        elif rtype == W.DELIVER:
            self._apply_deliver(rec["batch"], rec["c"], rec["sess"], rec["g"], rec["rid"])
        elif rtype == W.COMMIT:
            self._apply_commit(rec["batch"])
        elif rtype == W.DROP:
            self._apply_drop(rec["g"], rec["why"])
        elif rtype == W.VERSION:
            if rec["version"] != self.version:
                self.in_training.clear()
            self.version, self.groups_per_step = rec["version"], rec["groups_per_step"]

    def _log(self, rtype: int, payload: dict[str, Any], blobs: Sequence = ()) -> int:
        if self.wal is None or self._replaying:
            return self.wal.segment if self.wal else 0
        return self.wal.append(rtype, payload, blobs)

    # ---------------------------------------------------------------- producers
    def producer(self, pid: str) -> Producer:
        st = self.producers.get(pid)
        if st is None:
            st = self.producers[pid] = Producer()
        st.last_seen = time.monotonic()
        return st

    def put(self, pid: str, seq: int, blobs: list, trajs: list[Trajectory]) -> str:
        """Store one put; return "ok", "duplicate", "busy" (retry later) or "stale" (stored, but
        its group was already beyond max_staleness and was dropped). PutRejected: bad input."""
        st = self.producer(pid)
        if st.seen(seq):
            self.counts["duplicates"] += 1
            return "duplicate"
        if all(t.group_id in self.ready or t.group_id in self._recent_done_set for t in trajs):
            # The whole group is here already (a producer restarted between our ack and its
            # cursor save): acknowledge without storing it twice.
            st.mark(seq)
            self.counts["duplicate_groups"] += 1
            return "duplicate"
        new_groups: dict[str, int] = {}
        for t in trajs:
            g = self.pending.get(t.group_id)
            size = g.size if g else new_groups.setdefault(t.group_id, t.group_size)
            if t.group_size != size:
                raise PutRejected(
                    f"group_size: trajectory {t.id!r} says {t.group_size}, "
                    f"group {t.group_id!r} has size {size}"
                )
            if t.group_id in self.ready:
                raise PutRejected(f"group_id: group {t.group_id!r} is already complete")
            if g and t.id in g.traj_ids:
                raise PutRejected(f"id: trajectory {t.id!r} is already in group {t.group_id!r}")
        ids = [t.id for t in trajs]
        if len(set(ids)) != len(ids):
            raise PutRejected("id: the same trajectory id appears twice in one message")
        incoming = Counter(t.group_id for t in trajs)
        for gid, n in incoming.items():
            g = self.pending.get(gid)
            have, size = (len(g.blobs), g.size) if g else (0, new_groups[gid])
            if have + n > size:
                raise PutRejected(
                    f"group_size: group {gid!r} would hold {have + n} trajectories, size is {size}"
                )
        for gid, size in new_groups.items():
            if size > self.cfg.capacity_trajectories:
                raise PutRejected(
                    f"group_size: group {gid!r} of {size} exceeds capacity_trajectories "
                    f"{self.cfg.capacity_trajectories}"
                )
        nbytes = sum(len(b) for b in blobs)
        if nbytes > self.cfg.capacity_bytes:
            raise PutRejected(f"message of {nbytes} B exceeds capacity_bytes")
        if (
            self.held_trajectories + len(blobs) > self.cfg.capacity_trajectories
            or self.held_bytes + nbytes > self.cfg.capacity_bytes
        ):
            self.counts["busy"] += 1
            return "busy"
        for gid in new_groups:
            if gid not in self._recent_drop_set and st.grants > 0:
                st.grants -= 1
        self._log(W.PUT, {"p": pid, "s": seq}, blobs)
        self._apply_put(pid, seq, blobs, trajs)
        return "stale" if self.drop_stale([t.group_id for t in trajs]) else "ok"

    def _apply_put(self, pid: str, seq: int, blobs: list, trajs: list[Trajectory]) -> None:
        st = self.producers.setdefault(pid, Producer())
        if st.seen(seq):
            return
        st.mark(seq)
        self.counts["puts"] += 1
        segment = self.wal.segment if self.wal else 0
        for blob, t in zip(blobs, trajs, strict=True):
            self.counts["trajectories_in"] += 1
            if t.group_id in self._recent_drop_set:
                self.dropped["late_member_of_dropped_group"] += 1
                self.dropped_trajectories["late_member_of_dropped_group"] += 1
                continue
            g = self.pending.get(t.group_id)
            if g is None:
                g = self.pending[t.group_id] = Group(t.group_id, t.group_size)
            g.blobs.append(blob)
            g.traj_ids.add(t.id)
            g.nbytes += len(blob)
            g.ntokens += t.num_tokens
            oldest = t.oldest_version()
            if oldest is not None:
                g.oldest = min(g.oldest, oldest)
            if self.wal is not None and segment not in g.segments:
                g.segments.add(segment)
                self.wal.retain(segment)
            self.held_trajectories += 1
            self.held_bytes += len(blob)
            if len(g.blobs) == g.size:
                del self.pending[g.group_id]
                if g.oldest == _NO_VERSION:
                    g.oldest = self.version
                self._arrivals += 1
                g.arrival = self._arrivals
                self.ready[g.group_id] = g
                self.ready_tokens += g.ntokens
                key = (self._sign * g.oldest, self._sign * g.arrival, g.group_id)
                heapq.heappush(self._order, key)

    def admission(self, pid: str, want: int) -> int:
        """New groups `pid` may start now, within the staleness budget.

        With the learner at version v (announced after its weights reached the engines), a
        group started now is behind at most (max_staleness + 1) * groups_per_step - 1 others:
        the batch in training (delivered, neither committed nor followed by a new version),
        then the buffered, pending and granted ones. So it
        is trained at version <= v + max_staleness: the bound holds by construction, and with
        max_staleness = 0 generation waits for each step (synchronous RL).
        """
        self.expire_grants()
        st = self.producer(pid)
        budget = (self.cfg.max_staleness + 1) * self.groups_per_step
        outstanding = sum(p.grants for p in self.producers.values())
        held = len(self.pending) + len(self.ready) + sum(self.in_training.values())
        free = budget - held - outstanding
        grant = max(0, min(want, free))
        st.grants += grant
        self.counts["granted"] += grant
        return grant

    def expire_grants(self) -> None:
        """Release the grants of producers not heard from within `grant_timeout_s`."""
        horizon = time.monotonic() - self.cfg.grant_timeout_s
        for st in self.producers.values():
            if st.grants and st.last_seen < horizon:
                self.counts["grants_expired"] += st.grants
                st.grants = 0

    # ---------------------------------------------------------------- staleness
    def set_version(self, version: int, groups_per_step: int) -> None:
        if version != self.version:
            self.in_training.clear()  # the batches trained at the old version are done
        self.version, self.groups_per_step = version, groups_per_step
        self._log(W.VERSION, {"version": version, "groups_per_step": groups_per_step})
        self.drop_stale()

    def staleness(self, g: Group) -> int:
        return self.version - g.oldest if g.oldest != _NO_VERSION else 0

    def drop_stale(self, group_ids: list[str] | None = None) -> list[str]:
        """Drop held, undelivered groups beyond max_staleness (only `group_ids` if given)."""
        k = self.cfg.max_staleness
        if group_ids is None:
            candidates = [*self.ready.values(), *self.pending.values()]
        else:
            found = (self.ready.get(gid) or self.pending.get(gid) for gid in set(group_ids))
            candidates = [g for g in found if g is not None]
        stale = [g.group_id for g in candidates if self.staleness(g) > k]
        if stale:
            self._log(W.DROP, {"g": stale, "why": "stale"})
            self._apply_drop(stale, "stale")
        return stale

    def _apply_drop(self, group_ids: list[str], why: str) -> None:
        for gid in group_ids:
            g = self.pending.pop(gid, None)
            if g is None and (g := self.ready.pop(gid, None)) is not None:
                self.ready_tokens -= g.ntokens
            if g is None:
                continue
            self.dropped[why] += 1
            self.dropped_trajectories[why] += len(g.blobs)
            self._forget(g)
            self._recent_drops.append(gid)
            self._recent_drop_set.add(gid)
            if len(self._recent_drops) > _RECENT_DROPS:
                self._recent_drop_set.discard(self._recent_drops.popleft())

    def _forget(self, g: Group) -> None:
        self.held_trajectories -= len(g.blobs)
        self.held_bytes -= g.nbytes
        if self.wal is not None:
            for s in g.segments:
                self.wal.release(s)

    # ---------------------------------------------------------------- consumers
    def touch_session(self, consumer: str, session: str) -> None:
        """A new session of a consumer (it restarted): its uncommitted batches go out again."""
        if self.sessions.get(consumer) == session:
            return
        self.sessions[consumer] = session
        again = sorted(
            b.batch_id
            for b in self.delivered.values()
            if b.consumer == consumer and b.session != session
        )
        self.redeliver[consumer] = again
        self.last_get.pop(consumer, None)

    def get(
        self, consumer: str, session: str, rid: str, num_groups: int | None, num_tokens: int | None
    ) -> Delivered | None:
        """The next batch for `consumer`, or None when not enough is ready yet."""
        self.touch_session(consumer, session)
        last = self.last_get.get(consumer)
        if last and last[0] == rid and last[1] in self.delivered:
            return self.delivered[last[1]]  # a resend of a request whose reply was lost
        queue = self.redeliver.get(consumer)
        while queue:
            b = self.delivered.get(queue.pop(0))
            if b is not None:
                rec = {"batch": b.batch_id, "c": consumer, "sess": session, "g": [], "rid": rid}
                self._log(W.DELIVER, rec)
                self.counts["redelivered"] += 1
                return self._apply_deliver(b.batch_id, consumer, session, [], rid)
        chosen = self._choose(num_groups, num_tokens)
        if not chosen:
            return None
        gids = [g.group_id for g in chosen]
        batch_id = self.next_batch
        self._log(
            W.DELIVER, {"batch": batch_id, "c": consumer, "sess": session, "g": gids, "rid": rid}
        )
        for g in chosen:
            self.staleness_hist[self.staleness(g)] += 1
        return self._apply_deliver(batch_id, consumer, session, gids, rid)

    def _choose(self, num_groups: int | None, num_tokens: int | None) -> list[Group]:
        if num_groups is None and num_tokens is None:
            num_groups = self.groups_per_step
        if num_groups is not None and num_tokens is None and len(self.ready) < num_groups:
            return []
        if num_tokens is not None and num_groups is None and self.ready_tokens < num_tokens:
            return []
        chosen: list[Group] = []
        popped: list[tuple[int, int, str]] = []
        tokens = 0
        while self._order and (num_groups is None or len(chosen) < num_groups):
            entry = self._order[0]
            g = self.ready.get(entry[2])
            if g is None or g.arrival != self._sign * entry[1]:
                heapq.heappop(self._order)  # delivered or dropped since it was queued
                continue
            if num_tokens is not None and chosen and tokens + g.ntokens > num_tokens:
                break  # the token budget is full
            popped.append(heapq.heappop(self._order))
            chosen.append(g)
            tokens += g.ntokens
        # Exactly num_groups, or the token budget filled (one group alone may exceed it).
        if (num_groups is not None and len(chosen) == num_groups) or (
            num_tokens is not None and (tokens >= num_tokens or len(chosen) < len(self.ready))
        ):
            return chosen
        for entry in popped:  # not enough yet: leave them queued
            heapq.heappush(self._order, entry)
        return []

    def _apply_deliver(
        self, batch_id: int, consumer: str, session: str, gids: list[str], rid: str
    ) -> Delivered | None:
        self.next_batch = max(self.next_batch, batch_id + 1)
        # Logged with the request id, so a resent get answers with this batch even after a
        # buffer restart that lost the reply.
        self.last_get[consumer] = (rid, batch_id)
        if self._replaying:
            self.sessions[consumer] = session
        if batch_id in self.delivered:  # a redelivery to a new session
            self.delivered[batch_id].session = session
            return self.delivered[batch_id]
        groups = [g for gid in gids if (g := self.ready.pop(gid, None)) is not None]
        if not groups:
            return None
        self.ready_tokens -= sum(g.ntokens for g in groups)
        self.in_training[batch_id] = len(groups)
        for g in groups:
            self._recent_done.append(g.group_id)
            self._recent_done_set.add(g.group_id)
            if len(self._recent_done) > _RECENT_DROPS:
                self._recent_done_set.discard(self._recent_done.popleft())
        self.counts["delivered_batches"] += 1
        self.counts["delivered_groups"] += len(groups)
        b = self.delivered[batch_id] = Delivered(batch_id, consumer, session, groups)
        return b

    def commit(self, consumer: str, batch_id: int, through: bool = False) -> int:
        """Commit one batch (or every batch of `consumer` up to it); return how many."""
        ids = (
            sorted(b for b, d in self.delivered.items() if d.consumer == consumer and b <= batch_id)
            if through
            else [batch_id]
        )
        if not through and batch_id not in self.delivered:
            if batch_id >= self.next_batch:
                raise PutRejected(f"batch_id: batch {batch_id} was never delivered")
            return 0  # committed before (a resend after a lost reply)
        for b in ids:
            self._log(W.COMMIT, {"batch": b})
            self._apply_commit(b)
        return len(ids)

    def _apply_commit(self, batch_id: int) -> None:
        self.in_training.pop(batch_id, None)
        b = self.delivered.pop(batch_id, None)
        if b is None:
            return
        self.counts["committed_batches"] += 1
        for g in b.groups:
            self.counts["committed_groups"] += 1
            self.counts["committed_trajectories"] += len(g.blobs)
            self._forget(g)

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "groups_per_step": self.groups_per_step,
            "max_staleness": self.cfg.max_staleness,
            "groups_pending": len(self.pending),
            "groups_ready": len(self.ready),
            "batches_delivered_uncommitted": len(self.delivered),
            "trajectories_held": self.held_trajectories,
            "bytes_held": self.held_bytes,
            "grants_outstanding": sum(p.grants for p in self.producers.values()),
            "producers": len(self.producers),
            "counts": dict(self.counts),
            "dropped": dict(self.dropped),
            # Accounting in trajectories: counts.trajectories_in (acknowledged) ==
            # counts.committed_trajectories + sum(dropped_trajectories) + trajectories_held.
            "dropped_trajectories": dict(self.dropped_trajectories),
            "rejected": dict(self.rejected),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "wal": self.wal.stats() if self.wal else None,
        }
