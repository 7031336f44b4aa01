"""Real `slime-async run`s (buffer, STRICT embedded engines, generator, Megatron-core learner;
tiny model) that lose a role to SIGKILL and finish WITHOUT `--resume`: the supervisor restarts it
(restarts are on by default), the weight group is rebuilt under a fresh name, nothing the buffer
acknowledged is lost and no group is committed twice. And several engines with an API key behind
the real sglang-router: the run starts and trains.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_async.metrics import read_metrics
from tests.support.repo import REPO
from tests.support.run_config import tiny_run_config

GROUPS_PER_STEP = 2
GROUP_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("restarts")
    return (
        root,
        make_tiny_model(root / "model", "qwen3", seed=0),
        make_dataset(root / "train.jsonl", 300, seed=0),
    )


def _config(root: Path, model: Path, data: Path, name: str, steps: int, **engine) -> Path:
    return tiny_run_config(
        root / f"{name}.toml",
        model=model,
        data=data,
        run_dir=root / name,
        buffer={"max_staleness": 2},
        engine={"router_port": 0, **engine},
        learner={"num_steps": steps, "groups_per_step": GROUPS_PER_STEP},
        generator={"group_size": GROUP_SIZE},
    )


def _start(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "slime_async", "run", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _pid_of(run_dir: Path, role: str) -> int:
    """The role's PID as the supervisor logged it ("started <role> (pid N)")."""
    found = re.findall(
        rf"started {role} \(pid (\d+)", (run_dir / "logs" / "supervisor.log").read_text()
    )
    assert found, f"no pid of {role} in supervisor.log"
    return int(found[-1])


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics" / "learner.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not finish in {timeout}s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def _assert_nothing_lost_nothing_twice(run_dir: Path, steps: int) -> None:
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["step"] == steps
    # A restarted learner continues from the buffer's version when that is newer than its
    # checkpoint's (actors/learner/process.py), so versions never go back but may skip ahead.
    versions = [r["version"] for r in learner if r["step"] == max(x["step"] for x in learner)]
    assert versions[-1] >= steps
    final = json.loads((run_dir / "buffer_final.json").read_text())
    # Every step's groups committed exactly once: none twice, none missing.
    assert final["counts"]["committed_trajectories"] == steps * GROUPS_PER_STEP * GROUP_SIZE
    assert final["batches_delivered_uncommitted"] == 0
    dropped = sum(final["dropped_trajectories"].values())
    acknowledged = final["counts"]["trajectories_in"]
    committed = final["counts"]["committed_trajectories"]
    assert acknowledged == committed + dropped + final["trajectories_held"], final


def _kill(run_dir: Path, role: str) -> int:
    pid = _pid_of(run_dir, role)
    os.killpg(pid, signal.SIGKILL)  # the role's own process group (the supervisor made it)
    return pid


def test_learner_sigkill_run_finishes_without_resume(tiny):
    root, model, data = tiny
    steps = 8
    cfg = _config(root, model, data, "kill-learner", steps)
    run_dir = root / "kill-learner"
    proc = _start(cfg)
    try:
        ckpt = run_dir / "checkpoints" / "step_2"
        _wait_for(lambda: ckpt.is_dir() and _steps_done(run_dir) >= 3, 300, "step 3", proc)
        _kill(run_dir, "learner")
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert "restarting learner" in sup, out[-3000:]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed at step" in log
    # The new learner's group has a fresh name; the dead one's was destroyed first.
    names = {
        line.split("weight-update group ")[1].split()[0]
        for line in log.splitlines()
        if "weight-update group slime_async" in line
    }
    assert len(names) >= 2, names
    _assert_nothing_lost_nothing_twice(run_dir, steps)


def test_engine_sigkill_run_finishes_and_engine_rejoins(tiny):
    root, model, data = tiny
    steps = 8
    cfg = _config(root, model, data, "kill-engine", steps)
    run_dir = root / "kill-engine"
    proc = _start(cfg)
    try:
        _wait_for(lambda: _steps_done(run_dir) >= 2, 300, "step 2", proc)
        _kill(run_dir, "engine0")
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert "restarting engine0" in sup, out[-3000:]
    (rec,) = read_metrics(run_dir / "metrics" / "supervisor.jsonl")  # counted, with its signal
    assert rec["supervisor/restarts/engine0"] == 1 and rec["supervisor/exit_code/engine0"] == -9
    assert "restarted: engine0 1x" in out
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["push/resyncs"] >= 1  # the restarted engine was brought back
    assert learner[-1]["push/engines"] == 1.0
    _assert_nothing_lost_nothing_twice(run_dir, steps)


@pytest.mark.timeout(600)  # the run alone may take 420 s on a loaded 2-core machine (`_finish`)
def test_engines_with_api_key_behind_the_real_router_train(tiny):
    """Found 6: with an API key the real router never registered the engines (its /health probe
    got 401); /health is exempt from the key, as in SGLang, so the run starts and trains."""
    root, model, data = tiny
    steps = 3
    cfg = _config(root, model, data, "router-key", steps, num_engines=2, api_key="sekrit")
    run_dir = root / "router-key"
    _finish(_start(cfg))
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert "router is ready" in sup and "lists 2 healthy" in sup
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert [r["version"] for r in learner] == list(range(1, steps + 1))
    assert learner[-1]["push/engines"] == 2.0
    _assert_nothing_lost_nothing_twice(run_dir, steps)
