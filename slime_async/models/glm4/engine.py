"""GLM-4 in the embedded engine: HF's own modules with the two steps that differ from the
Llama-style layer (read from transformers' `glm4` code).

- `rotary`: GLM-4 rotates (2i, 2i + 1) pairs over the first `partial_rotary_factor` of the head
  only (HF's rotary embedding already gives cos/sin of that width);
- `o_proj` and `mlp`: the attention and MLP outputs are normalised before their residual adds
  (`post_self_attn_layernorm`, `post_mlp_layernorm`).
"""

from __future__ import annotations

import torch

from slime_async.models.layer_math import LayerMath


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
