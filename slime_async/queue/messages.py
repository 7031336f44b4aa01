"""Every message between the buffer and its clients, one typed definition shared by both ends.

A message is a ZeroMQ multipart message: frame 0 is a MessagePack header map
`{"v": SCHEMA_VERSION, "op": <Op>, <fields>}`; puts and batches carry encoded trajectories
(`schema.py`) after it: one payload frame cut by the header's `lengths` (what the clients send:
ZeroMQ's cost per frame is above a copy), or one frame each. Each header below is a dataclass whose annotations are its
wire types: `encode()` packs it, `decode(h)` checks every field it declares and raises
`SchemaError` naming the first bad one (keys it does not declare are ignored). A field left at
None is not sent; absent and nil read the same.

    producer socket
        Hello{producer}                               -> HelloReply{next_seq}
        Put{seq, producer}, trajectory, ...           -> Ack{seq, status}
                                                         | Acks{seqs, status} (batch_ack: true)
        Admit{producer, want}                         -> Granted{n}
        Heartbeat{producer}                           -> Ok
    consumer socket
        Get{consumer, session, num_groups | num_tokens, timeout_s}
            -> BatchReply{batch_id, sizes, staleness, version}, trajectory, ... | Empty
        Commit{consumer, session, batch_id, through}  -> Committed{n}
        SetVersion{consumer, session, version, groups_per_step} -> Ok
    either socket
        Ping | StatsRequest                           -> StatsReply{stats}
        a request refused                             -> Error{reason, error}

A reply carries the `rid` of its request; an ack (or the error refusing a put) its `seq`.

Batched acks: a put that sets `batch_ack` may be acknowledged by an `Acks` reply naming several
puts of its producer that got the same status in one turn of the buffer; each seq in it means
exactly what its own `Ack` would (sent only after the turn's WAL records are durable). Wire
compatibility: fields are only ever added, optional, and ignored by a side that does not know
them, so `SCHEMA_VERSION` stays 1 and a new client talks to an old buffer (which ignores
`batch_ack` and sends one `Ack` per put) and an old client to a new buffer (which sends `Acks`
only to puts that asked for them). A change that an old side would misread bumps
`SCHEMA_VERSION`, which both ends check in every header.
"""

from __future__ import annotations

import itertools
import math
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from typing import (
    Annotated,
    Any,
    ClassVar,
    Self,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgpack
import msgspec
import zmq

from slime_async.queue.schema import SCHEMA_VERSION, SchemaError, unpack_map


class Op(StrEnum):
    """The `op` of a header: what kind of message it is."""

    HELLO = "hello"
    PUT = "put"
    ACK = "ack"
    ACKS = "acks"
    ADMIT = "admit"
    GRANTED = "granted"
    HEARTBEAT = "heartbeat"
    GET = "get"
    BATCH = "batch"
    EMPTY = "empty"
    COMMIT = "commit"
    COMMITTED = "committed"
    VERSION = "version"
    OK = "ok"
    PING = "ping"
    STATS = "stats"
    ERROR = "error"


class AckStatus(StrEnum):
    """What became of an acknowledged put."""

    OK = "ok"
    """Stored."""
    DUPLICATE = "duplicate"
    """Already stored (a resend, or a whole group pushed again): not stored twice."""
    BUSY = "busy"
    """Not stored: the buffer is full. Send it again later."""
    STALE = "stale"
    """Stored, but its group was already beyond max_staleness and was dropped (counted)."""


PositiveInt = Annotated[int, "> 0"]
Count = Annotated[int, ">= 0"]
"""A sequence number, batch id, version or count: 0 <= n < MAX_INT."""
MAX_INT = 1 << 62
"""Every integer field stays below this (one past it still fits MessagePack's 64 bits)."""
MAX_NAME = 256
"""Longest id (producer, consumer, session, rid) accepted: ids are echoed and kept."""
MAX_ERROR = 1024
"""Longest error text sent back: a huge bad value is never echoed whole."""


def show(v: Any, limit: int = 64) -> str:
    """`repr(v)` cut to `limit` characters, for error messages about hostile values."""
    text = repr(v) if not isinstance(v, str | bytes | list | dict) or len(v) < limit else ""
    return text[:limit] if text else f"<{type(v).__name__} of length {len(v)}>"


def split(payload: memoryview, lengths: list[int]) -> list[memoryview]:
    """The trajectories of one payload frame, cut by a header's `lengths` (views, no copy)."""
    if sum(lengths) != len(payload):
        raise SchemaError("lengths", f"add up to {sum(lengths)}, the payload has {len(payload)} B")
    ends = list(itertools.accumulate(lengths))
    return [payload[end - n : end] for n, end in zip(lengths, ends, strict=True)]


_SNDMORE = int(zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)
"""zmq.POLLIN as a plain int: `events & zmq.POLLIN` builds an enum each time (1.4 us against
0.05 us for two ints, measured on the 2-core dev machine)."""


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags, copy=False)` with plain-int flags (pyzmq ORs its enum
    flags once per frame, 1.4 us each); frames below pyzmq's copy_threshold are copied, larger
    ones sent by reference."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=False)


def pack_header(op: str, **fields: Any) -> bytes:
    """Frame 0 of a message: `{"v": SCHEMA_VERSION, "op": op, **fields}`, nothing checked: for
    raw senders and tests (clients and buffer send the message classes below)."""
    return msgpack.packb({"v": SCHEMA_VERSION, "op": op, **fields}, use_bin_type=True)


def unpack_header(frame: bytes | memoryview) -> dict[str, Any]:
    """Decode frame 0 and check its version and op; raise `SchemaError` for malformed or foreign
    headers. The fields are checked by the message class of the op (`REQUESTS`, `REPLIES`)."""
    h = unpack_map(frame, "header")
    if h.get("v") != SCHEMA_VERSION:
        raise SchemaError(
            "v", f"unknown schema version {h.get('v')!r} (this side speaks {SCHEMA_VERSION})"
        )
    if not isinstance(h.get("op"), str):
        raise SchemaError("op", "missing message type")
    return h


# ---------------------------------------------------------------- field checks, by wire type
def _integer(name: str, v: Any) -> int:
    if type(v) is not int:  # bool is an int subclass: not accepted
        raise SchemaError(name, f"expected an integer, got {type(v).__name__}")
    if not -MAX_INT < v < MAX_INT:
        raise SchemaError(name, f"{v} is out of range (|n| < 2**62)")
    return v


def _at_least(low: int) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if type(v) is not int or not low <= v < MAX_INT:
            what = "a positive integer" if low else "an integer >= 0"
            raise SchemaError(name, f"expected {what} below 2**62, got {show(v)}")
        return v

    return check


def _number(name: str, v: Any) -> float:
    if type(v) is not float and type(v) is not int:
        raise SchemaError(name, f"expected a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise SchemaError(name, f"must be finite, got {v}")
    return float(v)


def _flag(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise SchemaError(name, f"expected true or false, got {type(v).__name__}")
    return v


def _name(name: str, v: Any) -> str:
    if type(v) is not str or not v:
        raise SchemaError(name, "expected a non-empty string")
    if len(v) > MAX_NAME:
        raise SchemaError(name, f"{len(v)} characters, at most {MAX_NAME}")
    return v


def _integers(name: str, v: Any) -> list[int]:
    if type(v) is not list or any(type(x) is not int for x in v):
        raise SchemaError(name, "expected a list of integers")
    return v


def _map(name: str, v: Any) -> dict[str, Any]:
    if type(v) is not dict:
        raise SchemaError(name, f"expected a map, got {type(v).__name__}")
    return v


def _status(name: str, v: Any) -> AckStatus:
    try:
        return AckStatus(v)
    except ValueError:
        raise SchemaError(name, f"unknown status {show(v)}") from None


_CHECKS: dict[Any, Callable[[str, Any], Any]] = {
    int: _integer,
    PositiveInt: _at_least(1),
    Count: _at_least(0),
    float: _number,
    bool: _flag,
    str: _name,
    list[int]: _integers,
    dict[str, Any]: _map,
    AckStatus: _status,
}


@dataclass(slots=True, kw_only=True)
class Message:
    """A header: `OP` plus the fields its subclass declares (see `_message`)."""

    OP: ClassVar[Op]
    _SPEC: ClassVar[tuple[tuple[str, Callable[[str, Any], Any], bool], ...]]

    def encode(self) -> bytes:
        h: dict[str, Any] = {"v": SCHEMA_VERSION, "op": self.OP}
        for name, _, _ in self._SPEC:
            v = getattr(self, name)
            if v is not None:
                h[name] = v
        return msgspec.msgpack.encode(h)

    @classmethod
    def decode(cls, h: dict[str, Any]) -> Self:
        """The message in header `h` (from `unpack_header`); `SchemaError` names a bad field."""
        values = {}
        for name, check, required in cls._SPEC:
            v = h.get(name)
            if v is not None:
                values[name] = check(name, v)
            elif required:
                raise SchemaError(name, "missing field")
        return cls(**values)


M = TypeVar("M", bound=Message)


def _message(op: Op) -> Callable[[type[M]], type[M]]:
    """Make `cls` a message of kind `op`: a dataclass whose fields are checked by wire type."""

    def wrap(cls: type[M]) -> type[M]:
        cls = dataclass(slots=True, kw_only=True)(cls)
        hints = get_type_hints(cls, include_extras=True)
        spec = []
        for f in fields(cls):
            kind = hints[f.name]
            if get_origin(kind) in (Union, types.UnionType):  # `T | None`: may be left out
                (kind,) = (a for a in get_args(kind) if a is not type(None))
            spec.append((f.name, _CHECKS[kind], f.default is MISSING))
        cls.OP = op
        cls._SPEC = tuple(spec)
        return cls

    return wrap


# ---------------------------------------------------------------- producer socket
@_message(Op.HELLO)
class Hello(Message):
    """A producer (re)starting: where does my put numbering continue?"""

    rid: str | None = None
    producer: str
    session: str
    """One per client object; an id held by another live session is refused ("producer_in_use")."""


@_message(Op.HELLO)
class HelloReply(Message):
    rid: str | None = None
    next_seq: int
    """Above every sequence number the buffer accepted from this producer."""


@_message(Op.PUT)
class Put(Message):
    """Followed by one or more encoded trajectories."""

    seq: Count
    """Per-producer number: the buffer stores each number once, so a resend is harmless."""
    lengths: list[int] | None = None
    """Bytes of each trajectory in the one payload frame; absent: one frame per trajectory."""
    producer: str
    session: str
    """The session that said hello under `producer`; puts of any other session are refused."""
    batch_ack: bool | None = None
    """True: this put may be acknowledged in an `Acks` with other puts of its producer."""


@_message(Op.ACK)
class Ack(Message):
    seq: int
    status: AckStatus


@_message(Op.ACKS)
class Acks(Message):
    """Several puts' acks at once, all with one status (see "Batched acks" above)."""

    seqs: list[int]
    status: AckStatus


@_message(Op.ADMIT)
class Admit(Message):
    """How many new groups may I start now?"""

    rid: str | None = None
    producer: str
    session: str
    want: Count


@_message(Op.GRANTED)
class Granted(Message):
    rid: str | None = None
    n: int
    """New groups the producer may start; a grant is used up when its group arrives."""


@_message(Op.HEARTBEAT)
class Heartbeat(Message):
    """Keeps the producer's grants from expiring while it has nothing to send."""

    rid: str | None = None
    producer: str
    session: str


# ---------------------------------------------------------------- consumer socket
@_message(Op.GET)
class Get(Message):
    rid: str | None = None
    consumer: str
    session: str
    """One per client object: a new session of a consumer first gets its uncommitted batches."""
    num_groups: PositiveInt | None = None
    """Exactly this many whole groups."""
    num_tokens: PositiveInt | None = None
    """Whole groups up to this many tokens. Neither: the announced groups_per_step."""
    timeout_s: float = 0.0
    """How long the buffer may hold the request before answering `Empty` (<= max_get_wait_s)."""


@_message(Op.BATCH)
class BatchReply(Message):
    """Followed by the batch's encoded trajectories, group after group."""

    rid: str | None = None
    batch_id: int
    sizes: list[int]
    """Trajectories per group, in frame order."""
    staleness: list[int]
    """Per group: `version` minus the group's oldest model-token version."""
    version: int
    """The policy version the buffer knew at delivery."""
    lengths: list[int] | None = None
    """Bytes of each trajectory in the one payload frame; absent: one frame per trajectory."""


@_message(Op.EMPTY)
class Empty(Message):
    """Not enough ready within the get's `timeout_s`."""

    rid: str | None = None


@_message(Op.COMMIT)
class Commit(Message):
    rid: str | None = None
    consumer: str
    session: str
    batch_id: PositiveInt
    """A batch delivered to this consumer id (ids start at 1)."""
    through: bool = False
    """Also every earlier batch delivered to this consumer id."""


@_message(Op.COMMITTED)
class Committed(Message):
    rid: str | None = None
    n: int
    """Batches retired by this commit (0 for a resend)."""


@_message(Op.VERSION)
class SetVersion(Message):
    """The learner's policy version (staleness) and step size (admission budget)."""

    rid: str | None = None
    consumer: str
    session: str
    version: Count
    """Below 2**31, monotone per session, at most `buffer.max_version_jump` ahead."""
    groups_per_step: PositiveInt
    """At most `buffer.capacity_trajectories` (each group holds at least one trajectory)."""


@_message(Op.OK)
class Ok(Message):
    rid: str | None = None


# ---------------------------------------------------------------- either socket
@_message(Op.PING)
class Ping(Message):
    """Readiness probe: answered with `StatsReply`."""

    rid: str | None = None


@_message(Op.STATS)
class StatsRequest(Message):
    rid: str | None = None
    producer: str | None = None
    consumer: str | None = None
    session: str | None = None


@_message(Op.STATS)
class StatsReply(Message):
    rid: str | None = None
    stats: dict[str, Any]


@_message(Op.ERROR)
class Error(Message):
    """The request was refused; `reason` is a short counter key (`rejected` in the stats)."""

    reason: str
    error: str
    """What was wrong, for a person: names the field."""
    seq: int | None = None
    rid: str | None = None

    def __post_init__(self) -> None:
        if len(self.error) > MAX_ERROR:  # bounded replies, whatever was wrong
            self.error = self.error[: MAX_ERROR - 3] + "..."

    @classmethod
    def answering(cls, h: dict[str, Any], reason: str, error: str) -> Error:
        """The error refusing raw header `h`, with its seq and rid as sent (to match it by) when
        they are well-formed: a hostile value is never echoed."""
        seq, rid = h.get("seq"), h.get("rid")
        seq = seq if type(seq) is int and 0 <= seq < MAX_INT else None
        rid = rid if type(rid) is str and len(rid) <= MAX_NAME else None
        return cls(reason=reason, error=error, seq=seq, rid=rid)


Request = Hello | Put | Admit | Heartbeat | Get | Commit | SetVersion | Ping | StatsRequest
Reply = HelloReply | Ack | Acks | Granted | BatchReply | Empty | Committed | Ok | StatsReply | Error

REQUESTS: dict[str, type[Request]] = {
    m.OP: m for m in (Hello, Put, Admit, Heartbeat, Get, Commit, SetVersion, Ping, StatsRequest)
}
REPLIES: dict[str, type[Reply]] = {
    m.OP: m
    for m in (HelloReply, Ack, Acks, Granted, BatchReply, Empty, Committed, Ok, StatsReply, Error)
}


def decode_reply(frame: bytes | memoryview) -> Reply:
    """The reply in frame 0 (clients); `SchemaError` for a malformed one."""
    h = unpack_header(frame)
    kind = REPLIES.get(h["op"])
    if kind is None:
        raise SchemaError("op", f"unknown reply type {h['op']!r}")
    return kind.decode(h)
