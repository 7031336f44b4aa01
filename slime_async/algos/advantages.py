"""Advantage estimators: one advantage per trajectory, `[G, n]`, from rewards `[G, n]`.

G groups of n samples of one prompt each. The learner broadcasts a trajectory's advantage over
its model tokens. Reward shaping (overlong penalty) and the group filter run before these
(filters.py, via `Algorithm.advantages`).

Arithmetic is in float64 and the result is cast to float32 once. A group (or, for the batch-wide
estimators, a batch) whose rewards are all equal gets advantages of exactly 0: it is detected by
comparing rewards, never by trusting `r - mean(r)` to round to 0 (eight rewards of -0.3 in
float32 leave a mean off by one ulp, and dividing that by a zero std plus eps gave about +-0.03).

`min_group_size(name)` is the smallest group an estimator can learn from (2 for the group
baselines); the config cross-check calls it, and the estimators refuse smaller groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slime_async.algos.api import ADVANTAGES, AdvantageInput
from slime_async.config.algo import AlgoConfig


def _needs_group_of(n_min: int) -> Callable:
    """Mark an estimator with the smallest group size it can learn from (`fn.min_group_size`)."""

    def mark(fn: Callable) -> Callable:
        fn.min_group_size = n_min  # type: ignore[attr-defined]
        return fn

    return mark


def min_group_size(estimator: str) -> int:
    """Smallest `generator.group_size` the estimator `estimator` (name or import path) can use.

    grpo, dr_grpo and rloo compare each sample with the others of its group: with one sample
    there is nothing to compare with (grpo/dr_grpo would train on advantages of 0, rloo divides
    by n - 1 = 0), so they need 2. reinforce and reinforce_pp need 1. A user's estimator may
    declare its own with a `min_group_size` attribute on the function; without one, 1.
    """
    return int(getattr(ADVANTAGES.resolve(estimator), "min_group_size", 1))


def _check_group_size(name: str, r: torch.Tensor) -> None:
    n = r.shape[1]
    if n < 2:
        raise ValueError(
            f"advantage estimator {name!r} needs groups of at least 2 samples, got group size "
            f"{n}: with one sample its advantage carries no signal. Set generator.group_size >= 2 "
            "or use algo.advantage = 'reinforce_pp' or 'reinforce'"
        )


def _rewards64(inp: AdvantageInput) -> torch.Tensor:
    return inp.rewards.to(torch.float64)


def _zero_if_equal(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """`a: [G, n]` with the rows of groups whose rewards `r: [G, n]` all agree set to exact 0."""
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # [G, 1]
    return torch.where(equal, torch.zeros_like(a), a)


@ADVANTAGES.register("grpo")
@_needs_group_of(2)
def grpo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_j r_j) / (std_j r_j + eps), within the group; 0 if all r_j agree.

    With `advantage_std_norm = false` the division is skipped (then equal to dr_grpo).
    std is the sample std (n - 1), as in the GRPO paper's reference code.
    """
    _check_group_size("grpo", inp.rewards)
    r = _rewards64(inp)
    a = r - r.mean(dim=1, keepdim=True)
    if cfg.advantage_std_norm:
        a = a / (r.std(dim=1, keepdim=True, unbiased=True) + cfg.advantage_eps)
    return _zero_if_equal(a, r).to(torch.float32)


@ADVANTAGES.register("dr_grpo")
@_needs_group_of(2)
def dr_grpo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean_j r_j (no std normalisation); 0 if all r_j agree.

    Dr.GRPO also drops the per-response length normalisation: pair it with
    aggregation = "seq_mean_token_sum_norm" (or the default token_mean).
    """
    _check_group_size("dr_grpo", inp.rewards)
    r = _rewards64(inp)
    return _zero_if_equal(r - r.mean(dim=1, keepdim=True), r).to(torch.float32)


@ADVANTAGES.register("rloo")
@_needs_group_of(2)
def rloo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """RLOO: A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_j r_j); 0 if all agree."""
    _check_group_size("rloo", inp.rewards)
    r = _rewards64(inp)
    n = r.shape[1]
    return _zero_if_equal(r - (r.sum(dim=1, keepdim=True) - r) / (n - 1), r).to(torch.float32)


def _global_sum(inp: AdvantageInput, x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the data-parallel ranks (`inp.all_reduce_sum`), or `x` on one rank."""
    if inp.all_reduce_sum is None:
        return x
    out = inp.all_reduce_sum(x.clone())
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise ValueError(
            "AdvantageInput.all_reduce_sum must return a tensor of the shape it was given "
            f"{tuple(x.shape)}, got {out!r}"
        )
    return out.to(device=x.device, dtype=x.dtype)


@ADVANTAGES.register("reinforce_pp")
@_needs_group_of(1)
def reinforce_pp(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """REINFORCE++: A = (r - mean(r)) / (std(r) + eps) over every trajectory of the whole batch.

    "The whole batch" is every data-parallel rank's part: with `inp.all_reduce_sum` the mean
    comes from the summed (count, sum) and the sample std from the summed squared deviations
    from that mean (two small all-reduces; every rank gets the same mean and std). If every
    reward of the batch is equal the advantages are exact 0: then every reward lies on one side
    of (or on) the float64 mean, which for distinct float32 rewards cannot happen, so the
    summed counts of rewards above and below the mean detect it on every rank.
    No per-prompt baseline: normalising over the whole batch is what keeps it stable. (The KL
    to the reference goes into the loss here, `kl_coef`, not into the reward.)
    """
    r = _rewards64(inp)
    flat = r.reshape(-1)
    count, total = _global_sum(inp, torch.stack([flat.new_tensor(flat.numel()), flat.sum()]))
    if count < 1:
        return torch.zeros_like(r, dtype=torch.float32)
    mean = total / count
    dev = flat - mean
    sq, above, below = _global_sum(
        inp,
        torch.stack([(dev * dev).sum(), (dev > 0).sum().to(r.dtype), (dev < 0).sum().to(r.dtype)]),
    )
    if above == 0 or below == 0:
        return torch.zeros_like(r, dtype=torch.float32)
    std = torch.sqrt(sq / (count - 1))
    return ((r - mean) / (std + cfg.advantage_eps)).to(torch.float32)


@ADVANTAGES.register("reinforce")
@_needs_group_of(1)
def reinforce(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """REINFORCE with a running baseline: A = r - b, then b <- d b + (1 - d) mean(r).

    d = `baseline_decay`; mean(r) is over the whole batch, every data-parallel rank's part
    (`inp.all_reduce_sum` of (count, sum)), so every rank holds the same baseline and rank 0's
    checkpoint of it is everyone's. b starts at the first batch's mean reward and lives in
    `state["baseline"]` (a float, saved with the learner's checkpoint).
    """
    r = _rewards64(inp)
    count, total = _global_sum(inp, torch.stack([r.new_tensor(r.numel()), r.sum()]))
    if count < 1:
        return torch.zeros_like(r, dtype=torch.float32)
    batch_mean = float(total / count)
    b = float(state.get("baseline", batch_mean))
    state["baseline"] = cfg.baseline_decay * b + (1 - cfg.baseline_decay) * batch_mean
    return (r - b).to(torch.float32)
