"""The Megatron-core learner: per-token log-probs, the training step, checkpoints, HF export.

Runs in every rank of a torchrun job (or alone: then it starts a one-process group on
127.0.0.1). Tensor parallelism shards the model inside a TP group, which must get identical
data; data parallelism splits the groups of a step across TP groups, and gradients are summed
over data-parallel ranks after the micro-batches of a step, so the ranks may run different
numbers of micro-batches. It binds nothing itself: torch.distributed rendezvous is torchrun's
(MASTER_ADDR/MASTER_PORT) or a free loopback port. Memory is bounded by the model, its
optimizer state (fp32 moments, and fp32 masters for bf16), one micro-batch of at most
`learner.micro_batch_tokens` padded tokens, and one weight-export bucket.

    learner = Learner(cfg.learner, cfg.algo, temperature=cfg.generator.sampling.temperature)
    metrics = learner.train_step(groups)          # [TrainGroup]: one optimizer step, version += 1
    for bucket in learner.export_hf_buckets(256 << 20): ...   # HF names; rank 0 only
    learner.save_checkpoint(dir, extra={"cursor": ...})

The algorithm is a loss and an advantage estimator looked up in `slime_async.algos`.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import slime_async.metrics.names as M
from slime_async import megatron_compat
from slime_async.actors.learner import checkpoint as learner_ckpt
from slime_async.actors.learner.batch import (
    MicroBatch,
    Row,
    TrainGroup,
    check_ids,
    check_trajectory,
    collate,
    gather_response,
    plan_micro_batches,
    rows_from_groups,
    vocab_parallel_logprobs,
)
from slime_async.actors.learner.optim import MasterAdamW, lr_at
from slime_async.algos import AdvantageInput, LossInput, build_algorithm
from slime_async.algos.metrics import finalize_metrics, merge_metrics
from slime_async.config.algo import AlgoConfig
from slime_async.config.learner import LearnerConfig
from slime_async.models import convert
from slime_async.models.megatron import ModelArch, build_gpt_model
from slime_async.utils.procs import free_port

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


class Learner:
    """One rank of the learner. All ranks construct it and call the same methods in step."""

    def __init__(self, learner_cfg: LearnerConfig, algo_cfg: AlgoConfig, temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {temperature})")
        self.cfg = learner_cfg
        self.algo_cfg = algo_cfg
        self.temperature = float(temperature)
        # Plug-ins first: a wrong name or a broken function fails before any process group.
        self.algo = build_algorithm(algo_cfg)
        if learner_cfg.load is None and learner_cfg.model_path is None:
            raise ValueError(
                "learner: set learner.model_path (HF dir) or learner.load (checkpoint)"
            )

        self._owns_dist, self._owns_mp = self._init_distributed(learner_cfg.tensor_parallel)
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
        self.device = megatron_compat.device()
        self.dtype = getattr(torch, cfg.dtype)
        self.step = 0
        self.version = 0
        self.loaded_extra: dict[str, Any] = {}

        if cfg.load is not None:
            common = learner_ckpt.read_common(cfg.load)
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
        self.model = build_gpt_model(self.arch, self.dtype, init=False, on_cpu=on_cpu)
        if cfg.load is None:
            convert.load_hf_into_model(self.model, cfg.model_path, self.arch)
        self.optimizer = MasterAdamW(self.model, cfg)
        self.ref_model = None
        if cfg.load is not None:
            self.load_checkpoint(cfg.load)
        if self.algo.needs_ref_logp:
            # The reference is the starting policy: model_path's weights when given, else the checkpoint's.
            self.ref_model = build_gpt_model(self.arch, self.dtype, init=False, on_cpu=on_cpu)
            if cfg.model_path is not None:
                convert.load_hf_into_model(self.ref_model, cfg.model_path, self.arch)
            else:
                self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False)
        self.model.train()

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _init_distributed(tp: int) -> tuple[bool, bool]:
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
        if world % tp:
            if owns_dist:
                dist.destroy_process_group()
            raise ValueError(f"world size {world} is not divisible by learner.tensor_parallel={tp}")
        owns_mp = False
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            owns_mp = True
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

    # ------------------------------------------------------------------ forward

    def _forward(
        self, model, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs [B, T] (and entropy [B, T]) at self.temperature."""
        s = mb.input_ids.shape[1]
        logits = model(mb.input_ids, mb.position_ids, megatron_compat.causal_mask(s, self.device))
        logp, ent = vocab_parallel_logprobs(logits, mb.labels, self.temperature, with_entropy)
        logp = gather_response(logp, mb)
        return logp, (gather_response(ent, mb) if ent is not None else None)

    @torch.no_grad()
    def compute_logprobs(
        self, sequences: list[list[int]], with_entropy: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """For each sequence, log p(seq[t+1] | seq[:t+1]) [L-1] (and entropy [L-1]), fp32 on CPU."""
        rows = [Row(np.asarray(s, dtype=np.int64), prompt_len=1) for s in sequences]
        out: list[Any] = [None] * len(rows)
        was_training = self.model.training
        self.model.eval()
        try:
            for idx in plan_micro_batches([r.input_len for r in rows], self.cfg.micro_batch_tokens):
                mb = collate(rows, idx, self.device)
                logp, ent = self._forward(self.model, mb, with_entropy)
                for j, i in enumerate(mb.rows):
                    n = rows[i].response_len
                    out[i] = (
                        logp[j, :n].float().cpu(),
                        None if ent is None else ent[j, :n].float().cpu(),
                    )
        finally:
            self.model.train(was_training)
        return out

    # ------------------------------------------------------------------ training

    def _check_same_data_in_tp_group(self, rows: list[Row]) -> None:
        """TP ranks compute one model together: they must hold the same rows."""
        if dist.get_world_size(self.tp_group) == 1:
            return
        lengths = np.array([len(r.tokens) for r in rows], dtype=np.float64)
        fingerprint = sum(
            float(r.tokens.astype(np.float64) @ np.arange(1, len(r.tokens) + 1)) for r in rows
        )
        # Collectives run on the model's device: NCCL has no CPU tensors.
        t = torch.tensor(
            [len(rows), lengths.sum(), fingerprint], dtype=torch.float64, device=self.device
        )
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.tp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.tp_group)
        if not torch.equal(lo, hi):
            raise ValueError(
                "tensor-parallel ranks of one data-parallel rank were given different data: "
                "every TP rank must receive the same groups"
            )

    def _run_step(
        self, rows: list[Row], loss_of: LossFn, extra_metrics: dict[str, float]
    ) -> dict[str, float]:
        """Micro-batches, forward/backward, DP gradient SUM, clip, optimizer step, version += 1."""
        t0 = time.perf_counter()
        self._check_same_data_in_tp_group(rows)
        local = torch.tensor(
            [
                float(sum(r.per_token["loss_mask"].sum() for r in rows)),
                float(len(rows)),
                float(sum(len(r.tokens) for r in rows)),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(local, group=self.dp_group)
        token_den, seq_den, total_tokens = local.tolist()
        self._denominators = (max(token_den, 1.0), max(seq_den, 1.0))

        loss_sum = 0.0
        raws: list[dict] = []
        padded = 0
        self.optimizer.zero_grad()
        need_entropy = self.algo.needs_entropy
        for idx in plan_micro_batches([r.input_len for r in rows], self.cfg.micro_batch_tokens):
            mb = collate(rows, idx, self.device)
            padded += mb.num_tokens
            logp, ent = self._forward(self.model, mb, need_entropy)
            loss, raw = loss_of(mb, logp, ent)
            loss.backward()
            loss_sum += float(loss.detach())
            raws.append(raw)
        t_fb = time.perf_counter()

        self.optimizer.reduce_gradients(self.dp_group)
        lr = lr_at(self.step, self.cfg)
        grad_norm = self.optimizer.step(lr, self.tp_group)
        self.step += 1
        self.version += 1
        t_opt = time.perf_counter()

        merged = merge_metrics(raws)
        if dist.get_world_size(self.dp_group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, merged, group=self.dp_group)
            merged = merge_metrics(gathered)
        loss_t = torch.tensor([loss_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss_t, group=self.dp_group)
        t_end = time.perf_counter()
        return {
            M.LOSS: float(loss_t),
            M.GRAD_NORM: grad_norm,
            M.LR: lr,
            M.TOKENS: token_den,
            M.SEQUENCES: seq_den,
            M.TOKENS_TOTAL: total_tokens,
            M.PADDING_FRAC: 1.0 - float(sum(r.input_len for r in rows)) / max(padded, 1),
            **extra_metrics,
            **finalize_metrics(merged),
            M.TIME_FORWARD_BACKWARD: t_fb - t0,
            M.TIME_OPTIMIZER: t_opt - t_fb,
            M.TIME_STEP: t_end - t0,
        }

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One RL optimizer step on this rank's groups; version += 1.

        Groups the algorithm filters out (e.g. DAPO's zero-variance filter) are not trained on
        and count in no denominator.
        """
        kept, advantages = self._advantages(groups)
        rows = rows_from_groups(kept, self.arch.vocab_size)
        for row, adv in zip(rows, advantages, strict=True):
            row.per_token["advantages"] = adv
        current = self.version

        def loss_of(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._forward(self.ref_model, mb, False)
            pt = mb.per_token
            out = self.algo.loss(
                LossInput(
                    logp=logp,
                    behavior_logp=pt["behavior_logp"],
                    advantages=pt["advantages"],
                    loss_mask=pt["loss_mask"],
                    versions=pt["versions"],
                    current_version=current,
                    token_denominator=self._denominators[0],
                    seq_denominator=self._denominators[1],
                    # One optimizer step per batch: the weights at the start of the step are the
                    # current ones, so the proximal forward pass equals logp.detach().
                    prox_logp=logp.detach(),
                    ref_logp=ref,
                    entropy=ent,
                )
            )
            return out.loss, out.metrics

        extra = {M.GROUPS_KEPT: float(len(kept)), M.GROUPS_GIVEN: float(len(groups))}
        return self._run_step(rows, loss_of, extra)

    def _advantages(
        self, groups: Sequence[TrainGroup]
    ) -> tuple[list[TrainGroup], list[np.ndarray]]:
        """The groups kept by the algorithm's filter, and [R] float32 advantages per trajectory.

        Groups of equal size go through the estimator together, as [G, n] (or [G, n, T]).
        """
        for g in groups:
            for t in g:
                check_trajectory(t, self.arch.vocab_size)
        by_size: dict[int, list[TrainGroup]] = {}
        for g in groups:
            by_size.setdefault(len(g), []).append(g)
        kept: list[TrainGroup] = []
        advantages: list[np.ndarray] = []
        for n, same in by_size.items():
            t_max = max(len(t.response_ids) for g in same for t in g)
            mask = torch.zeros(len(same), n, t_max)  # [G, n, T]
            for a, g in enumerate(same):
                for b, t in enumerate(g):
                    mask[a, b, : len(t.loss_mask)] = torch.from_numpy(
                        t.loss_mask.astype(np.float32)
                    )
            rewards = torch.tensor([[float(t.reward) for t in g] for g in same])  # [G, n]
            lengths = mask.sum(-1)
            keep = self.algo.keep_groups(rewards, lengths)
            if keep.numel() == 0:
                continue
            adv = self.algo.advantages(AdvantageInput(rewards[keep], lengths[keep], mask[keep]))
            if adv.dim() == 2:
                adv = adv.unsqueeze(-1).expand(-1, -1, t_max)
            for a, gi in enumerate(keep.tolist()):
                kept.append(same[gi])
                for b, t in enumerate(same[gi]):
                    advantages.append(adv[a, b, : len(t.response_ids)].detach().float().numpy())
        return kept, advantages

    def sft_step(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One supervised step: mean NLL of the target tokens over all ranks' examples."""
        rows = []
        for i, (prompt, target) in enumerate(examples):
            if len(prompt) < 1 or len(target) < 1:
                raise ValueError(f"sft example {i}: prompt and target need at least one token each")
            tokens = np.asarray(list(prompt) + list(target), dtype=np.int64)
            check_ids(tokens, self.arch.vocab_size, f"sft example {i}")
            rows.append(
                Row(tokens, len(prompt), {"loss_mask": np.ones(len(target), dtype=np.float32)})
            )

        def loss_of(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):
            mask = mb.per_token["loss_mask"]
            nll = -(logp * mask).sum()
            return nll / self._denominators[0], {
                "nll|sum": float(nll.detach()),
                "nll|n": float(mask.sum()),
            }

        return self._run_step(rows, loss_of, {})

    # ------------------------------------------------------------------ weights out

    def _gather_tp(self, local: torch.Tensor) -> list[torch.Tensor]:
        if dist.get_world_size(self.tp_group) == 1:
            return [local]
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(shards, local.contiguous(), group=self.tp_group)
        return shards

    def export_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named, HF-layout tensors in buckets of about `bucket_bytes`; every rank calls it.

        Rank 0 gets the tensors; every other rank gets an empty list for each bucket (same
        number of buckets on all ranks). Tensors may share memory with the parameters:
        consume a bucket before the next optimizer step.
        """
        tp = dist.get_world_size(self.tp_group)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for mname, param in self.model.named_parameters():
            full_bytes = param.numel() * param.element_size()
            if convert.partition_dim(mname) is not None:
                full_bytes *= tp
            if self.dp_rank == 0:
                local = param.detach()
                shards = (
                    self._gather_tp(local) if convert.partition_dim(mname) is not None else [local]
                )
                if self.is_rank0:
                    bucket.extend(convert.megatron_shards_to_hf(mname, shards, self.arch))
            size += full_bytes
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if size:
            yield bucket

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
