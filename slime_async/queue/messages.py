"""Every message between the buffer and its clients, one typed definition shared by both ends.

A message is a ZeroMQ multipart message: frame 0 is a MessagePack header map
`{"op": <Op>, "v": SCHEMA_VERSION, <fields>}`; puts and batches carry encoded trajectories
(`schema.py`) after it: one payload frame cut by the header's `lengths` (what the clients send:
ZeroMQ's cost per frame is above a copy), or one frame each.

`PROTOCOL` (below the messages) is the table of the protocol: for each socket, the requests it
serves and the replies each may get; any request may also be answered by an `Error`. A message's
fields are those of its class. A reply carries the `rid` of its request; an ack (or the error
refusing a put) its `seq`.

Each header is a `msgspec.Struct` tagged by its `op`: its annotations are its wire types, their
bounds `msgspec.Meta` constraints. `encode()` packs it; `decode_request` and `decode_reply` check
a whole header in one compiled pass. A header that pass refuses goes through `unpack_header` and
its class's `decode`, which raise `SchemaError` naming the first bad field in the order the class
declares them, so both give the same answer. Keys a class does not declare are ignored, whatever
they hold; a field left at None is not sent; absent and nil read the same.

Batched acks: a put that sets `batch_ack` may be acknowledged by an `Acks` reply naming several
puts of its producer that got the same status in one turn of the buffer; each seq in it means
exactly what its own `Ack` would (sent only after the turn's WAL records are durable). Wire
compatibility: fields are only ever added, optional, and ignored by a side that does not know
them, so `SCHEMA_VERSION` stays 1 and a new client talks to an older buffer (which ignores
`batch_ack` and sends one `Ack` per put) and an older client to a new buffer (which sends `Acks`
only to puts that asked for them). A change that an older side would misread bumps
`SCHEMA_VERSION`, which both ends check in every header.
"""

from __future__ import annotations

import itertools
import sys
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Self

import msgpack
import msgspec
import zmq
from msgspec import inspect as mi

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


MAX_INT = 1 << 62
"""Every integer field stays below this (one past it still fits MessagePack's 64 bits)."""
MAX_NAME = 256
"""Longest id (producer, consumer, session, rid) accepted: ids are echoed and kept."""
MAX_ERROR = 1024
"""Longest error text sent back: a huge bad value is never echoed whole."""

Int = Annotated[int, msgspec.Meta(gt=-MAX_INT, lt=MAX_INT)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=MAX_INT)]
"""A sequence number, batch id, version or count: 0 <= n < MAX_INT."""
PositiveInt = Annotated[int, msgspec.Meta(ge=1, lt=MAX_INT)]
Number = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A finite number: NaN and the infinities are outside these bounds."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ERROR)]
Version = Annotated[int, msgspec.Meta(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]
MAX_BREAKS = 4096
"""Most breaks of a line of weights (one per learner restart that left versions behind)."""
Lineage = Annotated[list[tuple[Count, Count]], msgspec.Meta(max_length=MAX_BREAKS)]


def _sent(value: Any) -> Any:
    """A default that is sent all the same: `omit_defaults` leaves a field out only while it
    holds its default object itself (the None of optional fields), never what a factory made."""
    return msgspec.field(default_factory=lambda: value)


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


class Message(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="op"):
    """A header: its class's tag is its `op` (also its `OP`); its fields follow `v`."""

    OP: ClassVar[Op]
    v: Version = _sent(SCHEMA_VERSION)

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, h: dict[str, Any]) -> Self:
        """The message in header `h` (from `unpack_header`, which checked `v` and `op`);
        `SchemaError` names the first bad field."""
        fields = {k: h[k] for k in cls.__struct_fields__ if k != "v" and h.get(k) is not None}
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError:
            raise _bad_field(cls, h) from None


def _bad_field(kind: type[Message], h: dict[str, Any]) -> SchemaError:
    """The first field of `kind`, in declaration order, that header `h` gets wrong."""
    for f in msgspec.structs.fields(kind):
        v = h.get(f.encode_name)
        if f.name == "v" or (v is None and not f.required):
            continue
        if v is None:
            return SchemaError(f.name, "missing field")
        try:
            msgspec.convert(v, f.type)
        except msgspec.ValidationError:
            return SchemaError(f.name, _problem(f.name, mi.type_info(f.type), v))
    return SchemaError("header", f"does not make a {kind.OP.value!r} message")


def _problem(name: str, t: mi.Type, v: Any) -> str:
    """What is wrong with value `v` of a field of wire type `t`, for a person (bounded)."""
    if isinstance(t, mi.UnionType):  # `T | None`: the value is not nil
        (t,) = (a for a in t.types if not isinstance(a, mi.NoneType))
    got = type(v).__name__
    match t:
        case mi.IntType(ge=None):
            if type(v) is int:
                return f"{v} is out of range (|n| < 2**62)"
            return f"expected an integer, got {got}"
        case mi.IntType(ge=low):
            what = "a positive integer" if low else "an integer >= 0"
            return f"expected {what} below 2**62, got {show(v)}"
        case mi.FloatType():
            if type(v) is float:
                return f"must be finite, got {v}"
            return f"expected a number, got {got}"
        case mi.BoolType():
            return f"expected true or false, got {got}"
        case mi.StrType(max_length=most):
            if type(v) is str and v:
                return f"{len(v)} characters, at most {most}"
            return "expected a non-empty string"
        case mi.ListType():
            return "expected a list of integers"
        case mi.DictType():
            return f"expected a map, got {got}"
        case mi.EnumType():
            return f"unknown {name} {show(v)}"
    return f"unexpected {got}"


# ---------------------------------------------------------------- producer socket
class Hello(Message, tag=Op.HELLO.value, kw_only=True):
    """A producer (re)starting: where does my put numbering continue?"""

    rid: Name | None = None
    producer: Name
    session: Name
    """One per client object; an id held by another live session is refused ("producer_in_use")."""


class HelloReply(Message, tag=Op.HELLO.value, kw_only=True):
    rid: Name | None = None
    next_seq: Int
    """Above every sequence number the buffer accepted from this producer."""


class Put(Message, tag=Op.PUT.value, kw_only=True):
    """Followed by one or more encoded trajectories."""

    seq: Count
    """Per-producer number: the buffer stores each number once, so a resend is harmless."""
    lengths: list[int] | None = None
    """Bytes of each trajectory in the one payload frame; absent: one frame per trajectory."""
    producer: Name
    session: Name
    """The session that said hello under `producer`; puts of any other session are refused."""
    batch_ack: bool | None = None
    """True: this put may be acknowledged in an `Acks` with other puts of its producer."""


class Ack(Message, tag=Op.ACK.value, kw_only=True):
    seq: Int
    status: AckStatus


class Acks(Message, tag=Op.ACKS.value, kw_only=True):
    """Several puts' acks at once, all with one status (see "Batched acks" above)."""

    seqs: list[int]
    status: AckStatus


class Admit(Message, tag=Op.ADMIT.value, kw_only=True):
    """How many new groups may I start now?"""

    rid: Name | None = None
    producer: Name
    session: Name
    want: Count


class Granted(Message, tag=Op.GRANTED.value, kw_only=True):
    rid: Name | None = None
    n: Int
    """New groups the producer may start; a grant is used up when its group arrives."""
    version: Count | None = None
    """The learner's announced version: a group granted now must start on engines serving it
    or a later version (an engine behind it holds weights the run no longer trains from)."""


class Heartbeat(Message, tag=Op.HEARTBEAT.value, kw_only=True):
    """Keeps the producer's grants from expiring while it has nothing to send."""

    rid: Name | None = None
    producer: Name
    session: Name


# ---------------------------------------------------------------- consumer socket
class Get(Message, tag=Op.GET.value, kw_only=True):
    rid: Name | None = None
    consumer: Name
    session: Name
    """One per client object: a new session of a consumer first gets its uncommitted batches."""
    num_groups: PositiveInt | None = None
    """Exactly this many whole groups."""
    num_tokens: PositiveInt | None = None
    """Whole groups up to this many tokens. Neither: the announced groups_per_step."""
    timeout_s: Number = _sent(0.0)
    """How long the buffer may hold the request before answering `Empty` (<= max_get_wait_s)."""


class BatchReply(Message, tag=Op.BATCH.value, kw_only=True):
    """Followed by the batch's encoded trajectories, group after group."""

    rid: Name | None = None
    batch_id: Int
    sizes: list[int]
    """Trajectories per group, in frame order."""
    staleness: list[int]
    """Per group: `version` minus the group's oldest model-token version."""
    version: Int
    """The policy version the buffer knew at delivery."""
    lengths: list[int] | None = None
    """Bytes of each trajectory in the one payload frame; absent: one frame per trajectory."""


class Empty(Message, tag=Op.EMPTY.value, kw_only=True):
    """Not enough ready within the get's `timeout_s`."""

    rid: Name | None = None


class Commit(Message, tag=Op.COMMIT.value, kw_only=True):
    rid: Name | None = None
    consumer: Name
    session: Name
    batch_id: PositiveInt
    """A batch delivered to this consumer id (ids start at 1)."""
    through: bool = _sent(False)
    """Also every earlier batch delivered to this consumer id."""


class Committed(Message, tag=Op.COMMITTED.value, kw_only=True):
    rid: Name | None = None
    n: Int
    """Batches retired by this commit (0 for a resend)."""
    missing: list[list[int]] | None = None
    """Ranges [first, last] of batch ids up to a `through` commit's that this buffer no longer
    holds: its write-ahead log lost the records that delivered them (`damage` says where)."""
    damage: Text | None = None
    """Where the buffer's log was damaged (segment, bytes, records lost)."""


class SetVersion(Message, tag=Op.VERSION.value, kw_only=True):
    """The learner's policy version (staleness) and step size (admission budget)."""

    rid: Name | None = None
    consumer: Name
    session: Name
    version: Count
    """Below 2**31, monotone per session, at most `buffer.max_version_jump` ahead."""
    groups_per_step: PositiveInt
    """At most `buffer.capacity_trajectories` (each group holds at least one trajectory)."""
    lineage: Lineage | None = None
    """The run's line of weights as [cut, fresh] breaks (`slime_async.queue.lineage`); absent:
    unchanged. It may change only with a new learner session."""


class Ok(Message, tag=Op.OK.value, kw_only=True):
    rid: Name | None = None


# ---------------------------------------------------------------- either socket
class Ping(Message, tag=Op.PING.value, kw_only=True):
    """Readiness probe: answered with `StatsReply`."""

    rid: Name | None = None


class StatsRequest(Message, tag=Op.STATS.value, kw_only=True):
    rid: Name | None = None
    producer: Name | None = None
    consumer: Name | None = None
    session: Name | None = None


class StatsReply(Message, tag=Op.STATS.value, kw_only=True):
    rid: Name | None = None
    stats: dict[str, Any]


class Error(Message, tag=Op.ERROR.value, kw_only=True):
    """The request was refused; `reason` is a short counter key (`rejected` in the stats)."""

    reason: Name
    error: Text
    """What was wrong, for a person: names the field."""
    seq: Int | None = None
    rid: Name | None = None

    def __post_init__(self) -> None:
        if len(self.error) > MAX_ERROR:  # bounded replies, whatever was wrong
            msgspec.structs.force_setattr(self, "error", self.error[: MAX_ERROR - 3] + "...")

    @classmethod
    def answering(cls, frame: bytes | memoryview, reason: str, error: str) -> Error:
        """The error refusing the request in header `frame`, with its seq and rid as sent (to
        match it by) when they are well-formed: a hostile value is never echoed."""
        try:
            h = unpack_map(frame, "header")
        except SchemaError:
            h = {}
        seq, rid = h.get("seq"), h.get("rid")
        seq = seq if type(seq) is int and 0 <= seq < MAX_INT else None
        rid = rid if type(rid) is str and len(rid) <= MAX_NAME else None
        return cls(reason=reason, error=error, seq=seq, rid=rid)


# msgspec fixes a class's tag once the class is made: each class's `OP` is its tag.
for _kind in Message.__subclasses__():
    _kind.OP = Op(_kind.__struct_config__.tag)
del _kind

Request = Hello | Put | Admit | Heartbeat | Get | Commit | SetVersion | Ping | StatsRequest
Reply = HelloReply | Ack | Acks | Granted | BatchReply | Empty | Committed | Ok | StatsReply | Error

_EITHER: dict[type[Request], tuple[type[Reply], ...]] = {
    Ping: (StatsReply,),
    StatsRequest: (StatsReply,),
}
PROTOCOL: dict[str, dict[type[Request], tuple[type[Reply], ...]]] = {
    "producer": {
        Hello: (HelloReply,),
        Put: (Ack, Acks),  # Acks: only to puts that set batch_ack
        Admit: (Granted,),
        Heartbeat: (Ok,),
        **_EITHER,
    },
    "consumer": {
        Get: (BatchReply, Empty),
        Commit: (Committed,),
        SetVersion: (Ok,),
        **_EITHER,
    },
}
"""Each socket's requests and the replies each may get; an `Error` may answer any of them."""

REQUESTS: dict[str, type[Request]] = {k.OP: k for served in PROTOCOL.values() for k in served}
REPLIES: dict[str, type[Reply]] = {
    k.OP: k for served in PROTOCOL.values() for replies in served.values() for k in replies
} | {Error.OP: Error}


class _Versioned(msgspec.Struct):
    """A header's version alone: the message classes default `v` (to send it), so this decode
    is what refuses a header without one."""

    v: Version


_encode = msgspec.msgpack.Encoder().encode
_VERSIONED = msgspec.msgpack.Decoder(_Versioned)
_REQUEST = msgspec.msgpack.Decoder(Request)
_REPLY = msgspec.msgpack.Decoder(Reply)


def _compiled(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview) -> Any:
    try:
        _VERSIONED.decode(frame)
        return decoder.decode(frame)
    except (msgspec.MsgspecError, RecursionError):
        return None


def decode_request(frame: bytes | memoryview) -> Request | None:
    """The request in frame 0, every field checked in one compiled pass; None for a header it
    refuses: `unpack_header` and `REQUESTS[op].decode` then decide it and name what is wrong."""
    return _compiled(_REQUEST, frame)


def decode_reply(frame: bytes | memoryview) -> Reply:
    """The reply in frame 0 (clients); `SchemaError` for a malformed one."""
    reply = _compiled(_REPLY, frame)
    if reply is not None:
        return reply
    h = unpack_header(frame)
    kind = REPLIES.get(h["op"])
    if kind is None:
        raise SchemaError("op", f"unknown reply type {h['op']!r}")
    return kind.decode(h)
