"""The run directory and the readiness convention between `slime-async run` and its roles.

    <run_dir>/config.json          the resolved config every role starts from (run.run_dir set)
    <run_dir>/logs/<role>.log      stdout+stderr of each child; logs/supervisor.log: its events
    <run_dir>/metrics/<role>.jsonl one record per step (slime_async/metrics.py)
    <run_dir>/ready/<role>         written by a role once it serves (see `announce_ready`)
    <run_dir>/checkpoints/         the learner's checkpoints unless learner.save says otherwise

Readiness: the supervisor sets the environment variable `SLIME_ASYNC_READY_FILE` for each child
it starts, and deletes that file before every (re)start. A role without a port to probe (the
learner, the generators) calls `announce_ready()` once it can do its work; outside a supervised
run the variable is unset and the call does nothing. Under torchrun every rank inherits the
variable: call it on rank 0 after a barrier so the file means all ranks are ready.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

READY_ENV = "SLIME_ASYNC_READY_FILE"


def announce_ready(detail: str = "") -> Path | None:
    """Tell the supervisor this process is ready (writes the file named by $SLIME_ASYNC_READY_FILE)."""
    target = os.environ.get(READY_ENV)
    if not target:
        return None
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"pid {os.getpid()} time {time.time():.3f} {detail}".rstrip() + "\n")
    os.replace(tmp, path)  # the supervisor never sees a half-written file
    return path


class RunDir:
    """Paths inside one run directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    @classmethod
    def create(cls, runs_dir: str | Path, name: str, run_dir: str | Path | None = None) -> RunDir:
        """A new run directory: `run_dir` if given, else `<runs_dir>/<name>-<YYYYmmdd-HHMMSS>`.

        Refuses a directory that already holds a run (that is what `--resume` is for)."""
        if run_dir is not None:
            rd = cls(run_dir)
            if rd.config_json.exists():
                raise FileExistsError(
                    f"{rd.path} already holds a run (config.json); use --resume {rd.path} "
                    "to continue it or choose another run.run_dir"
                )
            rd.path.mkdir(parents=True, exist_ok=True)
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            base = Path(runs_dir) / f"{name}-{stamp}"
            candidate, n = base, 0
            while True:  # two runs started in the same second get -1, -2, ...
                try:
                    candidate.mkdir(parents=True, exist_ok=False)
                    break
                except FileExistsError:
                    n += 1
                    candidate = base.with_name(f"{base.name}-{n}")
            rd = cls(candidate)
        for sub in (rd.logs_dir, rd.metrics_dir, rd.ready_dir):
            sub.mkdir(parents=True, exist_ok=True)
        return rd

    @classmethod
    def existing(cls, path: str | Path) -> RunDir:
        """A run directory to resume; it must hold the config.json of an earlier run."""
        rd = cls(path)
        if not rd.config_json.is_file():
            raise FileNotFoundError(
                f"{rd.path}: no config.json here, not a run directory to resume"
            )
        for sub in (rd.logs_dir, rd.metrics_dir, rd.ready_dir):
            sub.mkdir(parents=True, exist_ok=True)
        return rd

    @property
    def config_json(self) -> Path:
        return self.path / "config.json"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def metrics_dir(self) -> Path:
        return self.path / "metrics"

    @property
    def ready_dir(self) -> Path:
        return self.path / "ready"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def log(self, role: str) -> Path:
        return self.logs_dir / f"{role}.log"

    def ready_file(self, role: str) -> Path:
        return self.ready_dir / role

    def under(self, path: str | Path) -> Path:
        """`path` if absolute, else relative to the run directory (config paths like wal_dir)."""
        p = Path(path)
        return p if p.is_absolute() else self.path / p
