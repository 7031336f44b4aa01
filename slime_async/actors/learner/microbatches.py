"""Micro-batching and the forward pass: rows -> micro-batches -> per-token log-probs.

`MicroBatches` is a part of `Learner` (trainer.py): how one rank's rows are planned into
micro-batches of at most `learner.micro_batch_tokens` tokens (padded rows sorted by length, or
packed rows), collated onto the device, and run through the model to `[B, T]` response
log-probs (and entropy) at each row's temperature: the model returns final hidden states and only
the response positions go through the output layer, in chunks (`logprobs.py`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime_async import megatron_compat
from slime_async.actors.learner.batch import (
    MicroBatch,
    Row,
    collate,
    collate_packed,
    plan_micro_batches,
    plan_packs,
)
from slime_async.actors.learner.logprobs import chunked_logprobs, hidden_output, output_weight
from slime_async.models import routing
from slime_async.models.attention import packed_rows, set_packed

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")


class MicroBatches:
    """The micro-batch planning and forward pass of `Learner` (uses its model, config, device)."""

    def _plan(self, rows: list[Row]) -> tuple[list[list[int]], bool]:
        """This rank's micro-batches of `rows` as row indices, at most micro_batch_tokens each,
        and whether they are packed: padded rows sorted by length, or packed rows when packing
        is on and the padded plan would be at least `pack_min_padding` padding."""
        lens = [r.input_len for r in rows]
        budget = self.cfg.micro_batch_tokens
        if self.pack and not self.pack_min_padding:
            return plan_packs(lens, budget), True
        padded = plan_micro_batches(lens, budget)
        if self.pack:
            spent = sum(len(mb) * max(lens[i] for i in mb) for mb in padded)
            if spent and 1.0 - sum(lens) / spent >= self.pack_min_padding:
                return plan_packs(lens, budget), True
        return padded, False

    def _micro_batches(
        self, rows: list[Row], plan: tuple[list[list[int]], bool] | None = None
    ) -> Iterator[MicroBatch]:
        """The micro-batches of `plan` (default: `_plan(rows)`), collated on the device."""
        idx_lists, packed = self._plan(rows) if plan is None else plan
        collate_one = collate_packed if packed else collate
        for idx in idx_lists:
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
            h,
            output_weight(gpt),
            labels,
            temp_tok,
            with_entropy,
            self.cfg.logprob_chunk_tokens,
            fused=self.logprob_kernel == "triton",
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
