"""Host-to-device copies that do not make the host wait for the device."""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: on CUDA staged in pinned memory
    (torch's caching host allocator keeps the block until the copy has run) and copied
    asynchronously. A copy from pageable memory first waits for everything queued on the
    stream: the engine's decode step just launched, or the learner's previous micro-batch."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    # Staged in a fresh pinned block (not `x.pin_memory()`, which first asks the driver
    # whether `x` is pinned: a host tensor here never is).
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return staged.copy_(x).to(device, non_blocking=True)
