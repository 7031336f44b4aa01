"""One GPU shared by the learner and an embedded engine: how much of it the learner needs.

    shares = gpu_shares(cfg)      # [GpuShare(engine, gpu, learner: LearnerMemory | None), ...]
    shares[0].note()              # the line `slime-async run` prints

On one GPU the learner and the engine run as two processes. The engine starts first and sizes its
paged KV cache from the memory it sees; left to itself (`engine.embedded.mem_fraction`) it takes
what the learner will need at its first training step, and the learner dies out of memory. So
`slime-async run` estimates the learner's peak from its config and the model's `config.json`,
and hands it to every embedded engine that shares a GPU with a learner rank as
`engine.embedded.gpu_reserve_gib`; the engine keeps that much free and sizes its cache from the
rest, or refuses to start with the numbers when one request of `max_context_len` does not fit.

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

import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slime_async.config import ConfigError, SlimeConfig

if TYPE_CHECKING:  # the model package imports torch: only when an estimate is made
    from slime_async.models.arch import ModelArch

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


def read_arch(model_path: str | None) -> ModelArch | None:
    """The architecture in `model_path`/config.json; None where there is none to read."""
    from slime_async.models.arch import ModelArch
    from slime_async.models.family import UnsupportedModel

    if not model_path:
        return None
    try:
        return ModelArch.from_hf_dir(model_path)
    except (OSError, ValueError, KeyError, UnsupportedModel):
        return None


def _visible(setting: str | None) -> list[str] | None:
    """The GPU ids a process sees: its CUDA_VISIBLE_DEVICES, or None (all, in order)."""
    value = setting if setting is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def _physical(visible: list[str] | None, index: int) -> str | None:
    if visible is None:
        return str(index)
    return visible[index] if index < len(visible) else None


def _gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its device files; no CUDA context is made)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _engine_index(device: str) -> int | None:
    """The visible GPU index an embedded engine's `device` takes (None: the CPU)."""
    if device == "cpu" or (device == "auto" and not _gpu_present()):
        return None
    if device.startswith("cuda:"):
        return int(device.split(":", 1)[1])
    return 0  # "cuda", and "auto" where a GPU is there


def shared_gpus(cfg: SlimeConfig) -> dict[int, str]:
    """{engine index: GPU id} of the embedded engines `slime-async run` starts on this machine
    on a GPU that a learner rank also uses (ids as CUDA_VISIBLE_DEVICES names them)."""
    if cfg.engine.kind != "embedded" or cfg.run.launcher != "local":
        return {}
    learner_visible = _visible(cfg.run.learner_cuda_devices)
    learner = {_physical(learner_visible, r) for r in range(cfg.run.learner_procs)} - {None}
    index = _engine_index(cfg.engine.embedded.device)
    if index is None or not learner:
        return {}
    out = {}
    for i in range(cfg.engine.num_engines):
        devices = cfg.run.engine_cuda_devices
        gpu = _physical(_visible(devices[i] if i < len(devices) else None), index)
        if gpu is not None and gpu in learner:
            out[i] = gpu
    return out


@dataclass(frozen=True)
class GpuShare:
    """An embedded engine on a learner's GPU, and what it keeps free for the learner."""

    engine: int
    gpu: str
    learner: LearnerMemory | None
    """None: no estimate (no model config to read); the engine's own setting stands."""

    def note(self) -> str:
        """One line for the run's log: what the engine keeps free, and why."""
        who = f"engine{self.engine} shares GPU {self.gpu} with the learner"
        if self.learner is None:
            return (
                f"{who}; the learner's memory cannot be estimated (no config.json at "
                "learner.model_path): the engine sizes its KV cache by "
                "engine.embedded.mem_fraction alone; set engine.embedded.gpu_reserve_gib to "
                "what the learner needs"
            )
        return (
            f"{who}: it keeps {self.learner.describe()} free for the learner "
            "(engine.embedded.gpu_reserve_gib = auto) and sizes its KV cache from the rest"
        )


def gpu_shares(cfg: SlimeConfig) -> list[GpuShare]:
    """The engines that must leave room for the learner, when `gpu_reserve_gib` is "auto"."""
    if cfg.engine.embedded.gpu_reserve_gib != "auto":
        return []
    shared = shared_gpus(cfg)
    if not shared:
        return []
    crowded = sorted(g for g, n in Counter(shared.values()).items() if n > 1)
    if crowded:
        raise ConfigError(
            f"engine.embedded.gpu_reserve_gib = auto: several engines on GPU(s) "
            f"{', '.join(crowded)}, which the learner also uses; the first to start would take "
            "what the learner leaves: give each engine its own GPU (run.engine_cuda_devices) "
            "or size them by hand (engine.embedded.gpu_reserve_gib and mem_fraction)"
        )
    arch = read_arch(cfg.learner.model_path)
    memory = learner_memory(cfg, arch) if arch is not None else None
    return [GpuShare(i, gpu, memory) for i, gpu in shared.items()]


def reserve_gib(share: GpuShare) -> float:
    """What the engine of `share` keeps free, rounded up to 0.1 GiB."""
    assert share.learner is not None
    return math.ceil(share.learner.total_gib * 10) / 10
