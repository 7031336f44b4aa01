"""GLM-4 (transformers' `glm4`): the Llama-style decoder with four differences.

- q/k/v biases (`attention_bias`, on unless the config turns it off);
- RoPE on the first `partial_rotary_factor` of each head only, with pairs (2i, 2i + 1) rotating
  together (megatron's `rotary_interleaved`);
- an RMSNorm on the attention output and one on the MLP output before each residual add
  (`post_self_attn_layernorm`, `post_mlp_layernorm`): in megatron a `post_layernorm` inside the
  attention and the MLP modules (`megatron.py`); in the embedded engine `engine.py`;
- gate and up stored as one HF tensor, `mlp.gate_up_proj.weight` = cat(gate, up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from slime_async.models.family import LLAMA_LAYER_NAMES, Family
from slime_async.models.glm4.engine import Glm4Math
from slime_async.models.glm4.megatron import post_normed_layer

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


class Glm4(Family):
    model_type = "glm4"
    layer_names = {
        **LLAMA_LAYER_NAMES,
        "mlp.linear_fc1.weight": ("mlp.gate_up_proj.weight",),
        "self_attention.post_layernorm.weight": ("post_self_attn_layernorm.weight",),
        "mlp.post_layernorm.weight": ("post_mlp_layernorm.weight",),
    }
    layer_math = Glm4Math

    def arch_fields(self, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        return {
            "qkv_bias": cfg.get("attention_bias", True),
            "qk_norm": False,
            "rotary_percent": float(partial),
            "rotary_interleaved": True,
            "post_norms": True,
        }

    def layer_spec(self, spec: ModuleSpec, norm: type) -> ModuleSpec:
        return post_normed_layer(spec, norm)

    def fc1_from_hf(self, hf: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(hf[0].chunk(2, dim=0))

    def fc1_to_hf(self, gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([gate, up], dim=0)]
