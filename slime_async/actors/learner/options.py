"""The learner's speed options resolved for this device and model, impossible ones refused.

`resolve_speed_options(cfg, arch, tp, on_cpu)` -> (attention, pack, optimizer):
- attention "auto": Transformer Engine's core attention where TE imports, else "sdpa";
- `pack_sequences` None: padded (packing measured 0.94x of padded on the H200); true: packed,
  through CUDA's variable-length flash kernel on a GPU in bf16 when a one-time check against SDPA
  passes (otherwise padded, logged with the reason), else through a block-diagonal mask (the
  quadratic attention of the row's whole length);
- optimizer "auto": megatron-core's DDP + DistributedOptimizer on a GPU, `MasterAdamW` on the CPU.
Every refusal names the keys.
"""

from __future__ import annotations

import logging

import torch

from slime_async.config.learner import LearnerConfig
from slime_async.models.attention import transformer_engine_available, varlen_works
from slime_async.models.megatron import ModelArch

log = logging.getLogger("slime_async.learner")


def resolve_speed_options(
    cfg: LearnerConfig, arch: ModelArch, tp: int, on_cpu: bool
) -> tuple[str, bool, str]:
    attention = cfg.attention
    if attention == "auto":
        attention = "te" if transformer_engine_available() else "sdpa"
    elif attention == "te" and not transformer_engine_available():
        raise ValueError('learner.attention = "te" but Transformer Engine does not import here')
    sp_moe = arch.is_moe and tp > 1
    packable = attention == "sdpa" and not cfg.routing_replay and not sp_moe
    pack = cfg.pack_sequences
    if pack is None:
        # Padded by default: on the H200 (bench_learner --full, 0.51B Qwen3 shape, log-normal
        # RL lengths 64-1,024) packed rows ran 0.94x of padded ones, at more memory.
        pack = False
    elif pack and packable and not on_cpu and cfg.dtype != "float32":
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
    return attention, pack, optimizer
