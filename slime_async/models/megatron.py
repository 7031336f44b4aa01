"""A megatron-core GPTModel built from a Hugging Face config: Llama, Qwen2, Qwen3, GLM-4, Qwen3-MoE.

`ModelArch.from_hf_dir(dir)` reads config.json (no transformers import) and refuses what the
families' megatron mapping cannot reproduce exactly (RoPE scaling, biases outside QKV, other
activations). `build_gpt_model(arch, dtype)` builds the model with megatron-core's local layer
spec (no Transformer Engine, no apex), so the same code runs on CPU (gloo) and GPU (NCCL).
Call `megatron_compat.apply()` and `parallel_state.initialize_model_parallel()` first.

What differs from Llama (read from transformers' `glm4` and `qwen3_moe` modeling code):
- GLM-4: q/k/v biases; RoPE on the first `partial_rotary_factor` of each head only, with the
  interleaved layout (pairs (2i, 2i + 1) rotate together: megatron's `rotary_interleaved`); an
  RMSNorm on the attention output and one on the MLP output before each residual add (here a
  `post_layernorm` inside the attention and MLP modules); gate/up fused in one HF tensor.
- Qwen3-MoE: Qwen3's attention (q/k norms); a sparse MLP on layers where
  `(i + 1) % decoder_sparse_step == 0` and `i not in mlp_only_layers`: router softmax over all
  experts -> top-k -> renormalised when `norm_topk_prob` (megatron: top-k of the logits, then a
  softmax over those k, the same values; without renormalisation: softmax then top-k, megatron's
  `moe_router_pre_softmax`), experts as SwiGLU MLPs (megatron's SequentialMLP), no shared
  expert. Experts are never TP-sharded here (`expert_tensor_parallel_size = 1`): expert
  parallelism shards them by index; with TP > 1 megatron's MoE needs sequence parallelism, so
  it is on for MoE models at TP > 1 (sequence lengths are padded to a multiple of TP).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

FAMILIES = ("llama", "qwen2", "qwen3", "glm4", "qwen3_moe")


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
    rotary_percent: float = 1.0
    """GLM-4: the fraction of each head's dims that RoPE rotates (partial_rotary_factor)."""
    rotary_interleaved: bool = False
    """GLM-4: RoPE rotates pairs (2i, 2i + 1) instead of (i, i + d/2)."""
    post_norms: bool = False
    """GLM-4: RMSNorm on the attention output and on the MLP output before each residual add."""
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
        if family == "qwen3_moe" and cfg.get("attention_bias"):
            raise UnsupportedModel("qwen3_moe with attention_bias is not supported")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        extra: dict[str, Any] = {}
        if family == "glm4":
            partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
            extra = dict(rotary_percent=float(partial), rotary_interleaved=True, post_norms=True)
        # transformers 5 writes num_local_experts; the hub's configs say num_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if family == "qwen3_moe" and experts > 0:
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            n = cfg["num_hidden_layers"]
            extra = dict(
                num_experts=experts,
                moe_topk=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                moe_norm_topk=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0),
            )
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
            qkv_bias=family == "qwen2" or (family == "glm4" and cfg.get("attention_bias", True)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **extra,
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


def build_gpt_model(
    arch: ModelArch,
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    on_cpu: bool = True,
    moe_aux_loss_coeff: float = 0.0,
    routing_replay: bool = False,
    attention: str = "sdpa",
    recompute: str = "none",
):
    """A GPTModel for `arch` on this rank's TP/EP shard; `init=False` skips random init (to load).

    `moe_aux_loss_coeff` > 0 adds megatron's load-balancing loss (MoE models);
    `routing_replay` builds the routers with megatron's RouterReplay (see `routing.py`);
    `attention`: "sdpa" (torch's fused kernels, `attention.py`), "local" (megatron's unfused
    DotProductAttention) or "te" (Transformer Engine's); `recompute`: "none", "selective" (core
    attention) or "full" (every layer), megatron's activation recomputation."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    arch.check_tensor_parallel(tp, ep)
    moe: dict[str, Any] = {}
    if arch.is_moe:
        from slime_async import megatron_compat

        megatron_compat.patch_moe()
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_score_function="softmax",
            # norm_topk_prob: top-k of the logits then softmax over the k equals HF's softmax ->
            # top-k -> renormalise; without it, softmax over all experts first.
            moe_router_pre_softmax=not arch.moe_norm_topk,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            moe_enable_routing_replay=routing_replay,
            # megatron's MoE refuses to train at TP > 1 without sequence parallelism.
            sequence_parallel=tp > 1,
        )
        if len(arch.moe_layers) < arch.num_layers:
            # Dense and MoE layers mixed: checkpoints keep each layer's tensors apart
            # (megatron's non-homogeneous layers), not stacked along a layer axis.
            moe["moe_layer_freq"] = [int(i in arch.moe_layers) for i in range(arch.num_layers)]
    elif routing_replay:
        raise UnsupportedModel(
            f"learner.routing_replay needs a mixture-of-experts model ({arch.family} is dense)"
        )
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
        rotary_interleaved=arch.rotary_interleaved,
        **_recompute_kwargs(recompute),
        **moe,
    )
    theta = arch.rope_theta
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(arch, attention),
        rotary_percent=arch.rotary_percent,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        parallel_output=True,
    )
    # torch.nn.RMSNorm ignores params_dtype; the whole model computes in one dtype.
    model.to(dtype=dtype)
    if not init:
        _mark_tensor_parallel(model)
    if not on_cpu:
        model.cuda(torch.cuda.current_device())
    return model


def _recompute_kwargs(recompute: str) -> dict[str, Any]:
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    raise ValueError(f"recompute must be none, selective or full (got {recompute!r})")


def _mark_tensor_parallel(model) -> None:
    """Megatron sets `tensor_model_parallel` / `partition_dim` on sharded weights only while
    initialising them; models built to be loaded get them here, by name (megatron's grad-norm,
    DistributedOptimizer and checkpoints read them)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from slime_async.models.convert import partition_dim

    for name, p in model.named_parameters():
        dim = partition_dim(name)
        if dim is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, dim, 1)


def _norm_class():
    """torch's RMSNorm built the way megatron builds norms, usable with sequence parallelism.

    megatron's `WrappedTorchNorm` refuses sequence parallelism; with it each TP rank sees part
    of the sequence, so the weight is marked and its gradient summed over TP (the optimizer)."""

    class RMSNorm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            self.weight.sequence_parallel = bool(config.sequence_parallel)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            """Replicated over TP (megatron's MLP and attention ask their children for this)."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            # No groups given: megatron's TP and DP groups, so each TP rank is its own replica.
            sd = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(sd, prefix, {}, sharded_offsets)

    return RMSNorm


def _post_norm_classes(norm):
    """GLM-4's attention and MLP, each followed by its own RMSNorm (`post_layernorm`)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    def post_normed(base):
        class PostNorm(base):
            def __init__(self, config, *args, **kwargs):
                super().__init__(config, *args, **kwargs)
                self.post_layernorm = norm(config, config.hidden_size, config.layernorm_epsilon)

            def forward(self, *args, **kwargs):
                out, bias = super().forward(*args, **kwargs)
                return self.post_layernorm(out), bias

        PostNorm.__name__ = PostNorm.__qualname__ = f"PostNorm{base.__name__}"
        return PostNorm

    return post_normed(SelfAttention), post_normed(MLP)


def _core_attention(attention: str):
    if attention == "sdpa":
        from slime_async.models.attention import sdpa_attention_class

        return sdpa_attention_class()
    if attention == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if attention == "local":
        return None
    raise ValueError(f"attention must be sdpa, local or te (got {attention!r})")


def _block_spec(arch: ModelArch, attention: str = "sdpa"):
    """Per-layer specs of megatron's local layer: dense or MoE MLP, GLM-4's post norms, and the
    core attention chosen (`_core_attention`).

    With Transformer Engine only its core attention is taken: TE's full layer spec fuses the
    norms into the linear layers and renames their weights, which the HF conversion maps by the
    local spec's names."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    norm = _norm_class()
    core = _core_attention(attention)

    def layer(moe: bool):
        spec = get_gpt_layer_local_spec(
            num_experts=arch.num_experts if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_norm,
            normalization="RMSNorm",
        )
        sub = spec.submodules
        attn = sub.self_attention
        attn_sub = attn.submodules
        if core is not None:
            attn_sub = dataclasses.replace(attn_sub, core_attention=core)
        if arch.qk_norm:
            attn_sub = dataclasses.replace(attn_sub, q_layernorm=norm, k_layernorm=norm)
        mlp = sub.mlp
        if arch.post_norms:
            post_attn, post_mlp = _post_norm_classes(norm)
            attn = dataclasses.replace(attn, module=post_attn)
            mlp = dataclasses.replace(mlp, module=post_mlp)
        attn = dataclasses.replace(attn, submodules=attn_sub)
        sub = dataclasses.replace(
            sub, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attn, mlp=mlp
        )
        return dataclasses.replace(spec, submodules=sub)

    moe_layers = set(arch.moe_layers)
    specs = [layer(i in moe_layers) for i in range(arch.num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
