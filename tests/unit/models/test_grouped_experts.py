"""The grouped-experts math shared by the learner and the embedded engine: the token sort, the
grouped matmul's exact fallback, and the engine's sparse block against HF's (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_async.models.grouped_experts import grouped_mm, sort_by_expert, swiglu_experts


def test_sort_by_expert_groups_pairs_stably_and_counts_them():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1], [2, 0]])  # [T=4, k=2]
    order, counts = sort_by_expert(ids, num_experts=5)
    assert counts.tolist() == [3, 1, 2, 2, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    # within an expert the tokens keep their order (pair index t * k + j)
    assert order.tolist() == [1, 2, 7, 5, 3, 6, 0, 4]


def test_grouped_mm_equals_one_linear_per_expert_with_gradients():
    """Exactly the per-expert products (as megatron's SequentialMLP and HF's loop compute them),
    empty experts included, and the same gradients for x and w."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 2])
    x = torch.randn(int(counts.sum()), 16, generator=gen, requires_grad=True)
    w = torch.randn(6, 8, 16, generator=gen, requires_grad=True)
    got = grouped_mm(x, w, counts)
    sizes = counts.tolist()
    want = torch.cat([F.linear(xe, w[e]) for e, xe in enumerate(torch.split(x, sizes)) if sizes[e]])
    assert torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen)
    gx, gw = torch.autograd.grad(got, (x, w), g)
    wx, ww = torch.autograd.grad(want, (x, w), g)
    assert torch.equal(gx, wx) and torch.equal(gw, ww)
    assert float(gw[1].abs().sum()) == 0.0  # an expert without tokens gets no gradient


def test_grouped_mm_without_tokens_keeps_the_weights_in_the_graph():
    w = torch.randn(3, 4, 8, requires_grad=True)
    out = grouped_mm(torch.zeros(0, 8), w, torch.zeros(3, dtype=torch.int64))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def test_swiglu_experts_scales_the_activation_before_the_down_projection():
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([2, 3])
    x = torch.randn(5, 8, generator=gen)
    w1 = torch.randn(2, 12, 8, generator=gen)  # [E, 2I, H]: gate rows then up rows
    w2 = torch.randn(2, 8, 6, generator=gen)
    probs = torch.rand(5, generator=gen)
    got = swiglu_experts(x, w1, w2, counts, probs)
    rows = []
    for t in range(5):
        e = 0 if t < 2 else 1
        g, u = F.linear(x[t], w1[e]).chunk(2)
        rows.append(F.linear(F.silu(g) * u * probs[t], w2[e]))
    assert torch.allclose(got, torch.stack(rows), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_engine_sparse_block_equals_hf(norm):
    """The embedded engine's Qwen3-MoE block (grouped GEMMs over sorted pairs) computes HF's
    `Qwen3MoeSparseMoeBlock` on packed tokens, and reports the experts HF's router picks."""
    from transformers import AutoModelForCausalLM

    from slime_async.models.qwen3_moe.engine import sparse_block
    from slime_async.models.toy import tiny_config

    cfg = tiny_config("qwen3_moe", num_layers=1, norm_topk_prob=norm, num_experts=8)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        block.experts.gate_up_proj.normal_(0.0, 0.2)
        block.experts.down_proj.normal_(0.0, 0.2)
    x = torch.randn(11, cfg.hidden_size)
    with torch.no_grad():
        got, ids = sparse_block(block, x, cfg.num_experts_per_tok)
        want = block(x[None])[0]
        _, _, hf_ids = block.gate(x)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(ids, hf_ids)
