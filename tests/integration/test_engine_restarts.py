"""A real `slime-async run` (buffer, two STRICT embedded engines with an API key behind the real
sglang-router, generator, Megatron-core learner; tiny model) that loses an engine to SIGKILL and
finishes WITHOUT `--resume`: the run starts and trains behind the router with the key, the
supervisor restarts the killed engine (restarts are on by default), it rejoins the weights, the
last push reaches both engines, nothing the buffer acknowledged is lost and no group is
committed twice (the learner's SIGKILL, restarted the same way:
tests/integration/test_restart_versions.py).
"""

import os
import signal
from pathlib import Path

import pytest

from slime_async.metrics import read_metrics
from tests.support.run_config import tiny_run_config
from tests.support.runs import assert_nothing_lost_nothing_twice, tiny_inputs
from tests.support.runs import finish as _finish
from tests.support.runs import pid_of as _pid_of
from tests.support.runs import start_run as _start
from tests.support.runs import steps_done as _steps_done
from tests.support.runs import wait_for as _wait_for

GROUPS_PER_STEP = 2
GROUP_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("restarts"))


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


def _assert_nothing_lost_nothing_twice(run_dir: Path, steps: int) -> None:
    assert_nothing_lost_nothing_twice(run_dir, steps, GROUPS_PER_STEP, GROUP_SIZE)


def _kill(run_dir: Path, role: str) -> int:
    pid = _pid_of(run_dir, role)
    os.killpg(pid, signal.SIGKILL)  # the role's own process group (the supervisor made it)
    return pid


@pytest.mark.timeout(600)  # the run alone may take 420 s on a loaded 2-core machine (`_finish`)
def test_engine_sigkill_behind_the_router_with_a_key_finishes_and_the_engine_rejoins(tiny):
    """Found 6: with an API key the real router never registered the engines (its /health probe
    got 401); /health is exempt from the key, as in SGLang, so the run starts and trains. One of
    the two engines is then SIGKILLed after step 2: restarted, it rejoins the weight group."""
    root, model, data = tiny
    steps = 8
    cfg = _config(root, model, data, "kill-engine", steps, num_engines=2, api_key="sekrit")
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
    assert "router is ready" in sup and "lists 2 healthy" in sup
    assert "restarting engine0" in sup, out[-3000:]
    (rec,) = read_metrics(run_dir / "metrics" / "supervisor.jsonl")  # counted, with its signal
    assert rec["supervisor/restarts/engine0"] == 1 and rec["supervisor/exit_code/engine0"] == -9
    assert rec["supervisor/restarts"] == 1  # only the killed one
    assert "restarted: engine0 1x" in out
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["version"] >= steps - 1  # rewards vary: (almost) no batch is skipped
    assert learner[-1]["push/resyncs"] >= 1  # the restarted engine was brought back
    assert learner[-1]["push/engines"] == 2.0  # the last push reached both
    _assert_nothing_lost_nothing_twice(run_dir, steps)
