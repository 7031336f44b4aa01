"""Clients of the buffer: `ProducerClient` (asyncio, generators) and `ConsumerClient` (sync, learner).

Both connect a DEALER socket to the buffer's ROUTER and survive a buffer restart: a request not
answered within `request_timeout_s` is sent again on a fresh connection. Resends are safe: puts
carry a per-producer sequence number the buffer deduplicates, and consumer requests carry a
request id (a lost batch reply is answered with the same batch). After `give_up_s` without any
answer the waiting call raises `BufferUnavailable`.

Memory: a producer holds the encoded frames of its unacknowledged puts (as many as the caller
has in flight); a consumer holds one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from slime_async.config.buffer import BufferConfig
from slime_async.queue import security
from slime_async.queue.messages import (
    POLLIN,
    Ack,
    Acks,
    AckStatus,
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
    Reply,
    Request,
    SetVersion,
    StatsReply,
    StatsRequest,
    decode_reply,
    send_frames,
    split,
)
from slime_async.queue.schema import (
    SchemaError,
    Trajectory,
    decode_trajectory,
    encode_trajectories,
)
from slime_async.utils.retry import RetryPolicy

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)
_BUSY_RETRY = RetryPolicy(first_s=0.002, max_s=0.1)  # resending a put refused as busy
_DISK_RETRY = RetryPolicy(first_s=0.2, max_s=5.0)  # resending what the buffer's full disk refused
DISK_FULL = "wal_disk_full"
"""The `reason` of an `Error` refusing a request while the buffer's log disk is full."""
R = TypeVar("R", bound=Reply)


class BufferRejected(ValueError):
    """The buffer refused a request as bad input; the message is the buffer's."""


class BufferUnavailable(ConnectionError):
    """No answer from the buffer within `give_up_s` (down, unreachable, or CURVE refused us)."""


class IdInUse(BufferUnavailable):
    """Another live session holds this client's producer or consumer id: it must stop (a
    BufferUnavailable, so the generator exits with it)."""


def _refused(error: Error) -> BufferRejected | IdInUse:
    in_use = error.reason in ("producer_in_use", "consumer_in_use")
    return IdInUse(error.error) if in_use else BufferRejected(error.error)


def _socket(ctx: zmq.Context, cfg: BufferConfig, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    security.setup_client(sock, cfg.curve)
    sock.connect(endpoint)
    return sock


def _send_within(sock: zmq.Socket, frames: list, timeout_s: float) -> bool:
    """Send `frames` if the socket can take them within `timeout_s`; False if it cannot. A DEALER
    with no usable connection (the buffer down, or a CURVE handshake it refused) blocks a plain
    send forever; this turns that into the same "no answer" as a lost reply."""
    if not sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLOUT):
        return False
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def _check(reply: Reply, kind: type[R]) -> R:
    """`reply` as the kind of reply its request expects; BufferRejected for an `Error`."""
    if isinstance(reply, Error):
        raise _refused(reply)
    if not isinstance(reply, kind):
        raise SchemaError("op", f"expected a {kind.OP!r} reply, got {reply.OP!r}")
    return reply


@dataclass
class _Put:
    frames: list[bytes | memoryview]
    future: asyncio.Future
    sent_at: float
    busy_replies: int = 0
    disk_full_replies: int = 0
    refused: bool = False
    """Its last answer was "WAL disk full": not stored, waiting to be sent again."""


@dataclass
class Batch:
    """Whole groups delivered together; commit `batch_id` once trained on."""

    batch_id: int
    groups: list[list[Trajectory]]
    staleness: list[int] = field(default_factory=list)
    """Per group: the buffer's version at delivery minus the group's oldest model-token version."""
    version: int = 0
    """The policy version the buffer knew when it delivered this batch."""

    @property
    def num_trajectories(self) -> int:
        return sum(len(g) for g in self.groups)


def ping(endpoint: str, cfg: BufferConfig, timeout_s: float = 0.5) -> dict[str, Any] | None:
    """The buffer's stats if it answers at `endpoint` within `timeout_s`, else None (readiness)."""
    ctx = zmq.Context()
    sock = _socket(ctx, cfg, endpoint)
    try:
        if not _send_within(sock, [Ping(rid="ping").encode()], timeout_s):
            return None
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = decode_reply(sock.recv_multipart()[0])
        return reply.stats if isinstance(reply, StatsReply) else None
    finally:
        sock.close(0)
        ctx.term()


class ProducerClient:
    """Asyncio client for generators: `async with ProducerClient(cfg, "gen-0") as p: ...`."""

    def __init__(self, cfg: BufferConfig, producer_id: str):
        self.cfg = cfg
        self.producer_id = producer_id
        self.session = uuid.uuid4().hex
        """This client object's session: the buffer refuses a second live one under one id."""
        # A plain socket whose descriptor the event loop watches (`_readable`): sends go out at
        # once without the futures and callbacks of zmq.asyncio (measured: bench_buffer).
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._puts: dict[int, _Put] = {}
        self._calls: dict[str, tuple[list[bytes], asyncio.Future[Reply], float]] = {}
        self._seq = 0
        self._rids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._sends: set[asyncio.Future] = set()
        self._last_reply = time.monotonic()
        self._last_sent = 0.0
        self.resends = 0
        """Requests and puts sent again after no answer (each reconnect is logged)."""
        self.busy_replies = 0
        """Puts the buffer refused as full and that were sent again later (backpressure)."""
        self.send_waits = 0
        """Sends that waited because ZeroMQ's queue to the buffer was full (buffer away or slow)."""
        self.disk_full_replies = 0
        """Puts refused because the buffer's log disk was full, and sent again later (backoff)."""
        self.version = 0
        """The learner's version as of the last grant: groups started now must be generated by
        weights of that version or a later one (engines behind it are not used)."""

    async def __aenter__(self) -> ProducerClient:
        self._loop = asyncio.get_running_loop()
        self._connect()
        self._tasks.append(asyncio.create_task(self._watchdog()))
        hello = Hello(rid=self._rid(), producer=self.producer_id, session=self.session)
        try:
            reply = await self._call(hello, HelloReply)
        except BaseException:
            await self.close()
            raise
        self._seq = reply.next_seq
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop; puts still waiting for an ack raise BufferUnavailable (they may have landed)."""
        closed = BufferUnavailable("the producer client was closed before the buffer answered")
        for fut in [p.future for p in self._puts.values()] + [c[1] for c in self._calls.values()]:
            if not fut.done():
                fut.set_exception(closed)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._disconnect()
        self._ctx.term()

    def _disconnect(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.FD)
            self._sock.close(0)
            self._sock = None

    def _connect(self) -> None:
        assert self._loop is not None
        self._disconnect()
        self._sock = _socket(self._ctx, self.cfg, self.cfg.producer_endpoint)
        self._loop.add_reader(self._sock.FD, self._readable)

    def _readable(self) -> None:
        """Handle every reply waiting on the socket (called by the event loop when its
        descriptor signals, and after sends: ZeroMQ's descriptor signals edges, not levels, so
        messages that arrived while we were sending would otherwise wait for the next edge)."""
        self._drain_scheduled = False
        sock = self._sock
        for _ in range(256):  # then yield to the loop, and come back
            if sock is None or sock.closed or not sock.getsockopt(zmq.EVENTS) & POLLIN:
                return
            self._on_reply(sock.recv_multipart(zmq.NOBLOCK))
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._readable)

    def _send_now(self, frames: list[bytes | memoryview]) -> bool:
        """Send without waiting; False when ZeroMQ's queue to the buffer is full (its HWM)."""
        sock = self._sock
        if sock is None:
            raise BufferUnavailable("the producer client was closed")
        try:
            # copy=False: ZeroMQ sends the payload from our bytes (kept in `_puts` for resends)
            # instead of copying it first; pyzmq still copies frames below its copy_threshold.
            send_frames(sock, frames, _NOBLOCK)
        except zmq.Again:
            return False
        self._last_sent = time.monotonic()
        if sock.getsockopt(zmq.EVENTS) & POLLIN:
            self._schedule_drain()
        return True

    async def _send(self, frames: list[bytes | memoryview]) -> None:
        """Send, waiting while ZeroMQ's queue to the buffer is full, at most `give_up_s`."""
        if self._send_now(frames):
            return
        self.send_waits += 1
        if self.send_waits == 1 or self.send_waits % 1000 == 0:
            log.warning(
                "the send queue to the buffer at %s is full: waiting (%d sends so far)",
                self.cfg.producer_endpoint,
                self.send_waits,
            )
        give_up = time.monotonic() + self.cfg.give_up_s
        while not self._send_now(frames):
            if time.monotonic() > give_up:
                raise BufferUnavailable(
                    f"could not send to the buffer at {self.cfg.producer_endpoint} for "
                    f"{self.cfg.give_up_s:.0f}s: its queue stayed full"
                )
            await asyncio.sleep(0.002)

    async def put_group(self, trajs: list[Trajectory]) -> AckStatus:
        """Send trajectories (normally one whole group); return once the buffer stored them.

        Returns OK; DUPLICATE when the buffer already had this put (a resend); STALE when the
        group was stored but already beyond max_staleness, so it was dropped (counted).
        Waits and resends while the buffer is full (BUSY); raises BufferRejected for bad input.
        """
        now = time.time()
        for t in trajs:
            t.enqueued_at = now
        seq = self._seq
        self._seq += 1
        payload, lengths = encode_trajectories(trajs)  # one frame: cheaper than several
        header = Put(
            seq=seq,
            producer=self.producer_id,
            session=self.session,
            lengths=lengths,
            batch_ack=True,
        )
        frames = [header.encode(), payload]
        size = sum(len(f) for f in frames)
        if size > self.cfg.max_message_bytes:  # far above it ZeroMQ would just drop the link
            raise BufferRejected(
                f"message of {size} B exceeds max_message_bytes={self.cfg.max_message_bytes}; "
                "send the group in several puts"
            )
        fut = asyncio.get_running_loop().create_future()
        self._puts[seq] = _Put(frames, fut, time.monotonic())
        await self._send(frames)
        try:
            return await fut
        finally:
            self._puts.pop(seq, None)

    async def admission(self, want: int) -> int:
        """How many new groups may be started now (each grant is used up when its group arrives)."""
        granted = await self._call(
            Admit(rid=self._rid(), producer=self.producer_id, session=self.session, want=want),
            Granted,
        )
        if granted.version is not None:
            self.version = granted.version
        return granted.n

    async def stats(self) -> dict[str, Any]:
        ask = StatsRequest(rid=self._rid(), producer=self.producer_id)
        return (await self._call(ask, StatsReply)).stats

    def _rid(self) -> str:
        return f"{self.producer_id}:{next(self._rids)}"

    async def _call(self, request: Request, kind: type[R]) -> R:
        """Send `request` (it has a rid) and wait for its reply, resent by the watchdog."""
        assert request.rid is not None
        frames = [request.encode()]
        fut = asyncio.get_running_loop().create_future()
        self._calls[request.rid] = (frames, fut, time.monotonic())
        await self._send(frames)
        try:
            return _check(await fut, kind)
        finally:
            self._calls.pop(request.rid, None)

    def _on_reply(self, frames: list[bytes]) -> None:
        self._last_reply = time.monotonic()
        try:
            reply = decode_reply(frames[0])
        except SchemaError:
            return
        if not isinstance(reply, Ack | Acks) and reply.rid in self._calls:
            fut = self._calls[reply.rid][1]
            if not fut.done():
                fut.set_result(reply)
            return
        if isinstance(reply, Acks):  # several puts' acks at once: each as its own Ack
            for seq in reply.seqs:
                self._answered(Ack(seq=seq, status=reply.status))
        elif isinstance(reply, Ack | Error) and reply.seq is not None:
            self._answered(reply)

    def _answered(self, reply: Ack | Error) -> None:
        """Settle the put that `reply` answers (a put's future resolves once: a resend's answer
        after the first is ignored)."""
        put = self._puts.get(reply.seq)
        if put is None or put.future.done():
            return  # the answer to a resend already answered
        if isinstance(reply, Error) and reply.reason == DISK_FULL:
            put.disk_full_replies += 1
            self.disk_full_replies += 1
            if put.disk_full_replies == 1:
                log.warning("put %d refused, retrying with backoff: %s", reply.seq, reply.error)
            wait = _DISK_RETRY.delay(put.disk_full_replies)
            asyncio.get_running_loop().call_later(wait, self._resend_busy, reply.seq)
            put.sent_at = float("inf")  # answered: not a lost message, keep the watchdog off it
            put.refused = True
        elif isinstance(reply, Error):
            put.future.set_exception(_refused(reply))
        elif reply.status == AckStatus.BUSY:
            put.busy_replies += 1
            self.busy_replies += 1
            if put.busy_replies == 1:  # once per put: a full buffer answers busy often
                log.info("buffer full: put %d waits and is sent again (busy)", reply.seq)
            wait = _BUSY_RETRY.delay(put.busy_replies)
            asyncio.get_running_loop().call_later(wait, self._resend_busy, reply.seq)
            put.sent_at = float("inf")  # not lost, just waiting: keep the watchdog off it
        else:
            put.future.set_result(reply.status)

    def abandon_refused(self) -> int:
        """Cancel the puts that wait only because the buffer's disk was full (they are not
        stored), so a stopping generator does not wait for the disk; return how many."""
        refused = [p for p in self._puts.values() if p.refused and not p.future.done()]
        for put in refused:
            put.future.cancel()
        if refused:
            log.warning("%d put(s) refused (WAL disk full) abandoned: not stored", len(refused))
        return len(refused)

    def _resend_busy(self, seq: int) -> None:
        put = self._puts.get(seq)
        if put is not None and not put.future.done():
            put.refused = False
            put.sent_at = time.monotonic()
            task = asyncio.ensure_future(self._send(put.frames))
            self._sends.add(task)  # keep a reference until it is done (asyncio holds weak ones)
            task.add_done_callback(self._sends.discard)

    async def _watchdog(self) -> None:
        """Reconnect and resend when answers stop; heartbeat so admission grants stay ours."""
        tick = min(0.25, self.cfg.request_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            self._readable()  # a safety net for a descriptor edge missed
            now = time.monotonic()
            waiting = [p.sent_at for p in self._puts.values()] + [
                c[2] for c in self._calls.values()
            ]
            if waiting and now - self._last_reply > self.cfg.give_up_s:
                err = BufferUnavailable(
                    f"no answer from the buffer at {self.cfg.producer_endpoint} "
                    f"for {self.cfg.give_up_s:.0f}s"
                )
                for fut in [p.future for p in self._puts.values()] + [
                    c[1] for c in self._calls.values()
                ]:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            if waiting and now - min(waiting) > self.cfg.request_timeout_s:
                self.resends += len(self._puts) + len(self._calls)
                log.warning(
                    "no answer from the buffer at %s for %.1fs: reconnecting, resending %d puts "
                    "and %d requests",
                    self.cfg.producer_endpoint,
                    now - min(waiting),
                    len(self._puts),
                    len(self._calls),
                )
                self._connect()
                for p in list(self._puts.values()):
                    p.sent_at = now
                    await self._send(p.frames)
                for rid, (frames, fut, _) in list(self._calls.items()):
                    self._calls[rid] = (frames, fut, now)
                    await self._send(frames)
            elif now - self._last_sent > self.cfg.grant_timeout_s / 3:
                beat = Heartbeat(producer=self.producer_id, session=self.session)
                await self._send([beat.encode()])


class ConsumerClient:
    """Synchronous client for the learner. One session per object: a new object with the same
    `consumer_id` (a restarted learner) first receives every batch the old one did not commit."""

    def __init__(self, cfg: BufferConfig, consumer_id: str):
        self.cfg = cfg
        self.consumer_id = consumer_id
        self.session = uuid.uuid4().hex
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, cfg, cfg.consumer_endpoint)
        self._rids = itertools.count()
        self._cursor = 0
        self.resends = 0
        """Requests sent again on a fresh connection after no answer (each logged)."""
        self.disk_full_replies = 0
        """Requests refused because the buffer's log disk was full, and sent again (backoff)."""
        self.missing_batches: list[list[int]] = []
        """After `resume`: ranges [first, last] of batch ids the buffer no longer holds (its
        log was damaged and it was started with `buffer.wal_on_damage = "continue"`)."""

    def _rid(self) -> str:
        return f"{self.session}:{next(self._rids)}"

    def _request(self, request: Request, wait_s: float = 0.0) -> tuple[Reply, list[zmq.Frame]]:
        """Send `request` (it has a rid) until its reply comes; BufferRejected for an `Error`."""
        assert request.rid is not None
        return self._roundtrip(request.encode(), request.rid, wait_s)

    def _roundtrip(self, header: bytes, rid: str, wait_s: float) -> tuple[Reply, list[zmq.Frame]]:
        give_up = time.monotonic() + wait_s + self.cfg.give_up_s
        refused = 0  # answers "WAL disk full" in a row: sent again after a back-off
        while True:
            deadline = time.monotonic() + wait_s + self.cfg.request_timeout_s
            sent = _send_within(self._sock, [header], self.cfg.request_timeout_s)
            answered = False
            while sent and not answered and (left := deadline - time.monotonic()) > 0:
                if not self._sock.poll(int(left * 1000) + 1):
                    break
                frames = self._sock.recv_multipart(copy=False)  # decoded straight from zmq's buffer
                try:
                    reply = decode_reply(frames[0].buffer)
                except SchemaError:
                    continue
                if isinstance(reply, Ack | Acks) or reply.rid != rid:
                    continue
                if isinstance(reply, Error) and reply.reason == DISK_FULL:
                    answered, refused = True, refused + 1
                    self.disk_full_replies += 1
                    if time.monotonic() > give_up:
                        raise BufferUnavailable(f"{reply.error} (for {self.cfg.give_up_s:.0f}s)")
                    if refused == 1:
                        log.warning("%s; retrying with backoff", reply.error)
                    time.sleep(_DISK_RETRY.delay(refused))
                elif isinstance(reply, Error):
                    raise _refused(reply)
                else:
                    return reply, frames[1:]
            if answered:
                continue  # the same request (same rid) again, on the same connection
            if time.monotonic() > give_up:
                raise BufferUnavailable(
                    f"no answer from the buffer at {self.cfg.consumer_endpoint} for "
                    f"{self.cfg.give_up_s:.0f}s (down, unreachable, or refused our CURVE key)"
                )
            self.resends += 1
            log.warning(
                "no answer from the buffer at %s within %.1fs: reconnecting and resending",
                self.cfg.consumer_endpoint,
                wait_s + self.cfg.request_timeout_s,
            )
            self._sock.close(0)  # a fresh connection after a buffer restart
            self._sock = _socket(self._ctx, self.cfg, self.cfg.consumer_endpoint)

    def get_batch(
        self,
        num_groups: int | None = None,
        num_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Batch | None:
        """The next batch of whole groups, or None if none is ready within `timeout_s`.

        num_groups: exactly this many groups. num_tokens: whole groups up to this many tokens
        (prompt + response), delivered once that many are ready. Neither: the announced
        groups_per_step. Batches a previous session left uncommitted come first. A timeout longer
        than `buffer.max_get_wait_s` is served as several gets.
        """
        wait = 0.0 if timeout_s is None else float(timeout_s)
        if not math.isfinite(wait) or wait < 0:
            raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + wait
        while True:
            left = max(0.0, deadline - time.monotonic())
            batch = self._get_batch(num_groups, num_tokens, min(left, self.cfg.max_get_wait_s))
            if batch is not None or left <= self.cfg.max_get_wait_s:
                return batch

    def _get_batch(
        self, num_groups: int | None, num_tokens: int | None, wait: float
    ) -> Batch | None:
        get = Get(
            rid=self._rid(),
            consumer=self.consumer_id,
            session=self.session,
            num_groups=num_groups,
            num_tokens=num_tokens,
            timeout_s=wait,
        )
        reply, frames = self._request(get, wait)
        if isinstance(reply, Empty):
            return None
        h = _check(reply, BatchReply)
        # The buffer validated every trajectory on arrival and forwards its bytes unchanged.
        views = (
            [f.buffer for f in frames] if h.lengths is None else split(frames[0].buffer, h.lengths)
        )
        trajs = [decode_trajectory(v, validate=False) for v in views]
        groups, start = [], 0
        for n in h.sizes:
            groups.append(trajs[start : start + n])
            start += n
        self._cursor = max(self._cursor, h.batch_id)
        return Batch(h.batch_id, groups, h.staleness, h.version)

    def _commit(self, batch_id: int, through: bool) -> Committed:
        commit = Commit(
            rid=self._rid(),
            consumer=self.consumer_id,
            session=self.session,
            batch_id=batch_id,
            through=through,
        )
        return _check(self._request(commit)[0], Committed)

    def commit(self, batch_id: int) -> None:
        """Retire a batch for good (idempotent)."""
        self._commit(batch_id, through=False)

    def commit_through(self, batch_id: int) -> int:
        """Retire every batch of this consumer id up to `batch_id`; return how many were open."""
        return self._commit(batch_id, through=True).n

    def cursor(self) -> int:
        """The newest batch id received: store it in a checkpoint, pass it to `resume`."""
        return self._cursor

    def resume(self, cursor: int) -> int:
        """After a restart from a checkpoint taken at `cursor`: retire what it already holds.
        Batches up to it that the buffer no longer holds (a damaged log it was told to continue
        past) are logged with where the log was damaged, and kept in `missing_batches`."""
        self._cursor = max(self._cursor, cursor)
        if cursor <= 0:
            return 0
        done = self._commit(cursor, through=True)
        self.missing_batches = done.missing or []
        if self.missing_batches:
            spans = ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in done.missing)
            log.warning(
                "resuming at batch %d: the buffer no longer holds batch(es) %s (they were "
                "delivered in records its write-ahead log lost: %s); training goes on without "
                "them",
                cursor,
                spans,
                done.damage,
            )
        return done.n

    def set_version(
        self, version: int, groups_per_step: int, lineage: list[list[int]] | None = None
    ) -> None:
        """Announce the learner's policy version (staleness) and step size (admission), and its
        line of weights (`slime_async.queue.lineage.Line.to_list()`; None: unchanged)."""
        announce = SetVersion(
            rid=self._rid(),
            consumer=self.consumer_id,
            session=self.session,
            version=version,
            groups_per_step=groups_per_step,
            lineage=[(int(c), int(f)) for c, f in lineage] if lineage is not None else None,
        )
        _check(self._request(announce)[0], Ok)

    def stats(self) -> dict[str, Any]:
        ask = StatsRequest(rid=self._rid(), consumer=self.consumer_id, session=self.session)
        return _check(self._request(ask)[0], StatsReply).stats

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> ConsumerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
