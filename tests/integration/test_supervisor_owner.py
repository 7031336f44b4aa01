"""One owner per run directory: a second supervisor is refused while the first lives; when the
supervisor is SIGKILLed its roles die with it (parent-death signal) and so does what they started
(the watchdog); a new owner stops whatever a dead one left. Stand-in roles from
tests/support/standins.py; the same SIGKILL of a real run's supervisor, then `run --resume`:
tests/integration/test_restart_versions.py."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from slime_async.launch.run_dir import RunDir, RunDirBusy
from slime_async.launch.supervisor import Supervisor, cleanup_leftovers
from slime_async.utils.procs import Child, group_alive, wait_until
from tests.support.standins import alive, await_watchdog, role, start_driver, supervisor_watchdog
from tests.support.standins import env as env


def _start_driver(env, tmp_path):
    _script, record, run_dir = env
    driver, pidfile = start_driver(env, tmp_path)
    wait_until(lambda: run_dir.ready_file("learner").exists(), 60, "learner ready", child=driver)
    starts = [x.split() for x in record.read_text().splitlines() if x.startswith("start")]
    pids = {name: int(pid) for _s, name, pid in starts}
    return driver, pids, int(pidfile.read_text())


def test_sigkill_of_the_supervisor_leaves_no_orphan_and_one_owner_at_a_time(env, tmp_path):
    _script, _record, run_dir = env
    driver, pids, grandchild = _start_driver(env, tmp_path)
    try:
        recorded = json.loads(run_dir.children_json.read_text())
        assert {n: v[0] for n, v in recorded.items()} == pids
        # A second owner is refused while the first lives, naming its pid.
        with pytest.raises(RunDirBusy, match=f"live supervisor \\(pid {driver.pid}\\)"):
            RunDir(run_dir.path).lock()
        with pytest.raises(RunDirBusy):
            Supervisor(RunDir(run_dir.path), [[role(env, "x")]]).run()
        watchdog = supervisor_watchdog(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)  # the supervisor alone: no chance to stop anything
        driver.proc.wait(10)
        # The roles die with it; the grandchild that ignores SIGTERM goes too (watchdog).
        orphans = [*pids.values(), grandchild]
        await_watchdog(watchdog, lambda: not any(map(alive, orphans)), "orphans to be gone")
        for name, pid in pids.items():
            assert not group_alive(pid), f"{name}'s group survived"
        assert "watchdog: the supervisor died" in run_dir.log("supervisor").read_text()
        # The directory is free again: a new owner takes it and finds nothing left to stop.
        again = RunDir(run_dir.path)
        again.lock()
        assert cleanup_leftovers(again, 1.0) == []
        again.unlock()
    finally:
        driver.stop(5)


def test_a_new_owner_stops_what_a_dead_one_left(env, tmp_path):
    """Leftovers the watchdog could not stop (it was killed too): `run --resume` stops them."""
    script, record, run_dir = env
    leftover = Child(
        "left",
        [
            sys.executable,
            str(script),
            "--name",
            "left",
            "--record",
            str(record),
            "--ignore-term",
            "--no-ready",
        ],
    )
    try:
        run_dir.write_children({"buffer": (leftover.pid, leftover.started_at)})
        owner = RunDir(run_dir.path)
        owner.lock()
        assert cleanup_leftovers(owner, 0.5) == [leftover.pid]
        assert not alive(leftover.pid)
        assert run_dir.read_children() == {}
        owner.unlock()
    finally:
        leftover.stop(1)


DYING_OWNER = """
import fcntl, json, os, subprocess, sys, time
import psutil
from slime_async.utils.procs import WATCHDOG_CLEAN_STOP, python_module
run, clean = sys.argv[1], sys.argv[2] == "clean"
lock = os.open(f"{run}/supervisor.lock", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(lock, f"{os.getpid()}\\n".encode(), 0)
left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        start_new_session=True)
started = psutil.Process(left.pid).create_time()
json.dump({"buffer": [left.pid, started]}, open(f"{run}/children.json", "w"))
read, write = os.pipe()
dog = subprocess.Popen(python_module("slime_async.utils.procs", str(read),
                                     f"{run}/supervisor.lock", f"{run}/children.json", "0.5"),
                       pass_fds=(read,), start_new_session=True)
os.close(read)
print(left.pid, dog.pid, flush=True)
sys.stdin.readline()  # the test says when: the watchdog is running
if clean:
    os.write(write, WATCHDOG_CLEAN_STOP)
os.close(write)  # EOF, with the lock still held: as when a dying process's files go one by one
try:
    dog.wait(3)  # the old watchdog gave up at once, seeing the lock held
except subprocess.TimeoutExpired:
    pass
print("exiting", dog.poll(), flush=True)
os._exit(0)  # the lock goes with us
"""


@pytest.mark.parametrize("clean", [False, True])
def test_watchdog_waits_for_the_lock_of_a_dying_supervisor(tmp_path, clean):
    """Found under load: a SIGKILLed supervisor's pipe reached EOF while its lock was
    still held for a moment; the watchdog saw the lock held, took it for a new owner and left
    everything running. It now waits for a lock still held by its own (dying) parent, and a
    supervisor that stops cleanly says so, so the watchdog exits at once and stops nothing."""
    import subprocess

    script = tmp_path / "owner.py"
    script.write_text(DYING_OWNER)
    owner = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "clean" if clean else "died"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    left = dog = None
    try:
        left, dog = map(int, owner.stdout.readline().split())
        # Readiness: the watchdog is blocked reading its pipe (the kernel's wait channel).
        wchan = Path(f"/proc/{dog}/wchan")
        wait_until(lambda: "pipe" in wchan.read_text(), 60, "the watchdog to wait on its pipe")
        owner.stdin.write("go\n")
        owner.stdin.flush()
        said = owner.stdout.readline().split()
        owner.wait(30)
        wait_until(lambda: not alive(dog), 60, "the watchdog to finish")
        if clean:
            assert said == ["exiting", "0"]  # it exited while the lock was still held
            assert alive(left)  # a clean supervisor stops its children itself
        else:
            assert said == ["exiting", "None"]  # it waited for the lock
            wait_until(lambda: not alive(left), 30, "the leftover to be stopped")
            assert json.loads((tmp_path / "children.json").read_text()) == {}
    finally:
        owner.kill()
        for pid in (left, dog):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
