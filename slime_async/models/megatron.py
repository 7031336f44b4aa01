"""A megatron-core GPTModel built from a Hugging Face config of the dense Llama / Qwen2 / Qwen3 families.

`ModelArch.from_hf_dir(dir)` reads config.json (no transformers import) and refuses what the
families' megatron mapping cannot reproduce exactly (RoPE scaling, biases outside QKV, other
activations). `build_gpt_model(arch, dtype)` builds the model with megatron-core's local layer
spec (no Transformer Engine, no apex), so the same code runs on CPU (gloo) and GPU (NCCL).
Call `megatron_compat.apply()` and `parallel_state.initialize_model_parallel()` first.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

FAMILIES = ("llama", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The HF config describes something this mapping cannot reproduce exactly."""


@dataclass(frozen=True)
class ModelArch:
    """The architecture of one HF causal LM, in the terms both sides need."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Qwen2: biases on q/k/v projections only."""
    qk_norm: bool
    """Qwen3: per-head RMSNorm on queries and keys before RoPE."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise UnsupportedModel(f"model_type {family!r} is not one of {FAMILIES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r}: only silu (SwiGLU) is supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModel(f"RoPE scaling {rope_type!r} is not supported")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise UnsupportedModel("llama with attention_bias/mlp_bias is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{path}: no config.json (not a Hugging Face model directory)")
        return cls.from_hf_config(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_tensor_parallel(self, tp: int) -> None:
        """Megatron shards heads, kv groups, the FFN and the vocabulary over TP ranks."""
        for name, n in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            # Not padded: padded vocab rows would add exp(logit) terms and change log-probs.
            ("vocab_size", self.vocab_size),
        ):
            if n % tp:
                raise UnsupportedModel(f"{name}={n} is not divisible by tensor_parallel={tp}")


def build_gpt_model(
    arch: ModelArch,
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    on_cpu: bool = True,
):
    """A GPTModel for `arch` on this rank's TP shard; `init=False` skips random init (to load)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    arch.check_tensor_parallel(tp)
    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Every fusion off: they need CUDA kernels (apex/TE) that the CPU path lacks.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=init,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    theta = arch.rope_theta
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        parallel_output=True,
    )
    # torch.nn.RMSNorm ignores params_dtype; the whole model computes in one dtype.
    model.to(dtype=dtype)
    if not on_cpu:
        model.cuda(torch.cuda.current_device())
    return model
