"""`[run]`: the whole job as `slime-async run` starts it: on this machine (`launcher = "local"`)
or on a Ray cluster (`launcher = "ray"`, placed by the rules of `[run.ray]`)."""

from typing import Literal

from pydantic import Field, model_validator

from slime_async.config.base import Section


class RayConfig(Section):
    """`[run.ray]`: where the Ray launcher places each role (slime_async/launch/ray/).

    One placement group holds a bundle per process: each engine (gpus_per_engine GPUs), each
    learner rank (gpus_per_learner_rank GPUs), and one CPU bundle per buffer, router and
    generator. A node rule names a custom resource that the nodes meant for those roles declare
    (`ray start --resources='{"engine": 8}'`); each bundle asks for a sliver of it."""

    address: str | None = None
    """Ray cluster to join (`ray.init(address=...)`); None: $RAY_ADDRESS, else "auto" (the cluster
    `ray start` made on this node)."""
    namespace: str = "slime_async"
    """Ray namespace of the run's named actors (`<run name>/<role>`)."""
    engine_nodes: str | None = None
    """Custom resource that marks engine nodes; None: any node with free GPUs."""
    learner_nodes: str | None = None
    """Custom resource that marks the learner's nodes (its ranks are packed there); None: any."""
    cpu_nodes: str | None = "head"
    """Where the buffer, the router and the generators run: "head" (the node of `ray start
    --head`, where `slime-async run` gathers the logs), a custom resource name, or None (any)."""
    gpus_per_engine: int = Field(1, ge=0)
    """GPUs of one engine (its TP group); 0 for engines on CPU."""
    gpus_per_learner_rank: int = Field(1, ge=0, le=1)
    """GPUs of one learner rank (one, as under torchrun; 0 for a CPU learner)."""
    cpus_per_role: float = Field(1.0, gt=0)
    """CPUs each bundle reserves (every engine, learner rank, buffer, router, generator)."""
    strategy: Literal["PACK", "SPREAD"] = "PACK"
    """Placement-group strategy across the nodes the rules allow."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for the placement group once the resources were found to exist."""
    engine_command: list[str] = []
    """Command template of each engine instead of the embedded engine, e.g. ["python", "-m",
    "sglang.launch_server", "--model-path", "{model_path}", "--host", "{host}", "--port",
    "{port}", "--tp-size", "{gpus}"]; fields: {python} {config} {host} {port} {gpus} {index}
    {seed} {model_path}. The node's GPUs come from the bundle (CUDA_VISIBLE_DEVICES)."""
    sync_interval_s: float = Field(1.0, gt=0)
    """How often logs, metrics and ready files of nodes without the head's run directory (no
    shared file system) are copied into it."""


class RunConfig(Section):
    name: str = "run"
    """Name of the run (the run directory is <runs_dir>/<name>-<timestamp> unless run_dir is set)."""
    runs_dir: str = "runs"
    """Parent directory of run directories."""
    run_dir: str | None = None
    """Exact run directory (overrides runs_dir/name); `slime-async run` writes the one it uses here."""
    mode: Literal["async", "sync"] = "async"
    """async: generation and training overlap; sync: generate a batch, train, push, repeat (forces buffer.max_staleness=0, push.interval=1)."""
    prepare: str | None = None
    """Function `package.module:fn(cfg)` that `slime-async run` calls first (build datasets, base model)."""
    seed: int = 0
    """Seed of every role whose own `seed` is unset (engine sampler, dataset order, learner init,
    evaluation samplers): runs of one seed share all of them (a sweep's paired design)."""
    trackers: list[Literal["wandb", "tensorboard"]] = ["wandb"]
    """Where every role's metrics go besides `metrics/<role>.jsonl`: one wandb run and/or one
    TensorBoard directory (`<run_dir>/tensorboard`, needs `pip install
    'slime_async[tensorboard]'`) per job, on one x axis (the policy version), continued by
    `run --resume`. The supervisor forwards the records, so roles started without it (by
    hand, on a cluster) write the JSONL files only."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode of the "wandb" tracker; offline writes under the run dir (`wandb sync` uploads
    it later); disabled: no wandb even where `trackers` lists it, and wandb is never imported."""
    wandb_project: str = "slime-async"
    """wandb project of the job's run (the run name is the run directory's name)."""
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
    fork_server: bool = True
    """Local launcher: start the roles by forking one process that has imported torch,
    transformers and megatron-core once (a tiny CPU run then takes about half the CPU), on a
    machine where no GPU is visible; elsewhere, for a command other than `python -m
    slime_async ...` (torchrun, the router) and for a role whose environment differs in a
    variable read at import, a fresh interpreter. The supervisor's log says how each started."""
    launcher: Literal["local", "ray"] = "local"
    """local: every role a child process of this machine; ray: every role a Ray actor on an
    existing Ray cluster, placed by `[run.ray]` (needs `pip install 'slime_async[ray]'`)."""
    ray: RayConfig = RayConfig()
    """Placement on a Ray cluster (`launcher = "ray"` only)."""

    @model_validator(mode="after")
    def _unique_trackers(self) -> "RunConfig":
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"run.trackers = {self.trackers}: name each tracker once")
        return self

    @model_validator(mode="after")
    def _launcher_keys(self) -> "RunConfig":
        # Values, not fields_set: config.json (what every child reads) spells out every default.
        default = RayConfig()
        set_ray = [
            f"run.ray.{k}"
            for k in RayConfig.model_fields
            if getattr(self.ray, k) != getattr(default, k)
        ]
        if self.launcher == "local" and set_ray:
            raise ValueError(
                f"{', '.join(set_ray)} set but run.launcher = 'local' (they place roles on a Ray "
                "cluster): set run.launcher = 'ray' or drop them"
            )
        if self.launcher == "ray":
            local_only = [
                k for k in ("engine_cuda_devices", "learner_cuda_devices") if getattr(self, k)
            ]
            if local_only:
                keys = ", ".join(f"run.{k}" for k in local_only)
                raise ValueError(
                    f"{keys} set but run.launcher = 'ray': Ray gives each engine and learner "
                    "rank its GPUs from its placement bundle (run.ray.gpus_per_engine, "
                    "run.ray.gpus_per_learner_rank); drop them"
                )
        return self
