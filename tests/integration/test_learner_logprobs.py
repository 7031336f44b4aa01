"""The Megatron learner's per-token log-probs equal the HF model's, at TP=1 and TP=2 (gloo).

Also: HF export at TP=2 is bit-exact, training at TP=2 equals training at TP=1, a TP=2
checkpoint resumes at TP=1, and `slime-async export` of a trained TP=2 checkpoint (under torchrun
at TP=2, and in one process) gives an HF model whose log-probs are the learner's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime_async.actors.learner.trainer import Learner
from slime_async.utils.procs import free_port
from tests.support import learner_worker
from tests.support.learner_worker import (
    SEQS,
    TP_ALGO,
    TP_TRAIN,
    algo_cfg,
    learner_cfg,
    make_groups,
    make_sharp_model,
)

# (family, shape): GQA everywhere; qwen2 has QKV bias and tied embeddings; qwen3 q/k norm.
MODELS = {
    "llama": dict(tie_word_embeddings=False, rope_theta=500000.0),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False, rope_theta=1000000.0),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {fam: make_sharp_model(root / fam, fam, **shape) for fam, shape in MODELS.items()}


def hf_reference(model_dir, temperature: float = 1.0):
    """[(logp [L-1], entropy [L-1])] per SEQS row from the HF model at `temperature`."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in SEQS:
            logits = hf(torch.tensor([s])).logits[0, :-1].float() / temperature
            logsm = torch.log_softmax(logits, dim=-1)
            logp = logsm.gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            out.append((logp, -(logsm.exp() * logsm).sum(-1)))
    return out


def assert_close(got, want, tol=1e-5):
    for (lp, ent), (ref_lp, ref_ent) in zip(got, want, strict=True):
        assert lp.shape == ref_lp.shape
        assert (lp - ref_lp).abs().max().item() < tol, (lp, ref_lp)
        if ent is not None:
            assert (ent - ref_ent).abs().max().item() < tol


@pytest.mark.parametrize("family", list(MODELS))
def test_logprobs_match_hf_at_tp1(model_dirs, family):
    for temperature in (1.0, 0.7):
        learner = Learner(learner_cfg(str(model_dirs[family])), algo_cfg(), temperature)
        try:
            got = learner.compute_logprobs(SEQS, with_entropy=True)
        finally:
            learner.close()
        want = hf_reference(model_dirs[family], temperature)
        assert_close(got, want)
        # The reference is not trivially uniform: the check has something to catch.
        assert max(e.max().item() for _, e in want) < 0.9 * torch.log(torch.tensor(128.0)).item()


@pytest.fixture(scope="module")
def tp2_run(model_dirs, tmp_path_factory):
    """One torchrun job, 2 gloo ranks at TP=2, over the three families."""
    out = tmp_path_factory.mktemp("tp2")
    learner_worker.run_two_ranks("tp2", out, [str(model_dirs[f]) for f in MODELS], timeout=240)
    return out


def test_logprobs_match_hf_at_tp2(model_dirs, tp2_run):
    for i, fam in enumerate(MODELS):
        res = torch.load(tp2_run / f"tp2_{i}.pt")
        got = list(zip(res["logp"], res["entropy"], strict=True))
        assert_close(got, hf_reference(model_dirs[fam], temperature=0.7))


def test_hf_export_at_tp2_is_bit_exact(model_dirs, tp2_run):
    for i, fam in enumerate(MODELS):
        exported = torch.load(tp2_run / f"tp2_{i}.pt")["export"]
        original = load_file(str(model_dirs[fam] / "model.safetensors"))
        assert set(exported) == set(original)
        for name, t in original.items():
            assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


def test_tp2_checkpoint_resumes_at_tp1(tp2_run):
    trained = torch.load(tp2_run / "tp2_trained.pt")
    learner = Learner(learner_cfg(None, load=str(tp2_run / "ckpt_tp2")), algo_cfg(), 0.7)
    try:
        assert learner.version == trained["version"] == 2 and learner.step == 2
        assert learner.loaded_extra == {"cursor": 17}
        got = [lp for lp, _ in learner.compute_logprobs(SEQS)]
    finally:
        learner.close()
    for lp, want in zip(got, trained["logp"], strict=True):
        assert (lp - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("ranks", [2, 1])
def test_export_of_a_tp2_checkpoint_scores_like_the_learner(tp2_run, tmp_path, ranks):
    """The trained TP=2 checkpoint, exported by `slime-async export` under torchrun at TP=2 (and
    resharded into one process), loads in transformers with the learner's log-probs (fp32)."""
    out = tmp_path / "hf"
    args = ["export", str(tp2_run / "ckpt_tp2"), str(out)]
    if ranks == 2:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "slime_async",
        ]
        args += ["--tensor-parallel", "2"]
    else:
        launcher = ["-m", "slime_async"]
    r = subprocess.run(
        [sys.executable, *launcher, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote HF directory") == 1  # rank 0 alone reports
    trained = torch.load(tp2_run / "tp2_trained.pt")
    want = hf_reference(out, temperature=0.7)
    for lp, (ref_lp, _) in zip(trained["logp"], want, strict=True):
        assert (lp - ref_lp).abs().max().item() < 1e-5


def test_tp2_training_equals_tp1(model_dirs, tp2_run):
    """Two clipped steps with an entropy term: same losses, grad norms and resulting log-probs."""
    trained = torch.load(tp2_run / "tp2_trained.pt")
    cfg = learner_cfg(str(model_dirs["llama"]), **TP_TRAIN)
    learner = Learner(cfg, algo_cfg(**TP_ALGO), 0.7)
    try:
        metrics = [learner.train_step(make_groups(step, 3)) for step in range(2)]
        got = [lp for lp, _ in learner.compute_logprobs(SEQS)]
    finally:
        learner.close()
    # Step 1 starts from the same weights. Step 2 starts after an Adam step, whose update
    # g / (|g| + eps) turns fp rounding in tiny gradients into visible (1e-6) differences.
    for tol, m1, m2 in zip((1e-5, 1e-4), metrics, trained["metrics"], strict=True):
        assert m1["grad_norm"] > TP_TRAIN["clip_grad"]  # the clip acted
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=tol)
        # The loss sums advantage-weighted terms of both signs: cancellation costs a digit.
        assert m1["loss"] == pytest.approx(m2["loss"], rel=10 * tol)
    for lp, want in zip(got, trained["logp"], strict=True):
        assert (lp - want).abs().max().item() < 1e-4
