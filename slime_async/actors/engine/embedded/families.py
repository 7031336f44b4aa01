"""The embedded engine's per-family layer code: what GLM-4 and Qwen3-MoE do differently from the
Llama-style decoder layer that `model_runner.py` runs over its KV cache.

The runner keeps the layer's math in the small steps of `layers.LayerMath` (input norm, q/k/v with
q/k norms, rotary, o projection, post-attention norm, MLP); a family's subclass replaces the ones
that differ (read from transformers' `glm4` and `qwen3_moe` code):

- `rotary`: Llama/Qwen rotate (i, i + d/2) pairs over the whole head; GLM-4 rotates (2i, 2i + 1)
  pairs over the first `partial_rotary_factor` of the head only (HF's rotary embedding already
  gives cos/sin of that width).
- `o_proj`: GLM-4 normalises the attention output before the residual add
  (`post_self_attn_layernorm`).
- `mlp`: GLM-4 normalises the MLP output (`post_mlp_layernorm`); Qwen3-MoE's sparse block runs
  as HF wrote it (router softmax -> top-k -> renormalised, expert SwiGLUs) on packed tokens.

Also the weight names: the learner's push and checkpoints use the checkpoint layout (one tensor
per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, what SGLang loads) while transformers 5
keeps experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`):
`param_view(params, name)` maps a checkpoint name onto the slice of the fused parameter.

And `routed_experts(model, ids)`: the top-k experts of each MoE layer for every token but the
last (SGLang's `return_routed_experts`, `[T - 1, moe_layers, k]` int32).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from slime_async.actors.engine.embedded.layers import LayerMath

FAMILIES = ("llama", "qwen2", "qwen3", "glm4", "qwen3_moe")
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved layout's rotation."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Glm4Math(LayerMath):
    """GLM-4: interleaved partial rotary, and the attention and MLP outputs normalised before
    their residual adds."""

    def rotary(self, q, k, cos, sin):
        """q, k: [T, heads, D]; cos, sin: [T, 1, rd] with rd = partial_rotary_factor * D."""
        rd = cos.shape[-1]
        cos = cos[..., : rd // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : rd // 2].repeat_interleave(2, dim=-1)

        def apply(x):
            rot, rest = x[..., :rd], x[..., rd:]
            return torch.cat((rot * cos + _rotate_pairs(rot) * sin, rest), dim=-1)

        return apply(q), apply(k)

    def o_proj(self, li: int, o: torch.Tensor) -> torch.Tensor:
        layer = self.layers[li]
        return layer.post_self_attn_layernorm(layer.self_attn.o_proj(o))

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[li]
        return layer.post_mlp_layernorm(layer.mlp(x))


class MoeMath(LayerMath):
    """Qwen3-MoE: HF's sparse block wants [batch, seq, hidden]; the runner's tokens are packed."""

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[li].mlp(x[None])[0]


def check(model_path: str, model_type: str) -> None:
    """Refuse a model type the engine does not serve, naming the families it does."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"{model_path}: model_type {model_type!r} is not served by the embedded engine "
            f"(families: {', '.join(FAMILIES)})"
        )


def layer_math(model, head_dim: int) -> LayerMath:
    """The per-layer math (HF modules, exact) of the model's family."""
    cls = {"glm4": Glm4Math, "qwen3_moe": MoeMath}.get(model.config.model_type, LayerMath)
    return cls(model, head_dim)


def param_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The parameter (or the slice of a fused one) that checkpoint tensor `name` fills; None when
    the model has no such tensor."""
    if name in params:
        return params[name]
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


def moe_gates(model) -> list:
    """The router of each MoE layer, in layer order (empty for a dense model)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


@torch.inference_mode()
def routed_experts(model, ids: list[int]) -> np.ndarray:
    """[len(ids) - 1, moe_layers, k] int32: the experts each token but the last goes through,
    from one forward pass of `ids[:-1]` (no KV cache) with the model's current weights."""
    gates = moe_gates(model)
    if not gates:
        raise ValueError(f"{model.config.model_type} has no MoE layers: no routed experts")
    picked: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, i, o: picked.append(o[2])) for g in gates]
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([ids[:-1]], dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).to("cpu", torch.int32).numpy()
