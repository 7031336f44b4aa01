"""Qwen3-MoE in the embedded engine: the sparse block on packed tokens as grouped GEMMs, expert
tensors by their checkpoint names, and the experts each token went through.

`MoeMath.mlp` computes what HF's `Qwen3MoeSparseMoeBlock` computes (its router: softmax in fp32,
top-k, renormalised with `norm_topk_prob`; each expert's SwiGLU output scaled by its weight and
summed per token in expert order) with HF's own fused weights, but as two grouped GEMMs over the
token-expert pairs sorted by expert (`models/grouped_experts.py`) instead of a loop over the
experts that reads which experts were hit back to the host. The experts each token chose in each
MoE layer are kept (`picked`) for the runner to record (routing replay).

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
import torch.nn.functional as F

from slime_async.models.grouped_experts import sort_by_expert, swiglu_experts
from slime_async.models.layer_math import LayerMath

_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class MoeMath(LayerMath):
    """Dense layers through HF's MLP; sparse ones through `sparse_block` (module docstring)."""

    def __init__(self, model: torch.nn.Module, head_dim: int):
        super().__init__(model, head_dim)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if hasattr(layer.mlp, "gate")]
        self._index = {li: j for j, li in enumerate(self.moe_layers)}
        self.topk = int(model.config.num_experts_per_tok)
        self.picked: list[torch.Tensor | None] = [None] * len(self.moe_layers)
        """MoE layer j -> `[T, k]` int64 experts of each token of the last forward pass."""
        self._silu = model.config.hidden_act == "silu"

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        block = self.layers[li].mlp
        j = self._index.get(li)
        if j is None:
            return block(x)
        if not self._silu:  # HF's own block (its activation); routing read from its router
            _, _, ids = block.gate(x)
            self.picked[j] = ids
            return block(x[None])[0]
        out, self.picked[j] = sparse_block(block, x, self.topk)
        return out


def sparse_block(
    block: torch.nn.Module, x: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's Qwen3-MoE sparse block on packed x `[T, H]` as grouped GEMMs: (`[T, H]`, the
    experts `[T, k]`)."""
    gate, experts = block.gate, block.experts
    logits = F.linear(x, gate.weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    order, counts = sort_by_expert(ids, gate.weight.shape[0])
    tok = order // k
    y = swiglu_experts(x.index_select(0, tok), experts.gate_up_proj, experts.down_proj, counts)
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    # Summed per token in expert order, as HF's loop over the experts adds them.
    return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype)), ids


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
