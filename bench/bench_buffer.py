"""Buffer throughput and latency against raw pyzmq PUSH/PULL of the same bytes, in one run.

    .venv/bin/python bench/bench_buffer.py [--seconds 2.5] [--fsync]

Each row runs in fresh processes: producer -> buffer -> consumer through the real clients
(`ProducerClient.put_group`, `ConsumerClient.get_batch` + `commit`), or producer -> consumer over
a bare PUSH/PULL pair carrying the same encoded frames (encoded once, ahead of time, never
decoded: the transport alone). Throughput counts trajectories from the producer's first send to
the consumer's last receipt. Latency: one group at a time, enqueue (send) to delivery.

The project is imported inside the functions that use it: with spawn, every child process
re-imports this file, and the raw PUSH/PULL children need neither the clients nor the config;
`--help` answers in 0.15-0.2 s instead of 0.6-0.8 s (measured on the 2-core dev machine).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

GROUP = 4  # trajectories per put (one group)
WINDOW = 16  # puts in flight per producer
BATCH_GROUPS = 8  # groups per consumer batch


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


def raw(response_len: int, n: int, latency: bool, codec: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    c = ctx.Process(target=_raw_consumer, args=("tcp://127.0.0.1:*", n, latency, codec, out))
    c.start()
    endpoint = out.get()
    p = ctx.Process(target=_raw_producer, args=(endpoint, response_len, n, latency, codec, out))
    p.start()
    t0 = out.get()
    (t1, lat, cpu), role = _finish(out)
    cpu.update([role])
    p.join()
    c.join()
    return {"seconds": t1 - t0, "trajectories": n * GROUP, "latency": lat, "cpu": cpu}


def _finish(out) -> tuple[tuple, tuple]:
    """The consumer's (end time, latencies, cpu) and the producer's ("producer", cpu), in any order."""
    a, b = out.get(), out.get()
    return (a, b) if len(a) == 3 else (b, a)


# ---------------------------------------------------------------- the buffer
def _serve(cfg_json: str, out, stop):
    from slime_async.config import BufferConfig
    from slime_async.queue.server import Buffer

    buf = Buffer(BufferConfig.model_validate_json(cfg_json)).start()
    cpu = time.process_time()
    out.put((buf.producer_endpoint, buf.consumer_endpoint))
    stop.wait()
    buf.stop()
    out.put(("buffer", time.process_time() - cpu))


def _producer(cfg_json: str, response_len: int, n: int, latency: bool, out, taken):
    from slime_async.config import BufferConfig
    from slime_async.queue.client import ProducerClient

    cfg = BufferConfig.model_validate_json(cfg_json)
    groups = [_group(i, response_len) for i in range(min(n, 64))]

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
            sem = asyncio.Semaphore(WINDOW)

            async def one(i):
                async with sem:
                    await p.put_group(_renamed(groups[i % len(groups)], i))

            await asyncio.gather(*(one(i) for i in range(n)))
            return time.process_time() - cpu

    out.put(("producer", asyncio.run(go())))


def _renamed(group, i):
    for j, t in enumerate(group):
        t.group_id, t.id = f"g{i}", f"g{i}/{j}"
    return group


def _consumer(cfg_json: str, n: int, latency: bool, out, taken):
    from slime_async.config import BufferConfig
    from slime_async.queue.client import ConsumerClient

    cfg = BufferConfig.model_validate_json(cfg_json)
    got, lat = 0, []
    with ConsumerClient(cfg, "bench") as c:
        out.put("ready")
        cpu = time.process_time()
        while got < n:
            b = c.get_batch(num_groups=1 if latency else min(BATCH_GROUPS, n - got), timeout_s=30)
            now = time.time()
            c.commit(b.batch_id)
            got += len(b.groups)
            lat.extend(now - g[0].enqueued_at for g in b.groups)
            if latency:
                taken.put(None)
    out.put((time.perf_counter(), lat, {"consumer": time.process_time() - cpu}))


def buffered(response_len: int, n: int, latency: bool, wal_sync: str | None) -> dict:
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
        s = ctx.Process(target=_serve, args=(cfg.model_dump_json(), out, stop))
        s.start()
        pe, ce = out.get()
        cfg = cfg.model_copy(update={"producer_endpoint": pe, "consumer_endpoint": ce})
        c = ctx.Process(target=_consumer, args=(cfg.model_dump_json(), n, latency, out, taken))
        c.start()
        assert out.get() == "ready"
        p = ctx.Process(target=_producer, args=(cfg.model_dump_json(), response_len, n, latency, out, taken))  # fmt: skip
        p.start()
        t0 = out.get()
        (t1, lat, cpu), role = _finish(out)
        cpu.update([role])
        p.join()
        c.join()
        stop.set()
        cpu.update([out.get()])
        s.join()
    return {"seconds": t1 - t0, "trajectories": n * GROUP, "latency": lat, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="rough length of each run")
    ap.add_argument("--fsync", action="store_true", help="also run with wal_sync=fsync")
    args = ap.parse_args()
    from slime_async.queue.schema import encode_trajectory

    modes = [
        ("raw PUSH/PULL", "raw"),
        ("raw + encode/decode", "codec"),
        ("buffer, no WAL", "off"),
        ("buffer, WAL flush", "flush"),
    ]
    if args.fsync:
        modes.append(("buffer, WAL fsync", "fsync"))
    print(f"{'payload':>7} | {'path':<19} | {'traj/s':>7} | {'MB/s':>5} | {'ratio':>5} | "
          f"{'p50 ms':>6} | {'p99 ms':>6} | CPU us/traj: producer, buffer, consumer")  # fmt: skip
    print("-" * 118)
    for target, rate_guess in ((4 << 10, 40000), (64 << 10, 8000)):
        rl = _response_len(target)
        size = len(encode_trajectory(_group(0, rl)[0]))
        n = max(64, int(rate_guess * args.seconds / GROUP))
        base = None
        for name, mode in modes:
            if mode in ("raw", "codec"):
                r, lr = raw(rl, n, False, mode == "codec"), raw(rl, 300, True, mode == "codec")
            else:
                wal = None if mode == "off" else mode
                r, lr = buffered(rl, n, False, wal), buffered(rl, 300, True, wal)
            rate = r["trajectories"] / r["seconds"]
            base = base or rate
            q = statistics.quantiles(lr["latency"], n=100)
            cpu = ", ".join(
                f"{r['cpu'][k] / r['trajectories'] * 1e6:.0f}" if k in r["cpu"] else "-"
                for k in ("producer", "buffer", "consumer")
            )
            print(f"{size / 1024:>5.1f}KB | {name:<19} | {rate:>7.0f} | {rate * size / 1e6:>5.0f} | "
                  f"{rate / base:>5.2f} | {q[49] * 1e3:>6.2f} | {q[98] * 1e3:>6.2f} | {cpu}",
                  flush=True)  # fmt: skip
    print(f"\n{GROUP} trajectories per put/message, {WINDOW} puts in flight, {BATCH_GROUPS} groups "
          "per batch; ratio: against raw PUSH/PULL of the same pre-encoded bytes; "
          "latency: one group at a time, send to delivery.")  # fmt: skip


if __name__ == "__main__":
    main()
