"""Real `slime-async run`s (buffer, a STRICT embedded engine, generator, Megatron-core learner;
tiny model) whose engine is SIGSTOPped mid-run, so its port stays open and nothing answers.

- Past `engine.liveness.restart_after_s`: the generator and the learner's push report it hung
  within 15 s (naming the URL and what timed out), the supervisor restarts it (counted, with the
  reason), the restarted engine rejoins the weights, and the run completes with nothing lost.
- SIGCONT before the deadline (two engines behind the real sglang-router): marked down, the
  pushes go on without it, then it is back and rejoins the weights without a restart.

Each counted in the roles' metrics. The unit half (the probes themselves) is
tests/unit/engine/test_engine_liveness.py; the stuck update call is test_push_stuck_engine.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from slime_async.metrics import read_metrics
from tests.support.run_config import tiny_run_config
from tests.support.runs import (
    assert_nothing_lost_nothing_twice,
    finish,
    pid_of,
    start_run,
    steps_done,
    tiny_inputs,
    wait_for,
)

REPORTED_WITHIN_S = 15.0
LIVENESS = {"probe_interval_s": 1.0, "ready_timeout_s": 2.0, "hung_after_s": 4.0}
"""Faster than the defaults (2 s, 5 s, 10 s) so the runs stay short; the defaults' bound is
checked in the unit tier."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("liveness"))


def _config(
    root: Path,
    model: Path,
    data: Path,
    name: str,
    steps: int,
    restart_after_s: float,
    engines: int = 1,
):
    return tiny_run_config(
        root / f"{name}.toml",
        model=model,
        data=data,
        run_dir=root / name,
        buffer={"max_staleness": 2},
        learner={"num_steps": steps, "groups_per_step": 2},
        generator={"group_size": 4, "log_interval_s": 1.0},
        engine={"num_engines": engines, "router_port": 0},
        engine__liveness={**LIVENESS, "restart_after_s": restart_after_s},
    )


def _engine_url(run_dir: Path, role: str) -> str:
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    found = re.findall(rf"{role} is ready \(GET (http://[0-9.:]+)/health", sup)
    assert found, f"no {role} URL in supervisor.log"
    return found[-1]


def _log(run_dir: Path, role: str) -> str:
    path = run_dir / "logs" / f"{role}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def _sigstop_and_wait_for_reports(run_dir: Path, proc, role: str) -> tuple[int, str, float]:
    """SIGSTOP `role` after step 2; wait until the generator and the learner's push both
    reported it hung; return its pid, URL and the seconds the later report took."""
    wait_for(lambda: steps_done(run_dir) >= 2, 300, "step 2", proc)
    pid, url = pid_of(run_dir, role), _engine_url(run_dir, role)
    os.killpg(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    hung = f"engine {url} is hung: no answer to any probe"
    wait_for(lambda: hung in _log(run_dir, "generator0"), 60, "the generator's report", proc)
    gen_s = time.monotonic() - t0
    wait_for(lambda: hung in _log(run_dir, "learner"), 60, "the push's report", proc)
    push_s = time.monotonic() - t0
    for role in ("generator0", "learner"):
        line = next(ln for ln in _log(run_dir, role).splitlines() if hung in ln)
        assert "GET /ready: no answer in 2.0s" in line, line  # what timed out
    assert max(gen_s, push_s) <= REPORTED_WITHIN_S, (gen_s, push_s)
    return pid, url, max(gen_s, push_s)


def test_sigstopped_engine_is_reported_restarted_and_the_run_completes(tiny):
    root, model, data = tiny
    steps = 8
    run_dir = root / "stop-engine"
    proc = start_run(_config(root, model, data, "stop-engine", steps, restart_after_s=12.0))
    try:
        pid, url, _ = _sigstop_and_wait_for_reports(run_dir, proc, "engine0")
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    sup = _log(run_dir, "supervisor")
    assert f"engine0 ({url}) is hung" in sup
    assert f"stopping engine0 (pid {pid}) to restart it: engine0 ({url}) answered no probe" in sup
    assert "restart_after_s = 12" in sup and "restarting engine0" in sup
    (rec,) = read_metrics(run_dir / "metrics" / "supervisor.jsonl")
    assert rec["supervisor/hung_restarts"] == 1 and rec["supervisor/restarts/engine0"] == 1
    assert "restarted: engine0 1x" in out
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")
    assert gen[-1]["gen/engines_hung"] >= 1 and gen[-1]["gen/engines_back"] >= 1
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["push/engines_hung"] >= 1
    assert learner[-1]["push/resyncs"] >= 1  # the restarted engine got the current weights
    assert learner[-1]["push/engines"] == 1.0
    assert f"pushed version {learner[-1]['version']} to 1 engines" in _log(run_dir, "learner")
    assert_nothing_lost_nothing_twice(run_dir, steps, 2, 4)


@pytest.mark.timeout(600)  # two engines and the router on a loaded 2-core machine
def test_sigstop_then_sigcont_before_the_deadline_comes_back_and_rejoins(tiny):
    root, model, data = tiny
    steps = 10
    run_dir = root / "pause-engine"
    cfg = _config(root, model, data, "pause-engine", steps, restart_after_s=300.0, engines=2)
    proc = start_run(cfg)
    try:
        pid, url, _ = _sigstop_and_wait_for_reports(run_dir, proc, "engine1")
        # The other engine keeps generating: the learner pushes without the hung one at once.
        left_out = f"without {{'{url}': 'no answer to any probe"
        wait_for(lambda: left_out in _log(run_dir, "learner"), 120, "a push without it", proc)
        # The supervisor probes on its own clock: SIGCONT only once it too has reported the
        # engine hung (else the engine may be back before the supervisor ever saw it hang).
        hung = f"engine1 ({url}) is hung"
        wait_for(lambda: hung in _log(run_dir, "supervisor"), 60, "the supervisor's report", proc)
        os.killpg(pid, signal.SIGCONT)
        # Each watcher's state before "back" is hung, or down where a request to the engine
        # failed meanwhile (marked down quietly): either is the same return.
        back = f"engine {url} is back: GET /ready answered 200 (it was "
        wait_for(lambda: back in _log(run_dir, "generator0"), 60, "the generator: back", proc)
        wait_for(lambda: back in _log(run_dir, "learner"), 60, "the push: back", proc)
        rejoins = f"engine {url} is back: it rejoins the weight group"
        wait_for(lambda: rejoins in _log(run_dir, "learner"), 120, "it rejoins", proc)
        out = finish(proc, timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    sup = _log(run_dir, "supervisor")
    assert f"engine1 ({url}) is hung" in sup and f"engine1 ({url}) is back" in sup
    assert "restarting engine1" not in sup and "restarted:" not in out
    assert pid_of(run_dir, "engine1") == pid  # the same process throughout
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")
    assert gen[-1]["gen/engines_hung"] >= 1 and gen[-1]["gen/engines_back"] >= 1
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["push/engines_hung"] >= 1 and learner[-1]["push/engines_back"] >= 1
    assert learner[-1]["push/engines_left_out"] >= 1 and learner[-1]["push/resyncs"] >= 2
    # Both engines hold the learner's last weights: the last push reached them.
    assert learner[-1]["push/engines"] == 2.0
    assert f"pushed version {learner[-1]['version']} to 2 engines" in _log(run_dir, "learner")
    assert_nothing_lost_nothing_twice(run_dir, steps, 2, 4)
