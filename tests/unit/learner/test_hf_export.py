"""HF export of checkpoints: `hf/` complete or absent, `slime-async export` on a run directory,
the check against the learner, no half-written output, no library warnings.

The TP=2 export under torchrun, compared with the learner's log-probs, is in
tests/integration/test_learner_logprobs.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.learner import hf_export
from slime_async.actors.learner.trainer import Learner
from slime_async.config import LearnerConfig, SlimeConfig
from slime_async.models import convert
from tests.support.learner_worker import SEQS, algo_cfg, learner_cfg, make_groups, make_sharp_model


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime_async", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def hf_logp(model_dir, temperature: float = 1.0) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in SEQS:
            logits = hf(torch.tensor([s])).logits[0, :-1] / temperature
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.append(logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `slime-async run` leaves it: config.json, logs/, and checkpoints of
    steps 1 and 2 (step 2 with its complete `hf/`), trained by the real learner; plus the
    learner's log-probs after each step."""
    root = tmp_path_factory.mktemp("run")
    model = make_sharp_model(root / "model", "qwen3")
    run = root / "runs" / "r-1"
    (run / "logs").mkdir(parents=True)
    cfg = SlimeConfig()
    cfg.run.run_dir = str(run)
    cfg.learner.model_path = str(model)
    (run / "config.json").write_text(cfg.model_dump_json())
    learner = Learner(learner_cfg(str(model)), algo_cfg(), 1.0)
    logps = {}
    try:
        for step in (1, 2):
            learner.train_step(make_groups(step, 3))
            learner.save_checkpoint(run / "checkpoints" / f"step_{step}", extra={}, hf=step == 2)
            logps[step] = [lp for lp, _ in learner.compute_logprobs(SEQS)]
    finally:
        learner.close()
    return run, logps


def test_checkpoint_hf_folder_is_complete_or_absent(run_dir):
    """Without save_hf, no `hf/` (main wrote one with a config and no weights); with it, a
    complete HF model scoring like the learner."""
    run, logps = run_dir
    step1, step2 = run / "checkpoints" / "step_1", run / "checkpoints" / "step_2"
    assert not (step1 / "hf").exists()
    assert (step1 / "tokenizer" / "tokenizer.json").is_file()
    assert (step2 / "hf" / "model.safetensors").is_file()
    for got, want in zip(hf_logp(step2 / "hf"), logps[2], strict=True):
        assert (got - want).abs().max().item() < 1e-5


def test_export_command_takes_a_run_directory_and_a_step(run_dir, tmp_path):
    run, logps = run_dir
    r = export_cli("export", str(run), str(tmp_path / "newest"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2" in r.stdout and "checked" in r.stdout
    r = export_cli("export", str(run), "--step", "1", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr[-3000:]
    # No warning from megatron-core or torch's checkpoint code (nothing a user can act on).
    assert "Warning" not in r.stderr, r.stderr
    for step, out in ((2, "newest"), (1, "one")):
        for got, want in zip(hf_logp(tmp_path / out), logps[step], strict=True):
            assert (got - want).abs().max().item() < 1e-5
    assert (tmp_path / "one" / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["model_type"] == "qwen3"


def test_export_command_names_what_is_wrong(run_dir, tmp_path):
    run, _ = run_dir
    r = export_cli("export", str(run), "--step", "7", str(tmp_path / "x"))
    assert r.returncode == 2 and "no checkpoint of step 7 (steps there: 1, 2)" in r.stderr
    r = export_cli("export", str(tmp_path), str(tmp_path / "x"))
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr
    r = export_cli("export", str(run), str(run))
    assert r.returncode == 2 and "exists already" in r.stderr
    assert not (tmp_path / "x").exists()


def test_convert_prints_no_library_warnings(run_dir, tmp_path):
    """main's `convert` printed torch's FutureWarnings from dist_checkpointing's load."""
    run, _ = run_dir
    r = export_cli("convert", str(run / "checkpoints" / "step_1"), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr


def test_interrupted_export_leaves_no_directory(run_dir, tmp_path, monkeypatch):
    """A failure while writing leaves neither OUT nor its temporary (main left a partial OUT)."""
    run, _ = run_dir

    def fail_midway(out_dir, tensors, *a, **k):
        next(iter(tensors))
        (out_dir / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(convert, "write_hf_dir", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        hf_export.export_checkpoint(run / "checkpoints" / "step_1", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_check_catches_a_wrong_conversion(run_dir, tmp_path, monkeypatch):
    """A conversion that swaps the key and value heads writes a loadable model that scores
    differently: the check fails the export and removes it."""
    run, _ = run_dir
    split = convert._qkv_split
    monkeypatch.setattr(
        convert, "_qkv_split", lambda qkv, arch: (lambda q, k, v: [q, v, k])(*split(qkv, arch))
    )
    with pytest.raises(hf_export.ExportCheckFailed, match="differ from the learner's by up to"):
        hf_export.export_checkpoint(run / "checkpoints" / "step_1", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_hf_interval_is_refused_off_checkpoint_steps():
    with pytest.raises(ValueError, match=r"not a multiple of learner\.save_interval = 4"):
        LearnerConfig(save_interval=4, save_hf_interval=6)
    with pytest.raises(ValueError, match=r"learner\.save_interval = 0"):
        LearnerConfig(save_hf_interval=6)
    assert LearnerConfig(save_interval=4, save_hf_interval=8).save_hf_interval == 8
    with pytest.raises(ValueError, match="save_hf_interval"):
        SlimeConfig.model_validate({"learner": {"save_interval": 3, "save_hf_interval": 4}})
