"""Qwen3-MoE (transformers' `qwen3_moe`): Qwen3's attention (q/k norms) and, on the layers where
`(i + 1) % decoder_sparse_step == 0` and `i not in mlp_only_layers`, a sparse MLP; the other
layers keep a dense MLP of `intermediate_size`.

- Routing: a softmax over all experts -> top-k -> renormalised when `norm_topk_prob`; the experts
  are SwiGLU MLPs, no shared expert. Megatron-core's router computes exactly that, set up by
  `megatron.py` from ModelArch's MoE fields (read here); the experts run as grouped GEMMs
  (`models/moe_layer.py`), so the layer spec changes nothing beyond Qwen3's.
- Weights: the router `mlp.gate.weight` is megatron's `mlp.router.weight`; expert e's
  `mlp.experts.{e}.{gate,up,down}_proj.weight` (the checkpoint layout, which SGLang also loads)
  is slice i of `mlp.experts.weight{1,2}` (gate and up stacked in weight1) on the EP rank
  holding e (`convert.py` finds the rank).
- The embedded engine computes HF's sparse block as grouped GEMMs and records each token's
  experts (`engine.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from slime_async.models.family import LLAMA_LAYER_NAMES, UnsupportedModel
from slime_async.models.llama import Qwen3
from slime_async.models.qwen3_moe import engine


class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"
    layer_names = {**LLAMA_LAYER_NAMES, "mlp.router.weight": ("mlp.gate.weight",)}
    layer_math = engine.MoeMath

    def check_config(self, cfg: dict[str, Any]) -> None:
        if cfg.get("attention_bias"):
            raise UnsupportedModel("qwen3_moe with attention_bias is not supported")

    def arch_fields(self, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
        fields = super().arch_fields(cfg, rope)
        # transformers 5 writes num_local_experts; the hub's configs say num_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts == 0:
            return fields
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        n = cfg["num_hidden_layers"]
        return {
            **fields,
            "num_experts": experts,
            "moe_topk": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "moe_norm_topk": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0),
        }

    def expert_names(self, expert: int, fc: str) -> tuple[str, ...]:
        x = f"mlp.experts.{expert}."
        if fc == "linear_fc1":
            return (x + "gate_proj.weight", x + "up_proj.weight")
        return (x + "down_proj.weight",)

    def is_hf_expert(self, name: str) -> bool:
        return ".mlp.experts." in name

    def param_view(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        return params[name] if name in params else engine.expert_view(params, name)

    def moe_gates(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]

    def routed_experts(self, model: torch.nn.Module, ids: list[int]) -> np.ndarray:
        gates = self.moe_gates(model)
        if not gates:
            return super().routed_experts(model, ids)
        return engine.routed_experts(model, gates, ids)
