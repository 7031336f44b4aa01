"""Qwen3-MoE in the embedded engine: HF's sparse block on packed tokens, expert tensors by their
checkpoint names, and the experts each token went through.

The learner's push and checkpoints use the checkpoint layout (one tensor per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, what SGLang loads) while transformers 5 keeps the
experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`):
`expert_view` maps a checkpoint name onto the slice of the fused parameter. `routed_experts`
answers SGLang's `return_routed_experts`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from slime_async.models.layer_math import LayerMath

_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class MoeMath(LayerMath):
    """HF's sparse block wants [batch, seq, hidden]; the runner's tokens are packed."""

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[li].mlp(x[None])[0]


def expert_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a fused expert parameter that checkpoint tensor `name` fills (None: none)."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None or e >= fused.shape[0] else fused[e]
    fused = params.get(f"{prefix}.gate_up_proj")  # [E, 2I, H]: gate rows, then up rows
    if fused is None or e >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if which == "gate_proj" else fused[e, half:]


@torch.inference_mode()
def routed_experts(
    model: torch.nn.Module, gates: list[torch.nn.Module], ids: list[int]
) -> np.ndarray:
    """[len(ids) - 1, len(gates), k] int32: the experts each token but the last goes through,
    from one forward pass of `ids[:-1]` (no KV cache) with the model's current weights; HF's
    routers return (logits, weights, expert indices)."""
    picked: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, i, o: picked.append(o[2])) for g in gates]
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([ids[:-1]], dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).to("cpu", torch.int32).numpy()
