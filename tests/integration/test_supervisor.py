"""The run supervisor with small stand-in roles: readiness, completion, failure reports, restarts,
Ctrl-C and no orphans. The stand-ins are real processes (ports, ready files, signals, grandchildren);
what they wait on is always a file or a port, never a sleep."""

import io
import os
import signal
import socket
import sys
import threading

import pytest

from slime_async.commands.run import summarize_restarts
from slime_async.launch.run_dir import READY_ENV, RunDir, announce_ready
from slime_async.launch.supervisor import RoleSpec, Supervisor, ready_file_exists
from slime_async.metrics import read_metrics
from slime_async.utils.procs import Child, free_port, group_alive, wait_until
from tests.support.standins import alive, role, start_driver
from tests.support.standins import env as env


def events(record):
    return [line.split()[:2] for line in record.read_text().splitlines()]


def test_completes_when_learner_exits_0_and_stops_others_in_reverse(env):
    _script, record, run_dir = env
    port = free_port()
    learner_go = run_dir.ready_file("generator0")  # the learner finishes once the generator is up
    stages = [
        [role(env, "buffer", "--port", str(port)), role(env, "engine0")],
        [
            role(env, "generator0", on_exit_0="expected"),
            role(env, "learner", "--exit-when", str(learner_go), on_exit_0="ends_run"),
        ],
    ]
    err = io.StringIO()
    sup = Supervisor(run_dir, stages, stop_grace_s=5, poll_interval_s=0.05, err=err)
    assert sup.run() == 0
    ev = events(record)
    # Roles of one stage start together (any order); a stage starts once the last is ready.
    assert sorted(map(tuple, ev[:2])) == [("start", "buffer"), ("start", "engine0")]
    assert sorted(map(tuple, ev[2:4])) == [("start", "generator0"), ("start", "learner")]
    assert ev[4:] == [
        ["exit", "learner"],
        ["stop", "generator0"],
        ["stop", "engine0"],
        ["stop", "buffer"],
    ]
    log = run_dir.log("supervisor").read_text()
    assert "learner" in log and "the run is complete" in log
    assert "buffer is up" in run_dir.log("buffer").read_text()
    assert not sup.children


def test_dead_role_is_reported_and_the_run_stops(env):
    _script, record, run_dir = env
    stages = [
        [
            role(
                env,
                "engine0",
                "--exit-when",
                str(run_dir.ready_file("learner")),
                "--exit-code",
                "3",
            )
        ],
        [role(env, "learner", on_exit_0="ends_run")],
    ]
    err = io.StringIO()
    sup = Supervisor(run_dir, stages, stop_grace_s=5, poll_interval_s=0.05, err=err)
    assert sup.run() == 1
    report = err.getvalue()
    pid = next(
        int(x.split()[2]) for x in record.read_text().splitlines() if x.startswith("start engine0")
    )
    assert f"engine0 (pid {pid}) exited with code 3" in report
    assert "engine0: boom, exiting with 3" in report  # the last lines of its log
    assert "no restarts left" in report
    assert events(record)[-1] == ["stop", "learner"]
    assert sup.failure and "engine0" in sup.failure
    (rec,) = read_metrics(run_dir.path / "metrics" / "supervisor.jsonl")
    assert rec["supervisor/failures"] == 1 and rec["supervisor/restarts"] == 0
    assert rec["supervisor/exit_code/engine0"] == 3


def test_role_is_restarted_with_resume_then_run_completes(env):
    _script, record, run_dir = env
    go = run_dir.path / "go"
    stages = [
        # engine0 fails once the learner is up; started again (with --resumed) it stays up.
        [
            role(
                env,
                "engine0",
                "--exit-when",
                str(run_dir.ready_file("learner")),
                "--exit-code",
                "7",
                "--fail-first",
                resume_flag=True,
            )
        ],
        [role(env, "learner", "--exit-when", str(go), on_exit_0="ends_run")],
    ]
    err = io.StringIO()
    sup = Supervisor(
        run_dir, stages, restart_failed=1, stop_grace_s=5, poll_interval_s=0.05, err=err
    )

    def finish_learner_after_restart():
        wait_until(lambda: ["start-resumed", "engine0"] in events(record), 60, "engine0 restart")
        wait_until(lambda: run_dir.ready_file("engine0").exists(), 60, "engine0 ready again")
        go.touch()

    t = threading.Thread(target=finish_learner_after_restart, daemon=True)
    t.start()
    assert sup.run() == 0, err.getvalue()
    t.join(5)
    assert events(record) == [
        ["start", "engine0"],
        ["start", "learner"],
        ["exit", "engine0"],
        ["start-resumed", "engine0"],
        ["exit", "learner"],
        ["stop", "engine0"],
    ]
    assert "engine0" in err.getvalue() and "exited with code 7" in err.getvalue()
    assert "restarting engine0 (0 restarts left" in run_dir.log("supervisor").read_text()
    # Counted, not only logged: one failure, one restart of engine0, with its exit code.
    (rec,) = read_metrics(run_dir.path / "metrics" / "supervisor.jsonl")
    assert rec["supervisor/failures"] == 1 and rec["supervisor/restarts"] == 1
    assert rec["supervisor/restarts/engine0"] == 1 and rec["supervisor/exit_code/engine0"] == 7
    assert summarize_restarts([rec]).startswith("role failures: 1; restarted: engine0 1x")


def test_a_generator_may_finish_but_a_server_may_not(env):
    _script, record, run_dir = env
    sup_log = run_dir.log("supervisor")
    stages = [
        [role(env, "buffer")],
        [
            role(
                env,
                "generator0",
                "--exit-when",
                str(run_dir.ready_file("learner")),
                on_exit_0="expected",
            ),
            # Exits 0 once the supervisor has handled the generator's exit; not an ends_run role.
            role(env, "learner", "--exit-when", f"{sup_log}::finished its work"),
        ],
    ]
    err = io.StringIO()
    sup = Supervisor(run_dir, stages, stop_grace_s=5, poll_interval_s=0.05, err=err)
    assert sup.run() == 1
    assert "generator0" in sup_log.read_text()
    assert "learner" in err.getvalue() and "exited with code 0" in err.getvalue()
    assert "no restarts left" in err.getvalue()
    assert ["exit", "generator0"] in events(record) and ["stop", "buffer"] in events(record)


def test_role_that_never_gets_ready_stops_the_run(env):
    _script, record, run_dir = env
    stages = [[role(env, "buffer")], [role(env, "engine0", "--no-ready")], [role(env, "learner")]]
    err = io.StringIO()
    sup = Supervisor(
        run_dir, stages, ready_timeout_s=5.0, stop_grace_s=5, poll_interval_s=0.05, err=err
    )  # 5 s: the buffer stage must get ready within it too, also on a loaded machine
    assert sup.run() == 1
    assert (
        "engine0 did not start: timed out after 5s waiting for engine0 to be ready"
        in err.getvalue()
    )
    assert "engine0 is up" in err.getvalue()  # its log tail comes with the report
    assert ["start", "learner"] not in events(record)
    assert events(record)[-2:] == [["stop", "engine0"], ["stop", "buffer"]]


def test_role_that_exits_during_startup_is_reported(env):
    _script, _record, run_dir = env
    bad = RoleSpec(
        name="engine0",
        argv=lambda resume: [
            sys.executable,
            "-c",
            "import sys; print('no model here'); sys.exit(2)",
        ],
        ready=ready_file_exists,
    )
    err = io.StringIO()
    sup = Supervisor(run_dir, [[bad]], stop_grace_s=5, poll_interval_s=0.05, err=err)
    assert sup.run() == 1
    assert "engine0" in err.getvalue() and "exited with 2" in err.getvalue()
    assert "no model here" in err.getvalue()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_every_child_and_leaves_no_orphans(env, tmp_path, sig):
    _script, record, run_dir = env
    driver, pidfile = start_driver(env, tmp_path)
    try:
        wait_until(
            lambda: run_dir.ready_file("learner").exists(), 60, "learner ready", child=driver
        )
        starts = [x.split() for x in record.read_text().splitlines() if x.startswith("start")]
        pgids = {name: os.getpgid(int(pid)) for _s, name, pid in starts}
        grandchild = int(pidfile.read_text())
        assert os.getpgid(grandchild) == pgids["buffer"]  # in the role's group, ignoring SIGTERM
        os.kill(driver.pid, sig)  # what Ctrl-C (or `kill`) does to the supervisor alone
        driver.proc.wait(30)
        assert driver.proc.returncode == 128 + sig
        for name, pgid in pgids.items():
            assert pgid != driver.pid and not group_alive(pgid), f"{name}'s group survived"
        assert not alive(grandchild)
        assert ["stop", "learner"] in events(record)
        log = run_dir.log("supervisor").read_text()
        assert f"received {signal.Signals(sig).name}; stopping every role" in log
    finally:
        driver.stop(5)


def test_child_stop_kills_a_grandchild_that_ignores_sigterm(tmp_path):
    code = (
        "import signal, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)'],"
        " stdout=subprocess.PIPE)\n"
        f"open({str(tmp_path / 'g.pid')!r}, 'w').write(str(g.pid)); g.stdout.readline()\n"
        f"open({str(tmp_path / 'up')!r}, 'w').close()\n"
        "time.sleep(600)\n"
    )
    child = Child("parent", [sys.executable, "-c", code], log_path=tmp_path / "p.log")
    wait_until(lambda: (tmp_path / "up").exists(), 30, "grandchild up", child=child)
    gpid = int((tmp_path / "g.pid").read_text())
    child.stop(timeout=1.0)  # the parent dies of SIGTERM at once; the grandchild needs SIGKILL
    assert not group_alive(child.pid) and not alive(gpid)


def test_run_dir_layout_and_ready_convention(tmp_path, monkeypatch):
    a = RunDir.create(tmp_path / "runs", "demo")
    b = RunDir.create(tmp_path / "runs", "demo")  # same second: a distinct directory
    assert a.path != b.path and a.path.name.startswith("demo-") and a.logs_dir.is_dir()
    a.config_json.write_text("{}")
    with pytest.raises(FileExistsError, match="--resume"):
        RunDir.create(tmp_path / "runs", "demo", a.path)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        RunDir.existing(b.path)
    assert RunDir.existing(a.path).path == a.path
    assert a.under("wal") == a.path / "wal" and a.under("/abs") == a.path.__class__("/abs")

    monkeypatch.delenv(READY_ENV, raising=False)
    assert announce_ready() is None  # outside a supervised run: nothing to do
    monkeypatch.setenv(READY_ENV, str(a.ready_file("learner")))
    assert announce_ready("rank 0 of 2") == a.ready_file("learner")
    assert "rank 0 of 2" in a.ready_file("learner").read_text()


def test_supervisor_rejects_duplicate_role_names(env):
    with pytest.raises(ValueError, match="unique"):
        Supervisor(env[2], [[role(env, "x")], [role(env, "x")]])


def test_quick_role_that_is_ready_then_exits_counts_as_started(env):
    _script, record, run_dir = env
    # Ready and finished before the supervisor's first look: a start, then the run completes.
    learner = role(env, "learner", "--exit-when", os.devnull, on_exit_0="ends_run")
    sup = Supervisor(run_dir, [[learner]], stop_grace_s=5, poll_interval_s=0.05, err=io.StringIO())
    assert sup.run() == 0
    assert events(record) == [["start", "learner"], ["exit", "learner"]]


def test_free_ports_avoid_the_kernels_ephemeral_range_and_never_repeat():
    """A port promised to a child must not be one an outgoing connection can take first (the
    kernel draws those from its ephemeral range): that race failed whole runs with "address
    already in use". Ports handed out by one process are all different."""
    from slime_async.utils.procs import _ephemeral_range

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 20000 or high < 65535:  # else the kernel leaves no room outside: the OS's choice
        assert all(not low <= p <= high for p in ports), ports
    for p in ports[:5]:  # free now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
