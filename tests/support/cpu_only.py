"""The CPU tiers (tests/unit, tests/integration) see no GPU, also on a machine that has one.

`hide_gpus()` empties CUDA_VISIBLE_DEVICES for this process and every process it starts: torch
finds no device, megatron-core takes its CPU path (slime_async.megatron_compat) and the learner
gloo, exactly as on a machine without a GPU. CUDA reads the variable once, when torch first
initialises it, so the tiers' conftest calls this at import, before any test module imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


def hide_gpus() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialised before the CPU tiers could hide the GPUs; "
            "run them with CUDA_VISIBLE_DEVICES= (make test-unit, make test-integration)"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@contextlib.contextmanager
def fake_gpu_ids(n: int) -> Iterator[str]:
    """CUDA_VISIBLE_DEVICES as `n` ids that name no device ("-1,-2,..."), for as long as the block
    runs: a simulated Ray cluster whose nodes declare fake GPUs needs one id per GPU (an empty list
    refuses them), and the ids Ray hands each role still show CUDA nothing."""
    ids = ",".join(str(-i) for i in range(1, n + 1))
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids
    try:
        yield ids
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
