"""The checkout the tests run from: its root, found from this file, not from a fixed depth."""

from __future__ import annotations

import os
from pathlib import Path


def find_root(start: Path) -> Path:
    """The nearest folder at or above `start` that holds pyproject.toml."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml at or above {start}")


REPO = find_root(Path(__file__).resolve().parent)


def pythonpath_with_repo() -> str:
    """PYTHONPATH for a child that imports `tests.*`: one started as a script (a torchrun worker)
    has the script's folder on sys.path, not the checkout's root."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def torchrun_two_ranks(script: str, args: list[str], log_dir: Path, what: str, timeout: float):
    """`script args` as two ranks of one gloo job on loopback, each in a process group of its
    own, stopped before returning; fails with the job's log tail unless both exit 0 within
    `timeout` (`what` names the wait), and stops the other rank as soon as one fails. Its log is
    `log_dir / "log.txt"`. The ranks are forked (tests/support/forked.py) with the variables
    torchrun would set; where a GPU is visible, torchrun starts them."""
    from slime_async.utils.procs import Child, free_port, python_module, wait_until
    from tests.support.forked import fork_server, role_env, start_ranks

    log = log_dir / "log.txt"
    if fork_server() is not None:
        ranks = start_ranks(script, args, 2, log)
    else:
        argv = python_module(
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            script,
            *args,
        )
        ranks = [Child(f"torchrun-{Path(script).stem}", argv, log_path=log, env=role_env())]
    try:
        wait_until(
            lambda: (
                all(r.poll() is not None for r in ranks)
                or any(r.poll() not in (None, 0) for r in ranks)
            ),
            timeout,
            what,
        )
        codes = [r.poll() for r in ranks]
        assert codes == [0] * len(ranks), f"exit codes {codes}:\n{ranks[0].tail(60)}"
    finally:
        for r in ranks:
            r.stop()
