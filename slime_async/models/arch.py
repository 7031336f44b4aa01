"""`ModelArch`: the architecture of one HF causal LM in the terms the learner's model builder,
the conversion and a checkpoint need, read from config.json (no transformers import).

`from_hf_config` reads what every family writes alike and refuses what no family's mapping can
reproduce exactly (RoPE scaling, activations other than SiLU, sliding-window attention); the
family of the `model_type` (`families.py`) refuses what its own mapping cannot reproduce and
reads the fields that differ (biases, norms, the rotary layout, the experts).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slime_async.models.families import family_of
from slime_async.models.family import UnsupportedModel


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
    """Qwen2, GLM-4: biases on q/k/v projections only."""
    qk_norm: bool
    """Qwen3: per-head RMSNorm on queries and keys before RoPE."""
    rotary_percent: float = 1.0
    """GLM-4: the fraction of each head's dims that RoPE rotates (partial_rotary_factor)."""
    rotary_interleaved: bool = False
    """GLM-4: RoPE rotates pairs (2i, 2i + 1) instead of (i, i + d/2)."""
    post_norms: bool = False
    """GLM-4: RMSNorm on the attention output and on the MLP output before each residual add
    (the glm4 family's megatron layer and engine layer math add them)."""
    num_experts: int = 0
    """Qwen3-MoE: routed experts per MoE layer (0: a dense model)."""
    moe_topk: int = 0
    """Experts each token goes through (num_experts_per_tok)."""
    moe_intermediate_size: int = 0
    """FFN width of one expert."""
    moe_norm_topk: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (norm_topk_prob)."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the MoE layers (the others are dense MLPs of intermediate_size)."""

    def __post_init__(self):
        # JSON (a checkpoint's common part) gives a list; equality needs the tuple.
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        family = family_of(cfg.get("model_type"))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r}: only silu (SwiGLU) is supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModel(f"RoPE scaling {rope_type!r} is not supported")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        family.check_config(cfg)
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        fields = family.arch_fields(cfg, rope)
        return cls(
            family=family.model_type,
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
            **fields,
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{path}: no config.json (not a Hugging Face model directory)")
        return cls.from_hf_config(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_tensor_parallel(self, tp: int, ep: int = 1) -> None:
        """Megatron shards heads, kv groups, the FFN and the vocabulary over TP ranks, and the
        experts over EP ranks."""
        if ep > 1 and not self.is_moe:
            raise UnsupportedModel(
                f"learner.expert_parallel={ep} needs a mixture-of-experts model ({self.family} is dense)"
            )
        if self.is_moe and self.num_experts % ep:
            raise UnsupportedModel(
                f"num_experts={self.num_experts} is not divisible by expert_parallel={ep}"
            )
        for name, n in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            # Not padded: padded vocab rows would add exp(logit) terms and change log-probs.
            ("vocab_size", self.vocab_size),
        ):
            if n % tp:
                raise UnsupportedModel(f"{name}={n} is not divisible by tensor_parallel={tp}")
