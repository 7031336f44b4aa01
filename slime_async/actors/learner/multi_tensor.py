"""megatron-core's multi-tensor fallbacks as torch foreach kernels, for a GPU without Apex or TE.

Without Apex or Transformer Engine, megatron-core's optimizer and gradient clipping fall back to
`megatron.core.utils.local_multi_tensor_l2_norm` and `local_multi_tensor_scale`. The first
takes one `torch.norm` per gradient, then builds a host tensor from the list of device scalars
(one host sync per gradient: 226 a step at the 0.51B Qwen3 shape), and puts the result
back on the device; the second runs a multiply and a copy per tensor. These replacements keep
their contracts (the l2 norm as a one-element float32 tensor on the tensors' device, and
`dst = src * scale` tensor by tensor) with torch's multi-tensor `_foreach` kernels, and never
read a value on the host.

`install()` puts them where megatron's modules hold the fallbacks (module attributes bound at
import); it replaces only megatron's own local functions, so an Apex or TE kernel found at
import is kept. Idempotent; call it after `megatron_compat.apply()`.
"""

from __future__ import annotations

import importlib

import torch

# (module, attribute, megatron's local fallback's name): where megatron-core binds the fallback.
_SITES = (
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl", "local_multi_tensor_l2_norm"),
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl", "local_multi_tensor_scale"),
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl", "local_multi_tensor_scale"),
)


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm over every tensor of `tensor_lists` (a list of lists): `(norm[1], None)`."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """`dst.copy_(src * factor)` for each pair of `tensor_lists = [srcs, dsts]`."""
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts, strict=True)):
        torch._foreach_mul_(dsts, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dsts, srcs)
    else:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))


_OURS = {"local_multi_tensor_l2_norm": l2_norm, "local_multi_tensor_scale": scale}


def install() -> list[str]:
    """Replace megatron's local fallbacks where its modules hold them; the sites replaced."""
    from megatron.core import utils

    done = []
    for module_name, attr, local_name in _SITES:
        module = importlib.import_module(module_name)
        current = getattr(module, attr, None)
        if current is getattr(utils, local_name, None) and current is not None:
            setattr(module, attr, _OURS[local_name])
            done.append(f"{module_name}.{attr}")
        elif current is _OURS[local_name]:
            done.append(f"{module_name}.{attr}")
    return done
