"""The learner's compiled pointwise ops, eager on the CPU: the same function as megatron's RoPE
(read from the installed megatron-core) and torch's RMSNorm, values and gradients; the norm
class runs the function it is given; a compile that is not usable leaves the layers eager."""

from __future__ import annotations

import logging

import pytest
import torch

from slime_async import megatron_compat
from slime_async.models import fused_ops


def _megatron_rope():
    megatron_compat.apply()
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd


def _mla_keyword(fn) -> str:
    import inspect

    params = inspect.signature(fn).parameters
    return (
        "mla_rotary_interleaved" if "mla_rotary_interleaved" in params else "multi_latent_attention"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rot_dim,interleaved,mla,mscale",
    [
        (16, False, False, 1.0),
        (16, True, False, 1.0),
        (8, False, False, 1.0),
        (8, True, False, 0.7),
        (16, False, True, 1.0),
    ],
)
def test_rope_is_megatrons_rope_bit_for_bit(dtype, rot_dim, interleaved, mla, mscale):
    ref = _megatron_rope()
    if ref is fused_ops.rope:
        pytest.skip("megatron's RoPE is already replaced in this process")
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 16, generator=g).to(dtype)
    freqs = torch.rand(6, 1, 1, rot_dim, generator=g) * 10
    t_ref = t.clone().requires_grad_()
    t_ours = t.clone().requires_grad_()
    want = ref(
        t_ref, freqs, rotary_interleaved=interleaved, mscale=mscale, **{_mla_keyword(ref): mla}
    )
    got = fused_ops.rope(
        t_ours, freqs, rotary_interleaved=interleaved, mscale=mscale, mla_rotary_interleaved=mla
    )
    assert torch.equal(got, want)
    upstream = torch.randn(want.shape, generator=g).to(dtype)
    want.backward(upstream)
    got.backward(upstream)
    assert torch.equal(t_ours.grad, t_ref.grad)
    # megatron 0.16 spells the MLA reordering multi_latent_attention: both are taken
    old = fused_ops.rope(
        t, freqs, rotary_interleaved=interleaved, mscale=mscale, multi_latent_attention=mla
    )
    assert torch.equal(old, want.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 2, 32, generator=g) * 3).to(dtype)
    w = (torch.rand(32, generator=g) + 0.5).to(dtype)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.rms_norm(xa, (32,), wa, eps=1e-6)
    got = fused_ops.rms_norm(xb, wb, 1e-6)
    tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    up = torch.randn(want.shape, generator=g).to(dtype)
    want.backward(up)
    got.backward(up)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    torch.testing.assert_close(
        wb.grad, wa.grad, **({} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2})
    )


def test_the_norm_class_runs_the_function_it_is_given():
    megatron_compat.apply()
    from megatron.core.transformer import TransformerConfig

    from slime_async.models.megatron import _norm_class

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    calls = []

    def norm(x, weight, eps):
        calls.append(eps)
        return fused_ops.rms_norm(x, weight, eps)

    eager, given = _norm_class()(cfg, 8, eps=1e-5), _norm_class(norm)(cfg, 8, eps=1e-5)
    x = torch.randn(3, 1, 8)
    torch.testing.assert_close(given(x), eager(x))
    assert calls == [1e-5]


def test_a_compile_that_is_not_usable_is_logged_and_leaves_the_layers_eager(caplog):
    if torch.cuda.is_available():
        pytest.skip("the CPU's refusal is what this checks")
    with caplog.at_level(logging.WARNING, logger="slime_async.learner"):
        assert fused_ops.compiled.__wrapped__(0) is None
    assert "learner.torch_compile" in caplog.text and "eagerly" in caplog.text


def test_functions_dynamo_stops_recompiling_are_counted_and_logged(caplog):
    """Past dynamo's recompile limit a compiled function runs eagerly, which dynamo says only in
    its own log: `fallbacks()` counts it (the learner's learner/compile_fallbacks) and the
    learner's log says it."""
    fused_ops.watch_fallbacks()
    before = fused_ops.fallbacks()

    def scale(x, n):
        return x * n

    fn = torch.compile(scale, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        for n in range(3):  # every new int is a new graph
            assert fn(torch.ones(2), n).tolist() == [float(n)] * 2
    assert fused_ops.fallbacks() == before + 1
    assert "learner/compile_fallbacks" in caplog.text
    assert "scale" in caplog.text
