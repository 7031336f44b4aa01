"""The fork server (slime_async/utils/forkserver.py): a role forked from it must start as the
same `python -m` command started by a fresh interpreter would. The oracle is that fresh
interpreter: both start tests/support/forked_probe.py, which writes what it can observe."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from slime_async.utils.forkserver import ForkServer
from slime_async.utils.procs import Child, group_alive, wait_until

PROBE = [sys.executable, "-m", "tests.support.forked_probe"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _server(tmp_path, preload) -> ForkServer:
    """A server with the roles' environment (as the supervisor's is theirs)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    return ForkServer(preload, tmp_path / "server.log", env=env).start()


@pytest.fixture()
def start_server(tmp_path):
    """Started lazily, in the test itself: pytest's own variable differs between its phases."""
    started = []

    def start() -> ForkServer:
        started.append(_server(tmp_path, ["json", "numpy"]))
        return started[0]

    yield start
    for s in started:
        s.close()


def _facts(child: Child) -> dict:
    first = child.log_path.read_text().splitlines()
    return json.loads(next(line for line in first if line.startswith("{")))


def _run(tmp_path, name, args, server=None, env=None, argv=PROBE) -> tuple[Child, int]:
    log = tmp_path / f"{name}.log"
    log.write_text("earlier lines stay\n")
    child = Child(
        name,
        [*argv, *args],
        log_path=log,
        env={"SLIME_ASYNC_PROBE": name, "PYTHONPATH": REPO, **(env or {})},
        cwd=tmp_path,
        fork_server=server,
    )
    code = child.proc.wait(60)
    child.stop(5)
    return child, code


def _waiter(tmp_path, server, die_with_parent=False) -> Child:
    """A forked probe that waits (for a file nobody writes), once it has written its line."""
    child = Child(
        "waiter",
        [*PROBE, f"wait:{tmp_path / 'never'}"],
        log_path=tmp_path / "w.log",
        env={"PYTHONPATH": REPO},
        die_with_parent=die_with_parent,
        fork_server=server,
    )
    assert child.started_by == "fork"
    wait_until(lambda: "{" in child.log_path.read_text(), 30, "the probe's line", child=child)
    return child


@pytest.mark.parametrize("how", ["module", "script"])
def test_a_forked_role_observes_what_a_fresh_interpreter_would(start_server, tmp_path, how):
    server = start_server()
    # `python -m tests.support.forked_probe`, or `python <a link to it>` (python puts the
    # folder of the script it links to first on sys.path)
    argv = PROBE
    if how == "script":
        (tmp_path / "link.py").symlink_to(Path(REPO) / "tests" / "support" / "forked_probe.py")
        argv = [sys.executable, "link.py"]
    fresh, code_a = _run(tmp_path, "exec", ["exit:3", "x y"], argv=argv)
    forked, code_b = _run(tmp_path, "fork", ["exit:3", "x y"], server, argv=argv)
    assert fresh.started_by == "exec" and forked.started_by == "fork"
    assert code_a == code_b == 3
    a, b = _facts(fresh), _facts(forked)
    a.pop("numpy_draw"), b.pop("numpy_draw")
    assert a["probe_env"] == "exec" and b["probe_env"] == "fork"
    a.pop("probe_env"), b.pop("probe_env")
    assert a == b
    assert b["argv"] == ["exit:3", "x y"] and b["cwd"] == str(tmp_path)
    assert b["own_session"] and b["stdin_devnull"] and b["gc"] and b["threads"] == 1
    for child in (fresh, forked):  # appended to the log; atexit ran, the thread was joined
        lines = child.log_path.read_text().splitlines()
        assert lines[0] == "earlier lines stay"
        assert "atexit ran" in lines and "thread joined" in lines


def test_exit_codes_and_uncaught_exceptions_as_python_m(start_server, tmp_path):
    server = start_server()
    for how in ("exec", "fork"):
        child, code = _run(tmp_path, f"{how}-raise", ["raise"], server if how == "fork" else None)
        assert child.started_by == how and code == 1
        assert "RuntimeError: the probe raised" in child.log_path.read_text()


def test_sigterm_and_the_group_as_for_a_fresh_process(start_server, tmp_path):
    server = start_server()
    child = _waiter(tmp_path, server)
    assert os.getpgid(child.pid) == child.pid != os.getpgid(server.pid)
    assert child.stop(5) == -signal.SIGTERM
    assert not group_alive(child.pid)


def test_forked_children_draw_their_own_numpy_numbers(start_server, tmp_path):
    server = start_server()
    draws = {
        _facts(_run(tmp_path, f"fork{i}", ["exit:0"], server)[0])["numpy_draw"] for i in (1, 2)
    }
    assert len(draws) == 2  # the server's global RNG state was not inherited as is


def test_what_the_server_cannot_start_runs_in_a_fresh_interpreter_and_says_why(
    start_server, tmp_path
):
    server = start_server()
    # A variable read at import differs: the server's modules were imported without it.
    child, code = _run(tmp_path, "omp", ["exit:0"], server, env={"OMP_NUM_THREADS": "3"})
    assert code == 0 and child.started_by.startswith("exec (")
    assert "OMP_NUM_THREADS" in child.started_by
    # Neither `python -m` nor `python SCRIPT.py`.
    other = Child(
        "code", [sys.executable, "-c", "print(1)"], log_path=tmp_path / "c.log", fork_server=server
    )
    assert other.proc.wait(30) == 0 and other.started_by.startswith("exec (not ")
    # Variables read at run time may differ (the engines' CUDA devices, torch.distributed's).
    child, code = _run(
        tmp_path, "rank", ["exit:0"], server, env={"RANK": "1", "SLIME_ASYNC_X": "1"}
    )
    assert code == 0 and child.started_by == "fork"


def test_a_server_left_with_python_threads_forks_nothing(tmp_path):
    s = _server(tmp_path, ["tests.support.forked_probe:start_thread"])
    try:
        child, code = _run(tmp_path, "thr", ["exit:0"], s)
        assert code == 0
        assert child.started_by == "exec (its imports left 2 Python threads)"
    finally:
        s.close()


def test_a_failed_import_is_reported_and_the_rest_preloaded(tmp_path):
    s = _server(tmp_path, ["json", "no_such_module_here", "numpy"])
    try:
        child, code = _run(tmp_path, "ok", ["exit:0"], s)
        assert code == 0 and child.started_by == "fork"
        assert s.ready["imported"] == ["json", "numpy"]
        assert "ModuleNotFoundError" in s.ready["failed"]["no_such_module_here"]
    finally:
        s.close()


def test_when_the_server_dies_its_children_die_are_reported_killed_and_roles_start_fresh(
    start_server, tmp_path
):
    server = start_server()
    child = _waiter(tmp_path, server, die_with_parent=True)
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: child.poll() is not None, 30, "the orphan's end")
    assert child.poll() == -signal.SIGKILL  # the server took the real status with it
    assert "exited with code -9" in server.failure
    after, code = _run(tmp_path, "after", ["exit:0"], server)
    assert code == 0 and after.started_by == "exec (the fork server exited with code -9)"


def test_what_an_import_prints_goes_to_the_log_not_into_the_answers(tmp_path):
    s = _server(tmp_path, ["tests.support.forked_probe:chatty"])
    try:
        child, code = _run(tmp_path, "after", ["exit:0"], s)
        assert code == 0 and child.started_by == "fork"
        assert "an import that talks" in (tmp_path / "server.log").read_text()
        assert "an import that talks" not in child.log_path.read_text()
    finally:
        s.close()


def test_closing_the_server_ends_it(tmp_path):
    s = _server(tmp_path, ["json"])
    child, code = _run(tmp_path, "one", ["exit:0"], s)
    assert code == 0 and child.started_by == "fork"
    assert s.close() == 0
    assert not group_alive(s.pid)
