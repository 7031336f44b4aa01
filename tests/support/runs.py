"""Whole `slime-async run`s as child processes, for the tests that disturb their roles and resume:
start one, find a role's PID in the supervisor's log, wait on the run's files, finish or kill it,
and check that nothing the buffer acknowledged was lost or trained twice.

Every wait has a timeout and names what it waited for; processes are stopped by their process
group (each run is started in a session of its own), never by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def start_run(*args: str | Path) -> subprocess.Popen:
    """`python -m slime_async run ARGS` in a session of its own, output captured as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "slime_async", "run", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def pid_of(run_dir: Path, role: str) -> int:
    """The role's PID as the supervisor logged it last ("started <role> (pid N)")."""
    found = re.findall(
        rf"started {role} \(pid (\d+)", (run_dir / "logs" / "supervisor.log").read_text()
    )
    assert found, f"no pid of {role} in supervisor.log"
    return int(found[-1])


def engine_url(run_dir: Path, role: str = "engine0") -> str:
    """The engine's URL as the supervisor's readiness line names it."""
    log = (run_dir / "logs" / "supervisor.log").read_text()
    found = re.findall(rf"{role} is ready \(GET (http://[\d.:]+)/health", log)
    assert found, f"no ready line of {role} in supervisor.log"
    return found[-1]


def wait_for(pred: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen) -> None:
    """Poll `pred` (the run's files or a role's HTTP answer) until true, while `proc` runs."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


def steps_done(run_dir: Path) -> int:
    """Learner records written so far (every life's, a step redone after a restart counts again)."""
    path = run_dir / "metrics" / "learner.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def raw_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics file in the order written (no de-duplication of steps)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finish(proc: subprocess.Popen, timeout: float = 420, expect: int | None = 0) -> str:
    """Wait for the run to exit (with `expect`, unless None) and return its output; kill its
    group on a timeout."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not finish in {timeout}s:\n{out[-4000:]}") from None
    assert expect is None or proc.returncode == expect, out[-4000:]
    return out


def kill_role(run_dir: Path, role: str) -> int:
    """SIGKILL the role's own process group (the supervisor made one per role)."""
    pid = pid_of(run_dir, role)
    os.killpg(pid, signal.SIGKILL)
    return pid


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a run started by `start_run` (its session's group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def assert_nothing_lost_nothing_twice(
    run_dir: Path, steps: int, groups_per_step: int, group_size: int
) -> None:
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["step"] == steps
    # A restarted learner continues under a fresh version, one past every version the run used
    # (actors/learner/process.py), so versions never go back but may skip ahead.
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
