"""The buffer over real sockets (in-process thread): acks, dedupe, whole groups, staleness,
admission, backpressure, bad input, consumer re-delivery."""

import asyncio
import contextlib

import msgpack
import numpy as np
import pytest
import zmq

from slime_async.config import BufferConfig
from slime_async.queue.client import BufferRejected, ConsumerClient, ProducerClient
from slime_async.queue.messages import pack_header, unpack_header
from slime_async.queue.schema import SCHEMA_VERSION, encode_trajectory
from slime_async.queue.server import Buffer
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import free_port


@contextlib.contextmanager
def running(**overrides):
    """A started buffer on free loopback ports, and a config whose endpoints point at it."""
    defaults = {
        "producer_endpoint": "tcp://127.0.0.1:*",
        "consumer_endpoint": "tcp://127.0.0.1:*",
        "request_timeout_s": 2.0,
        "give_up_s": 10.0,
    }
    cfg = BufferConfig(**{**defaults, **overrides})
    buf = Buffer(cfg).start()
    try:
        yield (
            buf,
            cfg.model_copy(
                update={
                    "producer_endpoint": buf.producer_endpoint,
                    "consumer_endpoint": buf.consumer_endpoint,
                }
            ),
        )
    finally:
        buf.stop()


class Raw:
    """A bare DEALER speaking the wire protocol, for what the clients never send."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes) -> tuple[dict, list[bytes]]:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(5000), "no reply from the buffer"
        reply = self.sock.recv_multipart()
        return unpack_header(reply[0]), reply[1:]

    def put(self, seq: int, trajs, producer: str = "raw", session: str = "raw-session") -> dict:
        header = pack_header("put", seq=seq, producer=producer, session=session)
        return self.ask(header, *(encode_trajectory(t) for t in trajs))[0]

    def close(self):
        self.sock.close(0)
        self.ctx.term()


async def _put_all(cfg, groups, producer="p0"):
    async with ProducerClient(cfg, producer) as p:
        return [await p.put_group(g) for g in groups]


def test_put_ack_get_commit_whole_groups():
    with running() as (_buf, cfg):
        groups = [synthetic_group(f"g{i}", group_size=3, version=0, seed=i) for i in range(4)]
        assert asyncio.run(_put_all(cfg, groups)) == ["ok"] * 4
        with ConsumerClient(cfg, "learner") as c:
            b = c.get_batch(num_groups=3, timeout_s=2)
            assert [len(g) for g in b.groups] == [3, 3, 3]
            for got, sent in zip(b.groups, groups[:3], strict=True):  # oldest first, FIFO
                assert [t.id for t in got] == [t.id for t in sent]
                np.testing.assert_array_equal(got[2].response_ids, sent[2].response_ids)
                assert got[0].enqueued_at > 0
            c.commit(b.batch_id)
            c.commit(b.batch_id)  # idempotent
            assert c.get_batch(num_groups=2, timeout_s=0.2) is None  # one group left, never half
            s = c.stats()
            assert s["groups_ready"] == 1 and s["trajectories_held"] == 3
            assert s["counts"]["committed_groups"] == 3
            with pytest.raises(BufferRejected, match="never delivered"):
                c.commit(999)


def test_ipc_endpoints_and_oversized_groups_split_into_puts(tmp_path):
    cfg = BufferConfig(
        producer_endpoint=f"ipc://{tmp_path}/producer.sock",
        consumer_endpoint=f"ipc://{tmp_path}/consumer.sock",
        max_message_bytes=4096,
        request_timeout_s=2.0,
    )
    with Buffer(cfg):
        g = synthetic_group("big", 4, response_len=100)  # about 1.6 KB a trajectory

        async def go():
            async with ProducerClient(cfg, "p") as p:
                with pytest.raises(BufferRejected, match="send the group in several puts"):
                    await p.put_group(g)
                return [await p.put_group(g[:2]), await p.put_group(g[2:])]

        assert asyncio.run(go()) == ["ok", "ok"]
        with ConsumerClient(cfg, "learner") as c:
            assert len(c.get_batch(num_groups=1, timeout_s=2).groups[0]) == 4


def test_partial_puts_complete_a_group_and_late_get_is_served():
    with running() as (buf, cfg):
        g = synthetic_group("split", group_size=4)
        raw = Raw(buf.producer_endpoint)
        try:
            assert raw.put(0, g[:1])["status"] == "ok"
            assert raw.put(1, g[1:3])["status"] == "ok"
            with ConsumerClient(cfg, "learner") as c:
                assert c.get_batch(num_groups=1, timeout_s=0.1) is None
                assert c.stats()["groups_pending"] == 1
                assert raw.put(2, g[3:])["status"] == "ok"
                b = c.get_batch(num_groups=1, timeout_s=2)
                assert sorted(t.id for t in b.groups[0]) == sorted(t.id for t in g)
        finally:
            raw.close()


def test_resent_put_is_deduplicated():
    with running() as (buf, _cfg):
        raw = Raw(buf.producer_endpoint)
        try:
            g = synthetic_group("g0", group_size=2)
            assert raw.put(5, g)["status"] == "ok"
            assert raw.put(5, g)["status"] == "duplicate"  # a resend after a lost ack
            assert raw.put(3, synthetic_group("g1", 2))["status"] == "ok"  # out of order is fine
            assert raw.put(3, synthetic_group("g1", 2))["status"] == "duplicate"
            s = buf.stats()
            assert s["counts"]["duplicates"] == 2 and s["trajectories_held"] == 4
            # A rejected put never uses up its number: a later valid put may carry it.
            bad = synthetic_group("bad", 1)
            bad[0].reward = float("nan")
            for seq in (0, 1, 2, 4):
                assert raw.put(seq, bad)["op"] == "error"
            assert buf.state.producers["raw"].done == {3, 5}
            # The same session continues after every number the buffer accepted...
            hello, _ = raw.ask(pack_header("hello", rid="h", producer="raw", session="raw-session"))
            assert hello["next_seq"] == 6
            assert raw.put(0, synthetic_group("g2", 1))["status"] == "ok"
            # ... and a new session (the old connection gone) above them, gaps closed.
            raw.close()
            raw = Raw(buf.producer_endpoint)
            hello, _ = raw.ask(pack_header("hello", rid="h2", producer="raw", session="new"))
            assert hello["next_seq"] == 6 and buf.state.producers["raw"].done_below == 6
        finally:
            raw.close()


def _bad_inputs(g):
    m = msgpack.unpackb(encode_trajectory(g[0]), raw=False)

    def blob(**change):
        return msgpack.packb({**m, **change}, use_bin_type=True)

    seqs = iter(range(100))

    def put():  # a fresh number each time: a rejected number counts as used
        return pack_header("put", seq=next(seqs), producer="bad", session="s")

    return [
        ("malformed header", [b"\xc1\xc1"], "malformed", "malformed MessagePack"),
        ("malformed trajectory", [put(), b"\xc1"], "malformed", "malformed MessagePack"),
        (
            "unknown schema version",
            [msgpack.packb({"v": SCHEMA_VERSION + 1, "op": "put"})],
            "schema_version",
            "unknown schema version",
        ),
        (
            "trajectory schema version",
            [put(), blob(schema=SCHEMA_VERSION + 1)],
            "schema_version",
            "unknown schema version",
        ),
        (
            "lengths disagree",
            [put(), blob(logprobs=m["logprobs"][:-4])],
            "field:logprobs",
            "disagrees",
        ),
        ("NaN reward", [put(), blob(reward=float("nan"))], "field:reward", "finite"),
        (
            "infinite logprob",
            [put(), blob(logprobs=np.full(len(g[0].logprobs), -np.inf, "<f4").tobytes())],
            "field:logprobs",
            "NaN or infinite",
        ),
        (
            "negative token",
            [put(), blob(response_ids=np.full(len(g[0].response_ids), -3, "<i4").tobytes())],
            "field:response_ids",
            "negative token id",
        ),
        ("unknown op", [pack_header("launch", rid="x")], "unknown_op", "unknown message type"),
        (
            "too large",
            [put(), b"\0" * 3000, b"\0" * 3000],
            "too_large",
            "exceeds max_message_bytes",
        ),
        (
            "group size mismatch",
            [put(), blob(group_size=7), blob(id="other")],
            "group",
            "group_size",
        ),
        (
            "missing seq",
            [pack_header("put", producer="bad", session="s"), blob()],
            "bad_request",
            "seq",
        ),
    ]


def test_every_bad_input_gets_a_named_error_and_the_buffer_keeps_serving():
    with running(max_message_bytes=4096) as (buf, cfg):
        g = synthetic_group("good", group_size=2, response_len=8)
        raw = Raw(buf.producer_endpoint)
        try:
            for name, frames, reason, words in _bad_inputs(g):
                h, _ = raw.ask(*frames)
                assert h["op"] == "error", name
                assert h["reason"] == reason, name
                assert words in h["error"], (name, h["error"])
            rejected = buf.stats()["rejected"]
            assert sum(rejected.values()) == len(_bad_inputs(g))
            assert rejected["malformed"] == 2 and rejected["field:logprobs"] == 2
            assert buf.stats()["trajectories_held"] == 0  # nothing half-stored
            # Everyone else is still served, including the sender of the bad messages.
            assert asyncio.run(_put_all(cfg, [g])) == ["ok"]
            assert raw.put(0, synthetic_group("after", 1, response_len=8))["status"] == "ok"
            with ConsumerClient(cfg, "learner") as c, pytest.raises(BufferRejected) as e:
                fly = pack_header("fly", rid="f", consumer="learner", session=c.session)
                c._roundtrip(fly, "f", 0.0)  # an unknown op on the consumer socket
            assert "unknown message type 'fly' on the consumer socket" in str(e.value)
        finally:
            raw.close()


def test_producer_client_raises_buffer_rejected():
    with running() as (_buf, cfg):
        g = synthetic_group("g", group_size=2)
        g[1].reward = float("inf")

        async def go():
            async with ProducerClient(cfg, "p") as p:
                with pytest.raises(BufferRejected, match="reward: must be finite"):
                    await p.put_group(g)
                g[1].reward = 1.0
                assert await p.put_group(g) == "ok"  # the same client keeps working

        asyncio.run(go())


def test_staleness_drop_order_and_histogram():
    with running(max_staleness=2, stale_policy="drop") as (buf, cfg):
        groups = [synthetic_group(f"v{v}", 2, version=v, seed=v) for v in (0, 1, 3, 2)]
        groups[0][1].versions[-3:] = 9  # newer tail tokens do not make a group fresher
        asyncio.run(_put_all(cfg, groups))
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(3, groups_per_step=2)
            s = c.stats()
            assert s["dropped"] == {"stale": 1} and s["groups_ready"] == 3
            b = c.get_batch(num_groups=2, timeout_s=1)
            assert [g[0].group_id for g in b.groups] == ["v1", "v2"]  # oldest first
            assert b.staleness == [2, 1] and b.version == 3
            c.set_version(5, groups_per_step=2)  # delivered groups are never dropped
            c.commit(b.batch_id)
            assert c.stats()["counts"]["committed_groups"] == 2
            assert c.stats()["dropped"] == {"stale": 1}  # v3 is still fresh enough: 5-3 = 2
            c.set_version(6, groups_per_step=2)
            s = c.stats()
            assert s["dropped"] == {"stale": 2} and s["staleness_hist"] == {"1": 1, "2": 1}
            assert s["trajectories_held"] == 0
            # A late member of a dropped group is acknowledged and discarded, not re-grown.
            raw = Raw(buf.producer_endpoint)
            try:
                late = synthetic_group("v0", 2, version=0)  # from the group's own producer
                assert raw.put(100, late[:1], producer="p0")["status"] == "ok"
                assert c.stats()["groups_pending"] == 0
                # A group that is too old on arrival is acknowledged as "stale" and counted.
                assert raw.put(1, synthetic_group("old", 1, version=3))["status"] == "stale"
                s = c.stats()
                assert s["dropped"]["stale"] == 3 and s["trajectories_held"] == 0
            finally:
                raw.close()


def test_freshest_first_order_and_token_batches():
    with running(order="freshest_first") as (_buf, cfg):
        groups = [
            synthetic_group(f"v{v}", 2, prompt_len=10, response_len=20, version=v) for v in range(4)
        ]
        asyncio.run(_put_all(cfg, groups))
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(3, 1)
            b = c.get_batch(num_tokens=130, timeout_s=1)  # 60 tokens a group: two fit
            assert [g[0].group_id for g in b.groups] == ["v3", "v2"]
            assert c.get_batch(num_tokens=1000, timeout_s=0.1) is None  # only 120 ready
            b = c.get_batch(num_tokens=10, timeout_s=1)  # one group even past the budget
            assert [g[0].group_id for g in b.groups] == ["v1"]


def test_admission_keeps_work_within_the_staleness_budget():
    with running(max_staleness=1, groups_per_step=3, grant_timeout_s=0.3) as (buf, cfg):

        async def go():
            async with ProducerClient(cfg, "a") as a, ProducerClient(cfg, "b") as b:
                assert await a.admission(4) == 4  # budget (1 + 1) * 3 = 6
                assert await b.admission(4) == 2
                assert await b.admission(1) == 0
                for i in range(2):  # a's groups arrive: buffered now, grants used up
                    await a.put_group(synthetic_group(f"a{i}", 2, seed=i))
                s = await a.stats()
                assert s["grants_outstanding"] == 4 and s["groups_ready"] == 2
                assert await b.admission(1) == 0
            # Both producers are gone: their grants expire, buffered groups still count.
            await asyncio.sleep(0.4)
            async with ProducerClient(cfg, "c") as c:
                assert await c.admission(10) == 4
                assert (await c.stats())["counts"]["grants_expired"] == 4

        asyncio.run(go())
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(0, groups_per_step=5)  # the learner's step size sets the budget
        # c left a moment ago; on a loaded machine that moment can pass grant_timeout_s (0.3 s)
        # and release its 4 grants before this check: count c as just heard from.
        buf.state.admission.heard_from("c")
        assert buf.state.admit("d", 100) == 2 * 5 - 2 - 4


def test_backpressure_waits_instead_of_dropping(caplog):
    caplog.set_level("INFO", logger="slime_async.queue.client")
    with running(capacity_trajectories=4) as (buf, cfg):

        async def go():
            async with ProducerClient(cfg, "p") as p:
                puts = [
                    asyncio.create_task(p.put_group(synthetic_group(f"g{i}", 2, seed=i)))
                    for i in range(4)
                ]
                await asyncio.sleep(0.3)
                assert sum(t.done() for t in puts) == 2  # the other two wait for room
                s = await p.stats()
                assert s["trajectories_held"] == 4 and s["counts"]["busy"] >= 2
                loop = asyncio.get_running_loop()
                with ConsumerClient(cfg, "learner") as c:
                    for _ in range(2):
                        b = await loop.run_in_executor(None, lambda: c.get_batch(2, timeout_s=2))
                        await loop.run_in_executor(None, c.commit, b.batch_id)
                assert await asyncio.gather(*puts) == ["ok"] * 4
                assert p.busy_replies >= 2  # each wait counted by the client too, and logged
                assert caplog.text.count("buffer full: put") == 2  # once per waiting put
                with pytest.raises(BufferRejected, match="exceeds capacity_trajectories"):
                    await p.put_group(synthetic_group("huge", 5))

        asyncio.run(go())
        assert buf.stats()["trajectories_held"] == 0


def test_restarted_consumer_gets_uncommitted_batches_again():
    with running() as (_buf, cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(6)]))
        first = ConsumerClient(cfg, "learner")
        b1 = first.get_batch(num_groups=2, timeout_s=1)
        first.commit(b1.batch_id)
        b2 = first.get_batch(num_groups=2, timeout_s=1)
        b3 = first.get_batch(num_groups=1, timeout_s=1)
        assert first.cursor() == b3.batch_id
        first.close()  # "crashed" after training b2, b3 without committing

        again = ConsumerClient(cfg, "learner")
        r2 = again.get_batch(num_groups=5, timeout_s=1)  # same batches, same ids, in order
        r3 = again.get_batch(num_groups=5, timeout_s=1)
        assert (r2.batch_id, r3.batch_id) == (b2.batch_id, b3.batch_id)
        assert [t.id for g in r2.groups for t in g] == [t.id for g in b2.groups for t in g]
        fresh = again.get_batch(num_groups=1, timeout_s=1)
        assert fresh.batch_id > b3.batch_id and fresh.groups[0][0].group_id == "g5"
        again.close()

        # A learner resuming from a checkpoint taken at b2: b2 is retired, b3 and later return.
        third = ConsumerClient(cfg, "learner")
        assert third.resume(b2.batch_id) == 1
        assert third.get_batch(num_groups=1, timeout_s=1).batch_id == b3.batch_id
        assert third.get_batch(num_groups=1, timeout_s=1).batch_id == fresh.batch_id
        assert third.commit_through(third.cursor()) == 2
        s = third.stats()
        assert s["batches_delivered_uncommitted"] == 0 and s["trajectories_held"] == 0
        assert s["counts"]["redelivered"] == 4
        third.close()


def test_lost_batch_reply_is_answered_with_the_same_batch():
    with running() as (buf, cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2, seed=i) for i in range(3)]))
        raw = Raw(buf.consumer_endpoint)
        try:
            ask = pack_header("get", rid="r1", consumer="L", session="s", num_groups=1)
            h1, _ = raw.ask(ask)
            h2, frames = raw.ask(ask)  # the same request again: its reply was "lost"
            assert h1["batch_id"] == h2["batch_id"] and len(h2["lengths"]) == 2
            assert len(frames) == 1 and len(frames[0]) == sum(h2["lengths"])  # one payload frame
            assert buf.stats()["groups_ready"] == 2
        finally:
            raw.close()


def test_admission_counts_the_batch_in_training_until_the_next_version():
    # max_staleness 0 is synchronous RL: one batch per policy version, nothing started while
    # the learner trains, everything trained at the version it was generated with.
    with running(max_staleness=0, groups_per_step=2) as (buf, cfg):

        async def produce(first: int) -> None:
            async with ProducerClient(cfg, "p") as p:
                assert await p.admission(5) == 2
                for i in range(first, first + 2):
                    await p.put_group(synthetic_group(f"g{i}", 2, seed=i))
                assert await p.admission(1) == 0

        asyncio.run(produce(0))
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(0, groups_per_step=2)
            batch = c.get_batch(num_groups=2, timeout_s=5)
            assert batch is not None and batch.staleness == [0, 0]
            assert buf.state.admit("q", 5) == 0  # the learner is training on it
            c.set_version(1, groups_per_step=2)  # done: the new weights are on the engines
            assert buf.state.admit("q", 5) == 2
            c.commit(batch.batch_id)  # (the learner commits at its next checkpoint)
            assert buf.state.admit("q", 5) == 0  # q holds those 2 grants now

    # A consumer that commits right after training frees the budget the same way.
    with running(max_staleness=0, groups_per_step=1) as (buf, cfg):
        asyncio.run(_put_one(cfg, "g0"))
        with ConsumerClient(cfg, "learner") as c:
            batch = c.get_batch(num_groups=1, timeout_s=5)
            assert buf.state.admit("q", 5) == 0
            c.commit(batch.batch_id)
            assert buf.state.admit("q", 5) == 1


async def _put_one(cfg, gid: str) -> None:
    async with ProducerClient(cfg, "p") as p:
        assert await p.admission(1) == 1
        await p.put_group(synthetic_group(gid, 2))


def test_a_restarted_producer_does_not_inherit_its_grants():
    with running(max_staleness=0, groups_per_step=2, grant_timeout_s=60) as (buf, cfg):

        async def go() -> None:
            async with ProducerClient(cfg, "p") as p:
                assert await p.admission(2) == 2
            async with ProducerClient(cfg, "p") as again:  # same id: the process restarted
                assert await again.admission(2) == 2

        asyncio.run(go())
        assert buf.state.counts["grants_expired"] == 2


def test_a_group_pushed_again_after_delivery_is_a_duplicate():
    with running(groups_per_step=1) as (buf, cfg):

        async def put() -> str:
            async with ProducerClient(cfg, "p") as p:
                return await p.put_group(synthetic_group("g0", 2))

        assert asyncio.run(put()) == "ok"
        assert asyncio.run(put()) == "duplicate"  # still ready in the buffer
        with ConsumerClient(cfg, "learner") as c:
            batch = c.get_batch(num_groups=1, timeout_s=5)
            c.commit(batch.batch_id)
        # A producer restarted between our ack and its cursor save pushes it once more.
        assert asyncio.run(put()) == "duplicate"
        stats = buf.state.stats()
        assert stats["groups_ready"] == 0 and stats["counts"]["delivered_groups"] == 1


def test_batched_acks_settle_each_put_once_and_old_clients_get_one_ack_each(tmp_path):
    """Puts that ask for it (`batch_ack`, what ProducerClient sends) are acknowledged together:
    one `acks` message per turn and status names several puts, each exactly once, and only once
    the turn's WAL records are synced; a put without the flag (an older client) still gets its
    own `ack`; a resend inside a batch is named with status duplicate, not stored twice."""
    with running(wal_dir=str(tmp_path / "wal"), wal_sync="fsync") as (buf, _cfg):
        raw = Raw(buf.producer_endpoint)
        try:
            raw.ask(pack_header("hello", rid="h", producer="raw", session="raw-session"))
            n = 24
            frames = []
            for seq in range(n):
                blob = encode_trajectory(synthetic_group(f"g{seq}", 1)[0])
                head = pack_header(
                    "put",
                    seq=seq,
                    producer="raw",
                    session="raw-session",
                    lengths=[len(blob)],
                    batch_ack=True,
                )
                frames.append([head, blob])
            frames.append(frames[3])  # a resend of seq 3
            for f in frames:  # sent before the first reply: the buffer drains them in few turns
                raw.sock.send_multipart(f)
            acked: dict[int, list[str]] = {}
            messages = 0
            while sum(map(len, acked.values())) < n + 1:
                assert raw.sock.poll(5000), f"acks missing: got {acked}"
                h = unpack_header(raw.sock.recv_multipart()[0])
                assert h["op"] == "acks", h
                messages += 1
                for seq in h["seqs"]:
                    acked.setdefault(seq, []).append(h["status"])
            assert sorted(acked) == list(range(n))
            assert all(s == ["ok"] for q, s in acked.items() if q != 3)
            assert sorted(acked[3]) == ["duplicate", "ok"]
            assert messages < n  # batched: fewer messages than puts
            assert buf.stats()["trajectories_held"] == n
            # A put without the flag: one ack of its own, as before.
            assert raw.put(100, synthetic_group("solo", 1)) == {
                "v": SCHEMA_VERSION,
                "op": "ack",
                "seq": 100,
                "status": "ok",
            }
        finally:
            raw.close()


def test_producer_client_puts_are_acknowledged_in_batches_and_each_resolves():
    """ProducerClient asks for batched acks; each of many concurrent puts still resolves with
    its own status and every group is delivered once."""
    with running() as (buf, cfg):

        async def go():
            async with ProducerClient(cfg, "p0") as p:
                groups = [synthetic_group(f"g{i}", 2) for i in range(40)]
                return await asyncio.gather(*(p.put_group(g) for g in groups))

        statuses = asyncio.run(go())
        assert statuses == ["ok"] * 40
        with ConsumerClient(cfg, "learner") as c:
            b = c.get_batch(num_groups=40, timeout_s=5)
            assert sorted(g[0].group_id for g in b.groups) == sorted(f"g{i}" for i in range(40))
        assert buf.stats()["counts"].get("duplicates", 0) == 0


def test_producer_client_misses_no_reply_and_waits_while_its_send_queue_is_full():
    """The producer's socket is read from the event loop on its descriptor's edges: replies that
    arrive while it sends are not left waiting (many puts interleaved with admission and stats
    calls all resolve), and while the buffer is away puts queue up to ZeroMQ's limit (1,000
    messages), then wait, and all of them land once a buffer is back on the same port."""
    port = free_port()
    overrides = {"producer_endpoint": f"tcp://127.0.0.1:{port}", "groups_per_step": 64}
    with running(**overrides) as (buf, cfg):
        cfg = cfg.model_copy(update={"request_timeout_s": 60.0, "give_up_s": 60.0})

        async def mixed(p):
            puts = [p.put_group(synthetic_group(f"m{i}", 1, response_len=4)) for i in range(300)]
            calls = [p.admission(1) for _ in range(30)] + [p.stats() for _ in range(30)]
            return await asyncio.wait_for(asyncio.gather(*puts, *calls), 30)

        async def go():
            async with ProducerClient(cfg, "p0") as p:
                done = await mixed(p)
                assert done[:300] == ["ok"] * 300 and all(isinstance(s, dict) for s in done[330:])
                buf.stop()  # the buffer goes away; the client keeps its socket
                puts = [
                    asyncio.ensure_future(p.put_group(synthetic_group(f"w{i}", 1, response_len=4)))
                    for i in range(1100)
                ]
                await asyncio.sleep(0.5)
                assert not any(f.done() for f in puts)  # queued or waiting, none lost
                assert p.send_waits > 0
                again = Buffer(cfg.model_copy(update={"consumer_endpoint": "tcp://127.0.0.1:*"}))
                again.start()
                try:
                    assert await asyncio.wait_for(asyncio.gather(*puts), 30) == ["ok"] * 1100
                    return again.stats()["counts"]
                finally:
                    again.stop()

        counts = asyncio.run(go())
        assert counts["trajectories_in"] == 1100 and counts.get("duplicates", 0) == 0
