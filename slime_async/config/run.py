"""`[run]`: the whole job as `slime-async run` starts it on one machine."""

from typing import Literal

from pydantic import Field

from slime_async.config.base import Section


class RunConfig(Section):
    name: str = "run"
    """Name of the run (the run directory is <runs_dir>/<name>-<timestamp> unless run_dir is set)."""
    runs_dir: str = "runs"
    """Parent directory of run directories."""
    run_dir: str | None = None
    """Exact run directory (overrides runs_dir/name)."""
    mode: Literal["async", "sync"] = "async"
    """async: generation and training overlap; sync: generate a batch, train, push, repeat."""
    seed: int = 0
    """Global seed."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes under the run dir."""
    restart_failed: int = Field(0, ge=0)
    """How often a child role that dies is restarted before the run stops."""
