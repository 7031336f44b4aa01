"""MoE on a CUDA GPU: torch's grouped GEMM against the per-expert loop (bf16, forward and
backward), the learner's grouped experts against SequentialMLP in bf16, and the embedded engine's
MoE decode replayed from CUDA graphs with each token's experts recorded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_grouped_kernel_equals_the_per_expert_loop_in_bf16():
    from slime_async.models import grouped_experts as ge

    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([300, 0, 17, 1, 512, 90, 0, 104], device="cuda")
    n = int(counts.sum())
    x = torch.randn(n, 256, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w = (0.05 * torch.randn(8, 384, 256, device="cuda", generator=gen)).bfloat16()
    w.requires_grad_(True)
    assert ge.kernel_fits(x, w)
    got = ge.grouped_mm(x, w, counts)
    sizes = counts.tolist()
    want = torch.cat([F.linear(xe, w[e]) for e, xe in enumerate(x.split(sizes)) if sizes[e]])
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    g = torch.randn(got.shape, device="cuda", generator=gen).bfloat16()
    gx, gw = torch.autograd.grad(got, (x, w), g)
    wx, ww = torch.autograd.grad(want, (x, w), g)
    assert (gx.float() - wx.float()).abs().max() <= 2e-2 * wx.float().abs().max()
    assert (gw.float() - ww.float()).abs().max() <= 2e-2 * ww.float().abs().max()


def test_learner_grouped_experts_agree_with_sequential_in_bf16(tmp_path):
    from slime_async.actors.learner.trainer import Learner
    from slime_async.config import AlgoConfig, LearnerConfig
    from slime_async.models.toy import make_tiny_model

    d = make_tiny_model(
        tmp_path / "moe", "qwen3_moe", hidden_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
    )  # fmt: skip
    seqs = [[2, *range(10, 60)], [2, *range(70, 100)]]
    out = {}
    for experts in ("grouped", "sequential"):
        cfg = LearnerConfig(model_path=str(d), dtype="bfloat16", moe_experts=experts, lr=1e-5)
        learner = Learner(cfg, AlgoConfig(loss="ppo_clip", advantage="grpo", mini_batches=1))
        try:
            out[experts] = [lp for lp, _ in learner.compute_logprobs(seqs)]
        finally:
            learner.close()
    for a, b in zip(out["grouped"], out["sequential"], strict=True):
        assert (a - b).abs().mean() < 2e-2, (a - b).abs().max()


def test_engine_moe_decode_runs_from_cuda_graphs_and_records_routing(tmp_path):
    from slime_async.actors.engine.embedded.model_runner import ModelRunner
    from slime_async.models.toy import make_tiny_model
    from tests.support.engine_util import greedy_with_runner

    d = make_tiny_model(
        tmp_path / "moe", "qwen3_moe", hidden_size=128, num_layers=2, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64,
    )  # fmt: skip
    runner = ModelRunner(d, device="cuda", dtype=torch.bfloat16, max_slots=8, num_blocks=64)
    sizes = runner.capture_cuda_graphs()
    assert sizes, "no decode CUDA graph was captured"
    prompts = [[2, 10, 11, 12, 13], [2, 20, 21]]
    replayed, _ = greedy_with_runner(runner, prompts, steps=6)
    assert runner.routed is not None
    recorded = runner.routed.clone()
    assert int(recorded.max()) < 8 and int(recorded.min()) >= 0 and int(recorded.sum()) > 0
    runner.drop_cuda_graphs()
    eager, _ = greedy_with_runner(runner, prompts, steps=6)
    assert replayed == eager
