"""The run directory: where `slime-async run` keeps everything of one run.

    <run_dir>/config.json          the resolved config every role starts from (run.run_dir set)
    <run_dir>/logs/<role>.log      stdout+stderr of each child; logs/supervisor.log: its events
    <run_dir>/metrics/<role>.jsonl one record per step (slime_async/metrics.py)
    <run_dir>/ready/<role>         written by a role once it serves (see `announce_ready`)
    <run_dir>/checkpoints/         the learner's checkpoints unless learner.save says otherwise
    <run_dir>/supervisor.lock      flock()ed by the live supervisor: one owner per run directory
    <run_dir>/children.json        the owner's live children {role: [pid, start time]}: what a
                                   successor stops if the owner died without stopping them
    <run_dir>/buffer_final.json    the buffer's accounting when it stopped (after the generators)

Relative paths in the config are placed by one rule (`slime_async/config/paths.py`); readiness
files follow `slime_async/utils/readiness.py`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from slime_async.config.paths import CHECKPOINTS_DIR, written_path
from slime_async.utils.readiness import READY_ENV, announce_ready

__all__ = ["READY_ENV", "RunDir", "RunDirBusy", "announce_ready"]


class RunDirBusy(RuntimeError):
    """Another live process owns the run directory (its supervisor holds the lock)."""


class RunDir:
    """Paths inside one run directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self._lock_fd: int | None = None

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

    # ----- one owner ------------------------------------------------------------------------
    @property
    def lock_file(self) -> Path:
        return self.path / "supervisor.lock"

    @property
    def children_json(self) -> Path:
        return self.path / "children.json"

    def lock(self, wait_s: float = 0.0) -> None:
        """Become the directory's one owner: an exclusive flock on `supervisor.lock`, held until
        `unlock` or this process's death (the kernel releases it, even after SIGKILL).
        RunDirBusy when a live process holds it; a dead owner's watchdog, busy stopping what
        that owner left, is waited for up to `wait_s`."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                if owner.startswith("watchdog") and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                os.close(fd)
                what = owner if owner.startswith("watchdog") else f"a live supervisor (pid {owner})"
                raise RunDirBusy(
                    f"{self.path} is owned by {what}; stop it first (SIGTERM) or wait for it to end"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def write_children(self, children: dict[str, tuple[int, float]]) -> None:
        """Record the owner's live children (atomically: a crash leaves the old or the new)."""
        tmp = self.children_json.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: list(v) for n, v in children.items()}))
        os.replace(tmp, self.children_json)

    def read_children(self) -> dict[str, tuple[int, float]]:
        try:
            raw = json.loads(self.children_json.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return {n: (int(v[0]), float(v[1])) for n, v in raw.items()}

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
        return self.path / CHECKPOINTS_DIR

    def log(self, role: str) -> Path:
        return self.logs_dir / f"{role}.log"

    def ready_file(self, role: str) -> Path:
        return self.ready_dir / role

    def under(self, path: str | Path) -> Path:
        """A path the run writes, by the config's one rule (`slime_async/config/paths.py`)."""
        return written_path(self.path, path)
