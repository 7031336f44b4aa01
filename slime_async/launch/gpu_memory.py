"""One GPU shared by the learner and an embedded engine: which engines do, and what they keep free.

    shares = gpu_shares(cfg, estimate_learner_memory(cfg))   # [GpuShare(engine, gpu, learner)]
    shares[0].note()              # the line `slime-async run` prints
    plan_roles(cfg, run_dir, gpu_reserve={s.engine: reserve_gib(s) for s in shares ...})

On one GPU the learner and the engine run as two processes. The engine starts first and sizes its
paged KV cache from the memory it sees; left to itself (`engine.embedded.mem_fraction`) it takes
what the learner will need at its first training step, and the learner dies out of memory. So
`slime-async run` estimates the learner's peak (`slime_async/models/memory.py`) and hands it to
every embedded engine that shares a GPU with a learner rank as `engine.embedded.gpu_reserve_gib`;
the engine keeps that much free and sizes its cache from the rest, or refuses to start with the
numbers when one request of `max_context_len` does not fit.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slime_async.config import ConfigError, SlimeConfig


class Estimate(Protocol):
    """What is read of the learner's estimate (`slime_async.models.memory.LearnerMemory`)."""

    @property
    def total_gib(self) -> float: ...

    def describe(self) -> str: ...


def _visible(setting: str | None) -> list[str] | None:
    """The GPU ids a process sees: its CUDA_VISIBLE_DEVICES, or None (all, in order)."""
    value = setting if setting is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def _physical(visible: list[str] | None, index: int) -> str | None:
    if visible is None:
        return str(index)
    return visible[index] if index < len(visible) else None


def _gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its device files; no CUDA context is made)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _engine_index(device: str) -> int | None:
    """The visible GPU index an embedded engine's `device` takes (None: the CPU)."""
    if device == "cpu" or (device == "auto" and not _gpu_present()):
        return None
    if device.startswith("cuda:"):
        return int(device.split(":", 1)[1])
    return 0  # "cuda", and "auto" where a GPU is there


def shared_gpus(cfg: SlimeConfig) -> dict[int, str]:
    """{engine index: GPU id} of the embedded engines `slime-async run` starts on this machine
    on a GPU that a learner rank also uses (ids as CUDA_VISIBLE_DEVICES names them)."""
    if cfg.engine.kind != "embedded" or cfg.run.launcher != "local":
        return {}
    learner_visible = _visible(cfg.run.learner_cuda_devices)
    learner = {_physical(learner_visible, r) for r in range(cfg.run.learner_procs)} - {None}
    index = _engine_index(cfg.engine.embedded.device)
    if index is None or not learner:
        return {}
    out = {}
    for i in range(cfg.engine.num_engines):
        devices = cfg.run.engine_cuda_devices
        gpu = _physical(_visible(devices[i] if i < len(devices) else None), index)
        if gpu is not None and gpu in learner:
            out[i] = gpu
    return out


@dataclass(frozen=True)
class GpuShare:
    """An embedded engine on a learner's GPU, and what it keeps free for the learner."""

    engine: int
    gpu: str
    learner: Estimate | None
    """None: no estimate (no model config to read); the engine's own setting stands."""

    def note(self) -> str:
        """One line for the run's log: what the engine keeps free, and why."""
        who = f"engine{self.engine} shares GPU {self.gpu} with the learner"
        if self.learner is None:
            return (
                f"{who}; the learner's memory cannot be estimated (no config.json at "
                "learner.model_path): the engine sizes its KV cache by "
                "engine.embedded.mem_fraction alone; set engine.embedded.gpu_reserve_gib to "
                "what the learner needs"
            )
        return (
            f"{who}: it keeps {self.learner.describe()} free for the learner "
            "(engine.embedded.gpu_reserve_gib = auto) and sizes its KV cache from the rest"
        )


def gpu_shares(cfg: SlimeConfig, learner: Estimate | None) -> list[GpuShare]:
    """The engines that must leave room for the learner (its estimated peak `learner`), when
    `gpu_reserve_gib` is "auto"; several engines on the learner's GPU are refused."""
    if cfg.engine.embedded.gpu_reserve_gib != "auto":
        return []
    shared = shared_gpus(cfg)
    if not shared:
        return []
    crowded = sorted(g for g, n in Counter(shared.values()).items() if n > 1)
    if crowded:
        raise ConfigError(
            f"engine.embedded.gpu_reserve_gib = auto: several engines on GPU(s) "
            f"{', '.join(crowded)}, which the learner also uses; the first to start would take "
            "what the learner leaves: give each engine its own GPU (run.engine_cuda_devices) "
            "or size them by hand (engine.embedded.gpu_reserve_gib and mem_fraction)"
        )
    return [GpuShare(i, gpu, learner) for i, gpu in shared.items()]


def reserve_gib(share: GpuShare) -> float:
    """What the engine of `share` keeps free, rounded up to 0.1 GiB."""
    assert share.learner is not None
    return math.ceil(share.learner.total_gib * 10) / 10
