"""The learner on a CUDA GPU (bf16): bench/bench_learner.py on a reduced Qwen3 shape.

Checks correctness only (log-prob agreement with HF, finite losses, the version counter);
the speed figures come from running the bench itself at full size.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bf16_learner_agrees_with_hf_and_trains(tmp_path, repo_root):
    out = tmp_path / "bench.json"
    shape = ["--hidden", "512", "--layers", "4", "--heads", "8", "--kv-heads", "4"]
    shape += ["--ffn", "1536", "--vocab", "32768", "--batch", "4", "--seq", "512"]
    cmd = [sys.executable, str(repo_root / "bench/bench_learner.py"), *shape]
    cmd += ["--warmup", "1", "--steps", "2", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    ours, hf_noise = res["learner_vs_hf_fp32"], res["hf_bf16_vs_hf_fp32"]
    # The learner's bf16 error against the fp32 reference is of the order of HF's own bf16 error.
    assert ours["mean_abs"] < 3 * hf_noise["mean_abs"] + 1e-3, res
    assert res["learner_vs_hf_bf16"]["mean_abs"] < 0.05, res
    assert all(math.isfinite(x) for x in res["learner_losses"])
    assert res["version"] == 3
