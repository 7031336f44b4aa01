"""Weight gradients added into fp32 accumulators (`models/wgrad.py`): the product-and-add on
the CPU paths, and megatron-core's own linear layers running their gradient-accumulation
fusion through it (the installed megatron-core's backward, read as it is)."""

from __future__ import annotations

import pytest
import torch

from slime_async import megatron_compat
from slime_async.models import wgrad


def test_add_product_adds_in_place_in_the_accumulators_dtype():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=gen), torch.randn(5, 4, generator=gen)
    acc = torch.randn(6, 4, generator=gen)
    want = acc + a @ b
    ptr = acc.data_ptr()
    wgrad.add_product(acc, a, b)
    assert acc.data_ptr() == ptr
    assert torch.allclose(acc, want, atol=1e-6, rtol=1e-6)
    # bf16 factors into an fp32 accumulator (off a GPU: the product converted, then added)
    a16, b16 = a.bfloat16(), b.bfloat16()
    acc2 = want.clone()
    wgrad.add_product(acc2, a16, b16)
    assert acc2.dtype == torch.float32
    assert torch.equal(acc2, want + (a16 @ b16).float())


def test_install_megatron_keeps_a_real_extension_and_is_idempotent(monkeypatch):
    megatron_compat.apply()
    from megatron.core.tensor_parallel import layers

    real = object()
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", real, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    assert wgrad.install_megatron() == "apex"
    assert layers.fused_weight_gradient_mlp_cuda is real
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    assert wgrad.install_megatron() == "torch"
    assert wgrad.install_megatron() == "torch"
    assert layers.fused_weight_gradient_mlp_cuda is wgrad.EXTENSION
    assert layers._grad_accum_fusion_available is True


@pytest.mark.parametrize("kind", ["column", "row"])
def test_megatron_linear_with_the_fusion_sums_weight_gradients_into_main_grad(
    single_rank_megatron, monkeypatch, kind
):
    """Two backward passes (two micro-batches) through megatron's Column/RowParallelLinear with
    `gradient_accumulation_fusion`: `main_grad` holds the sum of the weight gradients the same
    layer computes without the fusion, and the weight's `.grad` is megatron's placeholder."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    megatron_compat.seed_model_parallel(0)

    def build(fusion: bool):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=fusion,
        )
        cls = layers.ColumnParallelLinear if kind == "column" else layers.RowParallelLinear
        extra = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
        return cls(
            8,
            12,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=False,
            skip_bias_add=True,
            **extra,
        )

    if kind == "column":  # megatron's column layer refuses the option without the extension
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            build(True)
    assert wgrad.install_megatron() == "torch"
    plain, fused = build(False), build(True)
    with torch.no_grad():
        fused.weight.copy_(plain.weight)
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    fused.weight.grad_added_to_main_grad = False
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(5, 3, 8, generator=gen)
        g = torch.randn(5, 3, 12, generator=gen)
        out_p, _ = plain(x)
        out_p.backward(g)
        out_f, _ = fused(x)
        out_f.backward(g)
    assert fused.weight.grad_added_to_main_grad is True
    assert torch.allclose(fused.weight.main_grad, plain.weight.grad, atol=1e-5, rtol=1e-5)
    assert fused.weight.main_grad.abs().max() > 0.1
