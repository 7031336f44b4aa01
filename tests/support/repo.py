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
    """`script args` under torchrun with two ranks on loopback, in a process group of its own
    stopped before returning; fails with the job's log tail unless it exits 0 within `timeout`
    (`what` names the wait). Its log is `log_dir / "log.txt"`."""
    from slime_async.utils.procs import Child, free_port, python_module, wait_until

    argv = python_module(
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        script,
        *args,
    )
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_with_repo()}
    child = Child(f"torchrun-{Path(script).stem}", argv, log_path=log_dir / "log.txt", env=env)
    try:
        wait_until(lambda: child.poll() is not None, timeout, what)
        assert child.poll() == 0, child.tail(60)
    finally:
        child.stop()
