"""Child processes: started in their own process group, waited on by readiness, stopped by PID.

Used by `slime-async run` and by the tests. Nothing here kills by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    """One child process in a new session (its own process group), output to a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path) if log_path else None
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        else:
            self._log = None
            out = None
        self.proc = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
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
