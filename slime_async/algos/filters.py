"""Reward shaping and group selection that run before the advantage estimator."""

from __future__ import annotations

import torch

from slime_async.config.algo import AlgoConfig


def overlong_penalty(response_lengths: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment, `[G, n]` (0 when `overlong_max_len` is None).

    With L = length, L_max = overlong_max_len, L_buf = overlong_buffer_len, f = factor:
        0                               if L <= L_max - L_buf
        f * (L_max - L_buf - L) / L_buf if L_max - L_buf < L <= L_max
        -f                              if L > L_max
    """
    length = response_lengths.to(torch.float32)
    if cfg.overlong_max_len is None:
        return torch.zeros_like(length)
    start = cfg.overlong_max_len - cfg.overlong_buffer_len
    ramp = (start - length) / max(cfg.overlong_buffer_len, 1)
    penalty = torch.where(length > start, ramp, torch.zeros_like(length))
    penalty = torch.where(length > cfg.overlong_max_len, torch.full_like(length, -1.0), penalty)
    return cfg.overlong_penalty_factor * penalty


def shape_rewards(
    rewards: torch.Tensor, response_lengths: torch.Tensor, cfg: AlgoConfig
) -> torch.Tensor:
    """`[G, n]` rewards plus the overlong penalty."""
    return rewards.to(torch.float32) + overlong_penalty(response_lengths, cfg)


def nonzero_variance_groups(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """`[G']` long: indices of the groups of `rewards: [G, n]` whose reward std exceeds `eps`.

    DAPO's dynamic sampling: a group whose samples all got the same reward has advantage 0
    under any group baseline and only dilutes the step's token denominator.
    """
    std = rewards.to(torch.float32).std(dim=1, unbiased=False)  # population std: 0 for n = 1
    return torch.nonzero(std > eps, as_tuple=False).reshape(-1)


def keep_groups(
    rewards: torch.Tensor, response_lengths: torch.Tensor, cfg: AlgoConfig
) -> torch.Tensor:
    """`[G']` long: the groups to train on (all unless `filter_zero_variance`).

    The filter sees the shaped rewards: an overlong penalty that separates otherwise equal
    samples gives the group a signal worth keeping.
    """
    if not cfg.filter_zero_variance:
        return torch.arange(rewards.shape[0], device=rewards.device)
    return nonzero_variance_groups(shape_rewards(rewards, response_lengths, cfg), cfg.filter_eps)
