"""The learner's peak GPU memory, estimated from its config and the model's architecture.

    memory = estimate_learner_memory(cfg)      # LearnerMemory | None (no config.json to read)
    memory.total_gib, memory.describe()

`slime-async run` hands the estimate to an embedded engine that shares a GPU with the learner
(`slime_async/launch/gpu_memory.py`), which keeps that much free.

The estimate, per learner rank (bytes; P = parameters on the rank, T = `micro_batch_tokens`),
from the model's `ModelArch` (what the learner's builder reads):
- weights: P x the learner's dtype size; a KL reference (`algo.kl_coef > 0`) holds another copy;
- gradients: 4P (megatron's optimizer reduces in fp32; master AdamW keeps bf16 grads and an fp32
  copy: 6P);
- optimizer: fp32 master weights (bf16 only) and two fp32 Adam moments, 12P or 8P, divided over
  the data-parallel ranks by megatron's distributed optimizer;
- activations of one micro-batch: T x the tensors each layer keeps for its backward
  (`_activation_elements`), in the dtype, x `ACTIVATION_SLACK`; with `recompute = "full"` one
  layer's and every layer's input;
- the output layer: one log-prob chunk's logits in fp32 (three buffers: logits, softmax,
  gradient) and the fp32 gradient of the output weight.
Checked against peaks measured on an H200 (tests/unit/launch/test_gpu_memory.py): a 0.51B Qwen3
shape at 8 x 1,024 tokens measured 21.2 GB, a 3.67B one (Qwen3-4B's layers) 105.7 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_async.config import SlimeConfig
from slime_async.models.arch import ModelArch
from slime_async.models.family import UnsupportedModel

GIB = 2**30
ACTIVATION_SLACK = 1.15
"""Norm statistics in fp32, attention's log-sum-exp and the allocator's rounding over the tensors
`_activation_elements` counts (fitted to the two H200 peaks in the module docstring)."""
MARGIN_BYTES = 2 * GIB
"""Added to the estimate: the learner's CUDA context, NCCL/gloo buffers, fragmentation."""


def _params(a: ModelArch) -> tuple[int, int]:
    """(parameters outside the experts, parameters of every expert of every layer)."""
    h, moe = a.hidden_size, len(a.moe_layers) if a.is_moe else 0
    attn = h * a.head_dim * (a.num_heads + 2 * a.num_kv_heads) + a.num_heads * a.head_dim * h
    dense_mlp = (a.num_layers - moe) * 3 * h * a.intermediate_size
    router = moe * h * a.num_experts
    embed = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    dense = a.num_layers * (attn + 2 * h) + dense_mlp + router + embed + h
    return dense, moe * 3 * h * a.moe_intermediate_size * a.num_experts


def _activation_elements(a: ModelArch) -> int:
    """Per token, summed over the layers, the tensors each layer keeps for its backward: the
    norms' inputs and outputs and the residual (5 h), q through the qkv projection, the q/k
    norms, rotary and attention's output (4 q), k and v likewise (4 kv), and gate, up and their
    product (3 ffn; an MoE layer's ffn is its experts' width x experts per token)."""
    moe = len(a.moe_layers) if a.is_moe else 0
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    attn = a.num_layers * (5 * a.hidden_size + 4 * q + 4 * kv)
    mlp = 3 * (a.num_layers - moe) * a.intermediate_size
    mlp += 3 * moe * a.moe_topk * a.moe_intermediate_size
    return attn + mlp


@dataclass(frozen=True)
class LearnerMemory:
    """The estimated peak of one learner rank, in bytes, by part."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    output_layer: int
    margin: int = MARGIN_BYTES

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.output_layer
            + self.margin
        )

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def describe(self) -> str:
        parts = (
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("output layer", self.output_layer),
            ("margin", self.margin),
        )
        return (
            f"{self.total_gib:.1f} GiB ("
            + ", ".join(f"{name} {b / GIB:.1f}" for name, b in parts)
            + ")"
        )


def learner_memory(cfg: SlimeConfig, arch: ModelArch) -> LearnerMemory:
    """The estimated peak GPU memory of one learner rank training `arch` under `cfg`."""
    lc = cfg.learner
    tp, ep = lc.tensor_parallel, lc.expert_parallel
    dp = max(1, cfg.run.learner_procs // tp)
    el = 2 if lc.dtype == "bfloat16" else 4
    dense, experts = _params(arch)
    params = dense // tp + experts // ep
    weights = params * el * (2 if cfg.algo.kl_coef > 0 else 1)
    megatron = lc.optimizer in ("auto", "megatron")  # "auto" is megatron's on a GPU
    gradients = params * (4 if megatron else 2 + (4 if el == 2 else 0))
    states = params * ((4 if el == 2 else 0) + 8)
    if megatron and lc.use_distributed_optimizer:
        states //= dp
    every_layer = _activation_elements(arch) // tp * el  # per token
    tokens = lc.micro_batch_tokens
    if lc.recompute == "full":  # each layer's input, and one layer recomputed at a time
        acts = tokens * (arch.num_layers * arch.hidden_size * el + every_layer // arch.num_layers)
    else:
        acts = tokens * every_layer
    activations = int(acts * ACTIVATION_SLACK)
    vocab = arch.vocab_size // tp
    chunk = min(lc.logprob_chunk_tokens, tokens)
    output_layer = 3 * chunk * vocab * 4 + vocab * arch.hidden_size * 4
    return LearnerMemory(weights, gradients, states, activations, output_layer)


def estimate_learner_memory(cfg: SlimeConfig) -> LearnerMemory | None:
    """`learner_memory` of the model at `learner.model_path`; None where it has no config.json
    this project reads."""
    if not cfg.learner.model_path:
        return None
    try:
        arch = ModelArch.from_hf_dir(cfg.learner.model_path)
    except (OSError, ValueError, KeyError, UnsupportedModel):
        return None
    return learner_memory(cfg, arch)
