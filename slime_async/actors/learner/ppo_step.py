"""The RL step: one batch of groups -> advantages, pi_prox, the loss -> `Updates.run`.

`PPOStep.train_step(groups)`: the algorithm's group filter and advantages (batch-wide estimators
all-reduce over DP ranks), the stale-token policy (`stale_tokens.py`), pi_prox (a no-grad
forward pass at the start of the batch, skipped with one update per batch where the loss's own
detached log-probs are pi_prox exactly; or AReaL's log-linear interpolation), the KL
reference's log-probs, routing replay's checks, then `algo.ppo_epochs x algo.mini_batches`
updates (`updates.py`) with the loss from `slime_async/algos/`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

import slime_async.metrics.names as M
from slime_async.actors.learner.batch import (
    MicroBatch,
    Row,
    TrainGroup,
    check_trajectory,
    rows_from_groups,
)
from slime_async.actors.learner.microbatches import MicroBatches
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.actors.learner.stale_tokens import StaleTokens
from slime_async.actors.learner.stop_ban import StopBan
from slime_async.actors.learner.token_record import TokenRecorder
from slime_async.actors.learner.updates import Denominators, Updates
from slime_async.algos import AdvantageInput, Algorithm, LossInput
from slime_async.algos.importance import interpolated_prox
from slime_async.models import routing
from slime_async.models.arch import ModelArch
from slime_async.models.moe_layer import losses_of

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")


def interpolated_prox_logp(
    behavior_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """AReaL's log-linear pi_prox (`algo.prox_source = "interpolate"`), all `[B, T]`:
    `slime_async.algos.importance.interpolated_prox` at lag = current_version - versions.

    `current_version` is the learner's version at the start of the batch (pi_prox, the weights
    that generated that version's tokens), so a token k versions old gets alpha = k / (k + 1)
    and only fresh tokens (sampled by pi_prox itself) get pi_prox = mu."""
    return interpolated_prox(behavior_logp, logp, current_version - versions.long())


class PPOStep:
    """The RL step of one learner rank: groups in, `Updates.run` with the algorithm's loss."""

    def __init__(
        self,
        layout: ParallelLayout,
        microbatches: MicroBatches,
        updates: Updates,
        algo: Algorithm,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        arch: ModelArch,
        *,
        interpolate: bool,
        prox_compare_interval: int,
        mini_batches: int,
        ppo_epochs: int,
        routing_replay: bool,
        temperature: float,
        stale: StaleTokens,
        token_record_interval: int = 0,
        stop_ban: StopBan | None = None,
    ):
        """`algo`: its loss gets pi_prox as `prox_logp` (this step resolves it); `ref_model`: the
        frozen KL reference, or None; `interpolate`: pi_prox by AReaL's log-linear interpolation,
        checked against the forward pass every `prox_compare_interval` batches (0: never), else
        the forward pass; `temperature`: for trajectories that record none; `stale`: the
        buffer's bound on model tokens and what to do with those beyond it;
        `token_record_interval`: record every token of every N-th step (0: never; see
        `token_record.py`), for `take_record()`; `stop_ban`: the engines' min_new_tokens rule
        (None: off)."""
        self.layout = layout
        self.microbatches = microbatches
        self.updates = updates
        self.algo = algo
        self.model = model
        self.ref_model = ref_model
        self.arch = arch
        self.interpolate = interpolate
        self.prox_compare_interval = prox_compare_interval
        self.mini_batches = mini_batches
        self.ppo_epochs = ppo_epochs
        self.routing_replay = routing_replay
        self.temperature = temperature
        self.stale = stale
        self.stop_ban = stop_ban
        self.batches = 0
        """RL batches seen, for the interval of the pi_prox comparison."""
        self.token_record_interval = token_record_interval
        self.record: dict | None = None
        """Rank 0: the last recorded step's per-token arrays, until `take_record()`."""

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One RL batch: `algo.ppo_epochs` x `algo.mini_batches` optimizer updates; version += 1.

        pi_prox is the policy at the start of the batch (a no-grad forward pass before the first
        update), or AReaL's log-linear interpolation (`algo.prox_source = "interpolate"`).
        Groups the algorithm filters out (e.g. DAPO's zero-variance filter) are not trained on
        and count in no denominator.
        """
        kept, advantages = self.advantages(groups)
        rows = rows_from_groups(kept, self.arch.vocab_size, self.temperature, self.stop_ban)
        for row, adv in zip(rows, advantages, strict=True):
            row.per_token["advantages"] = adv
        extra = {M.GROUPS_KEPT: float(len(kept)), M.GROUPS_GIVEN: float(len(groups))}
        extra.update(self.stale.apply(kept, rows))
        if self.routing_replay:  # before any forward pass: rows get the MoE layers' routing
            extra.update(self.check_routed(rows))
        current = self.updates.version
        interpolate = self.interpolate
        self.batches += 1
        exact = not interpolate or (
            self.prox_compare_interval > 0 and (self.batches - 1) % self.prox_compare_interval == 0
        )
        # With one update per batch the policy at the start of the batch is the one being
        # trained: the loss's logp.detach() is pi_prox exactly, and the forward pass is skipped.
        one_update = self.mini_batches * self.ppo_epochs == 1
        # Every rank takes the same branch (same config, same batch count): no collective waits.
        if exact and not (one_update and not interpolate):
            for row, lp in zip(
                rows, self.microbatches.rows_logprobs(self.model, rows), strict=True
            ):
                row.per_token["prox_logp"] = lp
        if self.ref_model is not None:
            ref = self.microbatches.rows_logprobs(self.ref_model, rows)
            for row, lp in zip(rows, ref, strict=True):
                row.per_token["ref_logp"] = lp

        def loss_of(
            mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, den: Denominators
        ) -> tuple[torch.Tensor, dict]:
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
                    token_denominator=den.tokens,
                    seq_denominator=den.sequences,
                    prox_logp=prox,
                    ref_logp=pt.get("ref_logp"),
                    entropy=ent,
                )
            )
            return out.loss, {**out.metrics, **compare}

        if self.routing_replay:
            self.take_routing_counts()  # only this step's update passes count
        n = self.token_record_interval
        recorder = None
        if n and (self.updates.step + 1) % n == 0:
            recorder = TokenRecorder(rows, [t.id for g in kept for t in g])
        self.updates.recorder = recorder
        try:
            out = self.updates.run(rows, loss_of, extra, self.mini_batches, self.ppo_epochs)
        finally:
            self.updates.recorder = None
        out.update(self.moe_loss_metrics())
        if recorder is not None:
            p = self.layout
            self.record = recorder.gather(p.dp_group, p.is_rank0, p.tp_rank)
        if self.routing_replay:
            diff, total = self.take_routing_counts()
            t = torch.tensor([diff, total], dtype=torch.float64, device=self.layout.device)
            dist.all_reduce(t)  # DP ranks: other rows; TP ranks: other sequence chunks
            out[M.MOE_ROUTING_DIFF] = float(t[0] / t[1]) if t[1] > 0 else 0.0
            out[M.MOE_REPLAY_TOKENS] = float(t[1])
        return out

    def take_record(self) -> dict | None:
        """Rank 0: the per-token arrays of the step just trained, if it was recorded (once)."""
        record, self.record = self.record, None
        return record

    def check_routed(self, rows: list[Row]) -> dict[str, float]:
        """Routing replay: each row's recorded routing must fit the model; rows without one
        (an engine that did not return it) route on their own, counted and logged."""
        k, moe = self.arch.moe_topk, list(self.arch.moe_layers)
        width = len(moe) * k
        missing = 0
        for r in rows:
            if r.routed is not None and r.routed.shape[1] == self.arch.num_layers * k != width:
                # SGLang's layout: every decoder layer (dense ones hold no routing): the MoE ones.
                n = r.routed.shape[0]
                r.routed = r.routed.reshape(n, self.arch.num_layers, k)[:, moe].reshape(n, -1)
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
        t = torch.tensor([float(missing)], dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t, group=self.layout.dp_group)
        if float(t) > 0 and self.layout.is_rank0:
            log.warning(
                "routing replay: %d trajectories carry no routed_experts; they use the "
                "learner's own routing",
                int(float(t)),
            )
        return {M.MOE_REPLAY_MISSING: float(t)}

    def moe_loss_metrics(self) -> dict[str, float]:
        """The MoE auxiliary losses of the step's updates (empty when none is on)."""
        losses = losses_of(self.model)
        if losses is None or not losses.active:
            return {}
        aux, z, _ = losses.take()
        # Each update's micro-batch shares add to 1 over the DP ranks: the sum over ranks,
        # divided by the updates, is the mean over updates.
        t = torch.tensor([aux, z], dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t, group=self.layout.dp_group)
        n = max(1, self.mini_batches * self.ppo_epochs)
        out = {}
        if losses.aux_coeff > 0:
            out[M.MOE_AUX_LOSS] = float(t[0]) / n
        if losses.z_coeff > 0:
            out[M.MOE_Z_LOSS] = float(t[1]) / n
        return out

    def take_routing_counts(self) -> tuple[float, float]:
        """(token x layer pairs whose own routing differed, pairs replayed) on this rank since
        the last call (the KL reference's are dropped)."""
        if self.ref_model is not None:
            routing.take_counts(self.ref_model)
        return routing.take_counts(self.model)

    def advantages(self, groups: Sequence[TrainGroup]) -> tuple[list[TrainGroup], list[np.ndarray]]:
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
        p = self.layout
        dp = p.dp_size > 1
        if dp:
            # Batch-wide estimators (reinforce_pp, reinforce) all-reduce inside the call: every
            # rank calls the estimator for the same sizes in the same order, with empty inputs
            # where it holds no group of that size, or the collectives would not pair up.
            gathered: list[list[int] | None] = [None] * p.dp_size
            dist.all_gather_object(gathered, sizes, group=p.dp_group)
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
                all_reduce_sum=p.all_reduce_sum if dp else None,
            )
            adv = self.algo.advantages(adv_in)
            if adv.dim() == 2:
                adv = adv.unsqueeze(-1).expand(-1, -1, t_max)
            for a, gi in enumerate(keep.tolist()):
                kept.append(same[gi])
                for b, t in enumerate(same[gi]):
                    advantages.append(adv[a, b, : len(t.response_ids)].detach().float().numpy())
        return kept, advantages
