"""megatron's multi-tensor fallbacks as foreach kernels: same results, installed where megatron
binds its local versions (and nowhere an Apex/TE kernel was found)."""

from __future__ import annotations

import pytest
import torch

from slime_async import megatron_compat
from slime_async.actors.learner import multi_tensor


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in [(3, 5), (7,), (2, 2, 4), ()]]


def test_l2_norm_is_the_norm_of_every_element():
    a, b = _tensors(), _tensors()[:2]
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = multi_tensor.l2_norm(2048 * 32, flag, [a, b], False)
    want = torch.cat([t.reshape(-1) for t in a + b]).norm()
    assert per_tensor is None
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], want, rtol=1e-6, atol=0)


def test_l2_norm_of_nothing_is_zero_on_the_flags_device():
    norm, _ = multi_tensor.l2_norm(1, torch.zeros(1, dtype=torch.int), [[]], False)
    assert norm.tolist() == [0.0]


def test_scale_in_place_copy_and_cast_as_megatrons_loop():
    src = _tensors()
    same = [t.clone() for t in src]
    multi_tensor.scale(1, None, [same, same], 0.25)
    for s, d in zip(src, same, strict=True):
        torch.testing.assert_close(d, s * 0.25, rtol=0, atol=0)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    multi_tensor.scale(1, None, [src, dst], 1.0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, s.to(torch.bfloat16))
    multi_tensor.scale(1, None, [src, dst], 3.0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s * 3.0).to(torch.bfloat16))  # megatron: dst.copy_(src * scale)


def test_install_replaces_megatrons_local_fallbacks_only():
    megatron_compat.apply()
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl)
    saved_opt = optimizer.multi_tensor_scale_impl
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        pytest.skip("megatron found Apex or Transformer Engine kernels here")
    try:
        sites = multi_tensor.install()
        assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
        assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
        assert optimizer.multi_tensor_scale_impl is multi_tensor.scale
        assert multi_tensor.install() == sites and len(sites) == 3  # idempotent

        def apex_kernel(*args):  # stands for a kernel megatron found at import
            raise AssertionError

        clip_grads.l2_norm_impl = apex_kernel
        assert "megatron.core.optimizer.clip_grads.l2_norm_impl" not in multi_tensor.install()
        assert clip_grads.l2_norm_impl is apex_kernel
    finally:
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl = saved
        optimizer.multi_tensor_scale_impl = saved_opt


def test_fused_adams_gradient_divisor_is_megatrons_clip():
    """MegatronOptim.step clips through the fused kernel's `grad_scale` (grads divided by
    (norm + 1e-6) / max_norm) instead of multiplying the gradients by max_norm / (norm + 1e-6)
    first: the same update (torch's fused AdamW on the CPU here, the same kernel contract)."""
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(17, 5, generator=g), torch.randn(9, generator=g)]
    grads = [torch.randn(t.shape, generator=g) * 4 for t in w]
    norm = float(torch.cat([x.reshape(-1) for x in grads]).norm())
    max_norm = 1.0
    assert norm > max_norm
    a = [t.clone().requires_grad_() for t in w]
    b = [t.clone().requires_grad_() for t in w]
    opt_a = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, fused=True)
    opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        for p, x in zip(a, grads, strict=True):
            p.grad = x * (max_norm / (norm + 1.0e-6))
        opt_a.step()
        for p, x in zip(b, grads, strict=True):
            p.grad = x.clone()
        opt_b.grad_scale = torch.tensor((norm + 1.0e-6) / max_norm, dtype=torch.float32)
        opt_b.step()
        del opt_b.grad_scale
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
