"""A fork server: one process imports the heavy modules once, then forks each role from itself.

Why: on a CPU machine a role's start-up is mostly imports. A tiny run's engine, learner,
generator and buffer each import torch, and the engine and learner also transformers and
megatron-core. Forked from a process that has imported them (and moved what the imports made
out of the garbage collector's sight, `gc.freeze`), a role starts with them in memory
(copy-on-write) and runs its own code at once.

Protocol (JSON lines). The server is `python -m slime_async.utils.forkserver MODULE...`; it
imports each MODULE (a name, or `package.module:function` to call after the import; a list it
returns names what it left out), then writes `{"ready": ...}` on its stdout (what it imported,
what failed and why, its CPU time). The client then writes one request per line on its stdin:
`{"id", "argv", "env", "cwd", "log", "die_with_parent"}`; the server forks and answers
`{"id", "pid"}` (or `{"id", "error"}`), and `{"exit": pid, "code": c}` when that child ends
(`Popen.returncode`'s convention: -N for a signal). EOF on its stdin (the client is gone)
ends the server.

A forked child behaves as `python -m MODULE ARGS` (or `python SCRIPT.py ARGS`) would: a new
session (own process group), stdin from /dev/null, stdout and stderr appended to its log, the
request's environment and working directory, `sys.argv` and `sys.path[0]` as python sets them,
the signal dispositions the server started with, and the module run as `__main__` and ended
by the normal end of an interpreter (its exit code, atexit handlers, non-daemon threads
joined). The request's environment may differ from the server's only in variables read at run
time, not at import (`RUNTIME_ENV`); `ForkServer.can_start` sends anything else to a fresh
interpreter instead.

Where it is used: `slime-async run` on a machine without a visible GPU (`run.fork_server`):
a process that has imported torch must not have initialised CUDA before a fork, and the
imports of transformers and megatron-core are not audited for that. Native thread pools
started by an import are fork-safe ones (OpenBLAS registers fork handlers); Python threads
would not be: the server refuses to fork if any exists after its imports (`"threads"` in
its ready line) and the client starts every role directly then, saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

RUNTIME_ENV_PREFIXES = ("SLIME_ASYNC_",)
RUNTIME_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises, never in the server
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    }
)
"""Variables a request may set differently from the server: read at run time, not at import."""

_PR_SET_PDEATHSIG = 1
_START_CWD = os.getcwd()
"""This process's working directory when it started (what `-m` put first on sys.path)."""


def die_with(parent: int) -> Callable[[], None]:
    """A preexec function: SIGKILL this process when `parent` dies (Linux only). libc is loaded
    here, in the parent: between fork and exec the child only makes the one call."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


# ----- the server ----------------------------------------------------------------------------


def _preload(specs: Sequence[str]) -> dict[str, Any]:
    imported, failed = [], {}
    t0 = time.process_time()
    gc.disable()  # imports allocate much and free little: collections would find nothing
    for spec in specs:
        name, _, func = spec.partition(":")
        try:
            mod = importlib.import_module(name)
            left_out = getattr(mod, func)() if func else None
            imported.append(spec)
            if isinstance(left_out, list) and left_out:  # what a function could not import
                failed[spec] = f"left out {left_out}"
        except Exception as e:  # a role that needs it fails in its own process, with its log
            failed[spec] = f"{type(e).__name__}: {e}"
    # What the imports made lives as long as every child: out of the collector's sight, so that
    # a child's collections neither walk it nor copy its pages (gc.freeze's purpose).
    gc.collect()
    gc.freeze()
    return {
        "ready": True,
        "imported": imported,
        "failed": failed,
        "threads": threading.active_count(),
        "cpu_s": round(time.process_time() - t0, 2),
    }


def _send(fd: int, msg: dict[str, Any]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def serve(specs: Sequence[str]) -> dict[str, Any] | None:
    """The server loop; returns a request only in a forked child (which then runs it), None
    when the client is gone. Single-threaded: it forks from this thread alone."""
    # What the child restores: the dispositions this process started with, as exec left them
    # (an ignored signal stays ignored, as it would across the client's own exec of a role).
    initial = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGCHLD)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops it; Ctrl-C is its to handle
    # The answers go out on a copy of stdout; stdout itself goes to the log (stderr), so that
    # what an import prints cannot garble them.
    out = os.dup(1)
    os.dup2(2, 1)
    ready = _preload(specs)
    _send(out, ready)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    me = os.getpid()
    buf = b""
    while True:
        _reap(out)
        try:
            readable, _, _ = select.select([0, wake_r], [], [], 1.0)
        except InterruptedError:
            continue
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if ready["threads"] != 1:
                _send(
                    out, {"id": req["id"], "error": f"{ready['threads']} Python threads: no fork"}
                )
                continue
            try:
                pid = os.fork()
            except OSError as e:
                _send(out, {"id": req["id"], "error": f"fork: {e}"})
                continue
            if pid == 0:
                _become_child(req, me, (wake_r, wake_w), initial)
                return req
            _send(out, {"id": req["id"], "pid": pid})


def _reap(out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_child(
    req: dict[str, Any], server_pid: int, wake: tuple[int, int], signals: dict[int, Any]
) -> None:
    """In the forked child, before it runs the request: what Popen + exec would have given."""
    os.setsid()
    gc.enable()
    if req.get("die_with_parent") and sys.platform == "linux":
        die_with(server_pid)()
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    for sig, disposition in signals.items():
        signal.signal(sig, disposition)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if req.get("log"):
        Path(req["log"]).parent.mkdir(parents=True, exist_ok=True)
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    else:
        out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.closerange(3, _max_fd())
    if req.get("cwd"):
        os.chdir(req["cwd"])
    if sys.path and sys.path[0] == _START_CWD:  # what this process's own `-m` put first
        argv = req["argv"]
        # `-m`: the working directory; a script: its folder, links resolved
        sys.path[0] = os.getcwd() if argv[1] == "-m" else os.path.dirname(os.path.realpath(argv[1]))
    os.environ.clear()
    os.environ.update(req["env"])
    if "numpy.random" in sys.modules:  # its global state was seeded once, in the server
        sys.modules["numpy.random"].seed()
    _set_title(req["argv"])


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 4096


def _set_title(argv: Sequence[str]) -> None:
    """`ps` shows the role's command line where setproctitle is installed (it comes with Ray)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(argv))


def run_request(req: dict[str, Any]) -> None:
    """Run `-m MODULE ARGS` or `SCRIPT ARGS` as `python` does; its exceptions and SystemExit end
    this process."""
    import runpy

    _python, first, *rest = req["argv"]
    if first == "-m":
        module, *args = rest
        sys.argv = ["-m", *args]  # run_module puts the module's file in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [first, *rest]
        runpy.run_path(os.path.abspath(first), run_name="__main__")  # python's __file__


# ----- the client ----------------------------------------------------------------------------


class ForkServerError(RuntimeError):
    """The fork server could not start a process (the caller starts it directly instead)."""


class ForkServer:
    """A running fork server and the processes it started (see the module docstring).

    `start()` returns at once; the first `spawn` waits for the server's imports. Thread-safe:
    a reader thread takes the server's answers."""

    def __init__(
        self,
        preload: Sequence[str],
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        runtime_env: Collection[str] = RUNTIME_ENV,
        packages: Collection[str] | None = None,
    ):
        self.preload = list(preload)
        self.packages = None if packages is None else tuple(packages)
        """The packages whose modules it starts (None: any `python -m` module)."""
        self.log_path = Path(log_path) if log_path else None
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.ready_timeout_s = ready_timeout_s
        self.runtime_env = frozenset(runtime_env)
        """Variables a request may set differently (with those starting `RUNTIME_ENV_PREFIXES`)."""
        self.proc: subprocess.Popen | None = None
        self.ready: dict[str, Any] | None = None
        self.failure: str | None = None
        """Why the server is unusable (it died, or its imports left threads); None while usable."""
        self._cond = threading.Condition()
        self._write = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._reader: threading.Thread | None = None

    def start(self) -> ForkServer:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slime_async.utils.forkserver", *self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with(os.getpid()) if sys.platform == "linux" else None,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # not an answer (the server's answers are JSON lines)
                continue
            with self._cond:
                if "ready" in msg:
                    self.ready = msg
                    if msg["threads"] != 1:
                        self.failure = f"its imports left {msg['threads']} Python threads"
                elif "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                else:
                    self._answers[msg["id"]] = msg
                self._cond.notify_all()
        code = self.proc.wait()
        with self._cond:
            self.failure = self.failure or f"the fork server exited with code {code}"
            self._cond.notify_all()

    def can_start(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """None if `argv` with `env` can be forked from the server, else why not."""
        module = len(argv) >= 3 and argv[1] == "-m"
        script = len(argv) >= 2 and argv[1].endswith(".py") and not argv[1].startswith("-")
        if argv[0] != sys.executable or not (module or script):
            return f"not `{sys.executable} -m MODULE` or `{sys.executable} SCRIPT.py`"
        if self.packages is not None and not (module and argv[2].split(".")[0] in self.packages):
            return f"{argv[1 + module]} is not a module of {', '.join(self.packages)}"
        for key in set(env) ^ set(self.env) | {k for k in env if env[k] != self.env.get(k)}:
            if key not in self.runtime_env and not key.startswith(RUNTIME_ENV_PREFIXES):
                return f"its environment sets {key} differently (read at import)"
        return None

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | Path | None = None,
        log_path: str | Path | None = None,
        die_with_parent: bool = False,
    ) -> ForkedProcess:
        """Fork `argv` (`python -m MODULE ...` or `python SCRIPT.py ...`) from the server;
        ForkServerError if it cannot."""
        if self.proc is None or self.proc.stdin is None:
            raise ForkServerError("the fork server was not started")
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.ready is not None or self.failure, self.ready_timeout_s
            )
            if not ok:
                raise ForkServerError(
                    f"the fork server's imports took over {self.ready_timeout_s:.0f} s"
                )
            if self.failure:
                raise ForkServerError(self.failure)
            self._next_id += 1
            rid = self._next_id
        req = {
            "id": rid,
            "argv": list(argv),
            "env": dict(env),
            "cwd": str(cwd) if cwd else None,
            "log": str(log_path) if log_path else None,
            "die_with_parent": die_with_parent,
        }
        try:
            with self._write:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
        except OSError as e:
            raise ForkServerError(f"the fork server is gone ({e})") from e
        with self._cond:
            self._cond.wait_for(lambda: rid in self._answers or self.failure, 30.0)
            answer = self._answers.pop(rid, None)
            if answer is None:
                raise ForkServerError(self.failure or "no answer from the fork server in 30 s")
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return ForkedProcess(self, answer["pid"])

    def _exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self.failure and not _alive(pid):
                # The server (its parent) is gone, and with it the exit status.
                return -signal.SIGKILL
            return None

    def _wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                code = self._exit_code(pid)
                if code is not None:
                    return code
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # After the server's death an orphan's end is seen by polling its pid.
                self._cond.wait(0.05 if self.failure else left)

    def close(self, timeout: float = 10.0) -> int | None:
        """End the server (its children stay: stop them first); returns its exit code."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ForkedProcess:
    """A process the fork server started: the part of `subprocess.Popen` that `Child` uses."""

    def __init__(self, server: ForkServer, pid: int):
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server._wait_exit(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired([f"pid {self.pid}"], timeout or 0)
        return self.returncode


if __name__ == "__main__":
    request = serve(sys.argv[1:])
    if request is not None:
        del request["env"]  # already in os.environ
        run_request(request)
