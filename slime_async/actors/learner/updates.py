"""Optimizer updates over the mini-batches of one batch: the loss, gradients, clipping, steps.

`Updates` owns the optimizer, the step and version counters and the LR schedule; the PPO step
(`ppo_step.py`) and SFT (`sft_rows`, `nll_loss`) hand it rows and a loss. `run(rows, loss_of, ...)`
runs `epochs x mini_batches` updates, each on a mini-batch of the rows (sorted by length, dealt
round robin), with the loss divided by that mini-batch's totals over all its micro-batches and
data-parallel ranks; an update on a mini-batch that is empty on every rank, or whose gradient is
zero or not finite, is skipped and counted. Version v + 1 is the weights after all the updates of
the batch trained at version v."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import slime_async.metrics.names as M
from slime_async.actors.learner.batch import MicroBatch, Row, check_ids
from slime_async.actors.learner.microbatches import MicroBatches
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.actors.learner.token_record import TokenRecorder
from slime_async.algos.build import ESS_KEYS, lr_scale_from
from slime_async.algos.metrics import finalize_metrics, merge_metrics

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")


class Denominators(NamedTuple):
    """One mini-batch's totals over all its micro-batches and data-parallel ranks (each >= 1)."""

    tokens: float
    sequences: float


LossFn = Callable[
    [MicroBatch, torch.Tensor, torch.Tensor | None, Denominators], tuple[torch.Tensor, dict]
]
"""(micro-batch, logp [B, T], entropy [B, T] or None, denominators) -> (loss, raw metrics)."""


class Updates:
    """The update loop of one learner rank: optimizer, step and version, LR schedule."""

    def __init__(
        self,
        layout: ParallelLayout,
        microbatches: MicroBatches,
        optimizer: Any,
        train_model: torch.nn.Module,
        *,
        optimizer_kind: str,
        lr_at: Callable[[int], float],
        with_entropy: bool,
        ess_scaled_lr: bool = False,
        version_per_batch: bool = False,
    ):
        """`optimizer`: a `MasterAdamW` or `MegatronOptim` ("master_adamw" or "megatron", the
        `optimizer_kind`); `train_model`: what training micro-batches run through (megatron's
        DDP wrapper, whose gradient hooks reduce, or the model itself); `lr_at(step)`: the LR
        schedule; `with_entropy`: the forward passes compute the entropy (the loss reads it);
        `ess_scaled_lr`: each update's LR is multiplied by sqrt of the ESS of its answers'
        behaviour weights, from the loss's raw metrics over all DP ranks (VCPO's step size);
        `version_per_batch`: a batch whose updates were all skipped still makes a version (with
        the previous weights), as buffer.fixed_lag needs."""
        self.layout = layout
        self.microbatches = microbatches
        self.optimizer = optimizer
        self.train_model = train_model
        self.optimizer_kind = optimizer_kind
        self.lr_at = lr_at
        self.with_entropy = with_entropy
        self.ess_scaled_lr = ess_scaled_lr
        self.version_per_batch = version_per_batch
        self.step = 0
        """Optimizer steps taken (batches trained on, applied or not)."""
        self.version = 0
        """The policy version of the weights: one more after each batch with an update applied
        (after every batch with `version_per_batch`)."""
        self.recorder: TokenRecorder | None = None
        """Set by the RL step for a step whose tokens are recorded (`token_record.py`)."""

    def check_same_data_in_tp_group(self, rows: list[Row]) -> None:
        """TP ranks compute one model together: they must hold the same rows."""
        if self.layout.tp_size == 1:
            return
        lengths = np.array([len(r.tokens) for r in rows], dtype=np.float64)
        fingerprint = sum(
            float(r.tokens.astype(np.float64) @ np.arange(1, len(r.tokens) + 1)) for r in rows
        )
        # Collectives run on the model's device: NCCL has no CPU tensors.
        t = torch.tensor(
            [len(rows), lengths.sum(), fingerprint], dtype=torch.float64, device=self.layout.device
        )
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.layout.tp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.layout.tp_group)
        if not torch.equal(lo, hi):
            raise ValueError(
                "tensor-parallel ranks of one data-parallel rank were given different data: "
                "every TP rank must receive the same groups"
            )

    def totals(self, rows: list[Row]) -> tuple[float, float, float]:
        """(loss tokens, sequences, all tokens) of `rows` summed over data-parallel ranks."""
        local = torch.tensor(
            [
                float(sum(r.per_token["loss_mask"].sum() for r in rows)),
                float(len(rows)),
                float(sum(len(r.tokens) for r in rows)),
            ],
            dtype=torch.float64,
            device=self.layout.device,
        )
        dist.all_reduce(local, group=self.layout.dp_group)
        token_den, seq_den, total = local.tolist()
        return token_den, seq_den, total

    def update(self, rows: list[Row], loss_of: LossFn, lr: float) -> dict[str, Any]:
        """One optimizer update on this rank's share `rows` of one mini-batch.

        The loss is divided by the mini-batch's totals over all its micro-batches and DP ranks,
        gradients are summed over DP ranks, clipped, and applied, unless the mini-batch is empty
        on every rank, or its gradient is zero (Adam would still move the weights by its
        momentum) or not finite: then nothing is applied and the reason is returned.
        """
        token_den, seq_den, all_tokens = self.totals(rows)
        routed_tokens = max(all_tokens - seq_den, 1.0)  # every token but each row's last
        out: dict[str, Any] = {"raws": [], "loss": 0.0, "padded": 0, "packed": 0, "skipped": None}
        self.optimizer.zero_grad()
        if seq_den == 0:
            out["skipped"] = "empty"
            return out
        den = Denominators(max(token_den, 1.0), max(seq_den, 1.0))
        megatron = self.optimizer_kind == "megatron"
        plan = self.microbatches.plan(rows)
        out["packed"] = len(plan[0]) if plan[1] else 0
        if megatron:
            self.optimizer.begin(len(plan[0]))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        for mb in self.microbatches.collated(rows, plan):
            out["padded"] += mb.num_tokens
            sync = self.optimizer.forward_context() if megatron else contextlib.nullcontext()
            # The MoE auxiliary losses' share: this micro-batch's routed tokens of the update's.
            share = float(sum(rows[i].input_len for i in mb.rows))
            with sync:
                logp, ent = self.microbatches.forward(
                    self.train_model, mb, self.with_entropy, aux_weight=share / routed_tokens
                )
                if self.recorder is not None and logp.requires_grad:
                    logp.retain_grad()  # d loss / d logp per token, for the record
                loss, raw = loss_of(mb, logp, ent, den)
                loss.backward()
                self.microbatches.end_aux(self.train_model)
            if self.recorder is not None:
                self.recorder.observe(rows, mb, logp)
            loss_sum += loss.detach()  # one host sync per update, below, not per micro-batch
            out["raws"].append(raw)
        out["loss"] = float(loss_sum)
        p = self.layout
        self.optimizer.reduce_gradients(p.dp_group, p.tp_group, p.expert_dp_group)
        norm = self.optimizer.grad_norm(p.tp_group, p.ep_group)
        out["grad_norm"] = norm
        if self.recorder is not None:
            self.recorder.update_done(norm)
        if not math.isfinite(norm):
            out["skipped"] = "non_finite"
        elif norm == 0.0:
            out["skipped"] = "zero_gradient"
        else:
            if self.ess_scaled_lr:
                out["lr_scale"] = self.ess_lr_scale(out["raws"])
                lr = lr * out["lr_scale"]
            self.optimizer.step(lr, p.tp_group, norm=norm)
        if not megatron:
            # Frees the gradients between updates. Megatron's gradient buffer stays allocated,
            # and zeroing it (a pass over an fp32 copy of the weights) is done once, above.
            self.optimizer.zero_grad()
        return out

    def ess_lr_scale(self, raws: list[dict]) -> float:
        """sqrt(ESS) of the update's answers' behaviour weights over all DP ranks (TP ranks of
        one group hold the same answers, so the sums are reduced over DP only)."""
        sums = [sum(float(r.get(k, 0.0)) for r in raws) for k in ESS_KEYS]
        t = torch.tensor(sums, dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t, group=self.layout.dp_group)
        return lr_scale_from(t.tolist())

    def run(
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
        self.check_same_data_in_tp_group(rows)
        token_den, seq_den, total_tokens = self.totals(rows)
        # Mini-batches of similar lengths on every rank: rows sorted by length, dealt round robin.
        order = sorted(range(len(rows)), key=lambda i: rows[i].input_len)
        parts = [[rows[i] for i in order[k::mini_batches]] for k in range(mini_batches)]
        lr = self.lr_at(self.step)
        raws: list[dict] = []
        losses: list[float] = []
        norms: list[float] = []
        scales: list[float] = []
        padded = packed = 0
        skipped: dict[str, int] = {}
        for _ in range(epochs):
            for part in parts:
                res = self.update(part, loss_of, lr)
                raws.extend(res["raws"])
                padded += res["padded"]
                packed += res["packed"]
                if "lr_scale" in res:
                    scales.append(res["lr_scale"])
                if res["skipped"] != "empty":
                    losses.append(res["loss"])
                    norms.append(res["grad_norm"])
                if res["skipped"] is not None:
                    skipped[res["skipped"]] = skipped.get(res["skipped"], 0) + 1
        t_fb = time.perf_counter()
        updates = epochs * mini_batches - sum(skipped.values())
        self.step += 1
        if updates or self.version_per_batch:
            self.version += 1
        if not updates:
            log.warning(
                "step %d: no update applied (%s): weights unchanged, %s",
                self.step,
                ", ".join(f"{k} x{v}" for k, v in sorted(skipped.items())),
                f"as version {self.version} (one version a batch: buffer.fixed_lag)"
                if self.version_per_batch
                else f"version {self.version} unchanged",
            )
        t_opt = time.perf_counter()

        merged = merge_metrics(raws)
        p = self.layout
        if p.dp_size > 1:
            gathered: list[Any] = [None] * p.dp_size
            dist.all_gather_object(gathered, merged, group=p.dp_group)
            merged = merge_metrics(gathered)
        loss_t = torch.tensor([sum(losses)], dtype=torch.float64, device=p.device)
        dist.all_reduce(loss_t, group=p.dp_group)
        t_end = time.perf_counter()
        finite_norms = [n for n in norms if math.isfinite(n)]
        graphs = self.microbatches.graphs
        graph_counts = graphs.take_counts() if graphs is not None else {}
        return {
            M.LOSS: float(loss_t) / max(len(losses), 1),
            M.GRAD_NORM: float(np.mean(finite_norms)) if finite_norms else 0.0,
            M.LR: lr,
            **({M.LR_ESS_SCALE: float(np.mean(scales))} if scales else {}),
            M.TOKENS: token_den,
            M.SEQUENCES: seq_den,
            M.TOKENS_TOTAL: total_tokens,
            M.PADDING_FRAC: 1.0 - float(sum(r.input_len for r in rows)) * epochs / max(padded, 1),
            M.UPDATES: float(updates),
            M.PACKED_MICRO_BATCHES: float(packed),
            **{f"{M.CUDA_GRAPHS}/{k}": v for k, v in graph_counts.items()},
            **{f"{M.SKIPPED_UPDATES}/{k}": float(v) for k, v in skipped.items()},
            M.BATCH_SKIPPED: float(updates == 0),
            **extra_metrics,
            **finalize_metrics(merged),
            M.TIME_FORWARD_BACKWARD: t_fb - t0,
            M.TIME_OPTIMIZER: t_opt - t_fb,
            M.TIME_STEP: t_end - t0,
        }


def sft_rows(
    examples: list[tuple[list[int], list[int]]], vocab_size: int, temperature: float
) -> list[Row]:
    """Supervised (prompt, target) examples as rows whose loss mask covers the target."""
    rows = []
    for i, (prompt, target) in enumerate(examples):
        if len(prompt) < 1 or len(target) < 1:
            raise ValueError(f"sft example {i}: prompt and target need at least one token each")
        tokens = np.asarray(list(prompt) + list(target), dtype=np.int64)
        check_ids(tokens, vocab_size, f"sft example {i}")
        mask = {"loss_mask": np.ones(len(target), dtype=np.float32)}
        rows.append(Row(tokens, len(prompt), mask, temperature))
    return rows


def nll_loss(
    mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, den: Denominators
) -> tuple[torch.Tensor, dict]:
    """SFT's loss: the target tokens' NLL over the mini-batch's target tokens of all ranks."""
    mask = mb.per_token["loss_mask"]
    nll = -(logp * mask).sum()
    return nll / den.tokens, {"nll|sum": float(nll.detach()), "nll|n": float(mask.sum())}
