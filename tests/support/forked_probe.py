"""A role stand-in for the fork server's tests: run as `python -m tests.support.forked_probe`,
it writes what a started process can observe of how it was started (one JSON line on stdout),
then ends as its first argument says. Started both ways, the two lines must agree.

    python -m tests.support.forked_probe exit:3      # SystemExit(3)
    python -m tests.support.forked_probe raise       # an uncaught exception: exit 1
    python -m tests.support.forked_probe wait:PATH   # wait until PATH exists (never a sleep)
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import stat
import sys
import threading

import numpy as np

THREAD = None


def start_thread() -> None:
    """A preload that leaves a Python thread behind (the server must then refuse to fork)."""
    global THREAD
    THREAD = threading.Thread(target=threading.Event().wait, daemon=True)
    THREAD.start()


def chatty() -> None:
    """A preload that prints on stdout (the server's answers must not be garbled by it)."""
    print("an import that talks", flush=True)


def _handler(sig: int) -> str:
    h = signal.getsignal(sig)
    return {
        signal.SIG_DFL: "default",
        signal.SIG_IGN: "ignore",
        signal.default_int_handler: "KeyboardInterrupt",
    }.get(h, repr(h))


def observed() -> dict:
    devnull = os.stat(os.devnull)
    stdin = os.fstat(0)
    return {
        "name": __name__,
        "argv0": os.path.basename(sys.argv[0]),
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "probe_env": os.environ.get("SLIME_ASYNC_PROBE"),
        "own_session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "stdin_devnull": stat.S_ISCHR(stdin.st_mode) and stdin.st_rdev == devnull.st_rdev,
        "gc": gc.isenabled(),
        "signals": {
            s.name: _handler(s)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGCHLD)
        },
        "threads": threading.active_count(),
        "main_spec": getattr(sys.modules["__main__"].__spec__, "name", None),
        "main_file": sys.modules["__main__"].__file__,
        "numpy_draw": float(np.random.random()),
    }


def main() -> None:
    facts = observed()
    print(json.dumps(facts), flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    done = threading.Event()

    def late() -> None:  # a non-daemon thread: the interpreter joins it before exiting
        done.wait()
        print("thread joined", flush=True)

    threading.Thread(target=late).start()
    what, _, arg = (sys.argv[1] if len(sys.argv) > 1 else "exit:0").partition(":")
    done.set()
    if what == "exit":
        sys.exit(int(arg))
    if what == "raise":
        raise RuntimeError("the probe raised")
    if what == "wait":
        import time

        while not os.path.exists(arg):
            time.sleep(0.01)


if __name__ == "__main__":
    main()
