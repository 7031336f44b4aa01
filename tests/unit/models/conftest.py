"""Fixtures of the model tests."""

import os

import pytest
import torch.distributed as dist

from slime_async import megatron_compat
from slime_async.utils.procs import free_port


@pytest.fixture()
def single_rank_megatron():
    """One gloo rank with megatron's TP 1 groups, for tests that build megatron layers."""
    megatron_compat.apply()
    from megatron.core import parallel_state

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
