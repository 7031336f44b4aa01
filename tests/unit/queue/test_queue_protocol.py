"""`messages.PROTOCOL` against a running buffer (in-process thread, loopback sockets): each
request gets one of the replies the table gives it, every reply of the table comes, and a request
of the other socket is refused as unknown."""

import contextlib

import zmq

from slime_async.config import BufferConfig
from slime_async.queue.messages import (
    PROTOCOL,
    Admit,
    Commit,
    Error,
    Get,
    Heartbeat,
    Hello,
    Message,
    Ping,
    Put,
    SetVersion,
    StatsRequest,
    decode_reply,
)
from slime_async.queue.schema import encode_trajectory
from slime_async.queue.server import Buffer
from slime_async.testing.trajectories import synthetic_group


@contextlib.contextmanager
def _peers():
    """A started buffer and a bare DEALER connected to each of its sockets, by socket name."""
    cfg = BufferConfig(producer_endpoint="tcp://127.0.0.1:*", consumer_endpoint="tcp://127.0.0.1:*")
    buf = Buffer(cfg).start()
    ctx = zmq.Context()
    socks = {}
    try:
        for name, endpoint in (
            ("producer", buf.producer_endpoint),
            ("consumer", buf.consumer_endpoint),
        ):
            socks[name] = ctx.socket(zmq.DEALER)
            socks[name].setsockopt(zmq.LINGER, 0)
            socks[name].connect(endpoint)
        yield socks
    finally:
        for sock in socks.values():
            sock.close(0)
        ctx.term()
        buf.stop()


def _ask(sock: zmq.Socket, header: Message, *payload: bytes) -> Message:
    sock.send_multipart([header.encode(), *payload])
    assert sock.poll(5000), f"no reply to {header!r}"
    return decode_reply(sock.recv_multipart()[0])


def _trajectory(group_id: str) -> bytes:
    return encode_trajectory(synthetic_group(group_id, 1, response_len=8)[0])


def test_each_request_gets_a_reply_the_table_gives_it():
    producer = {"producer": "gen-0", "session": "p"}
    consumer = {"consumer": "learner", "session": "c"}
    exchanges = [
        ("producer", Hello(rid="h", **producer)),
        ("producer", Put(seq=0, **producer), _trajectory("g0")),
        ("producer", Put(seq=1, batch_ack=True, **producer), _trajectory("g1")),
        ("producer", Admit(rid="a", want=1, **producer)),
        ("producer", Heartbeat(**producer)),
        ("producer", Ping(rid="p")),
        ("producer", StatsRequest(rid="s", producer="gen-0")),
        ("consumer", SetVersion(rid="v", version=0, groups_per_step=1, **consumer)),
        ("consumer", Get(rid="g", num_groups=1, **consumer)),
        ("consumer", Commit(rid="c", batch_id=1, **consumer)),
        ("consumer", Get(rid="e", num_groups=5, **consumer)),  # one group left: Empty
        ("consumer", Ping(rid="p")),
        ("consumer", StatsRequest(rid="s", **consumer)),
    ]
    seen = set()
    with _peers() as socks:
        for socket, request, *payload in exchanges:
            reply = _ask(socks[socket], request, *payload)
            assert type(reply) in PROTOCOL[socket][type(request)], (request, reply)
            seen.add((socket, type(request), type(reply)))
    assert seen == {
        (socket, request, reply)
        for socket, served in PROTOCOL.items()
        for request, replies in served.items()
        for reply in replies
    }


def test_a_request_of_the_other_socket_is_unknown_there():
    samples = [
        Hello(rid="h", producer="gen-0", session="p"),
        Put(seq=0, producer="gen-0", session="p"),
        Admit(rid="a", producer="gen-0", session="p", want=1),
        Heartbeat(producer="gen-0", session="p"),
        Get(rid="g", consumer="learner", session="c"),
        Commit(rid="c", consumer="learner", session="c", batch_id=1),
        SetVersion(rid="v", consumer="learner", session="c", version=0, groups_per_step=1),
    ]
    with _peers() as socks:
        for socket, served in PROTOCOL.items():
            for request in samples:
                if type(request) in served:
                    continue
                reply = _ask(socks[socket], request)
                assert isinstance(reply, Error) and reply.reason == "unknown_op", reply
                assert f"on the {socket} socket" in reply.error
        assert {type(r) for r in samples} | {Ping, StatsRequest} == {
            k for served in PROTOCOL.values() for k in served
        }
