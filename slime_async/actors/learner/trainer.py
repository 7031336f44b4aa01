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
`Learner` builds the model and its components (`ParallelLayout`, `MicroBatches`, `Updates`,
`PPOStep`: README.md says who owns what) and holds them; none of them refers back to it. HF
export and checkpoints are its own; `process.py` is the process-facing loop.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import slime_async.metrics.names as M
from slime_async import megatron_compat
from slime_async.actors.learner import checkpoint as learner_ckpt
from slime_async.actors.learner import export as learner_export
from slime_async.actors.learner import hf_export
from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.microbatches import MicroBatches
from slime_async.actors.learner.optim import MasterAdamW, lr_at
from slime_async.actors.learner.options import (
    resolve_cuda_graphs,
    resolve_logprob_kernel,
    resolve_speed_options,
    resolve_swiglu_kernel,
)
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.actors.learner.ppo_step import PPOStep, interpolated_prox_logp
from slime_async.actors.learner.stale_tokens import StaleTokens
from slime_async.actors.learner.stop_ban import StopBan
from slime_async.actors.learner.updates import Updates, nll_loss, sft_rows
from slime_async.algos import build_algorithm
from slime_async.config.algo import AlgoConfig
from slime_async.config.learner import LearnerConfig
from slime_async.models import convert, fused_ops
from slime_async.models.arch import ModelArch
from slime_async.models.megatron import build_gpt_model
from slime_async.queue.lineage import Line

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")

__all__ = ["Learner", "interpolated_prox_logp"]


class Learner:
    """One rank of the learner. All ranks construct it and call the same methods in step."""

    def __init__(
        self,
        learner_cfg: LearnerConfig,
        algo_cfg: AlgoConfig,
        temperature: float = 1.0,
        *,
        max_staleness: int | None = None,
        stale_policy: str = "keep",
        stop_ban: StopBan | None = None,
        version_per_batch: bool = False,
    ):
        """`temperature`: the run's sampling temperature, for trajectories that record none.
        `max_staleness` / `stale_policy`: the buffer's bound and what to do with tokens beyond it
        ("mask" zeroes their loss mask; "drop" and "keep" train on them; None: not checked).
        `stop_ban`: the engines' min_new_tokens rule, so the learner scores the first tokens of
        each turn with the stop ids left out, as they were sampled (`stop_ban.py`).
        `version_per_batch`: every batch makes a version, also one whose updates were all skipped
        (its weights are the previous version's; buffer.fixed_lag needs one version a batch)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {temperature})")
        if stale_policy not in ("drop", "mask", "keep"):
            raise ValueError(f"stale_policy must be drop, mask or keep (got {stale_policy!r})")
        self.cfg = learner_cfg
        self.algo_cfg = algo_cfg
        self.temperature = float(temperature)
        self.stop_ban = stop_ban if stop_ban is not None and stop_ban.active else None
        self.version_per_batch = version_per_batch
        # Plug-ins first: a wrong name or a broken function fails before any process group.
        # The learner resolves pi_prox itself (forward pass or interpolation, it knows the
        # weights' versions) and hands it to the loss as prox_logp, which the loss then uses as is.
        self.algo = build_algorithm(algo_cfg.model_copy(update={"prox_source": "forward"}))
        if learner_cfg.load is None and learner_cfg.model_path is None:
            raise ValueError(
                "learner: set learner.model_path (HF dir) or learner.load (checkpoint)"
            )

        self.parallel = ParallelLayout(learner_cfg.tensor_parallel, learner_cfg.expert_parallel)
        try:
            self._build(max_staleness, stale_policy)
        except BaseException:
            self.close()
            raise

    def _build(self, max_staleness: int | None, stale_policy: str) -> None:
        cfg, p = self.cfg, self.parallel
        # What callers outside read of the layout (the process loop, tests, benchmarks).
        self.rank, self.is_rank0, self.device = p.rank, p.is_rank0, p.device
        self.tp_group, self.dp_group, self.dp_rank = p.tp_group, p.dp_group, p.dp_rank
        self.ep_group, self.expert_dp_group = p.ep_group, p.expert_dp_group
        dtype = getattr(torch, cfg.dtype)
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
            self.tokenizer_dir: Path | None = learner_ckpt.tokenizer_dir(cfg.load)
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
        attention, pack_min_padding, optimizer_kind = resolve_speed_options(
            cfg, self.arch, p.tp_size, on_cpu
        )
        self.cuda_graphs = resolve_cuda_graphs(
            cfg, self.arch, p.tp_size, on_cpu, attention, optimizer_kind, dp=p.dp_size
        )
        if self.cuda_graphs:
            # This thread's CUDA work on a stream of the learner's own from here on, before the
            # model and megatron's DDP exist: a parameter's gradient accumulator belongs to the
            # stream it was made on, and a capture may not make the legacy default stream wait
            # (graphs.py). A stream of torch's pool does not order with the legacy default
            # stream: the learner's work, exports and pushes run on this thread, and each step
            # ends in host syncs on this stream.
            self._outer_stream = torch.cuda.current_stream()
            torch.cuda.set_stream(torch.cuda.Stream(p.device))
        self.microbatches = mb = MicroBatches(
            p,
            self.arch,
            micro_batch_tokens=cfg.micro_batch_tokens,
            pack_min_padding=pack_min_padding,
            attention=attention,
            logprob_kernel=resolve_logprob_kernel(cfg, on_cpu),
            logprob_chunk_tokens=cfg.logprob_chunk_tokens,
            routing_replay=cfg.routing_replay,
            temperature=self.temperature,
            stop_ids=self.stop_ban.stop_ids if self.stop_ban else (),
        )
        # The resolved speed options, as callers outside read them.
        self.attention, self.pack, self.pack_min_padding = (
            mb.attention,
            mb.pack,
            mb.pack_min_padding,
        )
        self.logprob_kernel = mb.logprob_kernel
        moe = {
            "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
            "moe_z_loss_coeff": cfg.moe_z_loss_coeff,
            "moe_experts": cfg.moe_experts,
            "routing_replay": cfg.routing_replay,
            "attention": self.attention,
        }
        # The compiled layer ops where asked for and usable here (their check runs once).
        ops = (
            fused_ops.compiled(torch.cuda.current_device())
            if cfg.torch_compile == "auto" and not on_cpu
            else None
        )
        self.compiled_ops = ops is not None
        self.swiglu_kernel = resolve_swiglu_kernel(cfg, on_cpu, ops)
        # The policy and (below) the reference model: one architecture, the same layer ops.
        build = functools.partial(
            build_gpt_model,
            self.arch,
            dtype,
            init=False,
            on_cpu=on_cpu,
            compiled_ops=self.compiled_ops,
            triton_swiglu=self.swiglu_kernel == "triton",
            **moe,
        )
        # Under megatron's DDP the layers add their weight gradients into its fp32 buffers.
        self.model = build(recompute=cfg.recompute, wgrad_fusion=optimizer_kind == "megatron")
        if cfg.load is None:
            convert.load_hf_into_model(self.model, cfg.model_path, self.arch)
        # Training micro-batches run through megatron's DDP wrapper (its gradient hooks) or
        # through the model itself.
        if optimizer_kind == "megatron":
            from slime_async.actors.learner.megatron_optim import MegatronOptim

            optimizer: Any = MegatronOptim(self.model, cfg)
            train_model = optimizer.ddp
        else:
            optimizer, train_model = MasterAdamW(self.model, cfg), self.model
        if self.cuda_graphs:
            mb.use_graphs(train_model, cfg.cuda_graph_shapes)
        self.updates = Updates(
            p,
            self.microbatches,
            optimizer,
            train_model,
            optimizer_kind=optimizer_kind,
            lr_at=lambda step: lr_at(step, cfg),
            with_entropy=self.algo.needs_entropy,
            ess_scaled_lr=self.algo.ess_scaled_lr,
            version_per_batch=self.version_per_batch,
        )
        if self.is_rank0:
            log.info(
                "learner: attention %s, %s micro-batches, optimizer %s, recompute %s, log-probs %s, "
                "layer ops %s, CUDA graphs %s",
                self.attention,
                "padded"
                if not self.pack
                else "packed"
                if not self.pack_min_padding
                else f"packed from {self.pack_min_padding:.0%} padding on",
                optimizer_kind,
                cfg.recompute,
                self.logprob_kernel,
                f"compiled (SwiGLU {self.swiglu_kernel})" if self.compiled_ops else "eager",
                "on" if self.cuda_graphs else "off",
            )
        self.ref_model = None
        if cfg.load is not None:
            self.load_checkpoint(cfg.load)
        if self.algo.needs_ref_logp:
            # The reference is the initial policy: model_path's weights when given, else the
            # checkpoint's, which is then a step-0 one (a converted model; checked above).
            self.ref_model = build()
            if cfg.model_path is not None:
                convert.load_hf_into_model(self.ref_model, cfg.model_path, self.arch)
            else:
                self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False)
        self.ppo = PPOStep(
            p,
            self.microbatches,
            self.updates,
            self.algo,
            self.model,
            self.ref_model,
            self.arch,
            interpolate=self.algo_cfg.prox_source == "interpolate",
            prox_compare_interval=cfg.prox_compare_interval,
            mini_batches=self.algo_cfg.mini_batches,
            ppo_epochs=self.algo_cfg.ppo_epochs,
            routing_replay=cfg.routing_replay,
            temperature=self.temperature,
            stale=StaleTokens(p, max_staleness, stale_policy),
            token_record_interval=cfg.token_record_interval,
            stop_ban=self.stop_ban,
        )
        self.model.train()

    def close(self) -> None:
        """Tear down what this learner initialised (model parallel state, process group, the
        CUDA stream of its graphs)."""
        outer = self.__dict__.pop("_outer_stream", None)
        if outer is not None:
            torch.cuda.current_stream().synchronize()
            torch.cuda.set_stream(outer)
        self.parallel.close()

    # ------------------------------------------------------------------ the updates' state

    @property
    def step(self) -> int:
        """Optimizer steps taken (batches trained on)."""
        return self.updates.step

    @step.setter
    def step(self, value: int) -> None:
        self.updates.step = value

    @property
    def version(self) -> int:
        """The policy version of the weights (the process loop may move it up to the buffer's)."""
        return self.updates.version

    @version.setter
    def version(self, value: int) -> None:
        self.updates.version = value

    @property
    def line(self) -> Line:
        """The run's line of weights, which staleness is counted along (`queue/lineage.py`)."""
        return self.ppo.stale.line

    @line.setter
    def line(self, value: Line) -> None:
        self.ppo.stale.line = value

    @property
    def optimizer(self) -> Any:
        """`MasterAdamW` or `MegatronOptim` (`optimizer_kind` "master_adamw" or "megatron")."""
        return self.updates.optimizer

    @property
    def optimizer_kind(self) -> str:
        return self.updates.optimizer_kind

    @property
    def train_model(self) -> torch.nn.Module:
        """What training micro-batches run through: megatron's DDP wrapper or the model."""
        return self.updates.train_model

    # ------------------------------------------------------------------ steps and log-probs

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One RL batch: `algo.ppo_epochs` x `algo.mini_batches` optimizer updates; version += 1.

        pi_prox is the policy at the start of the batch (a no-grad forward pass before the first
        update), or AReaL's log-linear interpolation (`algo.prox_source = "interpolate"`).
        Groups the algorithm filters out (e.g. DAPO's zero-variance filter) are not trained on
        and count in no denominator. See `ppo_step.py`.
        """
        return self._with_compile_fallbacks(self.ppo.train_step(groups))

    def _with_compile_fallbacks(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.compiled_ops:
            metrics[M.COMPILE_FALLBACKS] = float(fused_ops.fallbacks())
        return metrics

    def take_token_record(self) -> dict[str, Any] | None:
        """Rank 0: the per-token record of the RL step just trained (`token_record.py`), or
        None (another rank, or a step `learner.token_record_interval` does not record)."""
        return self.ppo.take_record()

    def sft_step(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One supervised step: mean NLL of the target tokens over all ranks' examples."""
        return self._with_compile_fallbacks(
            self.updates.run(
                sft_rows(examples, self.arch.vocab_size, self.temperature), nll_loss, {}
            )
        )

    def compute_logprobs(
        self,
        sequences: list[list[int]],
        with_entropy: bool = False,
        temperatures: Sequence[float] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """For each sequence, log p(seq[t+1] | seq[:t+1]) [L-1] (and entropy [L-1]), fp32 on CPU,
        at `temperatures[i]` (default: the learner's temperature)."""
        return self.microbatches.compute_logprobs(self.model, sequences, with_entropy, temperatures)

    # ------------------------------------------------------------------ weights out

    def export_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named, HF-layout tensors in buckets of about `bucket_bytes`; every rank calls it.

        Rank 0 gets the tensors; every other rank gets an empty list for each bucket (same
        number of buckets on all ranks). Tensors may share memory with the parameters:
        consume a bucket before the next optimizer step. See `export.py`.
        """
        return learner_export.hf_buckets(self.model, self.arch, self.parallel, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """A complete HF model directory (config, safetensors, tokenizer); every rank calls it.

        Written under `<out_dir>.partial` and renamed once complete (`hf_export.write_hf`)."""
        return hf_export.write_hf(
            self.model,
            self.arch,
            self.parallel,
            self.hf_config,
            self.tokenizer_dir,
            Path(out_dir),
            self.cfg.dtype,
        )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None, *, hf: bool = False
    ) -> Path:
        """Model, optimizer, step, version, RNG and `extra` (plain data) into `ckpt_dir`; with
        `hf`, also a complete HF export of the weights in its `hf/` (before it is complete)."""
        common = {
            "step": self.step,
            "version": self.version,
            "extra": dict(extra or {}),
            "arch": self.arch.to_dict(),
            "hf_config": self.hf_config,
            "algo_state": self.algo.state_dict(),
        }
        return learner_ckpt.save(
            ckpt_dir,
            self.model,
            self.optimizer,
            common,
            self.tokenizer_dir,
            write_hf=self.save_hf if hf else None,
        )

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
