"""The learner's speed options resolved for this device and model, impossible ones refused.

`resolve_speed_options(cfg, arch, tp, on_cpu)` -> (attention, pack_min_padding, optimizer):
- attention "auto": Transformer Engine's core attention where TE imports, else "sdpa";
- `pack_sequences` None (auto): on a GPU in bf16, a mini-batch is packed when its padded
  micro-batches would be at least `pack_min_padding` padding (returned as that share), else
  padded (None returned: never packed); true: always packed (share 0), through CUDA's
  variable-length flash kernel on a GPU in bf16 when a one-time check against SDPA passes
  (otherwise padded, logged with the reason), else through a block-diagonal mask (the
  quadratic attention of the row's whole length);
- optimizer "auto": megatron-core's DDP + DistributedOptimizer on a GPU, `MasterAdamW` on the CPU.
`resolve_logprob_kernel(cfg, on_cpu)`: "auto" is the fused Triton kernel on a GPU where Triton
imports, else the torch ops. `resolve_swiglu_kernel(cfg, on_cpu, ops)`: the MLP's SwiGLU, "auto"
the Triton kernels where the compiled layer ops are on and they passed their check, else
megatron's fusion, eager without the compiled ops. Every refusal names the keys.
"""

from __future__ import annotations

import logging

import torch

from slime_async.config.learner import LearnerConfig
from slime_async.models import fused_ops
from slime_async.models.arch import ModelArch
from slime_async.models.attention import transformer_engine_available, varlen_works

log = logging.getLogger("slime_async.learner")


def resolve_speed_options(
    cfg: LearnerConfig, arch: ModelArch, tp: int, on_cpu: bool
) -> tuple[str, float | None, str]:
    attention = cfg.attention
    if attention == "auto":
        attention = "te" if transformer_engine_available() else "sdpa"
    elif attention == "te" and not transformer_engine_available():
        raise ValueError('learner.attention = "te" but Transformer Engine does not import here')
    sp_moe = arch.is_moe and tp > 1
    packable = attention == "sdpa" and not cfg.routing_replay and not sp_moe
    pack = cfg.pack_sequences
    min_padding = 0.0  # pack_sequences = true: every mini-batch packed
    if pack is None:
        # Auto: where the varlen kernel serves packed rows (GPU, bf16), the mini-batches that
        # padding would waste much on. On the H200 (bench_learner --full, 0.51B Qwen3 shape)
        # packed rows ran 1.35-1.39x of padded ones at log-normal RL lengths 64-1,024 (about a
        # fifth of the padded tokens padding) and 0.85x at 8 equal rows of 1,024 (none).
        pack = packable and not on_cpu and cfg.dtype != "float32"
        min_padding = cfg.pack_min_padding
    if pack and packable and not on_cpu and cfg.dtype != "float32":
        why = varlen_works(torch.cuda.current_device())
        if why is not None:
            log.warning("learner: sequences padded, not packed: %s", why)
            pack = False
    if pack and not packable:
        why = (
            f'learner.attention = "{attention}" (packed rows run through the SDPA attention)'
            if attention != "sdpa"
            else "learner.routing_replay (replay targets are laid out per padded row)"
            if cfg.routing_replay
            else "a MoE model at learner.tensor_parallel > 1 (sequence parallelism pads rows)"
        )
        raise ValueError(f"learner.pack_sequences = true is not possible with {why}")
    optimizer = cfg.optimizer
    if optimizer == "auto":
        optimizer = "master_adamw" if on_cpu else "megatron"
    if optimizer == "megatron" and on_cpu:
        raise ValueError(
            'learner.optimizer = "megatron" needs a GPU: megatron-core\'s optimizers allocate '
            'on CUDA (its DDP alone runs on the CPU; use "master_adamw" or "auto" there)'
        )
    if optimizer != "megatron":
        for key in ("overlap_grad_reduce", "ddp_bucket_size"):
            if getattr(cfg, key) not in (False, None):
                raise ValueError(
                    f'learner.{key} is set but learner.optimizer resolves to "{optimizer}" '
                    "(it applies to megatron-core's DDP only)"
                )
    if cfg.recompute != "none" and on_cpu:
        raise ValueError(
            f'learner.recompute = "{cfg.recompute}" needs a GPU: megatron\'s checkpointed '
            "modules save and restore the CUDA RNG state"
        )
    return attention, (min_padding if pack else None), optimizer


def resolve_logprob_kernel(cfg: LearnerConfig, on_cpu: bool) -> str:
    """The kernel `learner.logprob_kernel` resolves to here: "triton" or "torch"."""
    kernel = cfg.logprob_kernel
    if kernel == "torch":
        return kernel
    if on_cpu:
        if kernel == "triton":
            raise ValueError(
                'learner.logprob_kernel = "triton" needs a GPU (use "torch" or "auto" on the CPU)'
            )
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if kernel == "triton":
            raise ValueError(
                f'learner.logprob_kernel = "triton" but Triton does not import: {e}'
            ) from e
        log.warning("learner: log-probs through torch ops, not Triton (%s)", e)
        return "torch"
    return "triton"


def resolve_swiglu_kernel(cfg: LearnerConfig, on_cpu: bool, ops: fused_ops.Compiled | None) -> str:
    """What runs the MLP's SwiGLU under `learner.swiglu_kernel`, given the compiled layer ops in
    use (`fused_ops.compiled()`, None where the layers run eagerly): "triton", "megatron" (its
    compiled fusion) or "eager" (no compiled ops)."""
    kernel = cfg.swiglu_kernel
    if kernel == "triton":
        why = (
            "a GPU (the CPU runs the layers eagerly)"
            if on_cpu
            else 'the compiled layer ops (learner.torch_compile = "auto")'
            if cfg.torch_compile == "off"
            else "the compiled layer ops, which failed their check at start (logged)"
            if ops is None
            else "its kernels, which failed their check at start (logged)"
            if ops.swiglu is None
            else None
        )
        if why is not None:
            raise ValueError(f'learner.swiglu_kernel = "triton" needs {why}; use "auto"')
    if ops is None:
        return "eager"
    return "triton" if kernel != "megatron" and ops.swiglu is not None else "megatron"


def resolve_cuda_graphs(
    cfg: LearnerConfig,
    arch: ModelArch,
    tp: int,
    on_cpu: bool,
    attention: str,
    optimizer: str,
    dp: int = 1,
) -> bool:
    """Whether training micro-batches run through CUDA graphs (`graphs.py`): "auto" where every
    condition below holds (else eager, the reason logged), "on" refused where one fails. Data
    parallelism: "auto" only at DP 1, where the graphs are checked against eager steps; "on"
    takes DP > 1 (megatron's DDP reduces the buffer the graphs add into, after the backward)."""
    if cfg.cuda_graphs == "off":
        return False
    why = (
        "the CPU"
        if on_cpu
        else "a MoE model (its token dispatch has data-dependent shapes)"
        if arch.is_moe
        else f"learner.tensor_parallel = {tp} (the graphs are captured at TP 1)"
        if tp > 1
        else f'learner.optimizer resolving to "{optimizer}" (the graphs add gradients into '
        "megatron DDP's buffer)"
        if optimizer != "megatron"
        else "learner.overlap_grad_reduce (its bucket reductions start inside the backward pass)"
        if cfg.overlap_grad_reduce
        else f'learner.attention resolving to "{attention}" (the graphs are checked with "sdpa")'
        if attention != "sdpa"
        else f'learner.recompute = "{cfg.recompute}" (megatron\'s recomputation sets the CUDA '
        "RNG state, which a capture cannot)"
        if cfg.recompute != "none"
        else None
    )
    if why is None and dp > 1 and cfg.cuda_graphs == "auto":
        why = f'data parallel {dp} (the graphs are checked at DP 1; cuda_graphs = "on" takes it)'
    if why is None:
        return True
    if cfg.cuda_graphs == "on":
        raise ValueError(f'learner.cuda_graphs = "on" is not possible with {why}')
    if not on_cpu:
        log.info("learner: no CUDA graphs (learner.cuda_graphs auto): %s", why)
    return False
