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
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
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
from slime_async.actors.learner import export as learner_export
from slime_async.actors.learner.batch import (
    MicroBatch,
    Row,
    TrainGroup,
    check_ids,
    check_trajectory,
    collate,
    collate_packed,
    plan_micro_batches,
    plan_packs,
    rows_from_groups,
)
from slime_async.actors.learner.logprobs import chunked_logprobs, hidden_output, output_weight
from slime_async.actors.learner.optim import MasterAdamW, lr_at
from slime_async.actors.learner.options import resolve_speed_options
from slime_async.algos import AdvantageInput, LossInput, build_algorithm
from slime_async.algos.metrics import finalize_metrics, merge_metrics
from slime_async.config.algo import AlgoConfig
from slime_async.config.learner import LearnerConfig
from slime_async.models import convert, routing
from slime_async.models.attention import packed_rows, set_packed
from slime_async.models.megatron import ModelArch, build_gpt_model
from slime_async.utils.procs import free_port

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]

log = logging.getLogger("slime_async.learner")


def interpolated_prox_logp(
    behavior_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """AReaL's log-linear pi_prox (`prox_logp_method = "loglinear"`), with AReaL's versions.

        log pi_prox ~ log mu + alpha * (log pi_theta - log mu),
        alpha = clamp((v_prox - v_mu) / (v_theta - v_mu), 0, 1),  0 where v_theta <= v_mu,

    with v_theta = `current_version` (AReaL passes the trained engine's version, which is the
    version of the weights at the start of the batch: the ones that generate version-v tokens)
    and v_prox = current_version - 1. So a token one version old gets pi_prox = mu, two versions
    old alpha = 1/2, k old (k - 1)/k; tokens of the current version get mu as well. All `[B, T]`.
    """
    v_mu = versions.to(logp.dtype)
    v_theta = float(current_version)
    diff = v_theta - v_mu
    alpha = torch.where(
        diff > 0, (v_theta - 1.0 - v_mu) / diff.clamp(min=1.0), torch.zeros_like(v_mu)
    )
    alpha = alpha.clamp(0.0, 1.0)
    return behavior_logp + alpha * (logp.detach() - behavior_logp)


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
        self.attention, self.pack, self.optimizer_kind = resolve_speed_options(
            cfg, self.arch, dist.get_world_size(self.tp_group), on_cpu
        )
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
                "learner: attention %s, %s micro-batches, optimizer %s, recompute %s",
                self.attention, "packed" if self.pack else "padded", self.optimizer_kind,
                cfg.recompute,
            )  # fmt: skip
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

    # ------------------------------------------------------------------ forward

    def _plan(self, rows: list[Row]) -> list[list[int]]:
        """This rank's micro-batches of `rows` as row indices: packed or padded, at most
        micro_batch_tokens each."""
        plan = plan_packs if self.pack else plan_micro_batches
        return plan([r.input_len for r in rows], self.cfg.micro_batch_tokens)

    def _micro_batches(
        self, rows: list[Row], plan: list[list[int]] | None = None
    ) -> Iterator[MicroBatch]:
        """The micro-batches of `plan` (default: `_plan(rows)`), collated on the device."""
        collate_one = collate_packed if self.pack else collate
        for idx in self._plan(rows) if plan is None else plan:
            yield collate_one(rows, idx, self.device)

    def _forward(
        self, model, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs [B, T] (and entropy [B, T]), each row at its own temperature.

        The model returns its final hidden states; only the response positions go through the
        output layer, in chunks (`logprobs.py`): no `[tokens x vocab]` fp32 logits exist."""
        ids, pos = mb.input_ids, mb.position_ids
        s = ids.shape[1]
        tp = dist.get_world_size(self.tp_group)
        if self.arch.is_moe and tp > 1 and s % tp:
            # Sequence parallelism (MoE at TP > 1) cuts the sequence into TP equal chunks:
            # right padding, which a causal mask keeps away from every real token.
            extra = tp - s % tp
            ids = torch.nn.functional.pad(ids, (0, extra))
            pos = torch.arange(s + extra, device=ids.device).expand(ids.shape[0], -1)
            s += extra
        gpt = getattr(model, "module", model)  # under megatron's DDP wrapper
        replay = mb.routed_experts is not None and self.cfg.routing_replay
        if replay:
            routed = mb.routed_experts  # [B, S0, L * k]
            b, s0, _ = routed.shape
            routed = torch.nn.functional.pad(routed, (0, 0, 0, s - s0))
            routed = routed.view(b, s, len(self.arch.moe_layers), self.arch.moe_topk)
            # A row's last response prediction sits at its input length - 1.
            lens = mb.resp_index.max(dim=1).values + 1
            per_layer, valid = routing.replay_targets(routed, lens, self.tp_rank, tp)
            routing.set_replay(gpt, per_layer, valid)
        # SDPA and TE attention are causal by construction; megatron's own needs the mask.
        mask = megatron_compat.causal_mask(s, self.device) if self.attention == "local" else None
        if mb.packed is not None:
            packing = packed_rows(gpt, mb.packed, pos)
        else:
            packing = contextlib.nullcontext()
            if self.attention == "sdpa":
                set_packed(gpt, None)  # ordinary rows (a packed batch may have run before)
        try:
            with hidden_output(gpt), packing:
                hidden = model(ids, pos, mask)  # [b, s, h]
        finally:
            if replay:
                routing.clear_replay(gpt)
        hidden = hidden[:, : mb.input_ids.shape[1]]
        valid = mb.resp_valid  # [B, T]
        where = mb.flat_index()[valid]  # [n] positions of the response predictions
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, where)
        labels = mb.labels.reshape(-1).index_select(0, where)
        if mb.temperature is None:
            temp_tok = torch.full_like(labels, self.temperature, dtype=torch.float32)
        else:  # each row at its own temperature
            temp_tok = mb.temperature[:, None].expand(valid.shape)[valid]
        lp, ent = chunked_logprobs(
            h, output_weight(gpt), labels, temp_tok, with_entropy, self.cfg.logprob_chunk_tokens
        )
        zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        logp = zeros.masked_scatter(valid, lp)
        return logp, (zeros.masked_scatter(valid, ent) if ent is not None else None)

    @torch.no_grad()
    def _rows_logprobs(self, model, rows: list[Row]) -> list[np.ndarray]:
        """[R] fp32 response log-probs of each row under `model` (no grad)."""
        out: list[Any] = [None] * len(rows)
        for mb in self._micro_batches(rows):
            logp, _ = self._forward(model, mb, False)
            for j, i in enumerate(mb.rows):
                out[i] = logp[j, : rows[i].response_len].float().cpu().numpy()
        return out

    @torch.no_grad()
    def compute_logprobs(
        self,
        sequences: list[list[int]],
        with_entropy: bool = False,
        temperatures: Sequence[float] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """For each sequence, log p(seq[t+1] | seq[:t+1]) [L-1] (and entropy [L-1]), fp32 on CPU,
        at `temperatures[i]` (default: the learner's temperature)."""
        temps = (
            list(temperatures) if temperatures is not None else [self.temperature] * len(sequences)
        )
        rows = [
            Row(np.asarray(s, dtype=np.int64), prompt_len=1, temperature=float(t))
            for s, t in zip(sequences, temps, strict=True)
        ]
        out: list[Any] = [None] * len(rows)
        was_training = self.model.training
        self.model.eval()
        try:
            for mb in self._micro_batches(rows):
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

    def _totals(self, rows: list[Row]) -> tuple[float, float, float]:
        """(loss tokens, sequences, all tokens) of `rows` summed over data-parallel ranks."""
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
        token_den, seq_den, total = local.tolist()
        return token_den, seq_den, total

    def _update(self, rows: list[Row], loss_of: LossFn, lr: float) -> dict[str, Any]:
        """One optimizer update on this rank's share `rows` of one mini-batch.

        The loss is divided by the mini-batch's totals over all its micro-batches and DP ranks,
        gradients are summed over DP ranks, clipped, and applied, unless the mini-batch is empty
        on every rank, or its gradient is zero (Adam would still move the weights by its
        momentum) or not finite: then nothing is applied and the reason is returned.
        """
        token_den, seq_den, _ = self._totals(rows)
        out: dict[str, Any] = {"raws": [], "loss": 0.0, "padded": 0, "skipped": None}
        self.optimizer.zero_grad()
        if seq_den == 0:
            out["skipped"] = "empty"
            return out
        self._denominators = (max(token_den, 1.0), max(seq_den, 1.0))
        need_entropy = self.algo.needs_entropy
        megatron = self.optimizer_kind == "megatron"
        plan = self._plan(rows)
        if megatron:
            self.optimizer.begin(len(plan))
        for mb in self._micro_batches(rows, plan):
            out["padded"] += mb.num_tokens
            sync = self.optimizer.forward_context() if megatron else contextlib.nullcontext()
            with sync:
                logp, ent = self._forward(self.train_model, mb, need_entropy)
                loss, raw = loss_of(mb, logp, ent)
                loss.backward()
            out["loss"] += float(loss.detach())
            out["raws"].append(raw)
        self.optimizer.reduce_gradients(self.dp_group, self.tp_group, self.expert_dp_group)
        norm = self.optimizer.grad_norm(self.tp_group, self.ep_group)
        out["grad_norm"] = norm
        if not math.isfinite(norm):
            out["skipped"] = "non_finite"
        elif norm == 0.0:
            out["skipped"] = "zero_gradient"
        else:
            self.optimizer.step(lr, self.tp_group, norm=norm)
        self.optimizer.zero_grad()
        return out

    def _run_step(
        self,
        rows: list[Row],
        loss_of: LossFn,
        extra_metrics: dict[str, float],
        mini_batches: int = 1,
        epochs: int = 1,
    ) -> dict[str, float]:
        """`epochs` x `mini_batches` optimizer updates on one batch; version += 1 if any applied.

        A policy version is a batch: version v + 1 is the weights after all mini-batch updates
        on the batch trained at version v (the push and the buffer's announcement follow it). A
        batch none of whose updates was applied leaves the weights, and the version, as they were.
        """
        t0 = time.perf_counter()
        self._check_same_data_in_tp_group(rows)
        token_den, seq_den, total_tokens = self._totals(rows)
        # Mini-batches of similar lengths on every rank: rows sorted by length, dealt round robin.
        order = sorted(range(len(rows)), key=lambda i: rows[i].input_len)
        parts = [[rows[i] for i in order[k::mini_batches]] for k in range(mini_batches)]
        lr = lr_at(self.step, self.cfg)
        raws: list[dict] = []
        losses: list[float] = []
        norms: list[float] = []
        padded = 0
        skipped: dict[str, int] = {}
        for _ in range(epochs):
            for part in parts:
                res = self._update(part, loss_of, lr)
                raws.extend(res["raws"])
                padded += res["padded"]
                if res["skipped"] != "empty":
                    losses.append(res["loss"])
                    norms.append(res["grad_norm"])
                if res["skipped"] is not None:
                    skipped[res["skipped"]] = skipped.get(res["skipped"], 0) + 1
        t_fb = time.perf_counter()
        updates = epochs * mini_batches - sum(skipped.values())
        self.step += 1
        if updates:
            self.version += 1
        else:
            log.warning(
                "step %d: no update applied (%s): weights and version %d unchanged",
                self.step, ", ".join(f"{k} x{v}" for k, v in sorted(skipped.items())),
                self.version,
            )  # fmt: skip
        t_opt = time.perf_counter()

        merged = merge_metrics(raws)
        if dist.get_world_size(self.dp_group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, merged, group=self.dp_group)
            merged = merge_metrics(gathered)
        loss_t = torch.tensor([sum(losses)], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss_t, group=self.dp_group)
        t_end = time.perf_counter()
        finite_norms = [n for n in norms if math.isfinite(n)]
        return {
            M.LOSS: float(loss_t) / max(len(losses), 1),
            M.GRAD_NORM: float(np.mean(finite_norms)) if finite_norms else 0.0,
            M.LR: lr,
            M.TOKENS: token_den,
            M.SEQUENCES: seq_den,
            M.TOKENS_TOTAL: total_tokens,
            M.PADDING_FRAC: 1.0 - float(sum(r.input_len for r in rows)) * epochs / max(padded, 1),
            M.UPDATES: float(updates),
            **{f"{M.SKIPPED_UPDATES}/{k}": float(v) for k, v in skipped.items()},
            M.BATCH_SKIPPED: float(updates == 0),
            **extra_metrics,
            **finalize_metrics(merged),
            M.TIME_FORWARD_BACKWARD: t_fb - t0,
            M.TIME_OPTIMIZER: t_opt - t_fb,
            M.TIME_STEP: t_end - t0,
        }

    def _stale_tokens(self, groups: Sequence[TrainGroup], rows: list[Row]) -> dict[str, float]:
        """Apply `stale_policy` to model tokens older than `max_staleness`; their metrics.

        A token's staleness is measured on the buffer's clock: the version the buffer knew at
        delivery (the group's staleness plus its oldest model-token version) minus the token's.
        """
        if self.max_staleness is None:
            return {}
        over_tokens = 0
        masked_groups: list[int] = []
        i = 0
        for k, g in enumerate(groups):
            mine = rows[i : i + len(g)]
            i += len(g)
            oldest = [o for t in g if (o := t.oldest_version()) is not None]
            if not oldest:
                continue
            clock = g.staleness + min(oldest)
            hit = False
            for r in mine:
                model = r.per_token["loss_mask"] > 0
                over = model & (clock - r.per_token["versions"] > self.max_staleness)
                n = int(over.sum())
                over_tokens += n
                if n and self.stale_policy == "mask":
                    r.per_token["loss_mask"] = np.where(over, 0.0, r.per_token["loss_mask"]).astype(
                        np.float32
                    )
                hit = hit or n > 0
            if hit:
                masked_groups.append(k)
        masked = set(masked_groups)
        # [over-bound tokens, masked groups, then (trajectories, length sum, reward sum) of the
        # masked groups and of the others]
        sums = np.zeros(8)
        sums[0], sums[1] = over_tokens, len(masked)
        for k, g in enumerate(groups):
            base = 2 if k in masked else 5
            for t in g:
                sums[base] += 1
                sums[base + 1] += float(t.loss_mask.sum())
                sums[base + 2] += float(t.reward)
        if dist.get_world_size(self.dp_group) > 1:  # the batch's totals, not this rank's share
            t = torch.tensor(sums, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=self.dp_group)
            sums = t.cpu().numpy()
        out = {M.STALE_OVER_BOUND_TOKENS: float(sums[0])}
        if self.stale_policy != "mask":
            return out
        mn, kn = max(sums[2], 1.0), max(sums[5], 1.0)
        out.update(
            {
                M.STALE_MASKED_TOKENS: float(sums[0]),
                M.STALE_MASKED_GROUPS: float(sums[1]),
                M.STALE_MASKED_LEN: float(sums[3] / mn),
                M.STALE_MASKED_REWARD: float(sums[4] / mn),
                M.STALE_KEPT_LEN: float(sums[6] / kn),
                M.STALE_KEPT_REWARD: float(sums[7] / kn),
            }
        )
        return out

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One RL batch: `algo.ppo_epochs` x `algo.mini_batches` optimizer updates; version += 1.

        pi_prox is the policy at the start of the batch (a no-grad forward pass before the first
        update), or AReaL's log-linear interpolation (`algo.prox_source = "interpolate"`).
        Groups the algorithm filters out (e.g. DAPO's zero-variance filter) are not trained on
        and count in no denominator.
        """
        kept, advantages = self._advantages(groups)
        rows = rows_from_groups(kept, self.arch.vocab_size, self.temperature)
        for row, adv in zip(rows, advantages, strict=True):
            row.per_token["advantages"] = adv
        extra = {M.GROUPS_KEPT: float(len(kept)), M.GROUPS_GIVEN: float(len(groups))}
        extra.update(self._stale_tokens(kept, rows))
        current = self.version
        interpolate = self.algo_cfg.prox_source == "interpolate"
        self._batches += 1
        exact = not interpolate or (
            self.cfg.prox_compare_interval > 0
            and (self._batches - 1) % self.cfg.prox_compare_interval == 0
        )
        # With one update per batch the policy at the start of the batch is the one being
        # trained: the loss's logp.detach() is pi_prox exactly, and the forward pass is skipped.
        one_update = self.algo_cfg.mini_batches * self.algo_cfg.ppo_epochs == 1
        # Every rank takes the same branch (same config, same batch count): no collective waits.
        if exact and not (one_update and not interpolate):
            for row, lp in zip(rows, self._rows_logprobs(self.model, rows), strict=True):
                row.per_token["prox_logp"] = lp
        if self.ref_model is not None:
            for row, lp in zip(rows, self._rows_logprobs(self.ref_model, rows), strict=True):
                row.per_token["ref_logp"] = lp

        def loss_of(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):
            pt = mb.per_token
            prox = pt.get("prox_logp")
            compare: dict[str, float] = {}
            if interpolate:
                approx = interpolated_prox_logp(
                    pt["behavior_logp"], logp.detach(), pt["versions"], current
                )
                if prox is not None:
                    m = pt["loss_mask"]
                    compare = {
                        f"{M.PROX_INTERP_ERR}|sum": float(((approx - prox).abs() * m).sum()),
                        f"{M.PROX_INTERP_ERR}|n": float(m.sum()),
                        f"{M.PROX_BEHAVIOR_ERR}|sum": float(
                            ((pt["behavior_logp"] - prox).abs() * m).sum()
                        ),
                        f"{M.PROX_BEHAVIOR_ERR}|n": float(m.sum()),
                    }
                prox = approx
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
                    prox_logp=prox,
                    ref_logp=pt.get("ref_logp"),
                    entropy=ent,
                )
            )
            return out.loss, {**out.metrics, **compare}

        if self.cfg.routing_replay:
            self._take_routing_counts()  # only this step's forward passes count
            extra.update(self._check_routed(rows))
        out = self._run_step(
            rows, loss_of, extra, self.algo_cfg.mini_batches, self.algo_cfg.ppo_epochs
        )
        if self.cfg.routing_replay:
            diff, total = self._take_routing_counts()
            t = torch.tensor([diff, total], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)  # DP ranks: other rows; TP ranks: other sequence chunks
            out[M.MOE_ROUTING_DIFF] = float(t[0] / t[1]) if t[1] > 0 else 0.0
            out[M.MOE_REPLAY_TOKENS] = float(t[1])
        return out

    def _check_routed(self, rows: list[Row]) -> dict[str, float]:
        """Routing replay: each row's recorded routing must fit the model; rows without one
        (an engine that did not return it) route on their own, counted and logged."""
        width = len(self.arch.moe_layers) * self.arch.moe_topk
        missing = 0
        for r in rows:
            if r.routed is None:
                missing += 1
            elif r.routed.shape[1] != width or (
                r.routed.size and r.routed.max() >= self.arch.num_experts
            ):
                raise ValueError(
                    f"routed_experts of shape {r.routed.shape} (max id {int(r.routed.max())}) do "
                    f"not fit {len(self.arch.moe_layers)} MoE layers x top-{self.arch.moe_topk} "
                    f"of {self.arch.num_experts} experts"
                )
        t = torch.tensor([float(missing)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        if float(t) > 0 and self.is_rank0:
            log.warning(
                "routing replay: %d trajectories carry no routed_experts; they use the "
                "learner's own routing", int(float(t)),
            )  # fmt: skip
        return {M.MOE_REPLAY_MISSING: float(t)}

    def _take_routing_counts(self) -> tuple[float, float]:
        """(token x layer pairs whose own routing differed, pairs replayed) on this rank since
        the last call (the KL reference's are dropped)."""
        if self.ref_model is not None:
            routing.take_counts(self.ref_model)
        return routing.take_counts(self.model)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the data-parallel ranks (a copy): `AdvantageInput.all_reduce_sum`."""
        out = t.detach().to(self.device, torch.float64).clone()
        dist.all_reduce(out, group=self.dp_group)
        return out.to(t.device, t.dtype)

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
        sizes = sorted(by_size)
        dp = dist.get_world_size(self.dp_group) > 1
        if dp:
            # Batch-wide estimators (reinforce_pp, reinforce) all-reduce inside the call: every
            # rank calls the estimator for the same sizes in the same order, with empty inputs
            # where it holds no group of that size, or the collectives would not pair up.
            gathered: list[list[int] | None] = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, sizes, group=self.dp_group)
            sizes = sorted({n for s in gathered for n in (s or [])})
        kept: list[TrainGroup] = []
        advantages: list[np.ndarray] = []
        for n in sizes:
            same = by_size.get(n, [])
            t_max = max((len(t.response_ids) for g in same for t in g), default=1)
            mask = torch.zeros(len(same), n, t_max)  # [G, n, T]
            for a, g in enumerate(same):
                for b, t in enumerate(g):
                    mask[a, b, : len(t.loss_mask)] = torch.from_numpy(
                        t.loss_mask.astype(np.float32)
                    )
            rewards = torch.tensor([[float(t.reward) for t in g] for g in same]).reshape(-1, n)
            lengths = mask.sum(-1)
            keep = (
                self.algo.keep_groups(rewards, lengths)
                if same
                else torch.zeros(0, dtype=torch.long)
            )
            if keep.numel() == 0 and not dp:
                continue
            adv_in = AdvantageInput(
                rewards[keep],
                lengths[keep],
                mask[keep],
                all_reduce_sum=self._all_reduce_sum if dp else None,
            )
            adv = self.algo.advantages(adv_in)
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
            mask = {"loss_mask": np.ones(len(target), dtype=np.float32)}
            rows.append(Row(tokens, len(prompt), mask, self.temperature))

        def loss_of(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None):
            mask = mb.per_token["loss_mask"]
            nll = -(logp * mask).sum()
            return nll / self._denominators[0], {
                "nll|sum": float(nll.detach()),
                "nll|n": float(mask.sum()),
            }

        return self._run_step(rows, loss_of, {})

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
