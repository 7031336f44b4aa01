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
    """Exact run directory (overrides runs_dir/name); `slime-async run` writes the one it uses here."""
    mode: Literal["async", "sync"] = "async"
    """async: generation and training overlap; sync: generate a batch, train, push, repeat (forces buffer.max_staleness=0, learner.push_interval=1)."""
    prepare: str | None = None
    """Function `package.module:fn(cfg)` that `slime-async run` calls first (build datasets, base model)."""
    seed: int = 0
    """Seed of every role whose own `seed` is unset (engine sampler, dataset order, learner init)."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes under the run dir, disabled never imports wandb."""
    wandb_project: str = "slime-async"
    """wandb project of every role's metrics (the run name is the run directory's name)."""
    restart_failed: int = Field(2, ge=0)
    """How often each child role that dies is restarted (resuming its state: the learner from its
    checkpoint, an engine rejoining the weight group) before the whole run stops; 0: never."""
    num_generators: int = Field(1, ge=1)
    """Generator processes `slime-async run` starts (producer ids gen0, gen1, ...)."""
    learner_cuda_devices: str | None = None
    """CUDA_VISIBLE_DEVICES of the learner's processes (e.g. "1" or "4,5,6,7"); None: inherit."""
    engine_cuda_devices: list[str] = []
    """CUDA_VISIBLE_DEVICES of each embedded engine, in order (e.g. ["0"]); empty: inherit."""
    learner_procs: int = Field(1, ge=1)
    """Learner processes (one per GPU); more than 1 starts the learner under torchrun."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one role to become ready (model loading included)."""
    stop_grace_s: float = Field(20.0, gt=0)
    """Time a child has to exit after SIGTERM before its process group gets SIGKILL."""
    poll_interval_s: float = Field(0.2, gt=0)
    """How often the supervisor checks its children and the learner's metrics."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Terminal display: rich bar on a TTY and plain lines otherwise (auto), or forced."""
