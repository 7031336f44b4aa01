"""`slime-async inspect`'s step table: from the write-ahead log's index against a full scan of
the log, on a log the size of the quickstart's (250 steps, about 22 MB), in one run.

    .venv/bin/python bench/bench_inspect.py [--steps 250] [--repeat 5]

Rows (median and range over `--repeat` runs, each on a fresh copy of the timing's state):
- full scan: replay every record and decode every trajectory, then the table (what `inspect`
  did before the index; the index build does the same work once);
- index build: the first `inspect` of a log (no cache beside it), writing the cache;
- index read: every later `inspect` (the cache is current: nothing of the log is decoded);
- index update: the log grew by one step since the cache was written (one segment re-read);
- step view: `--step N`'s data (the index read, then that step's groups decoded).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from slime_async.queue import wal as W
from slime_async.queue import wal_index
from slime_async.queue.schema import decode_trajectory
from slime_async.testing.wal_runs import SyntheticRun


def full_scan(wal_dir: Path) -> int:
    """Every trajectory decoded, the table's numbers from them (the baseline)."""
    groups: dict[str, list] = {}
    steps: dict[int, list[str]] = {}
    for rtype, meta, blobs in W.WriteAheadLog(wal_dir, "none", 1 << 62, snapshot=dict).replay():
        if rtype == W.PUT:
            for b in blobs:
                t = decode_trajectory(b)
                groups.setdefault(t.group_id, []).append(t)
        elif rtype == W.DELIVER and meta.get("g"):
            steps.setdefault(int(meta["batch"]), list(meta["g"]))
    rows = 0
    for gids in steps.values():
        trajs = [t for g in gids for t in groups.get(g, [])]
        _ = sum(float(t.reward) for t in trajs), sum(int(t.loss_mask.sum()) for t in trajs)
        _ = [t.oldest_version() for t in trajs]
        rows += 1
    return rows


CPU: dict[str, list[float]] = {}
"""CPU seconds of each timing (the wall time of a loaded machine also counts other work)."""


def timed(fn, repeat: int, setup=None, name: str = "") -> list[float]:
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        CPU.setdefault(name, []).append(time.process_time() - c0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_inspect_"))
    try:
        wal_dir = root / "wal"
        run = SyntheticRun(wal_dir)
        run.steps(args.steps)
        size = sum(p.stat().st_size for p in wal_dir.glob("wal-*.log"))
        cache = wal_index.cache_path(wal_dir)

        def drop_cache() -> None:
            cache.unlink(missing_ok=True)

        def step_view() -> None:
            index = wal_index.load_index(wal_dir)
            wal_index.read_groups(wal_dir, index, index.steps[args.steps // 2].group_ids)

        results = {
            "full scan": timed(lambda: full_scan(wal_dir), args.repeat, name="full scan"),
            "index build": timed(
                lambda: wal_index.load_index(wal_dir), args.repeat, drop_cache, "index build"
            ),
            "index read": timed(
                lambda: wal_index.load_index(wal_dir), args.repeat, name="index read"
            ),
            "step view": timed(step_view, args.repeat, name="step view"),
        }
        updates = []
        for _ in range(args.repeat):
            wal_index.load_index(wal_dir)
            run.steps(1)  # the live buffer appends one step to its segment
            updates.extend(
                timed(lambda: wal_index.load_index(wal_dir), 1, name="index update (+1 step)")
            )
        results["index update (+1 step)"] = updates
        run.close()
        print(
            f"log: {args.steps} steps, {size / 1e6:.1f} MB in "
            f"{len(list(wal_dir.glob('wal-*.log')))} segment(s); cache {cache.stat().st_size / 1e6:.2f} MB"
        )
        base = statistics.median(results["full scan"])
        print(
            f"{'what':<24} | {'median s':>9} | {'min-max s':>15} | {'CPU s (median)':>14} | "
            "full scan / this"
        )
        print("-" * 88)
        for name, xs in results.items():
            med = statistics.median(xs)
            cpu = statistics.median(CPU[name])
            print(
                f"{name:<24} | {med:>9.3f} | {min(xs):>6.3f}-{max(xs):<8.3f} | {cpu:>14.3f} | "
                f"{base / med:>7.1f}x"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
