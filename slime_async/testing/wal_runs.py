"""A write-ahead log as a run leaves it, written by the real buffer state: for `inspect`'s tests
and benchmark.

`write_run_wal(wal_dir, steps=250)` puts `groups_per_step` synthetic groups per step, delivers
them as batch N at policy version N - 1, commits it and announces version N, every record
through `BufferState` and `WriteAheadLog` as the buffer writes them (`SyntheticRun` keeps the
log open between steps, as a live buffer does). 250 steps of 16 groups of
8 trajectories with 28-token responses make about 22 MB, the size of the quickstart's log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_async.config.buffer import BufferConfig
from slime_async.queue import wal as W
from slime_async.queue.schema import encode_trajectory
from slime_async.queue.state import BufferState
from slime_async.testing.trajectories import synthetic_group


class SyntheticRun:
    """A buffer state writing a run's log: `steps(n)` adds n steps (put, deliver, commit unless
    `commit` is false, announce), each synced to disk; `close()` closes the log."""

    def __init__(
        self,
        wal_dir: str | Path,
        groups_per_step: int = 16,
        group_size: int = 8,
        response_len: int = 28,
        prompt_len: int = 24,
        segment_bytes: int = 64 << 20,
        commit: bool = True,
    ):
        cfg = BufferConfig(
            groups_per_step=groups_per_step,
            max_staleness=1 << 20,  # uncommitted batches must not stop admission here
            capacity_trajectories=1 << 30,
            wal_dir=str(wal_dir),
            wal_segment_bytes=segment_bytes,
        )
        self.shape = (groups_per_step, group_size, response_len, prompt_len)
        self.commit = commit
        self.state = BufferState(cfg)
        self.wal = W.WriteAheadLog(wal_dir, "none", segment_bytes, snapshot=self.state.snapshot)
        self.state.attach_wal(self.wal)
        self.step = self.state.version
        self.seq = 0

    def steps(self, n: int) -> None:
        groups_per_step, group_size, response_len, prompt_len = self.shape
        for _ in range(n):
            self.step += 1
            version = self.step - 1
            for g in range(groups_per_step):
                trajs = synthetic_group(
                    f"gen0/e{version}/o{self.seq}",
                    group_size=group_size,
                    prompt_len=prompt_len,
                    response_len=response_len,
                    version=max(0, version - g % 2),
                    seed=self.seq,
                )
                blobs = [encode_trajectory(t) for t in trajs]
                self.state.put(f"gen{version}", self.seq, blobs, trajs)
                self.seq += 1
            batch = self.state.get("learner", "s0", f"r{self.step}", groups_per_step, None)
            assert batch is not None, f"step {self.step}: the buffer delivered no batch"
            if self.commit:
                self.state.commit("learner", batch.batch_id)
            self.state.set_version(self.step, groups_per_step)
            self.wal.sync()
            self.wal.compact()  # as the server does after each turn

    def close(self) -> None:
        self.wal.close()


def write_run_wal(wal_dir: str | Path, steps: int = 250, **shape: Any) -> Path:
    """Write the log of a `steps`-step run into `wal_dir` (`shape`: `SyntheticRun`'s keywords)."""
    run = SyntheticRun(wal_dir, **shape)
    run.steps(steps)
    run.close()
    return Path(wal_dir)
