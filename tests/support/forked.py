"""One fork server per test process, for the processes tests start themselves (engines,
buffers, the ranks of a two-rank job): forked as `slime-async run` forks its roles on a machine
without a visible GPU (docs/running.md, slime_async/utils/forkserver.py), instead of each
importing torch, transformers and megatron-core again. Started on first use, from the test
process's main thread (it dies with that process); ended when the process exits.

`role_env()` is what such a process is given on top of the test process's environment: the
server has it too (a variable read at import must be the same on both sides), and the server
lets the variables read at run time differ (ForkServer.can_start), pytest's per-phase one
among them.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from slime_async.launch.preload import gpu_visible, modules
from slime_async.utils.forkserver import RUNTIME_ENV, ForkServer
from slime_async.utils.procs import Child, free_port
from tests.support.repo import pythonpath_with_repo

_server: list[ForkServer | None] = []


def role_env(**extra: str) -> dict[str, str]:
    """One thread for libraries that read it at load; the checkout importable (`tests.*`)."""
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_with_repo(), **extra}


def fork_server() -> ForkServer | None:
    """This process's fork server (None where a GPU is visible: processes then start fresh)."""
    if not _server:
        if gpu_visible() is not None:
            _server.append(None)
        else:
            server = ForkServer(
                modules(),
                env={**os.environ, "PYTHONUNBUFFERED": "1", **role_env()},
                runtime_env=RUNTIME_ENV | {"PYTEST_CURRENT_TEST"},
            ).start()
            atexit.register(server.close)
            _server.append(server)
    return _server[0]


def start_ranks(script: str, args: list[str], n: int, log: Path) -> list[Child]:
    """`python script args` as `n` ranks of one torch.distributed job on loopback (the variables
    torchrun sets that the code reads: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), each
    in its own process group, all appending to `log`."""
    port = str(free_port())
    return [
        Child(
            f"rank{r}-{Path(script).stem}",
            [sys.executable, script, *args],
            log_path=log,
            env=role_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            fork_server=fork_server(),
        )
        for r in range(n)
    ]
