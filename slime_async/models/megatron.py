"""A megatron-core GPTModel built from a `ModelArch`, for every family of `families.py`.

`build_gpt_model(arch, dtype)` builds the model with megatron-core's local layer spec (no
Transformer Engine, no apex), so the same code runs on CPU (gloo) and GPU (NCCL); the family of
`arch` changes what its layers do differently (`Family.layer_spec`: GLM-4's post norms). Call
`megatron_compat.apply()` and `parallel_state.initialize_model_parallel()` first.

Mixture-of-experts models (ModelArch's MoE fields) get megatron's MoE layer on their MoE layers:
top-k of the router logits, then a softmax over those k (HF's softmax -> top-k -> renormalise,
the same values), or, without `moe_norm_topk`, a softmax over all experts first (megatron's
`moe_router_pre_softmax`); experts as SwiGLU MLPs run as grouped GEMMs, the layer dispatching
without host syncs and adding HF's auxiliary losses (`moe_layer.py`). Experts are never
TP-sharded here (`expert_tensor_parallel_size = 1`): expert parallelism shards them by index;
with TP > 1 megatron's MoE needs sequence parallelism, so it is on for MoE models at TP > 1
(sequence lengths are padded to a multiple of TP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from slime_async.models.arch import ModelArch
from slime_async.models.convert import partition_dim
from slime_async.models.families import family_of
from slime_async.models.family import UnsupportedModel

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


def build_gpt_model(
    arch: ModelArch,
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    on_cpu: bool = True,
    moe_aux_loss_coeff: float = 0.0,
    routing_replay: bool = False,
    attention: str = "sdpa",
    recompute: str = "none",
    moe_experts: str = "grouped",
    moe_z_loss_coeff: float = 0.0,
    compiled_ops: bool | None = None,
    wgrad_fusion: bool = False,
    triton_swiglu: bool = True,
):
    """A GPTModel for `arch` on this rank's TP/EP shard; `init=False` skips random init (to load).

    `moe_aux_loss_coeff` > 0 adds HF's load-balancing loss, `moe_z_loss_coeff` > 0 the router
    z-loss (MoE models, `moe_layer.MoeLosses`); `moe_experts`: "grouped" (grouped GEMMs,
    `moe_layer.GroupedExperts`) or "sequential" (megatron's SequentialMLP);
    `routing_replay` builds the routers with megatron's RouterReplay (see `routing.py`);
    `attention`: "sdpa" (torch's fused kernels, `attention.py`), "local" (megatron's unfused
    DotProductAttention) or "te" (Transformer Engine's); `recompute`: "none", "selective" (core
    attention) or "full" (every layer), megatron's activation recomputation; `compiled_ops`:
    True: RMSNorm, RoPE and SwiGLU as compiled kernels on a GPU (`fused_ops.py`; eager where
    they do not pass its check, and on the CPU), False: eager (megatron's RoPE and SwiGLU
    fusion again, for the whole process), None: RoPE and SwiGLU as the process has them;
    `triton_swiglu`, with the compiled ops: the SwiGLU kernels of `swiglu_triton.py` (megatron's
    fusion where they did not pass their check), False: megatron's compiled fusion (process-wide
    as RoPE); `wgrad_fusion`: megatron's linear layers add their weight gradients into
    `main_grad` themselves (`wgrad.py`; only for a model that megatron's DDP wraps before its
    first backward pass)."""
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
            # The auxiliary losses are HF's, computed by moe_layer.MoeLosses, not megatron's.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
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
    elif moe_aux_loss_coeff > 0 or moe_z_loss_coeff > 0:
        raise UnsupportedModel(
            "learner.moe_aux_loss_coeff and learner.moe_z_loss_coeff need a mixture-of-experts "
            f"model ({arch.family} is dense)"
        )
    ops = None
    if compiled_ops is not None:
        from slime_async.models import fused_ops

        if compiled_ops and not on_cpu and torch.cuda.is_available():
            ops = fused_ops.compiled(torch.cuda.current_device())
        fused_ops.install_rope(ops.rope if ops is not None else None)
        fused_ops.install_swiglu(ops.swiglu if ops is not None and triton_swiglu else None)
    if wgrad_fusion:
        from slime_async.models import wgrad

        wgrad.install_megatron()
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
        # Every fusion off (they need CUDA kernels, Apex's or TE's, that the CPU path lacks)
        # but megatron's SwiGLU with the compiled ops (the function `fused_ops.install_swiglu`
        # put in its MLP: the Triton kernels, or megatron's own, compiled by megatron), and the
        # weight gradients' accumulation through torch's own matmul (`wgrad.py`).
        bias_activation_fusion=ops is not None,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=wgrad_fusion,
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
        transformer_layer_spec=_block_spec(
            arch, attention, moe_experts, ops.rms_norm if ops is not None else None
        ),
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
    if arch.is_moe:
        from slime_async.models.moe_layer import MoeLosses, attach_losses

        losses = MoeLosses(
            len(arch.moe_layers),
            arch.num_experts,
            arch.moe_topk,
            moe_aux_loss_coeff,
            moe_z_loss_coeff,
        )
        if tp > 1:  # sequence parallelism: each TP rank routes its own chunk
            losses.tp_group = parallel_state.get_tensor_model_parallel_group()
        attach_losses(model, losses)
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

    for name, p in model.named_parameters():
        dim = partition_dim(name)
        if dim is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, dim, 1)


def _norm_class(compiled_norm=None):
    """torch's RMSNorm built the way megatron builds norms, usable with sequence parallelism.

    megatron's `WrappedTorchNorm` refuses sequence parallelism; with it each TP rank sees part
    of the sequence, so the weight is marked and its gradient summed over TP (the optimizer).
    `compiled_norm`: `fused_ops.Compiled.rms_norm`, the same function compiled (GPU), or None."""

    class RMSNorm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            self.weight.sequence_parallel = bool(config.sequence_parallel)

        if compiled_norm is not None:

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
                return compiled_norm(x, self.weight, eps)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            """Replicated over TP (megatron's MLP and attention ask their children for this)."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            # No groups given: megatron's TP and DP groups, so each TP rank is its own replica.
            sd = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(sd, prefix, {}, sharded_offsets)

    return RMSNorm


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


def _block_spec(
    arch: ModelArch, attention: str = "sdpa", moe_experts: str = "grouped", compiled_norm=None
):
    """Per-layer specs of megatron's local layer: dense or MoE MLP, the core attention chosen
    (`_core_attention`), as the family changes them.

    With Transformer Engine only its core attention is taken: TE's full layer spec fuses the
    norms into the linear layers and renames their weights, which the HF conversion maps by the
    local spec's names."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from slime_async.models.moe_layer import moe_spec

    norm = _norm_class(compiled_norm)
    core = _core_attention(attention)
    family = family_of(arch.family)

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
        attn = dataclasses.replace(attn, submodules=attn_sub)
        sub = dataclasses.replace(
            sub, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attn
        )
        if moe:
            sub = dataclasses.replace(sub, mlp=moe_spec(sub.mlp, moe_experts))
        return family.layer_spec(dataclasses.replace(spec, submodules=sub), norm)

    moe_layers = set(arch.moe_layers)
    specs = [layer(i in moe_layers) for i in range(arch.num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
