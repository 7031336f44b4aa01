"""The trajectory buffer process: one thread, two ROUTER sockets, an optional write-ahead log.

    generators (ProducerClient, DEALER) --connect--> [ROUTER  producer_endpoint]
                                                 |  BufferState: pending -> ready -> delivered
                                                 |  WAL: PUT / DELIVER / COMMIT / DROP records
    learner (ConsumerClient, DEALER)   --connect--> [ROUTER  consumer_endpoint]

What each socket serves and answers is `messages.PROTOCOL`: producers say hello (their put
numbering survives restarts), put groups (acknowledged ok, duplicate, busy or stale), ask for
admission (`Admission`: the staleness budget) and send heartbeats (their grants stay alive); the
learner gets batches of whole groups, commits them and announces its policy version; either
side may ping for the stats (the readiness probe).

Every header is a typed message of `messages.py`, checked on decode (and in range: timeouts,
versions, groups_per_step, batch ids): a bad request is answered with a bounded `Error` naming
the field, counted by reason (stats `rejected`). An id belongs to one live session
(`utils/sessions.py`): a second live session under a producer or consumer id is refused
("producer_in_use" / "consumer_in_use"); a socket monitor frees the id once its connection closes.

The buffer binds both endpoints; clients connect (and reconnect after a restart). The loop polls
both sockets, drains what is queued, appends WAL records, makes them durable once for the whole
turn (`wal_sync`), then sends the acks: an ack means the trajectory is stored (and logged); the
acks of one turn to one producer connection go out as one `Acks` message per status when its puts
ask for it (`batch_ack`), which saves a message per put on both sides. A `get`
that cannot be served yet is parked until enough groups are ready or its timeout passes.

Memory is bounded by `capacity_trajectories` / `capacity_bytes` for stored groups (producers get
`busy` beyond them); per message by `max_message_bytes` (ZeroMQ's MAXMSGSIZE cuts off a larger
frame unread; larger sums are refused before decoding), `max_frames` (the rest is discarded as
read) and `MAX_HEADER`; in ZeroMQ's queues by RCVHWM messages per peer; ids by `max_producers` /
`max_consumers` and `producer_idle_s`; incomplete groups by `group_timeout_s`; one parked `get` per
consumer.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from slime_async.config.buffer import BufferConfig
from slime_async.metrics import names as m
from slime_async.queue import security
from slime_async.queue.groups import PutRejected
from slime_async.queue.messages import (
    PROTOCOL,
    Ack,
    Acks,
    Admit,
    BatchReply,
    Commit,
    Committed,
    Empty,
    Error,
    Get,
    Granted,
    Heartbeat,
    Hello,
    HelloReply,
    Ok,
    Ping,
    Put,
    Request,
    SetVersion,
    StatsReply,
    StatsRequest,
    decode_request,
    send_frames,
    split,
    unpack_header,
)
from slime_async.queue.schema import SchemaError, validate_trajectory
from slime_async.queue.state import BufferState
from slime_async.queue.wal import WriteAheadLog
from slime_async.utils.sessions import IdInUse, Owners, TooManyIds

log = logging.getLogger(__name__)

_DRAIN = 256  # messages handled per socket per turn before acks go out
_RCVHWM = 64  # messages queued per peer inside ZeroMQ
MAX_HEADER = 64 << 10
"""Largest header frame decoded (real ones are a few hundred bytes)."""
_DISCARD = 100_000  # frames past max_frames discarded per turn, then the other socket is served
_SERVED: dict[str, dict[str, type[Request]]] = {
    socket: {k.OP: k for k in requests} for socket, requests in PROTOCOL.items()
}
"""The requests each socket serves, by op."""


def _payload(lengths: list[int] | None, frames: list[zmq.Frame], max_n: int) -> list[memoryview]:
    """The trajectories of a put: `lengths` cut one payload frame, or one frame each."""
    if lengths is None:
        return [f.buffer for f in frames]
    if len(frames) != 1 or len(lengths) > max_n or min(lengths, default=0) < 1:
        raise SchemaError("lengths", "expected positive lengths cutting one payload frame")
    return split(frames[0].buffer, lengths)


def _reason(e: SchemaError) -> str:
    if "MessagePack" in e.problem:
        return "malformed"
    if "schema version" in e.problem:
        return "schema_version"
    return f"field:{e.field}"


class DiskFull(Exception):
    """A request that needs the log refused while its disk is full (reason "wal_disk_full")."""


class Buffer:
    """The buffer as an object: `start()` runs it in a thread (tests, benches), `serve_forever()`
    runs it in the calling thread (the `slime-async buffer` process)."""

    def __init__(self, cfg: BufferConfig, wal_dir: str | Path | None = None):
        security.check_bind(cfg)
        self.cfg = cfg
        self.state = BufferState(cfg)
        wal_dir = wal_dir or cfg.wal_dir
        if wal_dir:
            wal = WriteAheadLog(
                wal_dir,
                cfg.wal_sync,
                cfg.wal_segment_bytes,
                self.state.snapshot,
                reserve_bytes=cfg.wal_reserve_bytes,
                low_space_bytes=cfg.wal_low_space_bytes,
            )
            self.state.attach_wal(wal)  # WalDamaged, WalFormatError: refused to start
        self._ctx = zmq.Context()
        self._auth = None
        self._stop = threading.Event()
        self._serving = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._parked: dict[bytes, tuple[Get, float]] = {}  # consumer -> its get, deadline
        per = cfg.max_ids_per_connection
        self.producer_owners = Owners("producer", cfg.max_producers, cfg.producer_idle_s, per)
        self.consumer_owners = Owners("consumer", cfg.max_consumers, cfg.producer_idle_s, per)
        self._version_session: str | None = None  # who announced the current version
        self._discarding: dict[zmq.Socket, bytes] = {}  # socket -> sender of an oversized message
        self._acks: dict[tuple[bytes, str], list[int]] = {}  # this turn's batched acks
        # Replies of a turn whose records the disk refused: sent once they are written.
        self._held: list[tuple[zmq.Socket, list]] = []
        self.producer_sock = self._bind(cfg.producer_endpoint)
        self.consumer_sock = self._bind(cfg.consumer_endpoint)
        self._monitors = {
            sock.get_monitor_socket(zmq.EVENT_DISCONNECTED): owners
            for sock, owners in (
                (self.producer_sock, self.producer_owners),
                (self.consumer_sock, self.consumer_owners),
            )
        }
        self.producer_endpoint = self.producer_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.consumer_endpoint = self.consumer_sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bind(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # One frame above the limit is cut off by ZeroMQ before it is buffered (it drops the
        # connection: nothing can be answered); messages whose frames add up to more are
        # answered with an error (`_receive`).
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        # Heartbeats, so that a vanished peer's connection closes and frees its ids.
        ivl = max(100, int(self.cfg.peer_timeout_s * 1000 / 3))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.cfg.peer_timeout_s * 1000))
        if security.curve_enabled(self.cfg.curve):
            if self._auth is None:
                self._auth = security.start_authenticator(self._ctx, self.cfg.curve)
            security.setup_server(sock, self.cfg.curve)
        sock.bind(endpoint)
        return sock

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> Buffer:
        self._thread = threading.Thread(target=self.serve_forever, name="buffer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (safe from a signal handler of the serving thread) and close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        elif not self._serving:
            self._close()

    def __enter__(self) -> Buffer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.state.wal is not None:
            self.state.wal.close()
        for mon in self._monitors:
            mon.close(0)
        self.producer_sock.close(0)
        self.consumer_sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.producer_sock, zmq.POLLIN)
        poller.register(self.consumer_sock, zmq.POLLIN)
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        last_expiry = time.monotonic()
        self._serving = True
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                out: list[tuple[zmq.Socket, list]] = []
                if any(mon in events for mon in self._monitors):
                    self._disconnections()
                for sock in (self.producer_sock, self.consumer_sock):
                    if sock in events:
                        self._drain(sock, out)
                self._serve_parked(out)
                self._batched_acks(out)
                wal = self.state.wal
                if wal is not None and self.cfg.wal_sync != "none":
                    if not wal.sync():  # the disk refused: no ack before its record is written
                        self._held += out
                        out = []
                    elif self._held:
                        out, self._held = self._held + out, []
                for sock, frames in out:
                    send_frames(sock, frames)  # a batch's payload: by reference
                if wal is not None:
                    wal.sync()
                    wal.compact()
                if time.monotonic() - last_expiry > 1.0:
                    self._expire()
                    last_expiry = time.monotonic()
        finally:
            self._close()

    def _disconnections(self) -> None:
        """Free the ids of closed connections (read before the turn's messages, so that a
        restarted client's hello finds its predecessor's connection gone)."""
        for mon, owners in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                freed = owners.disconnected(int(event["value"]))
                if freed:
                    self.state.counts[m.BUF_DISCONNECTS] += 1
                    log.info("%s id(s) %s released: connection closed", owners.kind, freed)
                    self._release(owners, freed)

    def _release(self, owners: Owners, names: list[str]) -> None:
        """Forget at once the ids of a closed connection that stored nothing (a flood of ids
        over one connection leaves nothing behind); the others wait `producer_idle_s`."""
        producer = owners is self.producer_owners
        empty = [
            n for n in names if (self.state.stores_nothing(n) if producer else self._no_batch(n))
        ]
        for name in empty:
            owners.forget(name)
            if producer:
                self.state.release_producer(name)
        if empty:
            self.state.counts[m.BUF_IDS_RELEASED] += len(empty)

    def _no_batch(self, consumer: str) -> bool:
        return not any(b.consumer == consumer for b in self.state.delivered.values())

    def _expire(self) -> None:
        if self.state.wal is not None:
            self.state.wal.check_space()
        self.state.expire_grants()
        self.state.expire_incomplete()
        # Ids of closed connections whose grants have expired since, and that stored nothing.
        idle = [h for h in self.producer_owners.holders.items() if h[1].connection is None]
        self._release(self.producer_owners, [name for name, _ in idle])
        for owners in (self.producer_owners, self.consumer_owners):
            for name in owners.expire():
                if owners is self.producer_owners:
                    self.state.forget_producer(name)
                else:
                    self.state.counts[m.BUF_CONSUMERS_EXPIRED] += 1
                log.info("forgot %s %r: gone for %.0fs", owners.kind, name, owners.idle_s)

    def _poll_ms(self) -> int:
        if self._discarding:
            return 0
        if not self._parked:
            return 100
        soonest = min(deadline for _, deadline in self._parked.values())
        return max(0, min(100, int((soonest - time.monotonic()) * 1000) + 1))

    def _drain(self, sock: zmq.Socket, out: list) -> None:
        if sock in self._discarding and not self._discard(sock, out):
            return
        for _ in range(_DRAIN):
            try:
                first = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, conn = first.bytes, first.get(zmq.SRCFD)
            body, nbytes, more = self._receive(sock, first.more)
            if more:  # past max_frames: refuse once the rest is discarded
                self._discarding[sock] = ident
                if not self._discard(sock, out):
                    return
                continue
            try:
                reply = self._handle(sock, ident, conn, body, nbytes)
            except Exception as e:  # never let one message take the buffer down
                log.exception("internal error handling a message")
                reply = self._refuse(Error(reason="internal", error=f"internal error: {e}"))
            if reply is not None:
                out.append((sock, [ident, *reply]))

    def _receive(self, sock: zmq.Socket, more: bool) -> tuple[list[zmq.Frame], int, bool]:
        """The frames after the routing id, at most `max_frames`; True: more follow (`_discard`)."""
        body: list[zmq.Frame] = []
        nbytes = 0
        limit = self.cfg.max_frames
        while more:
            if len(body) >= limit:
                return body, nbytes, True
            f = sock.recv(copy=False)
            body.append(f)
            nbytes += len(f)
            more = f.more
        return body, nbytes, False

    def _discard(self, sock: zmq.Socket, out: list) -> bool:
        """Drop the rest of a too-long message, `_DISCARD` frames per turn; True once answered.
        Other clients of this socket wait meanwhile (ZeroMQ hands over a message's frames only
        in order), so this is the tightest loop pyzmq allows: a frame's own `more` flag, not a
        getsockopt per frame (1.1 us against 8.4 us a frame, measured on the 2-core dev machine)."""
        recv = sock.recv
        more = bool(sock.getsockopt(zmq.RCVMORE))
        for _ in range(_DISCARD):
            if not more:
                ident = self._discarding.pop(sock)
                error = f"message of more than max_frames={self.cfg.max_frames} frames"
                out.append(
                    (sock, [ident, *self._refuse(Error(reason="too_many_frames", error=error))])
                )
                return True
            more = recv(0, False, False).more
        return False

    # ---------------------------------------------------------------- messages
    def _refuse(self, error: Error) -> list[bytes]:
        self.state.reject(error.reason)
        return [error.encode()]

    def _handle(
        self, sock: zmq.Socket, ident: bytes, conn: int, body: list[zmq.Frame], size: int
    ) -> list | None:
        if not body or (len(body) == 1 and not len(body[0])):
            return self._refuse(Error(reason="malformed", error="empty message"))
        if len(body[0]) > MAX_HEADER:
            error = f"header of {len(body[0])} B exceeds {MAX_HEADER} B"
            return self._refuse(Error(reason="too_large", error=error))
        head = body[0].buffer  # at most MAX_HEADER bytes
        msg = decode_request(head)  # None: refused, the checks below name what is wrong
        try:
            op = msg.OP.value if msg is not None else unpack_header(head)["op"]
        except SchemaError as e:
            return self._refuse(Error(reason=_reason(e), error=f"header {e}"))
        if size > self.cfg.max_message_bytes:  # refused before any trajectory is decoded
            error = f"message of {size} B exceeds max_message_bytes={self.cfg.max_message_bytes}"
            return self._refuse(Error.answering(head, "too_large", error))
        producer = sock is self.producer_sock
        where = "producer" if producer else "consumer"
        kind = _SERVED[where].get(op)
        if kind is None:
            error = f"unknown message type {op!r} on the {where} socket"
            return self._refuse(Error.answering(head, "unknown_op", error))
        if kind is not Put and len(body) > 1:
            error = f"{op}: {len(body) - 1} unexpected frame(s) after the header"
            return self._refuse(Error.answering(head, "bad_request", error))
        try:
            if msg is None:
                msg = kind.decode(unpack_header(head))
            self._check_owner(msg, conn)
            return self._serve(msg, ident, body[1:])
        except SchemaError as e:
            return self._refuse(Error.answering(head, "bad_request", f"{op}: {e}"))
        except PutRejected as e:
            return self._refuse(Error.answering(head, "bad_request", str(e)))
        except IdInUse as e:
            reason = "producer_in_use" if producer else "consumer_in_use"
            return self._refuse(Error.answering(head, reason, str(e)))
        except TooManyIds as e:
            return self._refuse(Error.answering(head, "too_many_ids", str(e)))
        except DiskFull as e:
            return self._refuse(Error.answering(head, m.BUF_WAL_DISK_FULL, str(e)))

    def _check_owner(self, msg: Request, conn: int) -> None:
        """IdInUse when `msg` comes from a session other than the live holder of its id."""
        match msg:
            case Hello() | Put() | Admit() | Heartbeat():
                if not self._claim(self.producer_owners, msg.producer, msg.session, conn):
                    return
                if isinstance(msg, Hello):  # a new client: it numbers from next_seq on
                    n = self.state.producer_session(msg.producer)
                    log.info(
                        "producer %r: new session %s (puts continue at %d)",
                        msg.producer,
                        msg.session[:12],
                        n,
                    )
                else:  # a client of before a buffer restart: its resends may fill gaps
                    log.info("producer %r: session %s is back", msg.producer, msg.session[:12])
            case Get() | Commit() | SetVersion():
                if self._claim(self.consumer_owners, msg.consumer, msg.session, conn):
                    log.info("consumer %r: new session %s", msg.consumer, msg.session[:12])

    def _claim(self, owners: Owners, name: str, session: str, conn: int) -> bool:
        try:
            return owners.claim(name, session, conn)
        except IdInUse:
            self._disconnections()  # the holder's close may be reported only now
            return owners.claim(name, session, conn)
        except TooManyIds:
            if name in owners.holders or len(owners) < owners.limit:
                raise  # this connection's own bound
            gone = owners.evict()  # the table is full: the longest-silent disconnected id goes
            if gone is None:
                raise
            self.state.counts[m.BUF_IDS_EVICTED] += 1
            log.warning(
                "%s id table full: forgot %r (disconnected) for %r", owners.kind, gone, name
            )
            if owners is self.producer_owners:
                self.state.forget_producer(gone)
            return owners.claim(name, session, conn)

    def _disk_full(self, what: str) -> DiskFull:
        wal = self.state.wal
        assert wal is not None
        return DiskFull(
            f"WAL disk full: {what} refused, the buffer's log in {wal.dir} cannot be written "
            f"({wal.disk.error}); send it again later"
        )

    def _serve(self, msg: Request, ident: bytes, blobs: list[zmq.Frame]) -> list | None:
        wal = self.state.wal
        if wal is not None and wal.stuck and isinstance(msg, Get | Commit | SetVersion):
            raise self._disk_full(msg.OP.value)  # records are waiting for the disk
        match msg:
            case Put():
                return self._put(msg, ident, blobs)
            case Heartbeat():
                self.state.heartbeat(msg.producer)
                return [Ok(rid=msg.rid).encode()]
            case Get():
                most = self.cfg.max_get_wait_s
                if not 0 <= msg.timeout_s <= most:
                    raise SchemaError(
                        "timeout_s", f"{msg.timeout_s} not in [0, max_get_wait_s={most}]"
                    )
                return self._get(ident, msg)
            case Commit():
                n = self.state.commit(msg.consumer, msg.batch_id, msg.through)
                missing = self.state.missing_batches(msg.batch_id) if msg.through else []
                damage = self.state.damage_summary() if missing else None
                return [
                    Committed(rid=msg.rid, n=n, missing=missing or None, damage=damage).encode()
                ]
            case Admit():
                n = self.state.admit(msg.producer, msg.want)
                return [Granted(rid=msg.rid, n=n, version=self.state.version).encode()]
            case Hello():
                next_seq = self.state.producer_restarted(msg.producer)
                return [HelloReply(rid=msg.rid, next_seq=next_seq).encode()]
            case SetVersion():
                before = self._version_session  # rewinds only once its session is gone
                live = any(h.session == before and h.connection for h in self.consumer_owners)
                self.state.check_version(msg.version, msg.groups_per_step, not live, msg.lineage)
                if msg.version < self.state.version:
                    self.state.counts[m.BUF_VERSION_REWINDS] += 1
                    log.warning(
                        "version goes back from %d to %d (a new learner session)",
                        self.state.version,
                        msg.version,
                    )
                self._version_session = msg.session
                # A new learner session: its predecessor's uncommitted batches come back to it
                # first, and count against admission's budget from now on.
                self.state.touch_session(msg.consumer, msg.session)
                lineage = [list(b) for b in msg.lineage] if msg.lineage is not None else None
                self.state.set_version(msg.version, msg.groups_per_step, lineage)
                return [Ok(rid=msg.rid).encode()]
            case Ping() | StatsRequest():
                return [StatsReply(rid=msg.rid, stats=self.stats()).encode()]

    def _put(self, msg: Put, ident: bytes, blobs: list[zmq.Frame]) -> list[bytes] | None:
        if not blobs:
            error = Error(reason="bad_request", error="put: no trajectories", seq=msg.seq)
            return self._refuse(error)
        wal = self.state.wal
        if wal is not None and not wal.room(sum(len(b) for b in blobs)):
            error = str(self._disk_full(f"put {msg.seq}"))
            return self._refuse(Error(reason=m.BUF_WAL_DISK_FULL, error=error, seq=msg.seq))
        try:
            views = _payload(msg.lengths, blobs, self.cfg.max_frames)
            trajs = [validate_trajectory(b) for b in views]
            status = self.state.put(msg.producer, msg.seq, views, trajs)
        except (SchemaError, PutRejected) as e:
            # Its sequence number stays unused: a later valid put may carry it.
            if isinstance(e, SchemaError):
                return self._refuse(Error(reason=_reason(e), error=f"trajectory {e}", seq=msg.seq))
            return self._refuse(Error(reason="group", error=str(e), seq=msg.seq))
        if msg.batch_ack:  # answered with the turn's other acks to this peer (`_batched_acks`)
            self._acks.setdefault((ident, status), []).append(msg.seq)
            return None
        return [Ack(seq=msg.seq, status=status).encode()]

    def _batched_acks(self, out: list) -> None:
        """One `Acks` per producer connection and status for this turn's batch_ack puts; they go
        out with the other replies, after the turn's WAL records are durable."""
        for (ident, status), seqs in self._acks.items():
            out.append((self.producer_sock, [ident, Acks(seqs=seqs, status=status).encode()]))
        self._acks.clear()

    def _get(self, ident: bytes, msg: Get) -> list | None:
        reply = self._try_get(msg)
        if reply is None:
            self._parked[ident] = (msg, time.monotonic() + msg.timeout_s)
        return reply

    def _try_get(self, msg: Get) -> list | None:
        b = self.state.get(msg.consumer, msg.session, msg.rid or "", msg.num_groups, msg.num_tokens)
        if b is None:
            return None
        blobs = [blob for g in b.groups for blob in g.blobs]
        header = BatchReply(
            rid=msg.rid,
            batch_id=b.batch_id,
            sizes=[len(g.blobs) for g in b.groups],
            staleness=[self.state.staleness(g) for g in b.groups],
            version=self.state.version,
            lengths=[len(blob) for blob in blobs],
        )
        # One payload frame: ZeroMQ's cost per frame exceeds a copy of the bytes (measured for
        # 8 frames of 256 KB against one of 2 MB: twice the CPU to send and receive).
        return [header.encode(), b"".join(blobs)]

    def _serve_parked(self, out: list) -> None:
        # While the disk holds back records a delivery cannot be logged: gets wait (their timeout).
        stuck = self.state.wal is not None and self.state.wal.stuck
        now = time.monotonic()
        for ident, (msg, deadline) in list(self._parked.items()):
            reply = None if stuck else self._try_get(msg)
            if reply is None and now < deadline:
                continue
            del self._parked[ident]
            reply = reply or [Empty(rid=msg.rid).encode()]
            out.append((self.consumer_sock, [ident, *reply]))

    def stats(self) -> dict[str, Any]:
        s = self.state.stats()
        s["parked_gets"] = len(self._parked)
        s["producers_live"] = sum(1 for h in self.producer_owners if h.connection)
        s["consumers_live"] = sum(1 for h in self.consumer_owners if h.connection)
        s["producer_endpoint"] = self.producer_endpoint
        s["consumer_endpoint"] = self.consumer_endpoint
        return s
