"""The trajectory buffer process: one thread, two ROUTER sockets, an optional write-ahead log.

    generators (ProducerClient, DEALER) --connect--> [ROUTER  producer_endpoint]
        hello [hdr{producer}]               ->  hello{next_seq}   (numbering survives restarts)
        put   [hdr{seq}, traj, traj, ...]   ->  ack{seq, ok|duplicate|busy|stale} | error{reason}
        admit [hdr{want}]                   ->  granted{n}
        heartbeat                           ->  ok               (keeps admission grants alive)
                                                 |  BufferState: pending -> ready -> delivered
                                                 |  WAL: PUT / DELIVER / COMMIT / DROP records
    learner (ConsumerClient, DEALER)   --connect--> [ROUTER  consumer_endpoint]
        get    [hdr{num_groups|num_tokens}] ->  batch[hdr{batch_id, sizes}, traj, ...] | empty
        commit [hdr{batch_id}]              ->  committed{n}
        version[hdr{version, groups_per_step}] -> ok
    any client: ping / stats -> stats{...} (readiness probe)

The buffer binds both endpoints; clients connect (and reconnect after a restart). The loop polls
both sockets, drains what is queued, appends WAL records, makes them durable once for the whole
turn (`wal_sync`), then sends the acks: an ack means the trajectory is stored (and logged). A `get`
that cannot be served yet is parked until enough groups are ready or its timeout passes.

Memory is bounded by `capacity_trajectories` / `capacity_bytes` for stored groups (producers get
`busy` and retry beyond them) and by RCVHWM x `max_message_bytes` per connected peer for
messages still in ZeroMQ's queues (beyond that TCP pushes back on the sender).
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
from slime_async.queue.schema import SchemaError, decode_trajectory, pack_header, unpack_header
from slime_async.queue.state import BufferState, PutRejected
from slime_async.queue.wal import WriteAheadLog

log = logging.getLogger(__name__)

_DRAIN = 256  # messages handled per socket per turn before acks go out
_RCVHWM = 64  # messages queued per peer inside ZeroMQ


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
        self._parked: dict[bytes, tuple[dict[str, Any], float]] = {}
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
                self.state.rejected["internal"] += 1
                reply = [pack_header("error", reason="internal", error=f"internal error: {e}")]
            if reply is not None:
                out.append((sock, [ident, *reply]))

    # ---------------------------------------------------------------- messages
    def _error(self, reason: str, error: str, h: dict[str, Any] | None = None) -> list[bytes]:
        self.state.rejected[reason] += 1
        echo = {k: h[k] for k in ("seq", "rid") if h and k in h}
        return [pack_header("error", reason=reason, error=error, **echo)]

    def _handle(self, sock: zmq.Socket, ident: bytes, body: list[zmq.Frame]) -> list | None:
        size = sum(len(f) for f in body)
        if not body:
            return self._error("malformed", "empty message")
        try:
            h = unpack_header(body[0].buffer)
        except SchemaError as e:
            return self._error(_reason(e), f"header {e}")
        if size > self.cfg.max_message_bytes:
            return self._error(
                "too_large",
                f"message of {size} B exceeds max_message_bytes={self.cfg.max_message_bytes}",
                h,
            )
        op = h["op"]
        try:
            if op in ("ping", "stats"):
                return [pack_header("stats", rid=h.get("rid"), stats=self.stats())]
            if sock is self.producer_sock:
                if op == "put":
                    return self._put(h, body[1:])
                if op == "admit":
                    n = self.state.admission(_text(h, "producer"), _int(h, "want"))
                    return [pack_header("granted", rid=h.get("rid"), n=n)]
                if op == "hello":
                    return [pack_header("hello", rid=h.get("rid"), next_seq=self._next_seq(h))]
                if op == "heartbeat":
                    self.state.producer(_text(h, "producer"))
                    return [pack_header("ok", rid=h.get("rid"))]
            else:
                if op == "get":
                    return self._get(ident, h)
                if op == "commit":
                    n = self.state.commit(
                        _text(h, "consumer"), _int(h, "batch_id"), bool(h.get("through"))
                    )
                    return [pack_header("committed", rid=h.get("rid"), n=n)]
                if op == "version":
                    self.state.set_version(_int(h, "version"), max(1, _int(h, "groups_per_step")))
                    return [pack_header("ok", rid=h.get("rid"))]
        except (KeyError, TypeError) as e:
            return self._error("bad_request", f"{op}: missing or wrong field {e}", h)
        except PutRejected as e:
            return self._error("bad_request", str(e), h)
        where = "producer" if sock is self.producer_sock else "consumer"
        return self._error("unknown_op", f"unknown message type {op!r} on the {where} socket", h)

    def _next_seq(self, h: dict[str, Any]) -> int:
        """Where a (re)started producer continues, so it never reuses an accepted number."""
        st = self.state.producer(_text(h, "producer"))
        # A (re)started producer holds no rollouts yet: grants of its earlier life are void,
        # or they would count against the budget forever (it heartbeats under the same id).
        if st.grants:
            self.state.counts["grants_expired"] += st.grants
            st.grants = 0
        return max(st.done_below, max(st.done, default=-1) + 1)

    def _put(self, h: dict[str, Any], blobs: list[zmq.Frame]) -> list[bytes]:
        seq, pid = _int(h, "seq"), _text(h, "producer")
        if not blobs:
            return self._error("bad_request", "put: no trajectories", h)
        try:
            trajs = [decode_trajectory(b.buffer, copy=False) for b in blobs]
            status = self.state.put(pid, seq, blobs, trajs)
        except (SchemaError, PutRejected) as e:
            # The number is used up, so the producer's dedupe window keeps moving.
            self.state.producer(pid).mark(seq)
            if isinstance(e, SchemaError):
                return self._error(_reason(e), f"trajectory {e}", h)
            return self._error("group", str(e), h)
        return [pack_header("ack", seq=seq, status=status)]

    def _get(self, ident: bytes, h: dict[str, Any]) -> list | None:
        num_groups, num_tokens = h.get("num_groups"), h.get("num_tokens")
        for name, v in (("num_groups", num_groups), ("num_tokens", num_tokens)):
            if v is not None and (not isinstance(v, int) or v < 1):
                return self._error("bad_request", f"get: {name} must be a positive integer", h)
        _text(h, "consumer")
        _text(h, "session")
        reply = self._try_get(h)
        if reply is None:
            self._parked[ident] = (h, time.monotonic() + float(h.get("timeout_s") or 0.0))
        return reply

    def _try_get(self, h: dict[str, Any]) -> list | None:
        b = self.state.get(h["consumer"], h["session"], h.get("rid", ""), h.get("num_groups"),
                           h.get("num_tokens"))  # fmt: skip
        if b is None:
            return None
        header = pack_header(
            "batch",
            rid=h.get("rid"),
            batch_id=b.batch_id,
            sizes=[len(g.blobs) for g in b.groups],
            staleness=[self.state.staleness(g) for g in b.groups],
            version=self.state.version,
        )
        return [header, *(blob for g in b.groups for blob in g.blobs)]

    def _serve_parked(self, out: list) -> None:
        now = time.monotonic()
        for ident, (h, deadline) in list(self._parked.items()):
            reply = self._try_get(h)
            if reply is None and now < deadline:
                continue
            del self._parked[ident]
            reply = reply or [pack_header("empty", rid=h.get("rid"))]
            out.append((self.consumer_sock, [ident, *reply]))

    def stats(self) -> dict[str, Any]:
        s = self.state.stats()
        s["parked_gets"] = len(self._parked)
        s["producer_endpoint"] = self.producer_endpoint
        s["consumer_endpoint"] = self.consumer_endpoint
        return s


def _int(h: dict[str, Any], key: str) -> int:
    v = h[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{key!r} must be an integer")
    return v


def _text(h: dict[str, Any], key: str) -> str:
    v = h[key]
    if not isinstance(v, str) or not v:
        raise TypeError(f"{key!r} must be a non-empty string")
    return v
