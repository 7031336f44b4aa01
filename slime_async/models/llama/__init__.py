"""Llama, Qwen2 and Qwen3: the Llama-style dense decoder, one family with two flags.

Read from transformers' `llama`, `qwen2` and `qwen3` modeling code, the three decoder layers are
the same modules (RMSNorm, grouped-query attention with RoPE over (i, i + d/2) pairs, a SwiGLU
MLP) under the same weight names. Qwen2 adds biases on the q/k/v projections (always: its config
has no switch), Qwen3 a per-head RMSNorm on queries and keys before RoPE. Both are flags of
megatron-core's local layer (`add_qkv_bias`, `qk_layernorm`) and tensors that exist or do not,
so each model type is `Family`'s defaults (the local layer spec, the Llama weight names,
`LayerMath` and the embedded engine's fused path) with its flag set in `arch_fields`.
"""

from __future__ import annotations

from typing import Any

from slime_async.models.family import Family, UnsupportedModel


class Llama(Family):
    model_type = "llama"

    def check_config(self, cfg: dict[str, Any]) -> None:
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModel("llama with attention_bias/mlp_bias is not supported")


class Qwen2(Family):
    model_type = "qwen2"

    def arch_fields(self, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
        return {**super().arch_fields(cfg, rope), "qkv_bias": True}


class Qwen3(Family):
    model_type = "qwen3"

    def arch_fields(self, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
        return {**super().arch_fields(cfg, rope), "qk_norm": True}
