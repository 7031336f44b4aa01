"""The learner's weights out, with Hugging Face names and layouts, in buckets (the weight push,
`save_hf`).

Every rank calls `hf_buckets`; rank 0 gathers: TP shards from its TP group (all-gather), experts
from the EP group, and yields HF tensors; the other ranks yield empty buckets in step. The
parameters read are always whole: with megatron's DistributedOptimizer each DP rank steps only
its shard of the fp32 masters, but the step ends by all-gathering the updated bf16 parameters
into every rank's model (`overlap_param_gather` is never on), so DP rank 0 holds the complete,
current weights when the export runs (tests/gpu/test_learner_gpu.py checks an HF model built from
the export against the learner).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.models import convert
from slime_async.models.arch import ModelArch


def _gather_tp(layout: ParallelLayout, local: torch.Tensor) -> list[torch.Tensor]:
    if layout.tp_size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(layout.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=layout.tp_group)
    return shards


def hf_buckets(
    model: torch.nn.Module, arch: ModelArch, layout: ParallelLayout, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named, HF-layout tensors in buckets of about `bucket_bytes`; every rank calls it.

    Rank 0 gets the tensors; every other rank gets an empty list for each bucket (same
    number of buckets on all ranks). Tensors may share memory with the parameters:
    consume a bucket before the next optimizer step.
    """
    tp = layout.tp_size
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for mname, param in model.named_parameters():
        full_bytes = param.numel() * param.element_size()
        if convert.partition_dim(mname) is not None:
            full_bytes *= tp
        if convert.is_expert(mname):
            # Each EP rank holds its own experts: gather them from the EP group (the ranks
            # of expert-data-parallel rank 0, rank 0 among them).
            full_bytes *= layout.ep_size
            if layout.expert_dp_rank == 0:
                local = param.detach()
                shards = [local]
                if layout.ep_size > 1:
                    shards = [torch.empty_like(local) for _ in range(layout.ep_size)]
                    dist.all_gather(shards, local.contiguous(), group=layout.ep_group)
                if layout.is_rank0:
                    for r, t in enumerate(shards):
                        bucket.extend(
                            convert.megatron_shards_to_hf(mname, [t], arch, r, layout.ep_size)
                        )
        elif layout.dp_rank == 0:
            local = param.detach()
            shards = (
                _gather_tp(layout, local) if convert.partition_dim(mname) is not None else [local]
            )
            if layout.is_rank0:
                bucket.extend(convert.megatron_shards_to_hf(mname, shards, arch))
        size += full_bytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if size:
        yield bucket
