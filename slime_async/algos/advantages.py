"""Advantage estimators: one advantage per trajectory, `[G, n]`, from rewards `[G, n]`.

G groups of n samples of one prompt each. The learner broadcasts a trajectory's advantage over
its model tokens. Reward shaping (overlong penalty) and the group filter run before these
(filters.py, via `Algorithm.advantages`).
"""

from __future__ import annotations

import torch

from slime_async.algos.api import ADVANTAGES, AdvantageInput
from slime_async.config.algo import AlgoConfig


def _group_std(r: torch.Tensor) -> torch.Tensor:
    """`[G, 1]` sample std (n - 1 in the denominator); 0 for groups of one."""
    if r.shape[1] < 2:
        return torch.zeros_like(r[:, :1])
    return r.std(dim=1, keepdim=True, unbiased=True)


@ADVANTAGES.register("grpo")
def grpo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_j r_j) / (std_j r_j + eps), within the group.

    With `advantage_std_norm = false` the division is skipped (then equal to dr_grpo).
    std is the sample std (n - 1), as in the GRPO paper's reference code.
    """
    r = inp.rewards.to(torch.float32)
    a = r - r.mean(dim=1, keepdim=True)
    if cfg.advantage_std_norm:
        a = a / (_group_std(r) + cfg.advantage_eps)
    return a


@ADVANTAGES.register("dr_grpo")
def dr_grpo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean_j r_j (no std normalisation).

    Dr.GRPO also drops the per-response length normalisation: pair it with
    aggregation = "seq_mean_token_sum_norm" (or the default token_mean).
    """
    r = inp.rewards.to(torch.float32)
    return r - r.mean(dim=1, keepdim=True)


@ADVANTAGES.register("rloo")
def rloo(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """RLOO: A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_j r_j)."""
    r = inp.rewards.to(torch.float32)
    n = r.shape[1]
    if n < 2:
        raise ValueError(f"rloo needs groups of at least 2 samples, got group size {n}")
    return r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """REINFORCE++: A = (r - mean(r)) / (std(r) + eps) over every trajectory of the batch.

    No per-prompt baseline: normalising over the whole batch is what keeps it stable. (The KL
    to the reference goes into the loss here, `kl_coef`, not into the reward.)
    """
    r = inp.rewards.to(torch.float32)
    flat = r.reshape(-1)
    std = flat.std(unbiased=True) if flat.numel() > 1 else flat.new_zeros(())
    return (r - flat.mean()) / (std + cfg.advantage_eps)


@ADVANTAGES.register("reinforce")
def reinforce(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> torch.Tensor:
    """REINFORCE with a running baseline: A = r - b, then b <- d b + (1 - d) mean(r).

    d = `baseline_decay`. b starts at the first batch's mean reward and lives in
    `state["baseline"]` (a float, saved with the learner's checkpoint).
    """
    r = inp.rewards.to(torch.float32)
    batch_mean = float(r.mean())
    b = float(state.get("baseline", batch_mean))
    state["baseline"] = cfg.baseline_decay * b + (1 - cfg.baseline_decay) * batch_mean
    return r - b
