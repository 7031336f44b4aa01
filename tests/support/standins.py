"""Stand-in roles for the supervisor's tests: real processes (ports, ready files, signals,
grandchildren) that wait on a file or a port, never on a sleep.

`env` (a fixture) writes the stand-in script and makes a run directory; `role(env, name, ...)` is
the RoleSpec of one stand-in; `start_driver` runs a supervisor over two of them as its own process.
`supervisor_watchdog` and `await_watchdog` find and wait out a killed supervisor's watchdog (here
and for real runs).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from slime_async.launch.run_dir import RunDir
from slime_async.launch.supervisor import RoleSpec, ready_file_exists
from slime_async.utils.procs import Child, tcp_ready, wait_until

STANDIN = textwrap.dedent(
    """
    import argparse, os, signal, socket, subprocess, sys, time
    from slime_async.launch.run_dir import announce_ready

    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--record", required=True)       # appends "start/stop <name> ..." lines
    p.add_argument("--port", type=int)              # listen here (ready = port open)
    p.add_argument("--no-ready", action="store_true")
    p.add_argument("--exit-when")                   # exit once this path exists (::text) ...
    p.add_argument("--exit-code", type=int, default=0)  # ... with this code
    p.add_argument("--fail-first", action="store_true")  # only when started without --resumed
    p.add_argument("--resumed", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--grandchild")                  # spawn one that ignores SIGTERM; pid file
    p.add_argument("--touch-on-exit")               # create this file when exiting by itself
    a = p.parse_args()

    def record(text):
        with open(a.record, "a") as f:
            f.write(f"{text} {a.name} {os.getpid()}\\n")

    def on_term(signum, frame):
        record("stop")
        sys.exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if a.ignore_term else on_term)
    record("start-resumed" if a.resumed else "start")
    if a.grandchild:
        g = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
            "while True: time.sleep(0.05)"])
        open(a.grandchild, "w").write(str(g.pid))
    if a.port:
        sock = socket.socket(); sock.bind(("127.0.0.1", a.port)); sock.listen()
    elif not a.no_ready:
        announce_ready(a.name)
    print(f"{a.name} is up", flush=True)
    while True:
        path, _, text = (a.exit_when or "").partition("::")  # "file" or "file::text in it"
        if (path and os.path.exists(path) and (not text or text in open(path).read())
                and (a.resumed is False or not a.fail_first)):
            print(f"{a.name}: boom, exiting with {a.exit_code}", flush=True)
            record("exit")
            if a.touch_on_exit:
                open(a.touch_on_exit, "w").close()
            sys.exit(a.exit_code)
        time.sleep(0.02)
    """
)


@pytest.fixture()
def env(tmp_path: Path) -> tuple[Path, Path, RunDir]:
    """(the stand-in script, the record file every stand-in appends to, a fresh run directory)."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    record = tmp_path / "record.txt"
    record.touch()
    run_dir = RunDir.create(tmp_path, "t", tmp_path / "run")
    return script, record, run_dir


def role(
    env: tuple[Path, Path, RunDir],
    name: str,
    *args: str,
    on_exit_0: str = "failure",
    ready=None,
    resume_flag: bool = False,
) -> RoleSpec:
    """One stand-in role; ready once its `--port` listens, or else once it wrote its ready file."""
    script, record, _run_dir = env
    port = None
    if "--port" in args:
        port = int(args[args.index("--port") + 1])

    def argv(resume):
        extra = ["--resumed"] if (resume and resume_flag) else []
        return [sys.executable, str(script), "--name", name, "--record", str(record), *args, *extra]

    if ready is None:
        ready = (lambda _p: tcp_ready("127.0.0.1", port)) if port else ready_file_exists
    return RoleSpec(
        name=name, argv=argv, ready=ready, ready_what="port or file", on_exit_0=on_exit_0
    )


DRIVER = textwrap.dedent(
    """
    import sys
    from slime_async.launch.run_dir import RunDir
    from slime_async.launch.supervisor import RoleSpec, Supervisor, ready_file_exists

    script, record, run_dir, pidfile = sys.argv[1:5]
    def spec(name, *extra, on_exit_0="failure"):
        argv = [sys.executable, script, "--name", name, "--record", record, *extra]
        return RoleSpec(name, lambda resume: argv, ready_file_exists, on_exit_0=on_exit_0)
    stages = [[spec("buffer", "--ignore-term", "--grandchild", pidfile)],
              [spec("learner", on_exit_0="ends_run")]]
    sys.exit(Supervisor(RunDir(run_dir), stages, stop_grace_s=1.0, poll_interval_s=0.05).run())
    """
)


def start_driver(env: tuple[Path, Path, RunDir], tmp_path: Path) -> tuple[Child, Path]:
    """DRIVER as a supervisor process over `env`'s roles; its pid file of the grandchild."""
    script, record, run_dir = env
    driver_py = tmp_path / "driver.py"
    driver_py.write_text(DRIVER)
    pidfile = tmp_path / "grandchild.pid"
    driver = Child(
        "supervisor",
        [sys.executable, str(driver_py), str(script), str(record), str(run_dir.path), str(pidfile)],
        log_path=tmp_path / "driver.log",
    )
    return driver, pidfile


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def supervisor_watchdog(supervisor_pid: int) -> psutil.Process:
    """The supervisor's watchdog: its child that runs `slime_async.utils.procs`."""
    found = [
        c
        for c in psutil.Process(supervisor_pid).children()
        if "slime_async.utils.procs" in c.cmdline()
    ]
    assert len(found) == 1, found
    return found[0]


def await_watchdog(watchdog: psutil.Process, gone: Callable[[], bool], what: str) -> None:
    """Readiness, not timing: the watchdog exits once it has stopped what the dead supervisor
    left (SIGTERM, then SIGKILL); after that only the kernel's delivery of SIGKILL remains."""
    # Its own waits are bounded (grace, then 5 s); 300 s only bounds a hang. Not psutil's wait():
    # once its parent is dead it may stay a zombie nobody reaps (pid 1 of a container).
    wait_until(lambda: not alive(watchdog.pid), 300, "the watchdog to finish")
    wait_until(gone, 30, what)
