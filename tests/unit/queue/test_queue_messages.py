"""The message headers: the wire maps both ends exchange, round trips, and bad fields named."""

import msgpack
import pytest

from slime_async.queue.messages import (
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
    SetVersion,
    StatsReply,
    StatsRequest,
    decode_reply,
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
