"""Routing replay for megatron-core MoE models: the learner's forward goes through the experts
that generation chose, and counts how often its own router would have chosen differently.

The engine records, for every token but the last, the top-k experts of each MoE layer
(`Trajectory.routed_experts`, `[T - 1, moe_layers, k]`, SGLang's `return_routed_experts`).
megatron-core (0.16+) builds each router with a `RouterReplay` when
`moe_enable_routing_replay` is set; `set_replay(model, per_layer, valid)` hands each router its
`[tokens, k]` targets in the order the router sees tokens (sequence-major, `[s, b]` flattened,
this TP rank's sequence chunk under sequence parallelism) and the replayed forward takes those
experts, with the router's own probabilities for them (so the router still gets a gradient).
Not megatron's global instance list: a process may hold several models (the KL reference).
"""

from __future__ import annotations

import torch

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


def routers(model: torch.nn.Module) -> list:
    """The RouterReplay of each MoE layer of `model`, in layer order (empty: replay is off)."""
    out = []
    for m in model.modules():
        rr = getattr(m, "router_replay", None)
        if rr is not None:
            if not hasattr(rr, "slime_counts"):
                _count_differences(rr)
            out.append(rr)
    return out


def _count_differences(rr) -> None:
    """Wrap this router's top-k so that, while replaying, it also computes its own choice and
    counts the valid tokens whose expert set differs from the replayed one."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    # [tokens whose own top-k differs, tokens compared], on the device: read once a step.
    rr.slime_counts = [0.0, 0.0]
    rr.slime_valid = None
    replay_topk = rr.get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if rr.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, own = default_compute_topk(
                    scores, topk, num_groups=num_groups, group_topk=group_topk
                )
                target = rr.target_topk_idx.to(own.device)
                same = (own.sort(-1).values == target.sort(-1).values).all(-1)
                valid = rr.slime_valid.to(own.device)
                rr.slime_counts[0] = rr.slime_counts[0] + (~same & valid).sum()
                rr.slime_counts[1] = rr.slime_counts[1] + valid.sum()
        return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    rr.get_replay_topk = get_replay_topk


def set_replay(model: torch.nn.Module, per_layer: list[torch.Tensor], valid: torch.Tensor) -> None:
    """Replay `per_layer[i]` ([tokens, k] int64) in MoE layer i; `valid` [tokens] bool marks the
    real (non-padding) tokens the difference count covers."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rrs = routers(model)
    if len(rrs) != len(per_layer):
        raise ValueError(
            f"routing replay: {len(per_layer)} layers of routing for {len(rrs)} MoE layers"
        )
    for rr, idx in zip(rrs, per_layer, strict=True):
        rr.clear_indices()
        rr.set_target_indices(idx)
        rr.slime_valid = valid
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(model: torch.nn.Module) -> None:
    """Back to the router's own choice (and drop the targets)."""
    for rr in routers(model):
        rr.clear_indices()
        rr.clear_router_replay_action()
        rr.slime_valid = None


def take_counts(model: torch.nn.Module) -> tuple[float, float]:
    """(tokens x layers whose own routing differed, tokens x layers compared) since last call."""
    diff = total = 0.0
    for rr in routers(model):
        diff += float(rr.slime_counts[0])
        total += float(rr.slime_counts[1])
        rr.slime_counts = [0.0, 0.0]
    return diff, total


def router_token_mask(input_lens: torch.Tensor, s: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """`[s_local * B]` bool: the real tokens of padded rows of `input_lens` `[B]` in the order a
    router sees them (sequence-major, this TP rank's sequence chunk); S a multiple of tp_size."""
    chunk = s // tp_size
    lo, hi = tp_rank * chunk, (tp_rank + 1) * chunk
    lens = input_lens.to(input_lens.device)
    valid = torch.arange(s, device=lens.device)[:, None] < lens[None, :]  # [S, B]
    return valid[lo:hi].reshape(-1)


def replay_targets(
    routed: torch.Tensor, input_lens: torch.Tensor, tp_rank: int, tp_size: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """routed `[B, S, L, k]` (padding rows arbitrary) -> per layer `[s_local * B, k]` in the
    router's token order, and the `[s_local * B]` validity mask; S is a multiple of tp_size."""
    b, s, n_layers, k = routed.shape
    chunk = s // tp_size
    lo, hi = tp_rank * chunk, (tp_rank + 1) * chunk
    valid = torch.arange(s, device=routed.device)[:, None] < input_lens.to(routed.device)[None, :]
    pad = torch.arange(k, device=routed.device).expand(b, s, n_layers, k)
    routed = torch.where(valid.t()[:, :, None, None], routed, pad)
    local = routed[:, lo:hi].transpose(0, 1)  # [s_local, B, L, k]
    per_layer = [local[:, :, i].reshape(-1, k).long() for i in range(n_layers)]
    return per_layer, valid[lo:hi].reshape(-1)
