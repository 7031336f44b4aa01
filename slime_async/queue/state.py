"""What the buffer holds, without sockets: groups, batches, producers' ledgers, counters.

Every change goes through the write-ahead log first (when one is configured) and is applied by
the same `_apply_*` methods that recovery replays, so a restarted buffer rebuilds exactly the
acknowledged state. Lifecycle of a group:

    put (partial) -> pending --complete--> ready --get--> delivered --commit--> gone
                        \\________________________\\--stale--> dropped (counted by reason)

Delivered groups are never dropped for staleness: the consumer has them (and may be training).
What is stale, and how many groups producers may start, is decided by `Admission`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from slime_async.config.buffer import BufferConfig
from slime_async.metrics import names as m
from slime_async.queue import wal as W
from slime_async.queue.admission import FIXED_LAG_LATE, FIXED_LAG_SPANS, NO_VERSION, Admission
from slime_async.queue.damage import Loss, WalDamaged, describe
from slime_async.queue.groups import (
    Delivered,
    Group,
    ProducerLedger,
    PutRejected,
    ReadyGroups,
    RecentIds,
    check_put,
    scoped,
    shown,
)
from slime_async.queue.lineage import SUPERSEDED_POSITION, Line, LineError
from slime_async.queue.messages import AckStatus
from slime_async.queue.schema import (
    SchemaError,
    Summary,
    Trajectory,
    decode_trajectory,
    summarize,
    validate_trajectory,
)

log = logging.getLogger(__name__)

_RECENT = 65536  # how many delivered / dropped group ids are remembered (late members, re-pushes)
MAX_VERSION = (1 << 31) - 1  # token versions travel as int32
AHEAD = 1
"""How far a token's version may run ahead of the learner's announced one: the learner pushes
weights, then announces; tokens of the new weights may arrive in between."""


class BufferState:
    """Groups, batches and counters of one buffer; single-threaded (the server's loop)."""

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.counts: Counter[str] = Counter()
        self.admission = Admission(cfg, self.counts)
        self.pending: dict[str, Group] = {}
        self.ready = ReadyGroups(cfg.order)
        self.delivered: dict[int, Delivered] = {}
        self.sessions: dict[str, str] = {}
        self.redeliver: dict[str, list[int]] = {}
        self.last_get: dict[str, tuple[str, int]] = {}
        self.producers: dict[str, ProducerLedger] = {}
        self.next_batch = 1
        # Batches delivered since the learner last announced a new version and not committed:
        # it is training on them, so they still count against the staleness budget.
        self.in_training: dict[int, int] = {}  # batch id -> groups
        # Group ids delivered recently: a producer that re-pushes one (it crashed between the
        # ack and saving its cursor) is answered "duplicate" instead of training on it twice.
        self._recent_done = RecentIds(_RECENT)
        # Group ids dropped recently: their late members are discarded, not grown into a group.
        self._recent_drops = RecentIds(_RECENT)
        self.held_trajectories = 0
        self.held_bytes = 0
        self._arrivals = 0
        self.dropped: Counter[str] = Counter()
        self.dropped_trajectories: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        # Groups dropped as stale: their trajectories' response lengths and rewards, to compare
        # with the ones trained on (stale drops select against slow, i.e. long, rollouts).
        self.dropped_stale: Counter[str] = Counter()
        self.wal: W.WriteAheadLog | None = None
        self._replaying = False
        self.announced = False
        """The learner announced a version in this buffer's life (or the WAL recorded one)."""
        self.losses: list[Loss] = []
        """Regions of the log that could not be read (accepted with wal_on_damage = "continue")."""
        self.lost_groups: list[str] = []
        """Groups that later records name but whose data was in lost records."""
        self.versions_used = 0
        """The highest version the run has used: announced, reserved by a line, or on a token."""
        self.superseded: set[str] = set()
        """Held groups with a model token of a superseded version (`lineage.Line`)."""
        self._on_line_oldest: dict[str, int | None] = {}
        """Ready superseded groups -> their oldest model-token version on the line (None: none
        is), read from their tokens once per line (`_oldest_on_line`)."""
        self.awaiting_learner = False
        """Restarted from a log that holds a learner's version: no grants until a learner
        announces in this buffer's life (the engines may have restarted from the base model, and
        a restarted learner may train uncommitted batches again first)."""

    @property
    def line(self) -> Line:
        """The run's line of weights, as the learner announced it last."""
        return self.admission.line

    @property
    def version(self) -> int:
        """The policy version the learner announced last."""
        return self.admission.version

    @property
    def groups_per_step(self) -> int:
        return self.admission.groups_per_step

    # ---------------------------------------------------------------- durability
    def attach_wal(self, wal: W.WriteAheadLog) -> None:
        """Replay `wal` into this (empty) state, then log new changes to it. WalDamaged when
        records could not be read and `buffer.wal_on_damage = "refuse"` (nothing is changed on
        disk then); with "continue" the damaged segments are set aside (`WriteAheadLog.set_aside`)
        and the buffer goes on with what was readable, saying what was lost."""
        self.wal = wal
        self._replaying = True
        try:
            for rtype, rec, blobs in wal.replay():
                self._replay(rtype, rec, blobs)
        finally:
            self._replaying = False
        fresh = [loss for loss in self.losses if not loss.info.get("accepted")]
        if fresh:
            ready = {g.group_id for g in self.ready}
            may_repeat = len({k for loss in fresh for k in loss.held_before} & ready)
            report = describe(fresh, may_repeat, len(self.lost_groups))
            if self.cfg.wal_on_damage == "refuse":
                raise WalDamaged(
                    f"write-ahead log in {wal.dir} is damaged: {report}. Acknowledged data in the "
                    "lost records cannot be accounted for, so the buffer does not start. Restore "
                    'the segment from a copy, or set buffer.wal_on_damage = "continue" to start '
                    "with what is readable (the damaged segment is kept in "
                    f"{wal.dir / W.DAMAGED_DIR}, the learner is told which batches are gone)"
                )
            kept = wal.set_aside()
            self.counts[m.BUF_WAL_DAMAGED_REGIONS] += len(fresh)
            self.counts[m.BUF_WAL_GROUPS_LOST] += len(self.lost_groups)
            self.counts[m.BUF_WAL_MAY_REPEAT] += may_repeat
            log.error(
                "write-ahead log damaged, continuing without the lost records "
                '(buffer.wal_on_damage = "continue"): %s. Damaged segment(s) kept as %s',
                report,
                ", ".join(str(p) for p in kept),
            )
        wal.open()
        if wal.torn_bytes:
            self.counts[m.BUF_WAL_TORN_BYTES] += wal.torn_bytes
        wal.compact()
        self.awaiting_learner = self.announced
        if self.awaiting_learner:
            log.warning(
                "restarted at version %d: admission grants nothing until the learner announces "
                "its version again",
                self.version,
            )

    def snapshot(self) -> dict[str, Any]:
        return {
            "producers": {p: [s.done_below, sorted(s.done)] for p, s in self.producers.items()},
            "next_batch": self.next_batch,
            "version": self.version,
            "groups_per_step": self.groups_per_step,
            "announced": self.announced,
            "lineage": self.line.to_list(),
            "versions_used": self.versions_used,
        }

    def _replay(self, rtype: int, rec: dict[str, Any], blobs: list[bytes]) -> None:
        if rtype == W.SNAPSHOT:
            for p, (below, done) in rec["producers"].items():
                st = self.producers.setdefault(p, ProducerLedger())
                st.done_below = max(st.done_below, below)
                st.done.update(done)
                st.done = {s for s in st.done if s >= st.done_below}
            self.next_batch = max(self.next_batch, rec["next_batch"])
            self.admission.set_version(rec["version"], rec["groups_per_step"])
            self.announced = self.announced or rec.get("announced", rec["version"] > 0)
            if "lineage" in rec:
                self._apply_line(Line.parse(rec["lineage"]))
            self.versions_used = max(self.versions_used, rec.get("versions_used", 0))
        elif rtype == W.PUT:
            trajs = scoped(rec["p"], [validate_trajectory(b) for b in blobs])
            self._apply_put(rec["p"], rec["s"], blobs, trajs)
        elif rtype == W.DELIVER:
            self._apply_deliver(rec["batch"], rec["c"], rec["sess"], rec["g"], rec["rid"])
        elif rtype == W.COMMIT:
            self._apply_commit(rec["batch"])
        elif rtype == W.DROP:
            self._apply_drop(rec["g"], rec["why"])
        elif rtype == W.VERSION:
            self._apply_version(rec["version"], rec["groups_per_step"], rec.get("lineage"))
        elif rtype == W.DAMAGE:
            held = {g.group_id for g in self.ready} | set(self.pending)
            held |= {g.group_id for b in self.delivered.values() for g in b.groups}
            self.losses.append(Loss(rec, self.next_batch - 1, held_before=held))
        elif rtype == W.LOST:
            self.next_batch = max(self.next_batch, rec["floor"])

    def _log(self, rtype: int, payload: dict[str, Any], blobs: Sequence = ()) -> int:
        if self.wal is None or self._replaying:
            return self.wal.segment if self.wal else 0
        return self.wal.append(rtype, payload, blobs)

    # ---------------------------------------------------------------- producers
    def _producer(self, pid: str) -> ProducerLedger:
        """The ledger of `pid`, which was just heard from (that keeps its grants alive)."""
        self.admission.heard_from(pid)
        return self._ledger(pid)

    def _ledger(self, pid: str) -> ProducerLedger:
        ledger = self.producers.get(pid)
        if ledger is None:
            ledger = self.producers[pid] = ProducerLedger()
        return ledger

    def heartbeat(self, pid: str) -> None:
        self._producer(pid)

    def producer_restarted(self, pid: str) -> int:
        """`pid` says hello (a fresh start or a restart): void the grants of its earlier life (it
        holds no rollouts yet) and return the sequence number it continues from."""
        ledger = self._producer(pid)
        self.admission.void(pid)
        return ledger.next_seq

    def producer_session(self, pid: str) -> int:
        """A new session took `pid` over (the old one is gone): where its numbering continues."""
        ledger = self._producer(pid)
        self.admission.void(pid)
        return ledger.restart()

    def forget_producer(self, pid: str) -> None:
        """`pid` is gone for good (idle past `producer_idle_s`): drop its ledger and grants."""
        self.producers.pop(pid, None)
        self.admission.forget(pid)
        self.counts[m.BUF_PRODUCERS_EXPIRED] += 1

    def stores_nothing(self, pid: str) -> bool:
        """`pid` never had a put accepted and holds no grant: forgetting it loses nothing."""
        ledger = self.producers.get(pid)
        empty = ledger is None or (ledger.done_below == 0 and not ledger.done)
        return empty and not self.admission.holds(pid)

    def release_producer(self, pid: str) -> None:
        """Forget `pid`, which stored nothing, now that its connection closed."""
        self.producers.pop(pid, None)
        self.admission.forget(pid)

    def reject(self, reason: str) -> None:
        """Count a request refused for `reason`."""
        self.rejected[reason] += 1

    def admit(self, pid: str, want: int) -> int:
        """New groups `pid` may start now, within the staleness budget (see `Admission`).

        An incomplete group counts against everyone's budget only while it came from a grant and
        its members keep arriving (within `grant_timeout_s`); otherwise it is charged to the
        producer that opened it alone, so that one client's partial groups cannot shut the
        others out."""
        self._ledger(pid)
        if self.awaiting_learner:
            self.counts[m.BUF_ADMISSION_AWAITING_LEARNER] += 1
            return 0
        horizon = time.monotonic() - self.cfg.grant_timeout_s
        shared = mine = 0
        for g in self.pending.values():
            if g.granted and g.last_put >= horizon:
                shared += 1
            elif g.producer == pid:
                mine += 1
        held = shared + mine + len(self.ready) + sum(self.in_training.values())
        # A restarted learner trains its predecessor's uncommitted batches again first.
        held += sum(
            len(self.delivered[b].groups)
            for queue in self.redeliver.values()
            for b in queue
            if b in self.delivered
        )
        return self.admission.grant(pid, want, held)

    def expire_grants(self) -> None:
        self.admission.expire()

    def put(
        self, pid: str, seq: int, blobs: list, trajs: list[Summary] | list[Trajectory]
    ) -> AckStatus:
        """Store one put of encoded trajectories `blobs`, described by `trajs` (the summaries of
        `validate_trajectory`, or the trajectories themselves); see `AckStatus` for what the
        answer means. PutRejected: bad input."""
        trajs = scoped(pid, [t if type(t) is Summary else summarize(t) for t in trajs])
        st = self._producer(pid)
        if st.seen(seq):
            self.counts["duplicates"] += 1
            return AckStatus.DUPLICATE
        if all(t.group_id in self.ready or t.group_id in self._recent_done for t in trajs):
            # The whole group is here already (a producer restarted between our ack and its
            # cursor save): acknowledge without storing it twice.
            st.mark(seq)
            self.counts["duplicate_groups"] += 1
            return AckStatus.DUPLICATE
        new_groups = check_put(trajs, self.pending, self.ready, self.cfg.capacity_trajectories)
        if self.announced:
            for t in trajs:
                newest = t.newest
                if newest > self.version + AHEAD:
                    raise SchemaError(
                        "versions",
                        f"trajectory {t.id!r} has a token of policy version {newest}, newer than "
                        f"the learner's {self.version} (+{AHEAD} while a push is announced)",
                    )
        nbytes = sum(len(b) for b in blobs)
        if nbytes > self.cfg.capacity_bytes:
            raise PutRejected(f"message of {nbytes} B exceeds capacity_bytes")
        if (
            self.held_trajectories + len(blobs) > self.cfg.capacity_trajectories
            or self.held_bytes + nbytes > self.cfg.capacity_bytes
        ):
            self.counts["busy"] += 1
            return AckStatus.BUSY
        granted = {
            gid for gid in new_groups if gid not in self._recent_drops and self.admission.use(pid)
        }
        self._log(W.PUT, {"p": pid, "s": seq}, blobs)
        self._apply_put(pid, seq, blobs, trajs, granted)
        late = self.drop_fixed_lag()  # buffer.fixed_lag: spans versions, or too late
        stale = self.drop_stale([t.group_id for t in trajs])
        if stale or (late and set(late) & {t.group_id for t in trajs}):
            return AckStatus.STALE
        return AckStatus.OK

    def _apply_put(
        self, pid: str, seq: int, blobs: list, trajs: list[Summary], granted: set[str] = frozenset()
    ) -> None:
        """Store a put; `trajs` are scoped (`groups.scoped`); `granted`: the groups it opens
        that used up one of the producer's grants."""
        st = self._ledger(pid)
        if st.seen(seq):
            return
        st.mark(seq)
        self.counts["puts"] += 1
        segment = self.wal.segment if self.wal else 0
        now = time.monotonic()
        fixed = self.admission.fixed
        self.counts["trajectories_in"] += len(trajs)
        line = self.line
        for blob, t in zip(blobs, trajs, strict=True):
            if self.announced:  # checked against the announced version (`put`)
                self.versions_used = max(self.versions_used, t.newest)
            if t.group_id in self._recent_drops:
                self.dropped["late_member_of_dropped_group"] += 1
                self.dropped_trajectories["late_member_of_dropped_group"] += 1
                continue
            g = self.pending.get(t.group_id)
            if g is None:
                g = Group(t.group_id, t.group_size, producer=pid, granted=t.group_id in granted)
                self.pending[t.group_id] = g
            size = len(blob)
            g.blobs.append(blob)
            g.last_put = now
            g.traj_ids.add(t.id)
            g.nbytes += size
            g.ntokens += t.num_tokens
            if line.may_hold_superseded(t.oldest, t.newest_model) and _holds_superseded(line, blob):
                self.superseded.add(t.group_id)
            oldest = t.oldest
            if oldest is not None and oldest < g.oldest:
                g.oldest = oldest
            if fixed is not None:
                fixed.observe(t.group_id, oldest, t.newest_model)
            if self.wal is not None and segment not in g.segments:
                g.segments.add(segment)
                self.wal.retain(segment)
            self.held_trajectories += 1
            self.held_bytes += size
            if len(g.blobs) == g.size:
                del self.pending[g.group_id]
                if g.oldest == NO_VERSION:
                    g.oldest = self.version
                self._arrivals += 1
                g.arrival = self._arrivals
                self.ready.add(g)
                if self.admission.fixed is not None:
                    self.admission.fixed.completed(g.group_id, g.oldest)

    # ---------------------------------------------------------------- staleness
    def set_version(
        self, version: int, groups_per_step: int, lineage: list[list[int]] | None = None
    ) -> None:
        """The learner's announcement; `lineage`: its line of weights (None: unchanged)."""
        self.awaiting_learner = False
        self._apply_version(version, groups_per_step, lineage)
        rec: dict[str, Any] = {"version": version, "groups_per_step": groups_per_step}
        if lineage is not None:
            rec["lineage"] = [list(b) for b in lineage]
        self._log(W.VERSION, rec)
        self.drop_stale()
        self.drop_fixed_lag()

    def check_version(
        self,
        version: int,
        groups_per_step: int,
        rewind_ok: bool,
        lineage: list[tuple[int, int]] | None = None,
    ) -> None:
        """SchemaError naming the field of an announcement that cannot be right. `rewind_ok`: the
        session that announced before is gone (a restarted learner may go back to its checkpoint,
        or start from anywhere after a buffer restart without a log); only then may the line of
        weights change."""
        if lineage is not None:
            try:
                line = Line.parse(lineage)
            except LineError as e:
                raise SchemaError("lineage", str(e)) from None
            if line != self.line and not rewind_ok:
                raise SchemaError(
                    "lineage", "changes while the learner session that announced the line is live"
                )
            if line.superseded(version) or version < line.start:
                raise SchemaError(
                    "version", f"{version} is not on the announced line (it starts at {line.start})"
                )
        jump, cap, v = self.cfg.max_version_jump, self.cfg.capacity_trajectories, self.version
        problem = (
            f"{version} exceeds {MAX_VERSION} (versions are int32)"
            if version > MAX_VERSION
            else f"{version} goes back from {v}, announced by this learner"
            if not rewind_ok and version < v
            else f"{version} jumps more than buffer.max_version_jump={jump} ahead of {v}"
            if not rewind_ok and version > v + jump
            else None
        )
        if problem:
            raise SchemaError("version", problem)
        if groups_per_step > cap:
            raise SchemaError("groups_per_step", f"{groups_per_step} > capacity_trajectories={cap}")

    def _apply_version(
        self, version: int, groups_per_step: int, lineage: list[list[int]] | None = None
    ) -> None:
        self.announced = True
        if lineage is not None:
            self._apply_line(Line.parse(lineage))
        self.versions_used = max(self.versions_used, version)
        if self.admission.set_version(version, groups_per_step):
            self.in_training.clear()  # the batches trained at the old version are done

    def _apply_line(self, line: Line) -> None:
        """A new line of weights: versions in its gaps are superseded; find the held groups
        with tokens of them (each trajectory looked at once, only at a learner restart)."""
        if line == self.line:
            return
        self.admission.line = line
        self._on_line_oldest.clear()  # read against the old line
        self.versions_used = max(self.versions_used, line.start)
        self.superseded = {
            g.group_id
            for g in [*self.ready, *self.pending.values()]
            if any(_holds_superseded(line, b) for b in g.blobs)
        }
        if line.breaks:
            cut, fresh = line.breaks[-1]
            log.warning(
                "the learner continues from version %d as version %d: versions %d..%d are "
                "superseded; %d held group(s) hold tokens of them",
                cut,
                fresh,
                cut + 1,
                fresh - 1,
                len(self.superseded),
            )

    def staleness(self, g: Group) -> int:
        return self.admission.staleness(g.oldest)

    def drop_stale(self, group_ids: list[str] | None = None) -> list[str]:
        """Drop held, undelivered groups beyond max_staleness (only `group_ids` if given), when
        `stale_policy` is "drop" ("mask" and "keep" leave them to the learner)."""
        if self.cfg.stale_policy != "drop":
            return []
        if group_ids is None:
            candidates = [*self.ready, *self.pending.values()]
        else:
            found = (self.ready.get(gid) or self.pending.get(gid) for gid in set(group_ids))
            candidates = [g for g in found if g is not None]
        gone = [g.group_id for g in candidates if g.group_id in self.superseded]
        stale = [
            g.group_id
            for g in candidates
            if g.group_id not in self.superseded and self.admission.is_stale(g.oldest)
        ]
        for why, gids in ((m.BUF_SUPERSEDED, gone), ("stale", stale)):
            if gids:
                self._log(W.DROP, {"g": gids, "why": why})
                self._apply_drop(gids, why)
        return gone + stale

    def drop_fixed_lag(self) -> list[str]:
        """With buffer.fixed_lag: drop held groups that span versions or are older than the
        version trained next (they could never be trained at exactly that lag); logged."""
        fixed = self.admission.fixed
        if fixed is None:
            return []
        out = []
        spans = [gid for gid in fixed.take_spanning() if gid in self.ready or gid in self.pending]
        late = [
            g.group_id
            for g in [*self.ready, *self.pending.values()]
            if g.oldest != NO_VERSION
            and fixed.is_late(g.oldest, self.version)
            and g.group_id not in spans
        ]
        for why, gids in ((FIXED_LAG_SPANS, spans), (FIXED_LAG_LATE, late)):
            if gids:
                log.warning(
                    "dropping %d group(s), e.g. %s (%s, buffer.fixed_lag = %d)",
                    len(gids),
                    shown(gids[0]),
                    why,
                    fixed.k,
                )
                self._log(W.DROP, {"g": gids, "why": why})
                self._apply_drop(gids, why)
                out += gids
        return out

    def _apply_drop(self, group_ids: list[str], why: str) -> None:
        for gid in group_ids:
            g = self.pending.pop(gid, None) or self.ready.pop(gid)
            if g is None:
                continue
            self.dropped[why] += 1
            self.dropped_trajectories[why] += len(g.blobs)
            if why == "stale":
                self.dropped_stale["groups"] += 1
                for blob in g.blobs:
                    t = decode_trajectory(blob, copy=False)
                    self.dropped_stale["trajectories"] += 1
                    self.dropped_stale["response_tokens"] += int(t.loss_mask.sum())
                    self.dropped_stale["reward"] += float(t.reward)
            self._forget(g)
            self._recent_drops.add(gid)

    def _forget(self, g: Group) -> None:
        self.superseded.discard(g.group_id)
        self._on_line_oldest.pop(g.group_id, None)
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
        if num_groups is None and num_tokens is None:
            num_groups = self.groups_per_step
        if self.admission.fixed is not None:  # only the groups of version - fixed_lag
            fixed, version = self.admission.fixed, self.version
            mine = sorted(
                (g for g in self.ready if fixed.on_target(g.oldest, version)),
                key=lambda g: g.arrival,
            )
            want = num_groups or self.groups_per_step
            chosen = mine[:want] if len(mine) >= want else []
        else:
            chosen = self.ready.choose(num_groups, num_tokens, first=self._at_the_bound())
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

    def _at_the_bound(self) -> list[Group]:
        """While groups with tokens of superseded weights are held (kept by the stale policy
        after a learner's restart): the groups whose oldest token on the run's line is at or
        past max_staleness, most stale first, to deliver ahead of the others. Superseded versions
        are numbered below the fresh ones, so the oldest-first order alone would send superseded
        groups first and let tokens on the line cross the bound meanwhile. A group of both kinds
        (in flight across the restart) counts by its tokens on the line."""
        if not self.superseded:
            return []
        bound = self.admission.max_staleness
        urgent = []
        for g in self.ready:
            oldest = self._oldest_on_line(g) if g.group_id in self.superseded else g.oldest
            if oldest is not None and self.admission.staleness(oldest) >= bound:
                urgent.append((-self.admission.staleness(oldest), g.arrival, g))
        return [g for *_, g in sorted(urgent, key=lambda u: u[:2])]

    def _oldest_on_line(self, g: Group) -> int | None:
        """The oldest model-token version of ready `g` that is on the run's line (None: none
        is); its tokens are read once per line."""
        if g.group_id in self._on_line_oldest:
            return self._on_line_oldest[g.group_id]
        oldest = None
        for blob in g.blobs:
            t = decode_trajectory(blob, copy=False)
            v = t.versions[t.loss_mask.astype(bool)]
            v = v[self.line.positions(v) != SUPERSEDED_POSITION]
            if v.size:
                oldest = int(v.min()) if oldest is None else min(oldest, int(v.min()))
        self._on_line_oldest[g.group_id] = oldest
        return oldest

    def _apply_deliver(
        self, batch_id: int, consumer: str, session: str, gids: list[str], rid: str
    ) -> Delivered | None:
        self.next_batch = max(self.next_batch, batch_id + 1)
        # Logged with the request id, so a resent get answers with this batch even after a
        # buffer restart that lost the reply.
        self.last_get[consumer] = (rid, batch_id)
        if self._replaying:
            self.sessions[consumer] = session
        if batch_id in self.delivered:  # a redelivery to a new session: in training again
            b = self.delivered[batch_id]
            b.session = session
            self.in_training[batch_id] = len(b.groups)
            return b
        groups = [g for gid in gids if (g := self.ready.pop(gid)) is not None]
        if self._replaying and self.losses:
            self._placed(batch_id, gids, groups)
        if not groups:
            return None
        for g in groups:
            if g.group_id in self.superseded:  # kept by the stale policy: the learner counts it
                self.superseded.discard(g.group_id)
                self._on_line_oldest.pop(g.group_id, None)
                self.counts[m.BUF_SUPERSEDED_DELIVERED] += 1
        self.in_training[batch_id] = len(groups)
        for g in groups:
            self._recent_done.add(g.group_id)
        self.counts["delivered_batches"] += 1
        self.counts["delivered_groups"] += len(groups)
        b = self.delivered[batch_id] = Delivered(batch_id, consumer, session, groups)
        return b

    def _placed(self, batch_id: int, gids: list[str], found: list[Group]) -> None:
        """Replay of a delivery after damage: the first batch after each region, and the groups
        it names whose data was lost (a member's PUT among the lost records: dropped, counted)."""
        for loss in self.losses:
            if loss.batch_after is None and batch_id > loss.batch_before:
                loss.batch_after = batch_id
        have = {g.group_id for g in found}
        gone = [gid for gid in gids if gid not in have]
        self.lost_groups += gone
        partial = [gid for gid in gone if gid in self.pending]
        if partial:
            self._apply_drop(partial, m.BUF_WAL_DAMAGE)

    def missing_batches(self, batch_id: int) -> list[list[int]]:
        """Ranges [first, last] of batch ids up to `batch_id` that the lost records of a
        damaged log may have delivered: this buffer does not hold them."""
        out = []
        for loss in self.losses:
            span = loss.batches()
            if span is not None and span[0] <= batch_id:
                out.append([span[0], min(span[1], batch_id)])
        return out

    def damage_summary(self) -> str | None:
        """Where the log was damaged, for a learner told that batches are gone."""
        if not self.losses:
            return None
        return describe(self.losses, 0, len(self.lost_groups))

    def commit(self, consumer: str, batch_id: int, through: bool = False) -> int:
        """Commit one batch (or every batch of `consumer` up to it); return how many."""
        ids = (
            sorted(b for b, d in self.delivered.items() if d.consumer == consumer and b <= batch_id)
            if through
            else [batch_id]
        )
        if batch_id >= self.next_batch:
            if not any(lo <= batch_id <= hi for lo, hi in self.missing_batches(batch_id)):
                raise SchemaError("batch_id", self._never_delivered(batch_id))
            # Delivered in records the log lost: new batches must not reuse its id.
            self._log(W.LOST, {"floor": batch_id + 1})
            self.next_batch = batch_id + 1
        if not through and batch_id not in self.delivered:
            return 0  # committed before (a resend after a lost reply)
        for b in ids:
            self._log(W.COMMIT, {"batch": b})
            self._apply_commit(b)
        return len(ids)

    def _never_delivered(self, batch_id: int) -> str:
        last = f"its last batch id is {self.next_batch - 1}"
        if self.wal is None:
            return (
                f"batch {batch_id} was never delivered by this buffer ({last}; it keeps no "
                "write-ahead log, buffer.wal_dir, so a restarted buffer knows no earlier batch)"
            )
        return (
            f"batch {batch_id} was never delivered by this buffer ({last}): its write-ahead log "
            f"in {self.wal.dir} holds no record of it (a log removed or replaced, or a checkpoint "
            "of another run)"
        )

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

    # ---------------------------------------------------------------- expiry
    def expire_incomplete(self) -> list[str]:
        """Drop pending groups that received no member for `group_timeout_s` (logged, counted):
        their producer is gone or broken, and they would hold admission's budget for ever."""
        horizon = time.monotonic() - self.cfg.group_timeout_s
        old = [gid for gid, g in self.pending.items() if g.last_put < horizon]
        if old:
            why = m.BUF_INCOMPLETE_TIMEOUT
            log.warning(
                "dropping %d incomplete group(s), e.g. %s, silent for %.0fs (%s)",
                len(old),
                shown(old[0]),
                self.cfg.group_timeout_s,
                why,
            )
            self._log(W.DROP, {"g": old, "why": why})
            self._apply_drop(old, why)
        return old

    # ---------------------------------------------------------------- metrics
    def _dropped_stale_stats(self) -> dict[str, Any]:
        """Groups dropped as stale: count, and mean response length / reward per trajectory."""
        d = self.dropped_stale
        n = max(d["trajectories"], 1)
        return {
            "policy": self.cfg.stale_policy,
            "groups": d["groups"],
            "trajectories": d["trajectories"],
            "mean_response_len": d["response_tokens"] / n,
            "mean_reward": d["reward"] / n,
        }

    def _fixed_lag_stats(self) -> dict[str, int] | None:
        fixed = self.admission.fixed
        return fixed.stats(self.version, self.groups_per_step) if fixed is not None else None

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
            "grants_outstanding": self.admission.outstanding,
            "producers": len(self.producers),
            "counts": dict(self.counts),
            "dropped": dict(self.dropped),
            # Accounting in trajectories: counts.trajectories_in (acknowledged) ==
            # counts.committed_trajectories + sum(dropped_trajectories) + trajectories_held.
            "dropped_trajectories": dict(self.dropped_trajectories),
            "rejected": dict(self.rejected),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "dropped_stale": self._dropped_stale_stats(),
            "fixed_lag": self._fixed_lag_stats(),
            "wal": self.wal.stats() if self.wal else None,
            "wal_damage": [
                {"where": loss.where(), "batches": loss.batches()} for loss in self.losses
            ],
            "wal_groups_lost": len(self.lost_groups),
            "lineage": self.line.to_list(),
            "versions_used": self.versions_used,
            "groups_superseded_held": len(self.superseded),
        }


def _holds_superseded(line: Line, blob: bytes | memoryview) -> bool:
    """Whether the encoded trajectory has a model token of a version `line` left behind."""
    t = decode_trajectory(blob, copy=False)
    return line.any_superseded(t.versions[t.loss_mask.astype(bool)])
