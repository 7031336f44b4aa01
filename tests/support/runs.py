"""Whole `slime-async run`s as child processes, for the tests that disturb their roles: start one,
find a role's pid, wait for a condition while the run lives, finish it, and check that nothing the
buffer acknowledged was lost or trained twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from slime_async.metrics import read_metrics
from tests.support.repo import REPO


def tiny_inputs(root: Path) -> tuple[Path, Path, Path]:
    """(root, a tiny Qwen3-shaped model, 300 arithmetic prompts) for a tiny run under `root`."""
    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    return (
        root,
        make_tiny_model(root / "model", "qwen3", seed=0),
        make_dataset(root / "train.jsonl", 300, seed=0),
    )


def start_run(cfg: Path) -> subprocess.Popen:
    """`slime-async run CFG` in its own session, output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "slime_async", "run", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def pid_of(run_dir: Path, role: str) -> int:
    """The role's PID as the supervisor logged it ("started <role> (pid N)")."""
    found = re.findall(
        rf"started {role} \(pid (\d+)", (run_dir / "logs" / "supervisor.log").read_text()
    )
    assert found, f"no pid of {role} in supervisor.log"
    return int(found[-1])


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics" / "learner.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    """Wait for the run to end (SIGKILL of its group past `timeout`); it must exit 0."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not finish in {timeout}s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def assert_nothing_lost_nothing_twice(
    run_dir: Path, steps: int, groups_per_step: int, group_size: int
) -> None:
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["step"] == steps
    # A restarted learner continues from the buffer's version when that is newer than its
    # checkpoint's (actors/learner/process.py), so versions never go back but may skip ahead.
    versions = [r["version"] for r in learner if r["step"] == max(x["step"] for x in learner)]
    assert versions[-1] >= steps
    final = json.loads((run_dir / "buffer_final.json").read_text())
    # Every step's groups committed exactly once: none twice, none missing.
    assert final["counts"]["committed_trajectories"] == steps * groups_per_step * group_size
    assert final["batches_delivered_uncommitted"] == 0
    dropped = sum(final["dropped_trajectories"].values())
    acknowledged = final["counts"]["trajectories_in"]
    committed = final["counts"]["committed_trajectories"]
    assert acknowledged == committed + dropped + final["trajectories_held"], final
