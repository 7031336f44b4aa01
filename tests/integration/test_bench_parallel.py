"""The two-GPU benchmark rows, run at a tiny shape on two gloo ranks: `bench_learner.py
--tensor-parallel 2` and `bench_moe.py --part learner --expert-parallel 2`, each under torchrun
(loopback rendezvous, real megatron-core), their JSON checked: the parallel size recorded, each
rank holding a shard, finite losses, MFU per GPU, and log-probs equal to the same weights at
TP / EP 1 within fp32's reordering noise.

Tolerance: on the CPU the learner runs in fp32. TP 2 sums each row-parallel layer's two halves in
another order, and EP 2 runs each expert's GEMM on other row counts; that moves a log-prob of
about -4.9 by an ulp or two (one ulp there is 4.8e-7; 9.5e-7 measured at TP 2, 0 at EP 2). 1e-5
leaves ten times that, while what the check must catch (other weights, another batch, a wrong
shard) moves them by far more: rounding the same model's activations to bf16 alone moves them by
about 7e-4 on average at this shape (`hf_bf16_vs_hf_fp32`, asserted below).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.repo import REPO, torchrun_two_ranks

TOL = 1e-5
TIMEOUT_S = 120
TINY = ("--vocab", "128", "--batch", "2", "--seq", "64", "--warmup", "0", "--steps", "1")


def torchrun_bench(script: str, out: Path, *argv: str) -> tuple[dict, str]:
    """`script argv --json` under torchrun with two gloo ranks on loopback; (rank 0's JSON,
    the job's log). The job runs in a process group of its own, stopped by the test."""
    args = [*argv, "--json", str(out / "result.json")]
    torchrun_two_ranks(str(REPO / script), args, out, f"{script} on two ranks to finish", TIMEOUT_S)
    return json.loads((out / "result.json").read_text()), (out / "log.txt").read_text()


def test_bench_learner_at_tp2_on_two_gloo_ranks_matches_tp1(tmp_path):
    res, log = torchrun_bench(
        "bench/bench_learner.py", tmp_path, "--tensor-parallel", "2", "--hidden", "64",
        "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--peak-tflops", "1e-6", *TINY,
    )  # fmt: skip
    assert res["partial"] is False
    assert (res["tensor_parallel"], res["gpus"]) == (2, 2)
    # Each rank holds a shard: fewer parameters than the whole model, which TP 1 holds.
    assert len(res["params_per_rank"]) == 2
    assert all(n < res["params"] for n in res["params_per_rank"])
    assert all(math.isfinite(x) for x in res["learner_losses"]) and res["version"] == 1
    assert len(res["learner_peak_mem_gb_per_rank"]) == 2  # None each: the CPU has no allocator
    # Tokens/s of the TP group; MFU per GPU: over two GPUs' peak.
    tps = res["learner_tokens_per_s"]
    assert res["learner_tokens_per_s_per_gpu"] == pytest.approx(tps / 2)
    assert res["learner_mfu"] == pytest.approx(tps / 2 * res["flops_per_token"] / 1e6)
    # Log-probs: TP 2 against TP 1 on the same weights and batch, and each against HF fp32.
    assert res["learner_vs_tp1"]["max_abs"] <= TOL, res["learner_vs_tp1"]
    assert res["learner_vs_hf_fp32"]["max_abs"] <= TOL, res["learner_vs_hf_fp32"]
    assert res["tp1_vs_hf_fp32"]["max_abs"] <= TOL, res["tp1_vs_hf_fp32"]
    assert res["hf_bf16_vs_hf_fp32"]["mean_abs"] > 50 * TOL  # the check can see a change
    # The HF baseline is a one-GPU figure: not run at TP 2 (--baseline defaults to none).
    assert "hf" not in res and "no baseline (--baseline none)" in log
    # Rank 0 alone prints.
    assert log.count("[bench_learner] learner_tokens_per_s = ") == 1
    assert "log-probs |TP 2 - TP 1|" in log


def test_bench_moe_at_ep2_on_two_gloo_ranks_matches_ep1(tmp_path):
    res, log = torchrun_bench(
        "bench/bench_moe.py", tmp_path, "--part", "learner", "--expert-parallel", "2",
        "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--ffn", "128", "--experts", "4", "--topk", "2", "--moe-ffn", "32",
        "--peak-tflops", "1e-6", *TINY,
    )  # fmt: skip
    assert (res["expert_parallel"], res["gpus"]) == (2, 2)
    assert list(res["learner"]) == ["grouped"]  # HF is a one-GPU side: not run at EP 2
    row = res["learner"]["grouped"]
    assert (row["expert_parallel"], row["gpus"]) == (2, 2)
    # Each rank holds half the experts: fewer parameters than the EP 1 reference holds.
    assert len(row["params_per_rank"]) == 2
    assert all(n < row["ep1_params"] for n in row["params_per_rank"])
    assert all(math.isfinite(x) for x in row["losses"])
    # Each EP rank trains its own --batch rows: the world's tokens; MFU per GPU.
    assert row["tokens_per_s"] == pytest.approx(2 * 2 * 64 / row["step_s_mean"])
    flops = res["train_gflop_per_token"] * 1e9
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] / 2 * flops / 1e6)
    assert row["logprobs_vs_ep1"]["max_abs"] <= TOL, row["logprobs_vs_ep1"]
    assert -6 < row["mean_logp"] < -4  # about log(1/128): real log-probs, not zeros
    assert log.count("learner side grouped: ") == 1  # rank 0 alone prints


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
