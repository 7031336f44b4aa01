"""This rank's place in the learner's TP x DP (x EP) layout, and the process groups under it.

`ParallelLayout(tensor_parallel, expert_parallel)` joins (or starts) torch.distributed and
megatron-core's model-parallel state, and holds what the other components read of it: ranks,
groups, the device, the data-parallel sum. It binds nothing itself: the rendezvous is torchrun's
(env://, MASTER_ADDR/MASTER_PORT) or, alone, a one-process group on a free loopback port.
`close()` tears down only what it initialised, so a learner built inside a caller's process
group leaves that group alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from slime_async import megatron_compat

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


class ParallelLayout:
    """Ranks and process groups of one learner rank; every component reads them from here."""

    def __init__(self, tensor_parallel: int, expert_parallel: int = 1):
        from megatron.core import parallel_state as ps

        self._owns_dist, self._owns_mp = _init_distributed(tensor_parallel, expert_parallel)
        try:
            self.rank: int = dist.get_rank()
            self.is_rank0: bool = self.rank == 0
            self.tp_group = ps.get_tensor_model_parallel_group()
            self.dp_group = ps.get_data_parallel_group()
            self.tp_rank: int = ps.get_tensor_model_parallel_rank()
            self.dp_rank: int = ps.get_data_parallel_rank()
            self.tp_size: int = dist.get_world_size(self.tp_group)
            self.dp_size: int = dist.get_world_size(self.dp_group)
            self.ep_group = ps.get_expert_model_parallel_group()
            self.ep_rank: int = ps.get_expert_model_parallel_rank()
            self.ep_size: int = ps.get_expert_model_parallel_world_size()
            self.expert_dp_rank: int = ps.get_expert_data_parallel_rank()
            self.expert_dp_group = ps.get_expert_data_parallel_group()
            self.device: torch.device = megatron_compat.device()
        except BaseException:
            self.close()
            raise

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the data-parallel ranks (a copy): `AdvantageInput.all_reduce_sum`."""
        out = t.detach().to(self.device, torch.float64).clone()
        dist.all_reduce(out, group=self.dp_group)
        return out.to(t.device, t.dtype)

    def close(self) -> None:
        """Tear down what this layout initialised (model parallel state, process group)."""
        from megatron.core import parallel_state as ps

        if self._owns_mp:
            ps.destroy_model_parallel()
            self._owns_mp = False
        if self._owns_dist and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_dist = False


def _init_distributed(tp: int, ep: int) -> tuple[bool, bool]:
    """Join or start the process group and model-parallel state; (started one, started other)."""
    from megatron.core import parallel_state as ps

    megatron_compat.apply()
    owns_dist = False
    if not dist.is_initialized():
        backend = "gloo" if megatron_compat.cpu_mode() else "nccl"
        if not megatron_compat.cpu_mode():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)  # torchrun's env:// rendezvous
        else:
            # a world of one needs no rendezvous: an in-process store, no port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns_dist = True
    world = dist.get_world_size()
    if world % tp or world % ep:
        if owns_dist:
            dist.destroy_process_group()
        raise ValueError(
            f"world size {world} is not divisible by learner.tensor_parallel={tp} "
            f"and learner.expert_parallel={ep}"
        )
    owns_mp = False
    if not ps.model_parallel_is_initialized():
        # Experts are never TP-sharded (expert_tensor_parallel_size 1): EP ranks are carved
        # out of the data-parallel ranks, so TP x EP fits in TP x DP processes.
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
        owns_mp = True
    elif ps.get_expert_model_parallel_world_size() != ep:
        raise ValueError(
            f"model parallel already initialised with EP={ps.get_expert_model_parallel_world_size()}, "
            f"learner.expert_parallel={ep}"
        )
    elif ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(
            f"model parallel already initialised with TP={ps.get_tensor_model_parallel_world_size()}, "
            f"learner.tensor_parallel={tp}"
        )
    return owns_dist, owns_mp
