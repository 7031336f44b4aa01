"""One small real sweep, read by the end-to-end checks of the sweep, the fixed lag and pinned
evaluation (tests/integration/test_staleness_sweep.py).

`slime-async sweep --jobs 2` over `buffer.fixed_lag = 0, 2` (one seed, a few steps, a tiny random
model, pinned evaluation every 2 versions): two complete `slime-async run`s at once, each with its
own real buffer, embedded engine, generator and Megatron-core learner. Made once per test session
(a module-level cache; under pytest-xdist a lock in the session's shared temp directory), so the
two runs are paid once whichever modules read them.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.repo import REPO
from tests.support.run_config import tiny_run_config

TIMEOUT_S = 600
"""pytest-timeout of the tests that use the sweep (two runs: about a minute on an idle 2-core
machine, several under load; the project's default is 300 s)."""
STEPS = 4
LAGS = (0, 2)
EVAL_INTERVAL = 2
_CACHE: dict[str, object] = {}


def write_config(root: Path, model: Path, data: Path, evals: Path) -> Path:
    return tiny_run_config(
        root / "sweep-base.toml",
        model=model,
        data=data,
        run={"name": "sweep-test"},
        buffer={"max_staleness": 2, "wal_dir": None},
        generator__sampling={"max_new_tokens": 10},
        learner={"num_steps": STEPS, "save_interval": 0},
        eval={"interval": EVAL_INTERVAL, "data": str(evals), "max_examples": 4, "samples": 1},
    )


def sweep_argv(cfg: Path, out: Path) -> list[str]:
    grid = "buffer.fixed_lag=" + ",".join(map(str, LAGS))
    return [
        sys.executable,
        "-m",
        "slime_async",
        "sweep",
        str(cfg),
        "--grid",
        grid,
        "--seeds",
        "1",
        "--out",
        str(out),
        "--target-accuracy",
        "0.0",
        "--jobs",
        "2",
    ]


def shared_sweep(tmp_path_factory) -> dict:
    """{"out": sweep dir, "proc": the CompletedProcess, "cfg": base config, "argv": command}.

    Run once per test session: under pytest-xdist the modules that use it may sit on different
    workers (processes), so the first one runs it under a lock in the session's shared temp
    directory and writes what it got; the others wait on the lock and read that."""
    if "out" in _CACHE:
        return _CACHE
    run_uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_uid is None:  # one process: the module cache is enough
        return _run_sweep(tmp_path_factory)
    shared = tmp_path_factory.getbasetemp().parent  # the same for every worker of this session
    record = shared / f"staleness-sweep-{run_uid}.json"
    with open(shared / f"staleness-sweep-{run_uid}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            r = json.loads(record.read_text())
            proc = subprocess.CompletedProcess(r["argv"], r["rc"], r["stdout"], r["stderr"])
            _CACHE.update(out=Path(r["out"]), cfg=Path(r["cfg"]), argv=r["argv"], proc=proc)
            return _CACHE
        try:
            _run_sweep(tmp_path_factory)
        finally:
            if "proc" in _CACHE:
                proc = _CACHE["proc"]
                record.write_text(
                    json.dumps(
                        {
                            "out": str(_CACHE["out"]),
                            "cfg": str(_CACHE["cfg"]),
                            "argv": _CACHE["argv"],
                            "rc": proc.returncode,
                            "stdout": proc.stdout,
                            "stderr": proc.stderr,
                        }
                    )
                )
    return _CACHE


def _run_sweep(tmp_path_factory) -> dict:
    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("staleness")
    model = make_tiny_model(root / "model", "qwen3", seed=0)
    data = make_dataset(root / "train.jsonl", 200, seed=0)
    evals = make_dataset(root / "eval.jsonl", 20, seed=1)
    cfg = write_config(root, model, data, evals)
    out = root / "sweep"
    argv = sweep_argv(cfg, out)
    _CACHE.update(out=out, cfg=cfg, argv=argv)
    try:
        _CACHE["proc"] = run_group(argv, 540)
    except BaseException as e:  # e.g. pytest-timeout: the next module must not run it again
        _CACHE["proc"] = subprocess.CompletedProcess(argv, -1, "", f"not finished: {e!r}")
        raise
    return _CACHE


def run_group(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run `argv` in its own process group; on timeout SIGTERM the group (the sweep and the
    run's supervisor, which stops its roles), then SIGKILL: nothing is left behind."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException as e:  # our timeout, or the test's (pytest-timeout), or Ctrl-C
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        out, err = "", f"timed out after {timeout_s}s; process group stopped"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_dir(out: Path, lag: int, seed: int = 0) -> Path:
    return out / f"fixed_lag-{lag}" / f"seed{seed}"
