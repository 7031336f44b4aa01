"""The learner's SwiGLU kernels (swiglu_triton.py) against eager torch autograd of silu(a) * b,
in Triton's CPU interpreter (the GPU compares them with megatron's compiled fusion in
tests/gpu/test_learner_gpu.py): values and gradients in fp32 and bf16, row counts and half
widths that no block divides; `megatron_swiglu` hands a bias to megatron's own function, and
`fused_ops.install_swiglu` puts a function in megatron's MLP and takes it out again."""

import os

import pytest
import torch

from slime_async import megatron_compat
from slime_async.models import fused_ops, swiglu_triton

pytestmark = pytest.mark.skipif(
    swiglu_triton.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)

# fp32: the same formula in the same precision, a few ulps apart (exp's rounding). bf16: both
# computed in fp32 from the same bf16 inputs and rounded once; torch's eager bf16 rounds
# silu(a) and each product on the way, so the reference is fp32 autograd rounded to bf16 and
# the two may differ by one bf16 ulp of the result (2^-8 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}


def _eager(y: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(a) * b of y = [a, b] and y's gradient for the upstream `up`, fp32 autograd."""
    y32 = y.detach().float().requires_grad_()
    a, b = torch.chunk(y32, 2, dim=-1)
    out = torch.nn.functional.silu(a) * b
    out.backward(up.float())
    return out.to(y.dtype), y32.grad.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 2 * 200), (37, 2 * 1536), (2, 2 * 8)])
def test_values_and_gradients_are_eager_torchs(dtype, shape):
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(shape, generator=g) * 4).to(dtype)
    y.view(-1, shape[-1])[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # a: sig 0, 1 and 1/2
    up = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    y_ours = y.clone().requires_grad_()
    out = swiglu_triton.swiglu(y_ours)
    out.backward(up)
    want, grad = _eager(y, up)
    assert out.dtype == y.dtype and out.shape == want.shape
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(y_ours.grad, grad, **TOL[dtype])


def test_strided_rows_and_a_non_contiguous_gradient():
    """Rows with a stride past 2F (a slice of a wider tensor) and an upstream gradient with a
    non-contiguous last dimension are taken as they are (the gradient copied first)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 2 * 64 + 10, generator=g)
    y = wide[:, : 2 * 64]
    up = torch.randn(64, 6, generator=g).t()
    out = swiglu_triton.forward(y)
    dy = swiglu_triton.backward(up, y)
    want, grad = _eager(y, up)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(dy, grad, **TOL[torch.float32])


def _megatron_swiglu_module():
    megatron_compat.apply()
    from megatron.core.fusions import fused_bias_swiglu

    return fused_bias_swiglu


def test_a_bias_fp8_storage_or_offloading_runs_megatrons_own_function():
    fused_bias_swiglu = _megatron_swiglu_module()
    g = torch.Generator().manual_seed(2)
    y = torch.randn(8, 2 * 16, generator=g, requires_grad=True)
    bias = torch.randn(2 * 16, generator=g, requires_grad=True)
    # megatron torch.compiles its fusion; its eager function is the same math, faster to test
    with torch._dynamo.config.patch(disable=True):
        out = swiglu_triton.megatron_swiglu(y, bias)
        want = fused_bias_swiglu.bias_swiglu_impl(y, bias)
        offloaded = swiglu_triton.megatron_swiglu(y, None, cpu_offload_input=True)
    assert type(out.grad_fn).__name__ == "BiasSwiGLUFunctionBackward"
    assert type(offloaded.grad_fn).__name__ == "SwiGLUFunctionBackward"
    assert torch.equal(out, want)
    ours = swiglu_triton.megatron_swiglu(y, None)
    assert type(ours.grad_fn).__name__ == "SwiGLUBackward"
    torch.testing.assert_close(ours, offloaded, **TOL[torch.float32])


def test_install_swiglu_puts_a_function_in_megatrons_mlp_and_none_restores_its_own():
    fused_bias_swiglu = _megatron_swiglu_module()
    from megatron.core.transformer import mlp

    original = fused_bias_swiglu.bias_swiglu_impl
    try:
        fused_ops.install_swiglu(swiglu_triton.megatron_swiglu)
        assert mlp.bias_swiglu_impl is swiglu_triton.megatron_swiglu
        fused_ops.install_swiglu(swiglu_triton.megatron_swiglu)  # twice: still restorable
    finally:
        fused_ops.install_swiglu(None)
    assert mlp.bias_swiglu_impl is original


def test_the_check_on_the_device_passes_and_gives_megatrons_signature():
    """`fused_ops.compiled()` runs the same check on its CUDA device; here on the interpreter."""
    y = torch.randn(5, 3, 2 * 200, dtype=torch.bfloat16).requires_grad_()
    assert fused_ops._checked_triton_swiglu(y) is swiglu_triton.megatron_swiglu
