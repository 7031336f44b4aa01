"""Buffer throughput and latency against raw pyzmq PUSH/PULL of the same bytes, in one run.

    .venv/bin/python bench/bench_buffer.py [--seconds 1.5] [--fsync] [--sizes 4,64]
        [--modes raw,codec,relay,floor,off,flush,fsync] [--profile DIR]

Each row runs in fresh processes: producer -> buffer -> consumer through the real clients
(`ProducerClient.put_group` from WINDOW tasks, `ConsumerClient.get_batch` + `commit`), or
producer -> consumer over a bare PUSH/PULL pair carrying the same encoded frames (encoded once,
ahead of time, never decoded: the transport alone), or the same through a relay process that
forwards each message by reference ("raw relay, 2 hops": the floor of any broker, which adds a
hop). "buffer protocol only" is the real clients against the buffer process with its trajectory
checks and bookkeeping taken out (it stores each put's bytes and acknowledges it, forwards them
in batches, commits anything): what the protocol and the clients cost before the buffer does any
work of its own. Throughput counts trajectories from the producer's first send to the consumer's last
receipt; each row sends about `--seconds` worth at the rate this machine reaches. Latency: one
group at a time, enqueue (send) to delivery. CPU: `time.process_time` of each process (its
ZeroMQ I/O thread included) per trajectory. `--profile DIR` writes a cProfile file (CPU time)
per process and row.

The project is imported inside the functions that use it: with spawn, every child process
re-imports this file, and the raw PUSH/PULL children need neither the clients nor the config;
`--help` answers in 0.15-0.2 s instead of 0.6-0.8 s (measured on the 2-core dev machine).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time

GROUP = 4  # trajectories per put (one group)
WINDOW = 16  # puts in flight per producer
BATCH_GROUPS = 8  # groups per consumer batch
_RATES = {
    "raw": 100_000,
    "codec": 20_000,
    "relay": 30_000,
    "floor": 12_000,
    "off": 8_000,
    "flush": 6_000,
    "fsync": 2_000,
}
"""Trajectories/s at 4 KB (a quarter at 64 KB) on the shared 2-core machine: each row sends about
`--seconds` worth, so that the whole run stays under a minute (a faster machine finishes sooner)."""


def _group(i: int, response_len: int):
    from slime_async.testing.trajectories import synthetic_group

    return synthetic_group(f"g{i}", GROUP, prompt_len=64, response_len=response_len, seed=i % 7)


def _response_len(target: int) -> int:
    from slime_async.queue.schema import encode_trajectory

    r = max(1, (target - 500) // 13)
    return r + max(0, (target - len(encode_trajectory(_group(0, r)[0])))) // 13


# ---------------------------------------------------------------- raw pyzmq
def _raw_producer(endpoint: str, response_len: int, n: int, latency: bool, codec: bool, out):
    import zmq

    from slime_async.queue.schema import encode_trajectory

    group = _group(0, response_len)
    frames = [encode_trajectory(t) for t in group]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    ack = ctx.socket(zmq.PULL)
    ack.bind(endpoint.rsplit(":", 1)[0] + ":*")
    sock.send_multipart([ack.getsockopt_string(zmq.LAST_ENDPOINT).encode()])
    out.put(time.perf_counter())
    cpu = time.process_time()
    for _ in range(n):
        if codec:
            frames = [encode_trajectory(t) for t in group]
        sock.send_multipart([repr(time.time()).encode(), *frames], copy=False)
        if latency:
            ack.recv()  # one at a time, like the buffer's latency run
    ack.recv()
    out.put(("producer", time.process_time() - cpu))
    sock.close(0)
    ack.close(0)
    ctx.term()


def _raw_consumer(endpoint: str, n: int, latency: bool, codec: bool, out):
    import zmq

    from slime_async.queue.schema import decode_trajectory

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    back = ctx.socket(zmq.PUSH)
    back.connect(sock.recv_multipart()[0].decode())
    lat, nbytes = [], 0
    cpu = time.process_time()
    for _ in range(n):
        msg = sock.recv_multipart()
        lat.append(time.time() - float(msg[0]))
        nbytes += sum(len(f) for f in msg[1:])
        if codec:
            [decode_trajectory(f) for f in msg[1:]]
        if latency:
            back.send(b"")
    back.send(b"")  # done
    out.put((time.perf_counter(), lat, {"consumer": time.process_time() - cpu}))
    sock.close(0)
    back.close(0)
    ctx.term()


def _relay(endpoint: str, n: int, out):
    """PULL -> PUSH of every message as received (by reference): the floor of any broker."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("tcp://127.0.0.1:*")
    push.connect(endpoint)
    out.put(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    cpu = time.process_time()
    for _ in range(n + 1):  # the producer's ack address, then n messages
        push.send_multipart(pull.recv_multipart(copy=False), copy=False)
    out.put(("buffer", time.process_time() - cpu))
    pull.close()
    push.close()
    ctx.term()


def raw(response_len: int, n: int, latency: bool, codec: bool, relay: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    c = ctx.Process(target=_raw_consumer, args=("tcp://127.0.0.1:*", n, latency, codec, out))
    c.start()
    endpoint = out.get()
    if relay:
        r = ctx.Process(target=_relay, args=(endpoint, n, out))
        r.start()
        endpoint = out.get()
    p = ctx.Process(target=_raw_producer, args=(endpoint, response_len, n, latency, codec, out))
    p.start()
    t0 = out.get()
    got = [out.get() for _ in range(3 if relay else 2)]
    (t1, lat, cpu), *roles = sorted(got, key=lambda x: len(x) != 3)
    cpu.update(roles)
    p.join()
    c.join()
    if relay:
        r.join()
    return {"seconds": t1 - t0, "trajectories": n * GROUP, "latency": lat, "cpu": cpu}


# ---------------------------------------------------------------- the buffer
def _profiled(role: str, fn, *args):
    """`fn(*args)` under cProfile when BENCH_PROFILE names a directory (`--profile`)."""
    where = os.environ.get("BENCH_PROFILE")
    if not where:
        return fn(*args)
    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU, not waiting
    try:
        return prof.runcall(fn, *args)
    finally:
        tag = os.environ.get("BENCH_PROFILE_TAG", "")
        prof.dump_stats(os.path.join(where, f"{tag}{role}.prof"))


def _protocol_only():
    """The buffer process's class with its trajectory checks and bookkeeping taken out."""
    from slime_async.queue.messages import BatchReply, Commit, Committed, Put
    from slime_async.queue.server import Buffer, _payload

    class ProtocolOnly(Buffer):
        def __init__(self, *args):
            super().__init__(*args)
            self.held: list[list[memoryview]] = []
            self.batches = 0

        def _serve(self, msg, ident, blobs):
            if isinstance(msg, Put):  # stored as received and acknowledged, nothing checked
                self.held.append(_payload(msg.lengths, blobs, self.cfg.max_frames))
                self._acks.setdefault((ident, "ok"), []).append(msg.seq)
                return None
            if isinstance(msg, Commit):
                return [Committed(rid=msg.rid, n=1).encode()]
            return super()._serve(msg, ident, blobs)

        def _try_get(self, msg):
            n = msg.num_groups
            if len(self.held) < n:
                return None
            groups, self.held[:n] = self.held[:n], []
            blobs = [b for g in groups for b in g]
            self.batches += 1
            header = BatchReply(
                rid=msg.rid,
                batch_id=self.batches,
                sizes=[len(g) for g in groups],
                staleness=[0] * n,
                version=0,
                lengths=[len(b) for b in blobs],
            )
            return [header.encode(), b"".join(blobs)]

    return ProtocolOnly


def _serve(cfg_json: str, out, stop, protocol_only: bool = False):
    from slime_async.config import BufferConfig
    from slime_async.queue.server import Buffer

    kind = _protocol_only() if protocol_only else Buffer
    buf = kind(BufferConfig.model_validate_json(cfg_json))
    cpu = time.process_time()
    out.put((buf.producer_endpoint, buf.consumer_endpoint))
    threading.Thread(target=lambda: (stop.wait(), buf.stop()), daemon=True).start()
    _profiled("buffer", buf.serve_forever)
    out.put(("buffer", time.process_time() - cpu))


def _producer(cfg_json: str, response_len: int, n: int, latency: bool, out, taken):
    from slime_async.config import BufferConfig
    from slime_async.queue.client import ProducerClient

    cfg = BufferConfig.model_validate_json(cfg_json)
    groups = [_group(i, response_len) for i in range(min(n, 64 if response_len < 8192 else 8))]

    async def go():
        async with ProducerClient(cfg, "bench") as p:
            out.put(time.perf_counter())
            cpu = time.process_time()
            if latency:
                loop = asyncio.get_running_loop()
                for i in range(n):
                    await p.put_group(_renamed(groups[i % len(groups)], i))
                    await loop.run_in_executor(None, taken.get)  # no queueing: one at a time
                return 0.0
            todo = iter(range(n))

            async def worker():  # WINDOW of them: WINDOW puts in flight
                for i in todo:
                    await p.put_group(_renamed(groups[i % len(groups)], i))

            await asyncio.gather(*(worker() for _ in range(WINDOW)))
            return time.process_time() - cpu

    out.put(("producer", _profiled("producer", asyncio.run, go())))


def _renamed(group, i):
    for j, t in enumerate(group):
        t.group_id, t.id = f"g{i}", f"g{i}/{j}"
    return group


def _consumer(cfg_json: str, n: int, latency: bool, out, taken):
    from slime_async.config import BufferConfig
    from slime_async.queue.client import ConsumerClient

    cfg = BufferConfig.model_validate_json(cfg_json)

    def go(c):
        got, lat = 0, []
        cpu = time.process_time()
        while got < n:
            b = c.get_batch(num_groups=1 if latency else min(BATCH_GROUPS, n - got), timeout_s=30)
            now = time.time()
            c.commit(b.batch_id)
            got += len(b.groups)
            lat.extend(now - g[0].enqueued_at for g in b.groups)
            if latency:
                taken.put(None)
        return lat, time.process_time() - cpu

    with ConsumerClient(cfg, "bench") as c:
        out.put("ready")
        lat, cpu = _profiled("consumer", go, c)
    out.put((time.perf_counter(), lat, {"consumer": cpu}))


def buffered(
    response_len: int, n: int, latency: bool, wal_sync: str | None, protocol_only: bool = False
) -> dict:
    from slime_async.config import BufferConfig

    ctx = mp.get_context("spawn")
    out, taken = ctx.Queue(), ctx.Queue()
    stop = ctx.Event()
    with tempfile.TemporaryDirectory() as wal_dir:
        cfg = BufferConfig(
            producer_endpoint="tcp://127.0.0.1:*",
            consumer_endpoint="tcp://127.0.0.1:*",
            wal_dir=wal_dir if wal_sync else None,
            wal_sync=wal_sync or "none",
            capacity_trajectories=1 << 20,
            groups_per_step=n,
        )
        s = ctx.Process(target=_serve, args=(cfg.model_dump_json(), out, stop, protocol_only))
        s.start()
        pe, ce = out.get()
        cfg = cfg.model_copy(update={"producer_endpoint": pe, "consumer_endpoint": ce})
        c = ctx.Process(target=_consumer, args=(cfg.model_dump_json(), n, latency, out, taken))
        c.start()
        assert out.get() == "ready"
        p = ctx.Process(
            target=_producer, args=(cfg.model_dump_json(), response_len, n, latency, out, taken)
        )
        p.start()
        t0 = out.get()
        got = [out.get(), out.get()]  # the consumer's (end, latencies, cpu), ("producer", cpu)
        (t1, lat, cpu), role = sorted(got, key=lambda x: len(x) != 3)
        cpu.update([role])
        p.join()
        c.join()
        stop.set()
        cpu.update([out.get()])
        s.join()
    return {"seconds": t1 - t0, "trajectories": n * GROUP, "latency": lat, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="rough length of each run")
    ap.add_argument("--fsync", action="store_true", help="also run with wal_sync=fsync")
    ap.add_argument("--profile", metavar="DIR", help="cProfile each buffer process into DIR")
    ap.add_argument("--sizes", default="4,64", help="trajectory sizes in KB, comma-separated")
    ap.add_argument(
        "--modes", default="", help="only these rows: raw,codec,relay,floor,off,flush,fsync"
    )
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["BENCH_PROFILE"] = os.path.abspath(args.profile)  # inherited by the children
    from slime_async.queue.schema import encode_trajectory

    modes = [
        ("raw PUSH/PULL", "raw"),
        ("raw + encode/decode", "codec"),
        ("raw relay, 2 hops", "relay"),
        ("buffer protocol only", "floor"),
        ("buffer, no WAL", "off"),
        ("buffer, WAL flush", "flush"),
    ]
    if args.fsync or "fsync" in args.modes:
        modes.append(("buffer, WAL fsync", "fsync"))
    if args.modes:  # the ratio column needs the raw row
        modes = [(a, b) for a, b in modes if b in args.modes.split(",") or b == "raw"]
    print(
        f"{'payload':>7} | {'path':<20} | {'traj/s':>7} | {'MB/s':>5} | {'ratio':>5} | "
        f"{'p50 ms':>6} | {'p99 ms':>6} | CPU us/traj: producer, buffer, consumer"
    )
    print("-" * 118)
    for kb in (int(k) for k in args.sizes.split(",")):
        target = kb << 10
        rl = _response_len(target)
        size = len(encode_trajectory(_group(0, rl)[0]))
        base = None
        for name, mode in modes:
            rate_guess = _RATES[mode] if kb <= 4 else _RATES[mode] * 16 // kb
            n = max(64 if kb <= 256 else 16, int(rate_guess * args.seconds / GROUP))
            lat_n = 200 if kb <= 64 else 50  # groups sent one at a time for the latency
            os.environ["BENCH_PROFILE_TAG"] = f"{kb}k-{mode}-"
            if mode in ("raw", "codec", "relay"):
                codec, relay = mode == "codec", mode == "relay"
                r, lr = raw(rl, n, False, codec, relay), raw(rl, lat_n, True, codec, relay)
            else:
                wal = None if mode in ("off", "floor") else mode
                r = buffered(rl, n, False, wal, mode == "floor")
                os.environ["BENCH_PROFILE_TAG"] += "latency-"
                lr = buffered(rl, lat_n, True, wal, mode == "floor")
            rate = r["trajectories"] / r["seconds"]
            base = base or rate
            q = statistics.quantiles(lr["latency"], n=100)
            cpu = ", ".join(
                f"{r['cpu'][k] / r['trajectories'] * 1e6:.0f}" if k in r["cpu"] else "-"
                for k in ("producer", "buffer", "consumer")
            )
            print(
                f"{size / 1024:>5.1f}KB | {name:<20} | {rate:>7.0f} | {rate * size / 1e6:>5.0f} | "
                f"{rate / base:>5.2f} | {q[49] * 1e3:>6.2f} | {q[98] * 1e3:>6.2f} | {cpu}",
                flush=True,
            )
    print(
        f"\n{GROUP} trajectories per put/message, {WINDOW} puts in flight, {BATCH_GROUPS} groups "
        "per batch; ratio: against raw PUSH/PULL of the same pre-encoded bytes; "
        "latency: one group at a time, send to delivery."
    )


if __name__ == "__main__":
    main()
