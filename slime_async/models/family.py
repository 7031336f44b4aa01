"""What a model family is here: one object per HF `model_type` (`families.FAMILIES`) that answers
what the generic code asks about the family, in four parts:

- the HF config (`arch.py` reads what every family writes alike): what the family refuses
  (`check_config`) and the `ModelArch` fields that differ between families (`arch_fields`);
- megatron (`megatron.py` builds megatron-core's local layer from ModelArch's fields): what the
  family changes in that layer's spec (`layer_spec`);
- the weights (`convert.py` does the TP/EP sharding): the HF names of each megatron parameter of
  a layer (`layer_names`, `expert_names`, `is_hf_expert`) and how the HF checkpoint stores gate
  and up (`fc1_from_hf`, `fc1_to_hf`);
- the embedded engine (it runs the HF model's own modules): the per-layer math (`layer_math`),
  the model tensor a checkpoint tensor fills (`param_view`) and the MoE routers (`moe_gates`,
  `routed_experts`).

The defaults are the Llama-style decoder (`llama/`); each other family's folder changes what
differs. A family never takes a `ModelArch`: `arch.py` builds one by asking the family, so what
a family needs it reads from the HF config (or from the HF model) itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slime_async.models.layer_math import LayerMath

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


class UnsupportedModel(ValueError):
    """The HF config describes something this mapping cannot reproduce exactly."""


LLAMA_LAYER_NAMES: Mapping[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
    "self_attention.linear_qkv.bias": tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
"""Megatron parameter (after `decoder.layers.{i}.`) -> its HF tensors (after `model.layers.{i}.`)
in merge order; the biases and q/k norms exist where the arch has them."""


class Family:
    """The Llama-style decoder; a family's subclass replaces what its model does differently."""

    model_type: str
    layer_names: Mapping[str, tuple[str, ...]] = LLAMA_LAYER_NAMES
    layer_math: type[LayerMath] = LayerMath
    """The embedded engine's per-layer math, `layer_math(model, head_dim)`."""

    # ---- the HF config

    def check_config(self, cfg: dict[str, Any]) -> None:
        """Raise UnsupportedModel for what this family's mapping cannot reproduce."""

    def arch_fields(self, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
        """The ModelArch fields that differ between families; `rope`: the config's RoPE
        parameters (`rope_parameters`, or `rope_scaling`)."""
        return {"qkv_bias": False, "qk_norm": False}

    # ---- megatron

    def layer_spec(self, spec: ModuleSpec, norm: type) -> ModuleSpec:
        """Megatron-core's local layer spec as this family changes it; `norm`: the RMSNorm
        class the spec uses."""
        return spec

    # ---- the weights

    def expert_names(self, expert: int, fc: str) -> tuple[str, ...] | None:
        """The HF tensors (after `model.layers.{i}.`) of routed expert `expert`'s `fc`
        ("linear_fc1" or "linear_fc2"); None: the family has no experts."""
        return None

    def is_hf_expert(self, name: str) -> bool:
        """Whether HF tensor `name` belongs to one routed expert."""
        return False

    def fc1_from_hf(self, hf: list[torch.Tensor]) -> list[torch.Tensor]:
        """[gate, up] from the HF tensors of `linear_fc1`'s names."""
        return hf

    def fc1_to_hf(self, gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors of `linear_fc1`'s names from its full gate and up."""
        return [gate, up]

    # ---- the embedded engine

    def param_view(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """The model parameter (or the slice of a fused one) that checkpoint tensor `name`
        fills; None when the model has no such tensor."""
        return params.get(name)

    def moe_gates(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The router of each MoE layer, in layer order (empty for a dense model)."""
        return []

    def routed_experts(self, model: torch.nn.Module, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, moe_layers, k] int32: the experts each token but the last goes through."""
        raise ValueError(f"{model.config.model_type} has no MoE layers: no routed experts")
