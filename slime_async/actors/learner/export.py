"""The learner's weights out, with Hugging Face names and layouts, in buckets (the weight push,
`save_hf`).

Every rank calls `hf_buckets`; rank 0 gathers: TP shards from its TP group (all-gather), experts
from the EP group, and yields HF tensors; the other ranks yield empty buckets in step. The
parameters read are always whole: with megatron's DistributedOptimizer each DP rank steps only
its shard of the fp32 masters, but the step ends by all-gathering the updated bf16 parameters
into every rank's model (`overlap_param_gather` is never on), so DP rank 0 holds the complete,
current weights when the export runs (tests/test_learner_gpu.py checks an HF model built from
the export against the learner).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_async.models import convert


def _gather_tp(learner, local: torch.Tensor) -> list[torch.Tensor]:
    if dist.get_world_size(learner.tp_group) == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(learner.tp_group))]
    dist.all_gather(shards, local.contiguous(), group=learner.tp_group)
    return shards


def hf_buckets(learner, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named, HF-layout tensors in buckets of about `bucket_bytes`; every rank calls it.

    Rank 0 gets the tensors; every other rank gets an empty list for each bucket (same
    number of buckets on all ranks). Tensors may share memory with the parameters:
    consume a bucket before the next optimizer step.
    """
    tp = dist.get_world_size(learner.tp_group)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for mname, param in learner.model.named_parameters():
        full_bytes = param.numel() * param.element_size()
        if convert.partition_dim(mname) is not None:
            full_bytes *= tp
        if convert.is_expert(mname):
            # Each EP rank holds its own experts: gather them from the EP group (the ranks
            # of expert-data-parallel rank 0, rank 0 among them).
            full_bytes *= learner.ep_size
            if learner.expert_dp_rank == 0:
                local = param.detach()
                shards = [local]
                if learner.ep_size > 1:
                    shards = [torch.empty_like(local) for _ in range(learner.ep_size)]
                    dist.all_gather(shards, local.contiguous(), group=learner.ep_group)
                if learner.is_rank0:
                    for r, t in enumerate(shards):
                        bucket.extend(
                            convert.megatron_shards_to_hf(
                                mname, [t], learner.arch, r, learner.ep_size
                            )
                        )
        elif learner.dp_rank == 0:
            local = param.detach()
            shards = (
                _gather_tp(learner, local) if convert.partition_dim(mname) is not None else [local]
            )
            if learner.is_rank0:
                bucket.extend(convert.megatron_shards_to_hf(mname, shards, learner.arch))
        size += full_bytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if size:
        yield bucket
