"""The contract between the learner and the algorithms.

A policy loss is `fn(inp: LossInput, cfg: AlgoConfig) -> LossOutput`. It is called once per
micro-batch; `inp.token_denominator` / `inp.seq_denominator` are the totals over the whole
optimizer step (all micro-batches, all data-parallel ranks), so the learner sums the returned
losses' gradients and all-reduces them with SUM, whatever the aggregation.

An advantage estimator is `fn(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> Tensor`
returning one advantage per trajectory `[G, n]` (broadcast over its tokens by the learner) or
per token `[G, n, T]`. `state` persists across steps (running baselines). Batch-wide estimators
see the other data-parallel ranks' rewards only through `inp.all_reduce_sum`.

Both registries also accept `package.module:function`; the signature is checked at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slime_async.utils.plugins import Registry

LOSSES = Registry("loss", params=("inp", "cfg"), is_async=False)
ADVANTAGES = Registry(
    "advantage estimator", params=("inp", "cfg", "state"), is_async=False, entry_kind="advantage"
)


@dataclass
class LossInput:
    logp: torch.Tensor
    """[B, T] log-probs of the response tokens under the current policy (with grad)."""
    behavior_logp: torch.Tensor
    """[B, T] log-probs from the engine that sampled the tokens (mu); no grad."""
    advantages: torch.Tensor
    """[B, T] per-token advantages."""
    loss_mask: torch.Tensor
    """[B, T] float, 1 for model tokens that are trained on, 0 for padding and env tokens."""
    versions: torch.Tensor
    """[B, T] int, policy version that produced each token."""
    current_version: int
    """The learner's policy version at the start of this step."""
    token_denominator: float
    """Masked tokens in the whole step (all micro-batches and ranks)."""
    seq_denominator: float
    """Sequences in the whole step (all micro-batches and ranks)."""
    prox_logp: torch.Tensor | None = None
    """[B, T] log pi_prox (no grad): the policy at the start of the batch, from a forward pass
    before its first mini-batch update; the PPO family's trust region is around it."""
    ref_logp: torch.Tensor | None = None
    """[B, T] reference (initial) policy log-probs for a KL penalty, when configured."""
    entropy: torch.Tensor | None = None
    """[B, T] per-token entropy of the current policy (with grad), when configured."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar: this micro-batch's share of the step's loss (already divided by the denominator)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Named statistics of this micro-batch (sums or means; see the loss's docstring)."""


@dataclass
class AdvantageInput:
    rewards: torch.Tensor
    """[G, n] reward of each trajectory; G groups of n samples of one prompt."""
    response_lengths: torch.Tensor
    """[G, n] number of model (loss-mask 1) tokens of each trajectory."""
    token_mask: torch.Tensor | None = None
    """[G, n, T] loss mask, for estimators that return per-token advantages."""
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Given a tensor, its elementwise sum over all data-parallel ranks (None: one rank).

    Batch-wide estimators (reinforce_pp, reinforce) call it so that the batch is every rank's
    part; every rank must then call the estimator equally often each step, in the same order."""
