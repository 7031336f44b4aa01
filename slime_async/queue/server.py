"""The trajectory buffer process: one thread, two ROUTER sockets, an optional write-ahead log.

    generators (ProducerClient, DEALER) --connect--> [ROUTER  producer_endpoint]
        Hello{producer}                 -> HelloReply{next_seq}  (numbering survives restarts)
        Put{seq, producer}, traj, ...   -> Ack{seq, ok|duplicate|busy|stale} | Error{reason}
        Admit{producer, want}           -> Granted{n}            (Admission: staleness budget)
        Heartbeat{producer}             -> Ok                    (keeps admission grants alive)
                                                 |  BufferState: pending -> ready -> delivered
                                                 |  WAL: PUT / DELIVER / COMMIT / DROP records
    learner (ConsumerClient, DEALER)   --connect--> [ROUTER  consumer_endpoint]
        Get{num_groups|num_tokens, timeout_s} -> BatchReply{batch_id, sizes}, traj, ... | Empty
        Commit{batch_id, through}       -> Committed{n}
        SetVersion{version, groups_per_step} -> Ok
    either socket: Ping / StatsRequest -> StatsReply{stats} (readiness probe)

Every header is a typed message of `messages.py`, checked on decode: a bad request is answered
with an `Error` naming the field, and counted by reason (stats `rejected`).

The buffer binds both endpoints; clients connect (and reconnect after a restart). The loop polls
both sockets, drains what is queued, appends WAL records, makes them durable once for the whole
turn (`wal_sync`), then sends the acks: an ack means the trajectory is stored (and logged). A `get`
that cannot be served yet is parked until enough groups are ready or its timeout passes.

Memory is bounded by `capacity_trajectories` / `capacity_bytes` for stored groups (producers get
`busy` and retry beyond them), by RCVHWM x `max_message_bytes` per connected peer for messages
still in ZeroMQ's queues (beyond that TCP pushes back on the sender), and by one parked `get` per
connected consumer.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from slime_async.config.buffer import BufferConfig
from slime_async.queue import security
from slime_async.queue.groups import PutRejected
from slime_async.queue.messages import (
    Ack,
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
    unpack_header,
)
from slime_async.queue.schema import SchemaError, decode_trajectory
from slime_async.queue.state import BufferState
from slime_async.queue.wal import WriteAheadLog

log = logging.getLogger(__name__)

_DRAIN = 256  # messages handled per socket per turn before acks go out
_RCVHWM = 64  # messages queued per peer inside ZeroMQ
# What each socket serves.
_PRODUCER_REQUESTS: dict[str, type[Request]] = {
    m.OP: m for m in (Put, Heartbeat, Admit, Hello, Ping, StatsRequest)
}
_CONSUMER_REQUESTS: dict[str, type[Request]] = {
    m.OP: m for m in (Get, Commit, SetVersion, Ping, StatsRequest)
}


def _reason(e: SchemaError) -> str:
    if "MessagePack" in e.problem:
        return "malformed"
    if "schema version" in e.problem:
        return "schema_version"
    return f"field:{e.field}"


class Buffer:
    """The buffer as an object: `start()` runs it in a thread (tests, benches), `serve_forever()`
    runs it in the calling thread (the `slime-async buffer` process)."""

    def __init__(self, cfg: BufferConfig, wal_dir: str | Path | None = None):
        security.check_bind(cfg)
        self.cfg = cfg
        self.state = BufferState(cfg)
        wal_dir = wal_dir or cfg.wal_dir
        if wal_dir:
            self.state.attach_wal(
                WriteAheadLog(wal_dir, cfg.wal_sync, cfg.wal_segment_bytes, self.state.snapshot)
            )
        self._ctx = zmq.Context()
        self._auth = None
        self._stop = threading.Event()
        self._serving = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._parked: dict[bytes, tuple[Get, float]] = {}  # consumer -> its get, deadline
        self.producer_sock = self._bind(cfg.producer_endpoint)
        self.consumer_sock = self._bind(cfg.consumer_endpoint)
        self.producer_endpoint = self.producer_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.consumer_endpoint = self.consumer_sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bind(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # ZeroMQ silently disconnects a peer past MAXMSGSIZE; keep that as the last line of
        # defence only, far above the limit we answer with a readable error.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes)
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
        self.producer_sock.close(0)
        self.consumer_sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.producer_sock, zmq.POLLIN)
        poller.register(self.consumer_sock, zmq.POLLIN)
        last_expiry = time.monotonic()
        self._serving = True
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                out: list[tuple[zmq.Socket, list]] = []
                for sock in (self.producer_sock, self.consumer_sock):
                    if sock in events:
                        self._drain(sock, out)
                self._serve_parked(out)
                wal = self.state.wal
                if wal is not None and self.cfg.wal_sync != "none":
                    wal.sync()
                for sock, frames in out:
                    # Stored trajectories are zmq.Frames: sent by reference, never copied.
                    sock.send_multipart(frames, copy=False)
                if wal is not None:
                    wal.sync()
                    wal.compact()
                if time.monotonic() - last_expiry > 1.0:
                    self.state.expire_grants()
                    last_expiry = time.monotonic()
        finally:
            self._close()

    def _poll_ms(self) -> int:
        if not self._parked:
            return 100
        soonest = min(deadline for _, deadline in self._parked.values())
        return max(0, min(100, int((soonest - time.monotonic()) * 1000) + 1))

    def _drain(self, sock: zmq.Socket, out: list) -> None:
        for _ in range(_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, body = frames[0].bytes, frames[1:]
            try:
                reply = self._handle(sock, ident, body)
            except Exception as e:  # never let one message take the buffer down
                log.exception("internal error handling a message")
                reply = self._refuse(Error(reason="internal", error=f"internal error: {e}"))
            if reply is not None:
                out.append((sock, [ident, *reply]))

    # ---------------------------------------------------------------- messages
    def _refuse(self, error: Error) -> list[bytes]:
        self.state.reject(error.reason)
        return [error.encode()]

    def _handle(self, sock: zmq.Socket, ident: bytes, body: list[zmq.Frame]) -> list | None:
        size = sum(len(f) for f in body)
        if not body:
            return self._refuse(Error(reason="malformed", error="empty message"))
        try:
            h = unpack_header(body[0].buffer)
        except SchemaError as e:
            return self._refuse(Error(reason=_reason(e), error=f"header {e}"))
        if size > self.cfg.max_message_bytes:
            error = f"message of {size} B exceeds max_message_bytes={self.cfg.max_message_bytes}"
            return self._refuse(Error.answering(h, "too_large", error))
        op = h["op"]
        producer = sock is self.producer_sock
        kind = (_PRODUCER_REQUESTS if producer else _CONSUMER_REQUESTS).get(op)
        if kind is None:
            where = "producer" if producer else "consumer"
            error = f"unknown message type {op!r} on the {where} socket"
            return self._refuse(Error.answering(h, "unknown_op", error))
        try:
            return self._serve(kind.decode(h), ident, body[1:])
        except SchemaError as e:
            return self._refuse(Error.answering(h, "bad_request", f"{op}: {e}"))
        except PutRejected as e:
            return self._refuse(Error.answering(h, "bad_request", str(e)))

    def _serve(self, msg: Request, ident: bytes, blobs: list[zmq.Frame]) -> list | None:
        match msg:
            case Put():
                return self._put(msg, blobs)
            case Heartbeat():
                self.state.heartbeat(msg.producer)
                return [Ok(rid=msg.rid).encode()]
            case Get():
                return self._get(ident, msg)
            case Commit():
                n = self.state.commit(msg.consumer, msg.batch_id, msg.through)
                return [Committed(rid=msg.rid, n=n).encode()]
            case Admit():
                n = self.state.admit(msg.producer, msg.want)
                return [Granted(rid=msg.rid, n=n).encode()]
            case Hello():
                next_seq = self.state.producer_restarted(msg.producer)
                return [HelloReply(rid=msg.rid, next_seq=next_seq).encode()]
            case SetVersion():
                self.state.set_version(msg.version, max(1, msg.groups_per_step))
                return [Ok(rid=msg.rid).encode()]
            case Ping() | StatsRequest():
                return [StatsReply(rid=msg.rid, stats=self.stats()).encode()]

    def _put(self, msg: Put, blobs: list[zmq.Frame]) -> list[bytes]:
        if not blobs:
            error = Error(reason="bad_request", error="put: no trajectories", seq=msg.seq)
            return self._refuse(error)
        try:
            trajs = [decode_trajectory(b.buffer, copy=False) for b in blobs]
            status = self.state.put(msg.producer, msg.seq, blobs, trajs)
        except (SchemaError, PutRejected) as e:
            self.state.discard_put(msg.producer, msg.seq)
            if isinstance(e, SchemaError):
                return self._refuse(Error(reason=_reason(e), error=f"trajectory {e}", seq=msg.seq))
            return self._refuse(Error(reason="group", error=str(e), seq=msg.seq))
        return [Ack(seq=msg.seq, status=status).encode()]

    def _get(self, ident: bytes, msg: Get) -> list | None:
        reply = self._try_get(msg)
        if reply is None:
            self._parked[ident] = (msg, time.monotonic() + msg.timeout_s)
        return reply

    def _try_get(self, msg: Get) -> list | None:
        b = self.state.get(msg.consumer, msg.session, msg.rid or "", msg.num_groups, msg.num_tokens)
        if b is None:
            return None
        header = BatchReply(
            rid=msg.rid,
            batch_id=b.batch_id,
            sizes=[len(g.blobs) for g in b.groups],
            staleness=[self.state.staleness(g) for g in b.groups],
            version=self.state.version,
        )
        return [header.encode(), *(blob for g in b.groups for blob in g.blobs)]

    def _serve_parked(self, out: list) -> None:
        now = time.monotonic()
        for ident, (msg, deadline) in list(self._parked.items()):
            reply = self._try_get(msg)
            if reply is None and now < deadline:
                continue
            del self._parked[ident]
            reply = reply or [Empty(rid=msg.rid).encode()]
            out.append((self.consumer_sock, [ident, *reply]))

    def stats(self) -> dict[str, Any]:
        s = self.state.stats()
        s["parked_gets"] = len(self._parked)
        s["producer_endpoint"] = self.producer_endpoint
        s["consumer_endpoint"] = self.consumer_endpoint
        return s
