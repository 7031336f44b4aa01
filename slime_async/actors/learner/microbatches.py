"""Micro-batching and the forward pass: rows -> micro-batches -> per-token log-probs.

`MicroBatches` plans one rank's rows into micro-batches of at most `learner.micro_batch_tokens`
tokens (padded rows sorted by length, or packed rows), collates them onto the device, and runs
them through a model to `[B, T]` response log-probs (and entropy) at each row's temperature: the
model returns final hidden states and only the response positions go through the output layer,
in chunks (`logprobs.py`). It holds no model: the caller names the one to run (the trained
model, megatron's DDP wrapper of it, or the KL reference)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from slime_async import megatron_compat
from slime_async.actors.learner.batch import (
    MicroBatch,
    Row,
    collate,
    collate_packed,
    plan_micro_batches,
    plan_packs,
)
from slime_async.actors.learner.graphs import ModelGraphs
from slime_async.actors.learner.logprobs import chunked_logprobs, hidden_output, output_weight
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.models import routing
from slime_async.models.arch import ModelArch
from slime_async.models.attention import packed_rows, set_packed
from slime_async.models.moe_layer import losses_of

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

Plan = tuple[list[list[int]], bool]
"""Micro-batches as row indices, and whether they are packed."""


def plan_rows(input_lens: list[int], budget: int, pack_min_padding: float | None) -> Plan:
    """Micro-batches of rows of `input_lens` tokens, at most `budget` tokens each: padded rows
    sorted by length, or packed rows when `pack_min_padding` is 0 or the padded plan would be at
    least that share of padding (None: never packed)."""
    if pack_min_padding is not None and not pack_min_padding:
        return plan_packs(input_lens, budget), True
    padded = plan_micro_batches(input_lens, budget)
    if pack_min_padding is not None:
        spent = sum(len(mb) * max(input_lens[i] for i in mb) for mb in padded)
        if spent and 1.0 - sum(input_lens) / spent >= pack_min_padding:
            return plan_packs(input_lens, budget), True
    return padded, False


class MicroBatches:
    """Micro-batch planning, collation and the forward pass of one learner rank."""

    def __init__(
        self,
        layout: ParallelLayout,
        arch: ModelArch,
        *,
        micro_batch_tokens: int,
        pack_min_padding: float | None,
        attention: str,
        logprob_kernel: str,
        logprob_chunk_tokens: int,
        routing_replay: bool,
        temperature: float,
        stop_ids: tuple[int, ...] = (),
    ):
        """`pack_min_padding`: None never packs, else a mini-batch is packed from this share of
        padding on (0: always); `attention` and `logprob_kernel` as resolved in `options.py`;
        `temperature`: for micro-batches that carry no per-row temperature; `stop_ids`: the
        ids left out of the softmax on tokens a row marks `stop_banned` (min_new_tokens)."""
        self.layout = layout
        self.arch = arch
        self.micro_batch_tokens = micro_batch_tokens
        self.pack_min_padding = pack_min_padding
        self.attention = attention
        self.logprob_kernel = logprob_kernel
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.routing_replay = routing_replay
        self.temperature = temperature
        self._aux: dict[int, Any] = {}
        self.graphs: ModelGraphs | None = None
        """CUDA graphs of training micro-batches through `graphs_model` (`use_graphs`)."""
        self.graphs_model: torch.nn.Module | None = None
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=layout.device)

    def use_graphs(self, model: torch.nn.Module, max_shapes: int) -> None:
        """Training micro-batches through `model` (the one that trains: megatron's DDP wrapper)
        run through CUDA graphs from now on (`graphs.py`)."""
        params = [p for p in model.parameters() if p.requires_grad]
        self.graphs = ModelGraphs(self.layout.device, params, max_shapes)
        self.graphs_model = model

    @property
    def pack(self) -> bool:
        """Whether any mini-batch may be packed."""
        return self.pack_min_padding is not None

    def plan(self, rows: list[Row]) -> Plan:
        """This rank's micro-batches of `rows` (see `plan_rows`)."""
        return plan_rows(
            [r.input_len for r in rows], self.micro_batch_tokens, self.pack_min_padding
        )

    def collated(self, rows: list[Row], plan: Plan | None = None) -> Iterator[MicroBatch]:
        """The micro-batches of `plan` (default: `self.plan(rows)`), collated on the device."""
        idx_lists, packed = self.plan(rows) if plan is None else plan
        collate_one = collate_packed if packed else collate
        for idx in idx_lists:
            yield collate_one(rows, idx, self.layout.device)

    def forward(
        self, model, mb: MicroBatch, with_entropy: bool, aux_weight: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs [B, T] (and entropy [B, T]), each row at its own temperature.

        `aux_weight` (training forwards of a MoE model): this micro-batch's share of the step's
        tokens; the MoE auxiliary losses are recorded for it, until `end_aux` (after backward).

        The model returns its final hidden states; only the response positions go through the
        output layer, in chunks (`logprobs.py`): no `[tokens x vocab]` fp32 logits exist."""
        ids, pos = mb.input_ids, mb.position_ids
        s = ids.shape[1]
        tp = self.layout.tp_size
        if self.arch.is_moe and tp > 1 and s % tp:
            # Sequence parallelism (MoE at TP > 1) cuts the sequence into TP equal chunks:
            # right padding, which a causal mask keeps away from every real token.
            extra = tp - s % tp
            ids = torch.nn.functional.pad(ids, (0, extra))
            pos = torch.arange(s + extra, device=ids.device).expand(ids.shape[0], -1)
            s += extra
        gpt = getattr(model, "module", model)  # under megatron's DDP wrapper
        lens = mb.resp_index.max(dim=1).values + 1  # a row's last prediction: input length - 1
        losses = self._losses(gpt) if aux_weight is not None else None
        if losses is not None and losses.active:
            valid_tokens = None  # packed rows hold no padding
            if mb.packed is None:
                valid_tokens = routing.router_token_mask(lens, s, self.layout.tp_rank, tp)
            losses.begin(valid_tokens, aux_weight)
        replay = mb.routed_experts is not None and self.routing_replay
        if replay:
            routed = mb.routed_experts  # [B, S0, L * k]
            b, s0, _ = routed.shape
            routed = torch.nn.functional.pad(routed, (0, 0, 0, s - s0))
            routed = routed.view(b, s, len(self.arch.moe_layers), self.arch.moe_topk)
            per_layer, valid = routing.replay_targets(routed, lens, self.layout.tp_rank, tp)
            routing.set_replay(gpt, per_layer, valid)
        # SDPA and TE attention are causal by construction; megatron's own needs the mask.
        device = self.layout.device
        mask = megatron_compat.causal_mask(s, device) if self.attention == "local" else None
        if mb.packed is not None:
            packing = packed_rows(gpt, mb.packed, pos)
        else:
            packing = contextlib.nullcontext()
            if self.attention == "sdpa":
                set_packed(gpt, None)  # ordinary rows (a packed batch may have run before)
        graphs = self.graphs if model is self.graphs_model else None
        if graphs is not None and not (torch.is_grad_enabled() and model.training):
            graphs = None  # no-grad passes (pi_prox, evaluation) stay eager, uncounted
        if graphs is not None and mb.packed is not None:
            graphs.count_eager("packed")
            graphs = None
        try:
            with hidden_output(gpt), packing:
                if graphs is None:
                    hidden = model(ids, pos, mask)  # [b, s, h]
                else:
                    hidden = graphs.hidden(lambda i, q: model(i, q, mask), ids, pos)
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
        banned = mb.per_token.get("stop_banned")
        lp, ent = chunked_logprobs(
            h,
            output_weight(gpt),
            labels,
            temp_tok,
            with_entropy,
            self.logprob_chunk_tokens,
            fused=self.logprob_kernel == "triton",
            banned=None if banned is None else banned[valid] > 0,
            stop_ids=self.stop_ids,
        )
        zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        logp = zeros.masked_scatter(valid, lp)
        return logp, (zeros.masked_scatter(valid, ent) if ent is not None else None)

    def _losses(self, gpt):
        """The MoE auxiliary losses of `gpt` (None for a dense model), looked up once."""
        if not self.arch.is_moe:
            return None
        if id(gpt) not in self._aux:
            self._aux[id(gpt)] = losses_of(gpt)
        return self._aux[id(gpt)]

    def end_aux(self, model) -> None:
        """The training forward (and backward) of the MoE auxiliary losses is over."""
        losses = self._losses(getattr(model, "module", model))
        if losses is not None:
            losses.end()

    @torch.no_grad()
    def rows_logprobs(self, model, rows: list[Row]) -> list[np.ndarray]:
        """[R] fp32 response log-probs of each row under `model` (no grad)."""
        out: list[Any] = [None] * len(rows)
        for mb in self.collated(rows):
            logp, _ = self.forward(model, mb, False)
            for j, i in enumerate(mb.rows):
                out[i] = logp[j, : rows[i].response_len].float().cpu().numpy()
        return out

    @torch.no_grad()
    def compute_logprobs(
        self,
        model: torch.nn.Module,
        sequences: list[list[int]],
        with_entropy: bool = False,
        temperatures: Sequence[float] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """For each sequence, log p(seq[t+1] | seq[:t+1]) [L-1] (and entropy [L-1]) under
        `model` in eval mode, fp32 on CPU, at `temperatures[i]` (default: `self.temperature`)."""
        temps = (
            list(temperatures) if temperatures is not None else [self.temperature] * len(sequences)
        )
        rows = [
            Row(np.asarray(s, dtype=np.int64), prompt_len=1, temperature=float(t))
            for s, t in zip(sequences, temps, strict=True)
        ]
        out: list[Any] = [None] * len(rows)
        was_training = model.training
        model.eval()
        try:
            for mb in self.collated(rows):
                logp, ent = self.forward(model, mb, with_entropy)
                for j, i in enumerate(mb.rows):
                    n = rows[i].response_len
                    out[i] = (
                        logp[j, :n].float().cpu(),
                        None if ent is None else ent[j, :n].float().cpu(),
                    )
        finally:
            model.train(was_training)
        return out
