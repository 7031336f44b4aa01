"""The message headers: the wire maps both ends exchange, round trips, and bad fields named."""

import itertools
import typing

import msgpack
import pytest

from slime_async.queue.messages import (
    MAX_ERROR,
    PROTOCOL,
    REPLIES,
    REQUESTS,
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
    Op,
    Ping,
    Put,
    Reply,
    Request,
    SetVersion,
    StatsReply,
    StatsRequest,
    decode_reply,
    decode_request,
    pack_header,
    unpack_header,
)
from slime_async.queue.schema import SCHEMA_VERSION, SchemaError

EXAMPLES = [
    Hello(rid="p:0", producer="gen-0", session="a"),
    HelloReply(rid="p:0", next_seq=7),
    Put(seq=3, producer="gen-0", session="a"),
    Ack(seq=3, status=AckStatus.STALE),
    Acks(seqs=[4, 5, 7], status=AckStatus.OK),
    Admit(rid="p:1", producer="gen-0", session="a", want=4),
    Granted(rid="p:1", n=2),
    Heartbeat(producer="gen-0", session="a"),
    Ok(rid="s:2"),
    Get(rid="s:0", consumer="learner", session="s", num_tokens=4096, timeout_s=1.5),
    BatchReply(rid="s:0", batch_id=9, sizes=[4, 4], staleness=[0, 1], version=3),
    Empty(rid="s:0"),
    Commit(rid="s:1", consumer="learner", session="s", batch_id=9, through=True),
    Committed(rid="s:1", n=1),
    SetVersion(rid="s:2", consumer="learner", session="s", version=4, groups_per_step=8),
    Ping(rid="ping"),
    StatsRequest(rid="p:2", producer="gen-0"),
    StatsReply(rid="p:2", stats={"version": 4, "counts": {"puts": 1}}),
    Error(reason="field:reward", error="trajectory reward: must be finite, got nan", seq=3),
]


def test_every_op_has_its_messages():
    assert {m.OP for m in EXAMPLES} == set(Op)
    assert set(REQUESTS) | set(REPLIES) == set(Op)
    assert set(REQUESTS) & set(REPLIES) == {Op.HELLO, Op.STATS}  # request and answer share a name


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    h = unpack_header(msg.encode())
    kind = type(msg)
    back = decode_reply(msg.encode()) if kind in REPLIES.values() else REQUESTS[h["op"]].decode(h)
    assert back == msg and type(back) is kind


def test_wire_maps_are_the_protocol():
    """The header maps on the socket, as raw senders (and older peers) spell them."""

    def wire(msg):
        return msgpack.unpackb(msg.encode(), raw=False)

    v = SCHEMA_VERSION
    assert wire(Put(seq=3, producer="g", session="s")) == {
        "v": v,
        "op": "put",
        "seq": 3,
        "producer": "g",
        "session": "s",
    }
    assert wire(Ack(seq=3, status=AckStatus.BUSY)) == {
        "v": v,
        "op": "ack",
        "seq": 3,
        "status": "busy",
    }
    assert wire(Get(rid="r", consumer="c", session="s", num_groups=2)) == {
        "v": v,
        "op": "get",
        "rid": "r",
        "consumer": "c",
        "session": "s",
        "num_groups": 2,  # num_tokens left at None: not sent
        "timeout_s": 0.0,
    }
    assert wire(Error(reason="unknown_op", error="unknown message type 'x'", rid="r")) == {
        "v": v,
        "op": "error",
        "reason": "unknown_op",
        "error": "unknown message type 'x'",
        "rid": "r",
    }
    assert [s.value for s in AckStatus] == ["ok", "duplicate", "busy", "stale"]


@pytest.mark.parametrize(
    ("kind", "fields", "field", "words"),
    [
        (Put, {"producer": "g"}, "seq", "missing field"),
        (Put, {"seq": True, "producer": "g"}, "seq", "integer"),
        (Put, {"seq": 1, "producer": ""}, "producer", "non-empty string"),
        (Get, {"consumer": "c", "session": "s", "num_groups": 0}, "num_groups", "positive"),
        (Get, {"consumer": "c", "session": "s", "timeout_s": "1"}, "timeout_s", "number"),
        (Commit, {"consumer": "c", "session": "s", "batch_id": 1, "through": 1}, "through", "true"),
        (SetVersion, {"consumer": "c", "session": "s", "version": 1}, "groups_per_step", "missing"),
        (Ack, {"seq": 1, "status": "lost"}, "status", "unknown status 'lost'"),
        (BatchReply, {"batch_id": 1, "sizes": [1, "2"]}, "sizes", "list of integers"),
        (StatsReply, {"stats": [1]}, "stats", "map"),
    ],
)
def test_bad_field_is_named(kind, fields, field, words):
    with pytest.raises(SchemaError) as e:
        kind.decode({"v": SCHEMA_VERSION, "op": kind.OP, **fields})
    assert e.value.field == field
    assert words in str(e.value)


def test_nil_optional_fields_and_unknown_keys_are_accepted():
    h = {
        "v": SCHEMA_VERSION,
        "op": "get",
        "rid": None,
        "consumer": "c",
        "session": "s",
        "num_groups": None,
        "future_field": 1,
    }
    assert Get.decode(h) == Get(consumer="c", session="s")


def test_unknown_reply_is_a_schema_error():
    with pytest.raises(SchemaError, match="unknown reply type 'launch'"):
        decode_reply(msgpack.packb({"v": SCHEMA_VERSION, "op": "launch"}))


# ---------------------------------------------------------------- an older peer's bytes
OLDER_PEER = [
    (
        Hello(rid="p:0", producer="gen-0", session="a"),
        b"\x85\xa1v\x01\xa2op\xa5hello\xa3rid\xa3p:0\xa8producer\xa5gen-0\xa7session\xa1a",
    ),
    (
        HelloReply(rid="p:0", next_seq=7),
        b"\x84\xa1v\x01\xa2op\xa5hello\xa3rid\xa3p:0\xa8next_seq\x07",
    ),
    (
        Put(seq=3, producer="gen-0", session="a", lengths=[10, 20], batch_ack=True),
        b"\x87\xa1v\x01\xa2op\xa3put\xa3seq\x03\xa7lengths\x92\n\x14\xa8producer\xa5gen-0"
        b"\xa7session\xa1a\xa9batch_ack\xc3",
    ),
    (
        Ack(seq=3, status=AckStatus.STALE),
        b"\x84\xa1v\x01\xa2op\xa3ack\xa3seq\x03\xa6status\xa5stale",
    ),
    (
        Acks(seqs=[4, 5, 7], status=AckStatus.OK),
        b"\x84\xa1v\x01\xa2op\xa4acks\xa4seqs\x93\x04\x05\x07\xa6status\xa2ok",
    ),
    (
        Admit(rid="p:1", producer="gen-0", session="a", want=4),
        b"\x86\xa1v\x01\xa2op\xa5admit\xa3rid\xa3p:1\xa8producer\xa5gen-0\xa7session\xa1a"
        b"\xa4want\x04",
    ),
    (Granted(rid="p:1", n=2), b"\x84\xa1v\x01\xa2op\xa7granted\xa3rid\xa3p:1\xa1n\x02"),
    (
        Heartbeat(producer="gen-0", session="a"),
        b"\x84\xa1v\x01\xa2op\xa9heartbeat\xa8producer\xa5gen-0\xa7session\xa1a",
    ),
    (
        Get(rid="s:0", consumer="learner", session="s", num_groups=2),
        b"\x87\xa1v\x01\xa2op\xa3get\xa3rid\xa3s:0\xa8consumer\xa7learner\xa7session\xa1s"
        b"\xaanum_groups\x02\xa9timeout_s\xcb\x00\x00\x00\x00\x00\x00\x00\x00",
    ),
    (
        BatchReply(rid="s:0", batch_id=9, sizes=[2], staleness=[1], version=3, lengths=[10, 20]),
        b"\x88\xa1v\x01\xa2op\xa5batch\xa3rid\xa3s:0\xa8batch_id\t\xa5sizes\x91\x02"
        b"\xa9staleness\x91\x01\xa7version\x03\xa7lengths\x92\n\x14",
    ),
    (Empty(rid="s:0"), b"\x83\xa1v\x01\xa2op\xa5empty\xa3rid\xa3s:0"),
    (
        Commit(rid="s:1", consumer="learner", session="s", batch_id=9),
        b"\x87\xa1v\x01\xa2op\xa6commit\xa3rid\xa3s:1\xa8consumer\xa7learner\xa7session\xa1s"
        b"\xa8batch_id\t\xa7through\xc2",
    ),
    (Committed(rid="s:1", n=1), b"\x84\xa1v\x01\xa2op\xa9committed\xa3rid\xa3s:1\xa1n\x01"),
    (
        SetVersion(rid="s:2", consumer="learner", session="s", version=4, groups_per_step=8),
        b"\x87\xa1v\x01\xa2op\xa7version\xa3rid\xa3s:2\xa8consumer\xa7learner\xa7session\xa1s"
        b"\xa7version\x04\xafgroups_per_step\x08",
    ),
    (Ok(rid="s:2"), b"\x83\xa1v\x01\xa2op\xa2ok\xa3rid\xa3s:2"),
    (Ping(rid="ping"), b"\x83\xa1v\x01\xa2op\xa4ping\xa3rid\xa4ping"),
    (
        StatsRequest(rid="p:2", producer="gen-0"),
        b"\x84\xa1v\x01\xa2op\xa5stats\xa3rid\xa3p:2\xa8producer\xa5gen-0",
    ),
    (
        StatsReply(rid="p:2", stats={"version": 4, "counts": {"puts": 1}}),
        b"\x84\xa1v\x01\xa2op\xa5stats\xa3rid\xa3p:2\xa5stats\x82\xa7version\x04\xa6counts"
        b"\x81\xa4puts\x01",
    ),
    (
        Error(reason="field:seq", error="put: seq: missing field", seq=3, rid="p:3"),
        b"\x86\xa1v\x01\xa2op\xa5error\xa6reason\xa9field:seq\xa5error\xb7put: seq: missing field"
        b"\xa3seq\x03\xa3rid\xa3p:3",
    ),
]
"""Each message and its header as packed by the dataclass implementation of these messages
(key order v, op, fields; None fields left out; through and timeout_s always sent)."""


def _canonical(frame: bytes) -> bytes:
    """The header map packed again with its keys sorted: equal for equal keys, values and
    MessagePack types (0 and 0.0 differ, True and 1 too), whatever the order of the keys."""
    h = msgpack.unpackb(frame, raw=False)
    return msgpack.packb(dict(sorted(h.items())), use_bin_type=True)


def _is_reply(kind: type) -> bool:
    return kind in REPLIES.values()


@pytest.mark.parametrize(("msg", "wire"), OLDER_PEER, ids=lambda m: type(m).__name__)
def test_an_older_peer_and_this_one_read_each_other(msg, wire):
    kind = type(msg)
    assert {type(m) for m, _ in OLDER_PEER} == {*REQUESTS.values(), *REPLIES.values()}
    # Its bytes read here: by the compiled decode and by the reference path.
    decoded = decode_reply(wire) if _is_reply(kind) else decode_request(wire)
    assert decoded == msg and type(decoded) is kind
    assert kind.decode(unpack_header(wire)) == msg
    # Ours read there: an older peer reads a header into a dict and checks it, so the same map
    # (keys, values and their MessagePack types) is read the same; only the key order differs.
    assert _canonical(msg.encode()) == _canonical(wire)


def test_a_header_without_version_or_another_version_is_refused():
    for v in (None, 0, 2, "1"):
        h = {"op": "ping", "rid": "r"} if v is None else {"v": v, "op": "ping", "rid": "r"}
        frame = msgpack.packb(h)
        assert decode_request(frame) is None
        with pytest.raises(SchemaError, match="unknown schema version") as e:
            unpack_header(frame)
        assert e.value.field == "v"
        with pytest.raises(SchemaError, match="unknown schema version"):
            decode_reply(msgpack.packb({**h, "op": "ok"}))


def test_nil_reads_as_absent_for_fields_with_a_default():
    get = pack_header("get", consumer="c", session="s", num_groups=None, timeout_s=None)
    assert decode_request(get) is None  # the compiled pass refuses nil for a float ...
    h = unpack_header(get)
    assert Get.decode(h) == Get(consumer="c", session="s")  # ... the reference path reads it
    commit = pack_header("commit", consumer="c", session="s", batch_id=2, through=None)
    assert Commit.decode(unpack_header(commit)).through is False
    with pytest.raises(SchemaError, match="missing field") as e:
        Get.decode(unpack_header(pack_header("get", consumer=None, session="s")))
    assert e.value.field == "consumer"


# ---------------------------------------------------------------- errors, word for word
@pytest.mark.parametrize(
    ("op", "fields", "field", "problem"),
    [
        (
            "put",
            {"seq": True, "producer": "g", "session": "s"},
            "seq",
            "expected an integer >= 0 below 2**62, got True",
        ),
        (
            "put",
            {"seq": 2**64 - 1, "producer": "g", "session": "s"},
            "seq",
            "expected an integer >= 0 below 2**62, got 18446744073709551615",
        ),
        (
            "put",
            {"producer": "", "seq": -1, "session": "s"},
            "seq",
            "expected an integer >= 0 below 2**62, got -1",
        ),
        (
            "put",
            {"seq": 1, "producer": "g", "session": "s", "lengths": [1, 2.5]},
            "lengths",
            "expected a list of integers",
        ),
        (
            "get",
            {"consumer": "c", "session": "s", "num_groups": 0},
            "num_groups",
            "expected a positive integer below 2**62, got 0",
        ),
        (
            "get",
            {"consumer": "c", "session": "s", "timeout_s": "1"},
            "timeout_s",
            "expected a number, got str",
        ),
        (
            "get",
            {"consumer": "c", "session": "s", "timeout_s": float("nan")},
            "timeout_s",
            "must be finite, got nan",
        ),
        (
            "commit",
            {"consumer": "c", "session": "s", "batch_id": 1, "through": 1},
            "through",
            "expected true or false, got int",
        ),
        (
            "hello",
            {"producer": "p" * 300, "session": "s"},
            "producer",
            "300 characters, at most 256",
        ),
        (
            "hello",
            {"rid": 7, "producer": "p", "session": "s"},
            "rid",
            "expected a non-empty string",
        ),
        (
            "version",
            {"consumer": "c", "session": "s", "version": 1},
            "groups_per_step",
            "missing field",
        ),
        (
            "admit",
            {"producer": "p", "session": "s", "want": "x" * 100},
            "want",
            "expected an integer >= 0 below 2**62, got <str of length 100>",
        ),
    ],
)
def test_a_bad_request_gets_the_words_it_always_got(op, fields, field, problem):
    """The first bad field in the order its class declares them (not the order of the map),
    phrased from the field's wire type, a long bad value never echoed."""
    frame = pack_header(op, **fields)
    assert decode_request(frame) is None
    with pytest.raises(SchemaError) as e:
        REQUESTS[op].decode(unpack_header(frame))
    assert (e.value.field, e.value.problem) == (field, problem)


@pytest.mark.parametrize(
    ("op", "fields", "field", "problem"),
    [
        (
            "hello",
            {"next_seq": 2**62},
            "next_seq",
            "4611686018427387904 is out of range (|n| < 2**62)",
        ),
        ("hello", {"next_seq": "x"}, "next_seq", "expected an integer, got str"),
        ("ack", {"seq": 1, "status": "lost"}, "status", "unknown status 'lost'"),
        (
            "batch",
            {"batch_id": 1, "sizes": [1, "2"], "staleness": [0], "version": 0},
            "sizes",
            "expected a list of integers",
        ),
        ("stats", {"stats": [1]}, "stats", "expected a map, got list"),
        ("error", {"reason": "r", "error": ""}, "error", "expected a non-empty string"),
    ],
)
def test_a_bad_reply_gets_the_words_it_always_got(op, fields, field, problem):
    with pytest.raises(SchemaError) as e:
        decode_reply(pack_header(op, **fields))
    assert (e.value.field, e.value.problem) == (field, problem)


_GOOD = {
    "hello": {"rid": "r", "producer": "p", "session": "s"},
    "put": {"seq": 1, "producer": "p", "session": "s", "lengths": [3], "batch_ack": True},
    "admit": {"rid": "r", "producer": "p", "session": "s", "want": 2},
    "heartbeat": {"producer": "p", "session": "s"},
    "get": {"rid": "r", "consumer": "c", "session": "s", "num_groups": 1, "timeout_s": 1.0},
    "commit": {"rid": "r", "consumer": "c", "session": "s", "batch_id": 1, "through": True},
    "version": {"rid": "r", "consumer": "c", "session": "s", "version": 0, "groups_per_step": 1},
    "ping": {"rid": "r"},
    "stats": {"rid": "r", "producer": "p", "consumer": "c", "session": "s"},
}
_VALUES = [None, True, 0, 1, -1, 2**62, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf")]
_VALUES += ["", "x", "y" * 257, b"bin", [], [1, 2], [1, "2"], [True], {}, {"a": 1}, "ok"]


def _variants():
    """Requests with one field (or an unknown one) set to each value, missing, or two fields
    wrong at once."""
    for op, good in _GOOD.items():
        yield {"v": 1, "op": op, **good}
        for k in [*good, "extra"]:
            for bad in _VALUES:
                yield {"v": 1, "op": op, **good, k: bad}
            yield {"v": 1, "op": op, **{a: b for a, b in good.items() if a != k}}
        for a, b in itertools.combinations(good, 2):
            yield {"v": 1, "op": op, **good, b: -5, a: ""}
        for v in (True, 1.0, 2):
            yield {"v": v, "op": op, **good}


def test_the_compiled_decode_accepts_only_what_the_reference_path_accepts():
    compiled = 0
    for h in _variants():
        frame = msgpack.packb(h)
        fast = decode_request(frame)
        try:
            ref = REQUESTS[h["op"]].decode(unpack_header(frame))
        except SchemaError:
            assert fast is None, h
            continue
        assert fast is None or (fast == ref and type(fast) is type(ref)), h
        compiled += fast is not None
    assert compiled > 100  # the common case takes the compiled pass


def test_error_text_is_bounded_and_reaches_the_client_whole():
    long = Error(reason="bad_request", error="x" * 5000)
    assert len(long.error) == MAX_ERROR and long.error.endswith("...")
    assert decode_reply(long.encode()) == long
    assert decode_reply(Error(reason="r", error="y" * 600).encode()).error == "y" * 600


def test_the_protocol_table_holds_every_message_once():
    requests = {k for served in PROTOCOL.values() for k in served}
    replies = {r for served in PROTOCOL.values() for rs in served.values() for r in rs}
    assert requests == set(typing.get_args(Request)) == set(REQUESTS.values())
    assert replies | {Error} == set(typing.get_args(Reply)) == set(REPLIES.values())
    assert {Ping, StatsRequest} <= set(PROTOCOL["producer"]) & set(PROTOCOL["consumer"])
