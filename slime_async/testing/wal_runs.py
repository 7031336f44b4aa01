"""A write-ahead log as a run leaves it, written by the real buffer state: for `inspect`'s tests
and benchmark.

`write_run_wal(wal_dir, steps=250)` puts `groups_per_step` synthetic groups per step, delivers
them as batch N at policy version N - 1, commits it and announces version N, every record
through `BufferState` and `WriteAheadLog` as the buffer writes them. 250 steps of 16 groups of
8 trajectories with 28-token responses make about 22 MB, the size of the quickstart's log.
"""

from __future__ import annotations

from pathlib import Path

from slime_async.config.buffer import BufferConfig
from slime_async.queue import wal as W
from slime_async.queue.schema import encode_trajectory
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group


def write_run_wal(
    wal_dir: str | Path,
    steps: int = 250,
    groups_per_step: int = 16,
    group_size: int = 8,
    response_len: int = 28,
    prompt_len: int = 24,
    segment_bytes: int = 64 << 20,
) -> Path:
    """Write the log of a `steps`-step run into `wal_dir` (must be empty); returns it."""
    cfg = BufferConfig(
        groups_per_step=groups_per_step,
        max_staleness=1,
        capacity_trajectories=4 * groups_per_step * group_size,
        wal_dir=str(wal_dir),
        wal_segment_bytes=segment_bytes,
    )
    state = BufferState(cfg)
    wal = W.WriteAheadLog(wal_dir, "none", segment_bytes, snapshot=state.snapshot)
    state.attach_wal(wal)
    seq = 0
    for step in range(1, steps + 1):
        version = step - 1
        for g in range(groups_per_step):
            trajs = synthetic_group(
                f"gen0/e0/o{seq}",
                group_size=group_size,
                prompt_len=prompt_len,
                response_len=response_len,
                version=max(0, version - g % 2),
                seed=seq,
            )
            state.put("gen0", seq, [encode_trajectory(t) for t in trajs], trajs)
            seq += 1
        batch = state.get("learner", "s0", f"r{step}", groups_per_step, None)
        assert batch is not None, f"step {step}: the buffer delivered no batch"
        state.commit("learner", batch.batch_id)
        state.set_version(step, groups_per_step)
        wal.sync()
    wal.close()
    return Path(wal_dir)
