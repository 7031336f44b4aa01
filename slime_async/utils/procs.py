"""Child processes: started in their own process group, waited on by readiness, stopped by PID.

Used by `slime-async run` and by the tests. Nothing here kills by name.

A child started with `die_with_parent` gets SIGKILL from the kernel when its parent dies (Linux
PR_SET_PDEATHSIG, set in the child before it runs its program). That reaches the child alone, not
what it started in its process group: `kill_groups` stops whole groups by id, for a watchdog or a
successor that finds them left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from slime_async.utils.forkserver import ForkedProcess, ForkServer, ForkServerError, die_with

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICKED: set[int] = set()  # handed out by this process: never twice


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to binds on port 0."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port that is free now on `host`, for a process that binds it later.

    Picked at random outside the kernel's ephemeral range: a port from that range (what binding
    port 0 gives) can be taken by any outgoing connection on the machine before the child that
    was promised it binds it ("address already in use"). Ports already handed out by this
    process are not handed out again. Falls back to the OS's choice if nothing else is free.
    The port must also be free on the wildcard address: a process elsewhere on the machine that
    holds it on another address (a TCPStore listens on all of them) would make the bind fail.
    """
    low, high = _ephemeral_range()
    candidates = [r for r in ((20000, low - 1), (high + 1, 65535)) if r[0] <= r[1]]
    rng = random.SystemRandom()
    for _ in range(attempts if candidates else 0):
        start, end = rng.choice(candidates)
        port = rng.randint(start, end)
        if port in _PICKED:
            continue
        if not _bindable(host, port) or not _bindable("0.0.0.0", port):
            continue
        _PICKED.add(port)
        return port
    for _ in range(attempts):  # no room outside the range (or none free): the OS's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _PICKED:
            break
    _PICKED.add(port)
    return port


def _bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind host:port now (bound and closed at once, never listening)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Child:
    """One child process in a new session (its own process group), output to a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        die_with_parent: bool = False,
        fork_server: ForkServer | None = None,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path) if log_path else None
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self._log = None
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.started_by = "exec"
        """"fork" (from `fork_server`), "exec" (a fresh interpreter), or "exec (why the fork
        server did not start it)"."""
        if fork_server is not None:
            self._fork(fork_server, full_env, cwd, die_with_parent)
        if self.proc is None:
            self._popen(full_env, cwd, die_with_parent)
        self.started_at = start_time(self.pid)
        """The kernel's start time of the child (with the pid, it names the process uniquely)."""

    def _fork(self, server: ForkServer, env, cwd, die_with_parent: bool) -> None:
        why = server.failure or server.can_start(self.argv, env)
        if why is None:
            try:
                self.proc = server.spawn(self.argv, env, cwd, self.log_path, die_with_parent)
                self.started_by = "fork"
                return
            except ForkServerError as e:
                why = str(e)
        self.started_by = f"exec ({why})"

    def _popen(self, env, cwd, die_with_parent: bool) -> None:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        out = self._log
        self.proc = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=die_with(os.getpid())
            if die_with_parent and sys.platform == "linux"
            else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the child's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL after `timeout`; return the exit code."""
        if self.alive():
            deadline = time.monotonic() + timeout
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
            # The leader may exit while processes it started in its group ignore SIGTERM.
            while group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.signal(signal.SIGKILL)
            self.proc.wait(5)
        else:
            # The leader is gone; make sure nothing it started lingers in its group.
            self.signal(signal.SIGKILL)
        # SIGKILL is delivered asynchronously: return only once the group is really gone.
        gone_by = time.monotonic() + 5
        while group_alive(self.proc.pid) and time.monotonic() < gone_by:
            time.sleep(0.02)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process group at once (crash tests)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(5)

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of the child's log (for error messages)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def start_time(pid: int) -> float:
    """The kernel's start time of process `pid` (now, if it is already gone)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return time.time()


def group_alive(pgid: int) -> bool:
    """True while process group `pgid` holds a live (not zombie) process."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # kill(0) also succeeds on zombies that nobody reaps (pid 1 of a container may not): look.
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def group_members(pgid: int, started_at: float) -> list[psutil.Process]:
    """Live processes of process group `pgid` started no earlier than `started_at` (its leader's
    start time: an older process with a reused id is not one of them)."""
    members = []
    for p in psutil.process_iter(["status", "create_time"]):
        try:
            if (
                os.getpgid(p.pid) == pgid
                and p.info["status"] != psutil.STATUS_ZOMBIE
                and p.info["create_time"] >= started_at - 0.01
            ):
                members.append(p)
        except (OSError, psutil.Error):
            continue
    return members


def kill_groups(groups: Mapping[int, float], grace_s: float) -> list[int]:
    """Stop process groups {pgid: leader start time}: SIGTERM, then SIGKILL after `grace_s`.
    Returns the pids that were alive. Used for what a dead supervisor left behind."""
    found = {g: group_members(g, t) for g, t in groups.items()}
    pids = sorted(p.pid for ps in found.values() for p in ps)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for ps in found.values():
            for p in ps:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            found = {g: [p for p in ps if _running(p)] for g, ps in found.items()}
            if not any(found.values()):
                return pids
            time.sleep(0.05)
    return pids


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.05,
    child: Child | None = None,
) -> None:
    """Poll `predicate` until true; fail early if `child` exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # readiness probes fail until the service is up
            pass
        if child is not None and not child.alive():
            tail = child.tail()
            raise RuntimeError(
                f"{child.name} (pid {child.pid}) exited with {child.poll()} while waiting "
                f"for {what}"
                + (f"; last lines of {child.log_path}:\n{tail}" if tail else " (its log is empty)")
            )
        if time.monotonic() > deadline:
            extra = f"\n{child.tail()}" if child is not None else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def tcp_ready(host: str, port: int) -> bool:
    """True when something accepts TCP connections at host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


WATCHDOG_CLEAN_STOP = b"q"
"""What a supervisor writes to its watchdog's pipe before closing it when it stops cleanly."""


def watch_parent(fd: int, lock_path: str, children_path: str, grace_s: float) -> None:
    """A supervisor's watchdog (its own process, this module's `__main__`: light to start): wait
    for EOF on pipe `fd`; if the supervisor said it stopped cleanly (`WATCHDOG_CLEAN_STOP`),
    exit; else it died: unless a new owner holds `lock_path`, stop the process groups recorded
    in `children_path` ({role: [pid, start time]}) and record none.

    A dying process releases its files one by one: the pipe's EOF can arrive while its lock is
    still held for a moment (seen under load). So a lock still held by the dead
    supervisor (its pid is in the file) is waited for, bounded; a lock held by anyone else (a
    new owner) means there is nothing to do."""
    parent = os.getppid()
    clean = False
    with contextlib.suppress(OSError):
        while data := os.read(fd, 1):
            clean = clean or data == WATCHDOG_CLEAN_STOP
    if clean:
        return
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + 30.0
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(lock, 200, 0).decode(errors="replace").strip()
            if holder == str(parent) and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            os.close(lock)
            return
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"watchdog {os.getpid()}\n".encode(), 0)
    try:
        left = json.loads(Path(children_path).read_text())
    except (OSError, ValueError):
        left = {}
    pids = kill_groups({int(v[0]): float(v[1]) for v in left.values()}, grace_s)
    tmp = Path(children_path + ".tmp")
    tmp.write_text("{}")
    os.replace(tmp, children_path)
    if pids:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{stamp} watchdog: the supervisor died; stopped what it left: pids {pids}", flush=True
        )
    os.close(lock)


if __name__ == "__main__":
    watch_parent(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]))
