"""HF <-> Megatron conversion: bit-exact round trips, `slime-async convert`, refused configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime_async.actors.learner.trainer import Learner
from slime_async.models.arch import ModelArch, UnsupportedModel
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import tiny_config
from tests.support.learner_worker import algo_cfg, learner_cfg, make_sharp_model

SHAPES = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "qwen3": {}}


def assert_same_hf_weights(got_dir, want_dir):
    got = load_file(str(got_dir / "model.safetensors"))
    want = load_file(str(want_dir / "model.safetensors"))
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("family", list(SHAPES))
def test_hf_megatron_hf_round_trip_is_bit_exact(tmp_path, family):
    src = make_sharp_model(tmp_path / "src", family, **SHAPES[family])
    learner = Learner(learner_cfg(str(src)), algo_cfg())
    try:
        learner.save_hf(tmp_path / "out")
    finally:
        learner.close()
    out = tmp_path / "out"
    assert_same_hf_weights(out, src)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text()
    )
    assert load_tokenizer(out).encode("12+3") == load_tokenizer(src).encode("12+3")
    AutoModelForCausalLM.from_pretrained(out)  # a complete, loadable HF directory


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime_async", "convert", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_convert_command_both_ways(tmp_path):
    src = make_sharp_model(tmp_path / "src", "qwen3")
    r = run_cli(str(src), str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_hf_weights(tmp_path / "back", src)
    assert (tmp_path / "back" / "tokenizer.json").is_file()

    learner = Learner(learner_cfg(None, load=str(tmp_path / "ckpt")), algo_cfg())
    try:
        assert (learner.step, learner.version, learner.loaded_extra) == (0, 0, {})
    finally:
        learner.close()


def test_convert_command_names_bad_input(tmp_path):
    r = run_cli(str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert r.returncode == 2 and "neither an HF model directory" in r.stderr
    (tmp_path / "out").mkdir()
    r = run_cli(str(tmp_path), str(tmp_path / "out"))
    assert r.returncode == 2 and "exists already" in r.stderr


def hf_config(family="llama", **changes) -> dict:
    cfg = tiny_config(family).to_dict()
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling 'llama3'"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_configs_are_refused(changes, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelArch.from_hf_config(hf_config(**changes))


def test_arch_reads_each_family():
    llama = ModelArch.from_hf_config(
        hf_config("llama", rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    )
    assert (llama.qkv_bias, llama.qk_norm, llama.rope_theta) == (False, False, 5e5)
    assert ModelArch.from_hf_config(hf_config("qwen2")).qkv_bias
    qwen3 = ModelArch.from_hf_config(hf_config("qwen3", head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32  # head_dim may differ from hidden / heads
    with pytest.raises(UnsupportedModel, match="num_key_value_heads=2 is not divisible"):
        llama.check_tensor_parallel(4)


@pytest.mark.parametrize("family", ["glm4", "qwen3_moe"])
def test_glm4_and_moe_round_trip_through_a_checkpoint_is_bit_exact(tmp_path, family):
    """HF -> torch_dist checkpoint -> complete HF directory, bit-exact (GLM-4's fused gate/up
    and post norms; Qwen3-MoE's router and per-expert tensors, with a dense layer between)."""
    from slime_async.models.toy import make_tiny_model

    shape = {"mlp_only_layers": (1,), "num_layers": 3} if family == "qwen3_moe" else {}
    src = make_tiny_model(tmp_path / "src", family=family, seed=1, **shape)
    learner = Learner(learner_cfg(str(src)), algo_cfg())
    try:
        learner.save_checkpoint(tmp_path / "ckpt", extra={})
    finally:
        learner.close()
    learner = Learner(learner_cfg(None, load=str(tmp_path / "ckpt")), algo_cfg())
    try:
        learner.save_hf(tmp_path / "out")
    finally:
        learner.close()
    assert_same_hf_weights(tmp_path / "out", src)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family


def test_glm4_post_norm_mlp_replaces_either_kind_of_mlp_spec():
    """megatron-core 0.16 gives the dense MLP as a ModuleSpec, 0.17+ as a partial of
    `MLP.as_mlp_submodule`: GLM-4's post-norm MLP must take the place of the MLP in both."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime_async.models.glm4.megatron import post_normed_mlp

    class Base:
        @classmethod
        def as_mlp_submodule(cls, submodules=None, **kw):
            return cls, submodules, kw

    class PostNorm(Base):
        pass

    spec = post_normed_mlp(ModuleSpec(module=Base, submodules="subs"), PostNorm)
    assert spec.module is PostNorm and spec.submodules == "subs"
    built = post_normed_mlp(functools.partial(Base.as_mlp_submodule, submodules="subs"), PostNorm)
    assert built(config="c") == (PostNorm, "subs", {"config": "c"})
    with pytest.raises(TypeError, match="unexpected MLP spec"):
        post_normed_mlp(object(), PostNorm)
