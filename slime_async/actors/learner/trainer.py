"""The Megatron-core learner: per-token log-probs, the training step, checkpoints, HF export.

Runs in every rank of a torchrun job (or alone: then it starts a one-process group on
127.0.0.1). Tensor parallelism shards the model inside a TP group, which must get identical
data; data parallelism splits the groups of a step across TP groups, and gradients are summed
over data-parallel ranks after the micro-batches of each mini-batch, so the ranks may run
different numbers of micro-batches (every rank runs every mini-batch update, empty or not). It
binds nothing itself: torch.distributed rendezvous is torchrun's (MASTER_ADDR/MASTER_PORT) or a
free loopback port. Memory is bounded by the model, its
optimizer state (fp32 moments, and fp32 masters for bf16; sharded over DP ranks with megatron's
DistributedOptimizer), one micro-batch of at most `learner.micro_batch_tokens` tokens (padded or
packed) and its activations, `learner.logprob_chunk_tokens x vocab / TP` fp32 logits at a time,
and one weight-export bucket. The speed options (attention, packing, optimizer, recomputation)
are resolved in `options.py`.

    learner = Learner(cfg.learner, cfg.algo, temperature=cfg.generator.sampling.temperature,
                      max_staleness=cfg.buffer.max_staleness, stale_policy=cfg.buffer.stale_policy)
    metrics = learner.train_step(groups)  # [TrainGroup]: ppo_epochs x mini_batches updates, version += 1
    for bucket in learner.export_hf_buckets(256 << 20): ...   # HF names; rank 0 only
    learner.save_checkpoint(dir, extra={"cursor": ...})

The algorithm is a loss and an advantage estimator looked up in `slime_async.algos`.
`Learner` is built here (model, optimizer, process groups, export, checkpoints); its parts
live by role: `ppo_step.py` (the RL step: advantages, pi_prox, the loss), `updates.py` (the
optimizer updates over mini-batches, shared with SFT), `microbatches.py` (micro-batch planning
and the forward pass to per-token log-probs); `process.py` is the process-facing loop.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime_async import megatron_compat
from slime_async.actors.learner import checkpoint as learner_ckpt
from slime_async.actors.learner import export as learner_export
from slime_async.actors.learner.microbatches import MicroBatches
from slime_async.actors.learner.optim import MasterAdamW
from slime_async.actors.learner.options import resolve_logprob_kernel, resolve_speed_options
from slime_async.actors.learner.ppo_step import PPOStep, interpolated_prox_logp
from slime_async.actors.learner.updates import Updates
from slime_async.algos import build_algorithm
from slime_async.config.algo import AlgoConfig
from slime_async.config.learner import LearnerConfig
from slime_async.models import convert
from slime_async.models.arch import ModelArch
from slime_async.models.megatron import build_gpt_model
from slime_async.utils.procs import free_port

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")

__all__ = ["Learner", "interpolated_prox_logp"]


class Learner(PPOStep, Updates, MicroBatches):
    """One rank of the learner. All ranks construct it and call the same methods in step."""

    def __init__(
        self,
        learner_cfg: LearnerConfig,
        algo_cfg: AlgoConfig,
        temperature: float = 1.0,
        *,
        max_staleness: int | None = None,
        stale_policy: str = "keep",
    ):
        """`temperature`: the run's sampling temperature, for trajectories that record none.
        `max_staleness` / `stale_policy`: the buffer's bound and what to do with tokens beyond it
        ("mask" zeroes their loss mask; "drop" and "keep" train on them; None: not checked)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {temperature})")
        if stale_policy not in ("drop", "mask", "keep"):
            raise ValueError(f"stale_policy must be drop, mask or keep (got {stale_policy!r})")
        self.cfg = learner_cfg
        self.algo_cfg = algo_cfg
        self.temperature = float(temperature)
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self._batches = 0
        # Plug-ins first: a wrong name or a broken function fails before any process group.
        # The learner resolves pi_prox itself (forward pass or interpolation, it knows the
        # weights' versions) and hands it to the loss as prox_logp, which the loss then uses as is.
        self.algo = build_algorithm(algo_cfg.model_copy(update={"prox_source": "forward"}))
        if learner_cfg.load is None and learner_cfg.model_path is None:
            raise ValueError(
                "learner: set learner.model_path (HF dir) or learner.load (checkpoint)"
            )

        self._owns_dist, self._owns_mp = self._init_distributed(
            learner_cfg.tensor_parallel, learner_cfg.expert_parallel
        )
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.expert_dp_rank = ps.get_expert_data_parallel_rank()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self._routing_counts = [0.0, 0.0]
        self.device = megatron_compat.device()
        self.dtype = getattr(torch, cfg.dtype)
        self.step = 0
        self.version = 0
        self.loaded_extra: dict[str, Any] = {}

        if cfg.load is not None:
            common = learner_ckpt.read_common(cfg.load)
            if self.algo.needs_ref_logp and cfg.model_path is None and int(common["step"]) > 0:
                # The KL reference is the initial policy; a resumed checkpoint is a trained one.
                raise ValueError(
                    f"algo.kl_coef > 0 and learner.load = {cfg.load} (a checkpoint after step "
                    f"{common['step']}) without learner.model_path: the KL reference must be "
                    "the initial model; set learner.model_path to it"
                )
            self.arch = ModelArch(**common["arch"])
            self.hf_config = common["hf_config"]
            self.tokenizer_dir: Path | None = Path(cfg.load) / "hf"
        else:
            self.arch = ModelArch.from_hf_dir(cfg.model_path)
            self.hf_config = json.loads((Path(cfg.model_path) / "config.json").read_text())
            self.tokenizer_dir = Path(cfg.model_path)

        # Every RNG of the process: torch's and megatron's for init and dropout, Python's and
        # numpy's for whatever a plug-in draws.
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        megatron_compat.seed_model_parallel(cfg.seed)
        on_cpu = megatron_compat.cpu_mode()
        self.attention, pack_min_padding, self.optimizer_kind = resolve_speed_options(
            cfg, self.arch, dist.get_world_size(self.tp_group), on_cpu
        )
        # None: never packed; else a mini-batch is packed from this share of padding on.
        self.pack_min_padding = pack_min_padding
        self.pack = pack_min_padding is not None
        self.logprob_kernel = resolve_logprob_kernel(cfg, on_cpu)
        moe = {
            "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
            "routing_replay": cfg.routing_replay,
            "attention": self.attention,
        }
        self.model = build_gpt_model(
            self.arch, self.dtype, init=False, on_cpu=on_cpu, recompute=cfg.recompute, **moe
        )
        if cfg.load is None:
            convert.load_hf_into_model(self.model, cfg.model_path, self.arch)
        # `self.train_model` is what training micro-batches run through: megatron's DDP wrapper
        # (its gradient hooks) or the model itself.
        if self.optimizer_kind == "megatron":
            from slime_async.actors.learner.megatron_optim import MegatronOptim

            self.optimizer = MegatronOptim(self.model, cfg)
            self.train_model = self.optimizer.ddp
        else:
            self.optimizer = MasterAdamW(self.model, cfg)
            self.train_model = self.model
        if self.is_rank0:
            log.info(
                "learner: attention %s, %s micro-batches, optimizer %s, recompute %s, log-probs %s",
                self.attention,
                "padded"
                if not self.pack
                else "packed"
                if not self.pack_min_padding
                else f"packed from {self.pack_min_padding:.0%} padding on",
                self.optimizer_kind,
                cfg.recompute,
                self.logprob_kernel,
            )
        self.ref_model = None
        if cfg.load is not None:
            self.load_checkpoint(cfg.load)
        if self.algo.needs_ref_logp:
            # The reference is the initial policy: model_path's weights when given, else the
            # checkpoint's, which is then a step-0 one (a converted model; checked above).
            self.ref_model = build_gpt_model(
                self.arch, self.dtype, init=False, on_cpu=on_cpu, **moe
            )
            if cfg.model_path is not None:
                convert.load_hf_into_model(self.ref_model, cfg.model_path, self.arch)
            else:
                self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False)
        self.model.train()

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _init_distributed(tp: int, ep: int = 1) -> tuple[bool, bool]:
        from megatron.core import parallel_state as ps

        megatron_compat.apply()
        owns_dist = False
        if not dist.is_initialized():
            backend = "gloo" if megatron_compat.cpu_mode() else "nccl"
            if not megatron_compat.cpu_mode():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend)  # torchrun's env:// rendezvous
            else:
                dist.init_process_group(
                    backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
                )
            owns_dist = True
        world = dist.get_world_size()
        if world % tp or world % ep:
            if owns_dist:
                dist.destroy_process_group()
            raise ValueError(
                f"world size {world} is not divisible by learner.tensor_parallel={tp} "
                f"and learner.expert_parallel={ep}"
            )
        owns_mp = False
        if not ps.model_parallel_is_initialized():
            # Experts are never TP-sharded (expert_tensor_parallel_size 1): EP ranks are carved
            # out of the data-parallel ranks, so TP x EP fits in TP x DP processes.
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
            )
            owns_mp = True
        elif ps.get_expert_model_parallel_world_size() != ep:
            raise ValueError(
                f"model parallel already initialised with EP={ps.get_expert_model_parallel_world_size()}, "
                f"learner.expert_parallel={ep}"
            )
        elif ps.get_tensor_model_parallel_world_size() != tp:
            raise ValueError(
                f"model parallel already initialised with TP={ps.get_tensor_model_parallel_world_size()}, "
                f"learner.tensor_parallel={tp}"
            )
        return owns_dist, owns_mp

    def close(self) -> None:
        """Tear down what this learner initialised (model parallel state, process group)."""
        from megatron.core import parallel_state as ps

        if self._owns_mp:
            ps.destroy_model_parallel()
            self._owns_mp = False
        if self._owns_dist and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_dist = False

    # ------------------------------------------------------------------ weights out

    def export_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named, HF-layout tensors in buckets of about `bucket_bytes`; every rank calls it.

        Rank 0 gets the tensors; every other rank gets an empty list for each bucket (same
        number of buckets on all ranks). Tensors may share memory with the parameters:
        consume a bucket before the next optimizer step. See `export.py`.
        """
        return learner_export.hf_buckets(self, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """A complete HF model directory (config, safetensors, tokenizer); every rank calls it."""
        tensors = (t for bucket in self.export_hf_buckets(1 << 30) for t in bucket)
        if not self.is_rank0:
            for _ in tensors:
                pass
            return None
        config = dict(self.hf_config)
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = self.cfg.dtype
        return convert.write_hf_dir(out_dir, tensors, config, self.tokenizer_dir)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Model, optimizer, step, version, RNG and `extra` (plain data) into `ckpt_dir`."""
        common = {
            "step": self.step,
            "version": self.version,
            "extra": dict(extra or {}),
            "arch": self.arch.to_dict(),
            "hf_config": self.hf_config,
            "algo_state": self.algo.state_dict(),
        }
        return learner_ckpt.save(ckpt_dir, self.model, self.optimizer, common, self.tokenizer_dir)

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written at any TP size; returns its `extra` dict."""
        common = learner_ckpt.load(ckpt_dir, self.model, self.optimizer)
        if ModelArch(**common["arch"]) != self.arch:
            raise ValueError(f"{ckpt_dir}: checkpoint architecture differs from the model's")
        self.step = int(common["step"])
        self.version = int(common["version"])
        self.algo.load_state_dict(common.get("algo_state", {}))
        self.loaded_extra = common["extra"]
        return self.loaded_extra
