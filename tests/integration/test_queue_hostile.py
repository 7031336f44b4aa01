"""The real buffer process (`slime-async buffer`) under hostile and careless input: each test is
one finding of a hostile-input review. Afterwards the buffer is alive and answering, nothing acknowledged is
lost or delivered twice, and its memory stays under the configured bound."""

import asyncio
import contextlib
import time

import msgpack
import psutil
import pytest
import zmq

from slime_async.config import BufferConfig
from slime_async.queue import server
from slime_async.queue.client import (
    BufferRejected,
    ConsumerClient,
    IdInUse,
    ProducerClient,
    ping,
)
from slime_async.queue.messages import pack_header, unpack_header
from slime_async.queue.schema import encode_trajectory
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import Child, free_port, python_module, wait_until

MB = 1 << 20


@contextlib.contextmanager
def buffer_process(tmp_path, **overrides):
    """`slime-async buffer` on free loopback ports; yields (child, client config)."""
    cfg = BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        **{"request_timeout_s": 2.0, "give_up_s": 20.0, **overrides},
    )
    args = [
        f"buffer.{k}={v}" if not isinstance(v, str) else f'buffer.{k}="{v}"'
        for k, v in cfg.model_dump(exclude={"curve"}).items()
        if v is not None
    ]
    log = tmp_path / "buffer.log"
    child = Child("buffer", python_module("slime_async", "buffer", *args), log_path=log)
    try:
        wait_until(
            lambda: ping(cfg.consumer_endpoint, cfg) is not None, 60, "the buffer", child=child
        )
        yield child, cfg
        assert child.alive(), f"the buffer died:\n{child.tail()}"
        assert ping(cfg.consumer_endpoint, cfg, timeout_s=5) is not None, "the buffer hangs"
    finally:
        child.stop()
    assert "Traceback" not in log.read_text()


class Raw:
    """A bare DEALER speaking the wire protocol, for what the clients never send."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes, wait_s: float = 10) -> tuple[dict, int]:
        """The reply's header and its size in bytes."""
        self.sock.send_multipart(list(frames), copy=False)
        assert self.sock.poll(int(wait_s * 1000)), "no reply from the buffer"
        reply = self.sock.recv_multipart()
        return unpack_header(reply[0]), sum(len(f) for f in reply)

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@contextlib.contextmanager
def raw(endpoint):
    r = Raw(endpoint)
    try:
        yield r
    finally:
        r.close()


def _rss(child: Child) -> int:
    return psutil.Process(child.pid).memory_info().rss


async def _put_all(cfg, groups, producer="p0"):
    async with ProducerClient(cfg, producer) as p:
        return [await p.put_group(g) for g in groups]


def _consume_all(cfg, n_groups, consumer="learner"):
    ids = []
    with ConsumerClient(cfg, consumer) as c:
        while len(ids) < n_groups:
            b = c.get_batch(num_groups=1, timeout_s=5)
            assert b is not None, f"only {len(ids)} of {n_groups} groups came"
            c.commit(b.batch_id)
            ids.extend(g[0].group_id for g in b.groups)
    return ids


# ---------------------------------------------------------------- Found 1: one request kills it
def test_unbounded_timeouts_and_bad_versions_are_refused_naming_the_field(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg), raw(cfg.consumer_endpoint) as r:
        base = {"consumer": "learner", "session": "s1"}
        for timeout, words in (
            (float("inf"), "finite"),
            (float("nan"), "finite"),
            (1e300, "max_get_wait_s"),
            (-1.0, "max_get_wait_s"),
            ("soon", "expected a number"),
        ):
            h, _ = r.ask(pack_header("get", rid="g", num_groups=1, timeout_s=timeout, **base))
            assert h["op"] == "error" and "timeout_s" in h["error"], h
            assert words in h["error"] and h["rid"] == "g"
        for version in (-(2**63), -1, 2**31, 2**64 - 1):
            h, _ = r.ask(
                pack_header("version", rid="v", version=version, groups_per_step=2, **base)
            )
            assert h["op"] == "error" and "version" in h["error"], (version, h)
        # The project's own client refuses an infinite wait before sending it.
        with ConsumerClient(cfg, "other") as c, pytest.raises(ValueError, match="timeout_s"):
            c.get_batch(timeout_s=float("inf"))
        # Batches still flow, at the version the learner had.
        assert asyncio.run(_put_all(cfg, [synthetic_group("g0", 2)])) == ["ok"]
        h, _ = r.ask(pack_header("get", rid="g2", num_groups=1, timeout_s=5.0, **base))
        assert h["op"] == "batch" and h["version"] == 0, h


# ---------------------------------------------------------------- Found 2: two producers, one id
def test_second_live_session_under_one_producer_id_is_refused_and_nothing_is_lost(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg):

        async def go():
            async with ProducerClient(cfg, "gen0") as first:
                with pytest.raises(IdInUse, match=r"gen0.*held by another live session"):
                    async with ProducerClient(cfg, "gen0"):
                        pass
                statuses = [await first.put_group(synthetic_group(f"a{i}", 2)) for i in range(10)]
            # The first one is gone (its connection closed): a restarted generator takes over.
            async with ProducerClient(cfg, "gen0") as again:
                statuses += [await again.put_group(synthetic_group(f"b{i}", 2)) for i in range(10)]
            return statuses

        assert asyncio.run(go()) == ["ok"] * 20
        got = _consume_all(cfg, 20)
        assert sorted(got) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])


def test_a_malformed_put_under_another_producers_id_uses_up_nothing(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg):
        bad = synthetic_group("bad", 1)
        bad[0].reward = float("nan")

        async def go():
            async with ProducerClient(cfg, "gen0") as owner:
                with raw(cfg.producer_endpoint) as r:
                    for seq in range(owner._seq, owner._seq + 5):  # its next numbers
                        h, _ = r.ask(
                            pack_header("put", seq=seq, producer="gen0", session="intruder"),
                            encode_trajectory(bad[0]),
                        )
                        assert h["op"] == "error" and h["reason"] == "producer_in_use", h
                return [await owner.put_group(synthetic_group(f"g{i}", 2)) for i in range(8)]

        assert asyncio.run(go()) == ["ok"] * 8
        assert sorted(_consume_all(cfg, 8)) == sorted(f"g{i}" for i in range(8))


def test_a_second_consumer_under_the_learners_id_is_refused_never_handed_its_batch(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg):
        asyncio.run(_put_all(cfg, [synthetic_group(f"g{i}", 2) for i in range(2)]))
        with ConsumerClient(cfg, "learner") as learner:
            b = learner.get_batch(num_groups=1, timeout_s=5)
            with ConsumerClient(cfg, "learner") as intruder:
                with pytest.raises(IdInUse, match="learner"):
                    intruder.get_batch(num_groups=1, timeout_s=1)
                with pytest.raises(IdInUse):
                    intruder.commit(b.batch_id)
            learner.commit(b.batch_id)
            seen = [b.groups[0][0].group_id]
        # The learner restarted (its connection gone): the new session takes over.
        seen += _consume_all(cfg, 1)
        assert sorted(seen) == ["g0", "g1"]


# ---------------------------------------------------------------- Found 4: announcements
def test_version_announcements_are_checked(tmp_path):
    with buffer_process(tmp_path, capacity_trajectories=64) as (_child, cfg):
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(3, 2)
            with pytest.raises(BufferRejected, match="version: 2 goes back from 3"):
                c.set_version(2, 2)
            with pytest.raises(BufferRejected, match=r"version: .*max_version_jump"):
                c.set_version(10**9, 2)
            with pytest.raises(BufferRejected, match="version"):
                c.set_version(10**15, 2)
            with pytest.raises(BufferRejected, match="groups_per_step"):
                c.set_version(4, 10**12)
            with pytest.raises(BufferRejected, match="groups_per_step"):
                c.set_version(4, 0)
            c.set_version(4, 2)
            assert c.stats()["version"] == 4

            async def want_many():
                async with ProducerClient(cfg, "gen0") as p:
                    return await p.admission(10**6)

            assert asyncio.run(want_many()) <= (cfg.max_staleness + 1) * 2
        # A restarted learner (the announcing session gone) may go back to its checkpoint.
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(1, 2)
            assert c.stats()["version"] == 1


# ---------------------------------------------------------------- Found 5: memory bound
def test_hostile_sizes_are_refused_before_they_cost_memory(tmp_path):
    with (
        buffer_process(tmp_path, max_message_bytes=MB, max_frames=64) as (child, cfg),
        raw(cfg.producer_endpoint) as r,
    ):
        rss0 = _rss(child)
        put = pack_header("put", seq=0, producer="x", session="s")
        # A million empty frames: refused, discarded as read, never held.
        h, _ = r.ask(put, *([b""] * 1_000_000), wait_s=60)
        assert h["op"] == "error" and h["reason"] == "too_many_frames", h
        # A header far beyond any real one: refused without being decoded.
        big = msgpack.packb({"v": 1, "op": "put", "pad": "x" * (512 << 10)})
        h, _ = r.ask(big)
        assert h["reason"] == "too_large" and "header" in h["error"], h
        # Frames adding up to more than max_message_bytes: refused before decoding any.
        h, _ = r.ask(put, *([b"\0" * (MB // 2)] * 3))
        assert h["reason"] == "too_large" and "max_message_bytes" in h["error"], h
        # A huge bad value is never echoed: the reply stays small.
        h, size = r.ask(pack_header("put", seq="x" * (60 << 10), producer="x", session="s"))
        assert h["op"] == "error" and size < 2048, size
        h, size = r.ask(pack_header("put", seq=1, producer="p" * (60 << 10), session="s"))
        assert "producer" in h["error"] and size < 2048, size
        # One frame above the limit is cut off by ZeroMQ before it is buffered.
        r.sock.send_multipart([put, b"\0" * (8 * MB)])
        assert not r.sock.poll(1000)
        assert _rss(child) - rss0 < 64 * MB, (_rss(child) - rss0) / MB
    # Everyone else was served throughout (checked on exit), and the memory bound held.


# ---------------------------------------------------------------- Found 6: jammed admission
def test_incomplete_groups_and_idle_producers_expire(tmp_path):
    overrides = {"group_timeout_s": 1.0, "producer_idle_s": 1.0, "groups_per_step": 2}
    with buffer_process(tmp_path, max_staleness=0, **overrides) as (_child, cfg):

        async def jam():
            async with ProducerClient(cfg, "jam") as p:
                for i in range(4):  # one member of each 4-trajectory group, never the rest
                    assert await p.put_group(synthetic_group(f"j{i}", 4)[:1]) == "ok"
                return await p.admission(2)

        assert asyncio.run(jam()) == 0  # the budget is held by the incomplete groups
        with ConsumerClient(cfg, "learner") as c:
            wait_until(lambda: c.stats()["groups_pending"] == 0, 10, "incomplete groups to expire")
            s = c.stats()
            assert s["dropped"]["incomplete_timeout"] == 4
            assert s["dropped_trajectories"]["incomplete_timeout"] == 4
            wait_until(lambda: c.stats()["producers"] == 0, 10, "the idle producer to be forgotten")
            assert c.stats()["counts"]["producers_expired"] == 1

        async def admitted():
            async with ProducerClient(cfg, "gen0") as p:
                return await p.admission(2)

        assert asyncio.run(admitted()) == 2


def test_producer_ids_are_bounded(tmp_path):
    with (
        buffer_process(tmp_path, max_producers=3) as (_child, cfg),
        raw(cfg.producer_endpoint) as r,
    ):
        for i in range(3):
            h, _ = r.ask(pack_header("hello", rid="h", producer=f"p{i}", session="s"))
            assert h["op"] == "hello"
        h, _ = r.ask(pack_header("hello", rid="h", producer="p3", session="s"))
        assert h["reason"] == "too_many_ids" and "max_producers" in h["error"], h


# ---------------------------------------------------------------- Found 7: small
def test_future_versions_negative_batch_ids_and_huge_sequence_numbers(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg):
        with ConsumerClient(cfg, "learner") as c:
            c.set_version(2, 2)
            for batch_id in (-1, 0, 7):
                with pytest.raises(BufferRejected, match="batch_id"):
                    c.commit(batch_id)

            async def go():
                async with ProducerClient(cfg, "gen0") as p:
                    with pytest.raises(BufferRejected, match=r"versions: .* newer than"):
                        await p.put_group(synthetic_group("future", 2, version=9))
                    # A push in flight: one version ahead is fine.
                    return await p.put_group(synthetic_group("next", 2, version=3))

            assert asyncio.run(go()) == "ok"
            assert c.get_batch(num_groups=1, timeout_s=5).staleness == [-1]
        with raw(cfg.producer_endpoint) as r:
            g = synthetic_group("g", 1)
            h, _ = r.ask(
                pack_header("put", seq=2**64 - 1, producer="q", session="s"),
                encode_trajectory(g[0]),
            )
            assert h["op"] == "error" and "seq" in h["error"], h
            h, _ = r.ask(pack_header("hello", rid="h", producer="q", session="s"))
            assert h["op"] == "hello" and h["next_seq"] == 0, h


def test_the_buffer_stays_responsive_while_discarding(tmp_path):
    """Frames past max_frames are read in slices: other clients are served meanwhile."""
    with buffer_process(tmp_path, max_frames=16) as (_child, cfg), raw(cfg.producer_endpoint) as r:
        frames = 10 * server._DISCARD  # ten turns of discarding: the ping is served among them
        r.sock.send_multipart(
            [pack_header("put", seq=0, producer="x", session="s")] + [b""] * frames
        )
        t0 = time.monotonic()
        assert ping(cfg.consumer_endpoint, cfg, timeout_s=5) is not None
        assert time.monotonic() - t0 < 5
        assert r.sock.poll(60_000)
        assert unpack_header(r.sock.recv_multipart()[0])["reason"] == "too_many_frames"


# ---------------------------------------------------------------- a local client jamming others
def test_partial_groups_of_a_squatter_do_not_shut_a_real_generator_out(tmp_path):
    """(max_staleness + 1) x groups_per_step one-trajectory puts, asked for or not: the real
    generator still gets grants (they are charged to the squatter, or stop counting once the
    squatter's groups go silent)."""
    overrides = {"max_staleness": 2, "groups_per_step": 4, "grant_timeout_s": 1.0}
    with buffer_process(tmp_path, **overrides) as (_child, cfg):

        async def squat(ask_first: bool, tag: str) -> int:
            async with ProducerClient(cfg, f"squatter-{tag}") as p:
                n = await p.admission(12) if ask_first else 12
                assert n >= 1
                for i in range(n):  # one member of each 8-trajectory group, never the rest
                    g = synthetic_group(f"{tag}{i}", 8)[:1]
                    assert await p.put_group(g) == "ok"
                return await p.admission(1)

        async def real() -> int:
            async with ProducerClient(cfg, "gen0") as p:
                return await p.admission(4)

        assert asyncio.run(squat(ask_first=False, tag="u")) == 0  # charged to itself
        assert asyncio.run(real()) == 4
        asyncio.run(squat(ask_first=True, tag="g"))  # granted, then silent: out of the budget
        time.sleep(1.5)
        assert asyncio.run(real()) == 4
        with ConsumerClient(cfg, "learner") as c:
            assert c.stats()["groups_pending"] > 12  # still held, until group_timeout_s


def test_a_squatter_under_another_producers_group_id_does_not_get_its_group_rejected(tmp_path):
    with buffer_process(tmp_path) as (_child, cfg):
        gid = "gen0/e0/o3"  # the id the real generator will use
        group = synthetic_group(gid, 8)

        async def put(producer, trajs):
            async with ProducerClient(cfg, producer) as p:
                return await p.put_group(trajs)

        assert asyncio.run(put("squatter", synthetic_group(gid, 8, seed=1)[:1])) == "ok"
        assert asyncio.run(put("gen0", group)) == "ok"  # its own group, whole
        with ConsumerClient(cfg, "learner") as c:
            b = c.get_batch(num_groups=1, timeout_s=5)
            assert sorted(t.id for t in b.groups[0]) == sorted(t.id for t in group)
            c.commit(b.batch_id)
            # 9 acknowledged = 8 trained + 0 dropped + 1 held (the squatter's, incomplete).
            s = c.stats()
            assert s["counts"]["trajectories_in"] == 9 and s["trajectories_held"] == 1


def test_a_flood_of_ids_over_one_connection_locks_no_generator_out(tmp_path):
    with buffer_process(tmp_path, max_producers=64) as (_child, cfg):
        with raw(cfg.producer_endpoint) as r:
            refused = 0
            for i in range(64):
                h, _ = r.ask(pack_header("heartbeat", rid=f"b{i}", producer=f"f{i}", session="s"))
                refused += h["op"] == "error" and h["reason"] == "too_many_ids"
            assert refused == 64 - cfg.max_ids_per_connection
            assert "max_ids_per_connection" in h["error"], h
        # Many connections, each within its bound: the table fills, and empties as they close.
        flooders = [Raw(cfg.producer_endpoint) for _ in range(8)]
        try:
            for k, f in enumerate(flooders):
                for i in range(8):
                    h, _ = f.ask(pack_header("hello", rid="h", producer=f"c{k}-{i}", session="s"))
                    assert h["op"] == "hello", h
        finally:
            for f in flooders:
                f.close()

        async def admitted():
            async with ProducerClient(cfg, "gen0") as p:
                return await p.admission(1)

        assert asyncio.run(admitted()) == 1  # at once, not producer_idle_s later
        with ConsumerClient(cfg, "learner") as c:
            s = c.stats()
            assert s["counts"]["ids_released"] >= 8 * 8 and s["producers"] <= 2, s["producers"]


def test_a_frame_bomb_is_answered_while_another_client_of_its_socket_is_served(tmp_path):
    """A million empty frames (2 MB): refused ("too_many_frames"), and another client of the
    same socket keeps getting answers before its give_up_s (ZeroMQ hands a message over whole,
    so it waits while the frames are read out: about 1 us each, `Buffer._discard`)."""
    with buffer_process(tmp_path) as (_child, cfg):

        async def other(bombed: asyncio.Event, answered: asyncio.Event) -> tuple[int, int]:
            async with ProducerClient(cfg, "gen0") as p:
                calls = 0
                while not answered.is_set():
                    await p.admission(0)
                    calls += bombed.is_set()
                    await asyncio.sleep(0.05)
                return calls, p.resends

        async def go():
            bombed, answered = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(other(bombed, answered))
            with raw(cfg.producer_endpoint) as r:
                put = pack_header("put", seq=0, producer="x", session="s")
                frames = [put, *([b""] * 1_000_000)]
                await asyncio.to_thread(r.sock.send_multipart, frames, copy=False)
                bombed.set()
                assert await asyncio.to_thread(r.sock.poll, 60_000), "no answer to the bomb"
                h = unpack_header(r.sock.recv_multipart()[0])
            answered.set()
            return h, *(await task)

        h, calls, _resends = asyncio.run(go())
        assert h["reason"] == "too_many_frames", h
        assert calls >= 1
