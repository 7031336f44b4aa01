"""One GPU shared by the learner and an embedded engine: the learner's estimated peak, which
engines share a learner's GPU, the reserve `slime-async run` hands them, and the engine's sizing
of its KV cache around it (the CUDA queries replaced by the numbers of a GPU)."""

import gc
import json

import pytest
import torch

from slime_async.actors.engine.embedded import kv_cache
from slime_async.config import ConfigError, SlimeConfig, load_config
from slime_async.launch import gpu_memory as gm
from slime_async.models import memory as mm
from slime_async.models.arch import ModelArch
from tests.support.launch_plan import child_config, planned

GB = 1e9


def qwen3(hidden, layers, heads, kv_heads, ffn, vocab=151936, **extra) -> dict:
    return dict(
        model_type="qwen3_moe" if "num_experts" in extra else "qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        tie_word_embeddings=True,
        **extra,
    )


def arch(config: dict) -> ModelArch:
    return ModelArch.from_hf_config(config)


BENCH = {"dtype": "bfloat16", "micro_batch_tokens": 8 * 1024}
"""bench/bench_learner.py's learner: one micro-batch of 8 x 1,024 tokens, megatron's optimizer."""


@pytest.mark.parametrize(
    ("shape", "measured_gb"),
    [
        # peaks measured by bench/bench_learner.py on an H200 (docs/benchmarks, 2026-12-02)
        (qwen3(1024, 28, 16, 8, 3072), 21.2),
        (qwen3(2560, 36, 32, 8, 9728), 105.7),
    ],
    ids=["0.51B", "qwen3-4b-layers"],
)
def test_the_estimate_covers_measured_peaks(shape, measured_gb):
    cfg = SlimeConfig.model_validate({"learner": BENCH})
    mem = mm.learner_memory(cfg, arch(shape))
    assert mem.total / GB >= measured_gb  # never below what a real step took
    # and not wasteful: without the margin within 15% of the measured peak
    assert (mem.total - mem.margin) / GB <= 1.15 * measured_gb


def test_the_estimate_follows_the_settings():
    shape = arch(qwen3(1024, 28, 16, 8, 3072))
    base = mm.learner_memory(SlimeConfig.model_validate({"learner": BENCH}), shape)
    full = mm.learner_memory(
        SlimeConfig.model_validate({"learner": {**BENCH, "recompute": "full"}}), shape
    )
    assert full.activations < base.activations / 10
    dp4 = mm.learner_memory(
        SlimeConfig.model_validate({"learner": BENCH, "run": {"learner_procs": 4}}), shape
    )
    assert dp4.optimizer * 4 == base.optimizer  # sharded by the distributed optimizer
    tp2 = mm.learner_memory(
        SlimeConfig.model_validate(
            {"learner": {**BENCH, "tensor_parallel": 2}, "run": {"learner_procs": 2}}
        ),
        shape,
    )
    assert tp2.weights == pytest.approx(base.weights / 2, rel=0.01)
    kl = mm.learner_memory(
        SlimeConfig.model_validate({"learner": BENCH, "algo": {"kl_coef": 0.01}}), shape
    )
    assert kl.weights == 2 * base.weights  # the frozen reference


def test_moe_counts_every_expert_and_routes_each_token_to_top_k():
    moe = qwen3(
        2048, 4, 32, 4, 6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768
    )
    shape = arch(moe)
    assert mm._params(shape)[1] == 3 * 2048 * 768 * 128 * 4
    dense = arch(qwen3(2048, 4, 32, 4, 8 * 768))  # each token through 8 experts of 768
    assert mm._activation_elements(shape) == mm._activation_elements(dense)
    cfg = SlimeConfig.model_validate({"learner": {**BENCH, "expert_parallel": 2}})
    one = mm.learner_memory(SlimeConfig.model_validate({"learner": BENCH}), shape)
    assert mm.learner_memory(cfg, shape).weights < one.weights


def _cfg(*overrides: str) -> SlimeConfig:
    return load_config([], ["engine.embedded.device=cuda", *overrides])


def test_which_engines_share_a_learner_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gm.shared_gpus(_cfg()) == {0: "0"}  # both on the first GPU by default
    two = _cfg('run.engine_cuda_devices=["0"]', 'run.learner_cuda_devices="1"')
    assert gm.shared_gpus(two) == {}
    one = _cfg('run.engine_cuda_devices=["0"]', 'run.learner_cuda_devices="0"')
    assert gm.shared_gpus(one) == {0: "0"}
    assert gm.shared_gpus(_cfg("engine.embedded.device=cpu")) == {}
    assert gm.shared_gpus(_cfg('run.learner_cuda_devices=""')) == {}  # a CPU learner
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    # the engine takes the second visible GPU ("4"), the learner's two ranks "3" and "4"
    assert gm.shared_gpus(_cfg("engine.embedded.device=cuda:1", "run.learner_procs=2")) == {0: "4"}
    assert gm.shared_gpus(_cfg("engine.embedded.device=cuda:1")) == {}
    external = load_config([], ["engine.kind=external", 'engine.urls=["http://e:1"]'])
    assert gm.shared_gpus(external) == {}


def test_auto_on_a_machine_without_a_gpu_shares_nothing(monkeypatch):
    monkeypatch.setattr(gm, "_gpu_present", lambda: False)
    assert gm.shared_gpus(_cfg("engine.embedded.device=auto")) == {}
    monkeypatch.setattr(gm, "_gpu_present", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gm.shared_gpus(_cfg("engine.embedded.device=auto")) == {0: "0"}


def test_several_engines_on_the_learner_gpu_are_refused(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg("engine.num_engines=2", 'run.engine_cuda_devices=["0", "0"]')
    with pytest.raises(ConfigError, match=r"several engines on GPU\(s\) 0"):
        gm.gpu_shares(cfg, None)
    # sized by hand: the launcher leaves them alone
    by_hand = _cfg("engine.num_engines=2", "engine.embedded.gpu_reserve_gib=10")
    assert gm.gpu_shares(by_hand, None) == []


def test_the_engine_on_the_learner_gpu_gets_the_reserve(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(qwen3(1024, 28, 16, 8, 3072)))
    over = ("engine.embedded.device=cuda", f"learner.model_path={model}", "learner.dtype=bfloat16")
    cfg = _cfg(*over)
    estimate = mm.estimate_learner_memory(cfg)
    assert estimate is not None
    (share,) = gm.gpu_shares(cfg, estimate)
    reserve = {share.engine: gm.reserve_gib(share)}
    cfg, run_dir, stages = planned(tmp_path, *over, gpu_reserve=reserve)
    engine = child_config(run_dir, stages[0][1].argv(False))
    assert engine.engine.embedded.gpu_reserve_gib == reserve[0] >= estimate.total_gib
    assert "keeps" in share.note() and "activations" in share.note()
    # its own GPU: nothing kept back
    own = (*over, 'run.engine_cuda_devices=["0"]', 'run.learner_cuda_devices="1"')
    assert gm.gpu_shares(_cfg(*own), estimate) == []
    cfg, run_dir, stages = planned(tmp_path / "b", *own)
    assert child_config(run_dir, stages[0][1].argv(False)).engine.embedded.gpu_reserve_gib == "auto"
    # no model config to read: no estimate, no reserve, and the note says what to set
    cfg = _cfg("learner.model_path=/nowhere")
    assert mm.estimate_learner_memory(cfg) is None
    (share,) = gm.gpu_shares(cfg, None)
    assert "engine.embedded.gpu_reserve_gib" in share.note()


class FakeGpu:
    """The CUDA queries `blocks_for_memory` makes, answered as a GPU of `total` bytes would:
    `ours` allocated by live tensors of this process, `cached` freed but still held by torch's
    allocator (reserved, not free to the driver) until `empty_cache`."""

    def __init__(self, monkeypatch, total: int, free: int, ours: int, cached: int = 0):
        self.free, self.ours, self.cached = free, ours, cached
        props = type("Props", (), {"total_memory": total})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (self.free, total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: self.ours + self.cached)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def empty_cache(self) -> None:
        self.free, self.cached = self.free + self.cached, 0


class DeadEngine:
    """An engine nobody references but itself (a reference cycle): its tensors go back to
    torch's cache only when the cycle is collected."""

    def __init__(self, gpu: FakeGpu, size: int):
        self.gpu, self.size, self.me = gpu, size, self
        gpu.ours += size

    def __del__(self):
        self.gpu.ours -= self.size
        self.gpu.cached += self.size


def test_the_engine_sizes_its_cache_around_the_reserve(monkeypatch):
    gib = 2**30
    FakeGpu(monkeypatch, total=80 * gib, free=78 * gib, ours=2 * gib)
    block = 16 * 100_000
    dev = torch.device("cuda:0")
    alone, _ = kv_cache.blocks_for_memory(dev, 0.8, block, gib)
    shared, info = kv_cache.blocks_for_memory(dev, 0.8, block, gib, others_bytes=30 * gib)
    assert alone == (int(0.8 * 80 * gib) - 2 * gib - gib) // block  # mem_fraction binds
    assert shared == (78 * gib - 30 * gib - gib) // block  # what the learner leaves binds
    assert info["others_bytes"] == 30 * gib
    with pytest.raises(ValueError, match=r"kept free for the learner 76\.0 GiB") as e:
        kv_cache.blocks_for_memory(dev, 0.8, block, gib, others_bytes=76 * gib, min_blocks=1000)
    assert "needs 1000 blocks" in str(e.value) and "engine weights 2.0 GiB" in str(e.value)


def test_memory_an_earlier_engine_left_counts_as_free(monkeypatch):
    """An earlier engine of the same process, unreachable but not yet collected (a reference
    cycle), holds 60 GiB, and torch caches 2 GiB an earlier model freed: the new engine's cache is
    sized as if both were free (collected and handed back first), not refused for want of room
    (seen on a GPU: "no room for the KV cache ... engine weights 62.4 GiB")."""
    gib = 2**30
    gpu = FakeGpu(monkeypatch, total=80 * gib, free=16 * gib, ours=2 * gib, cached=2 * gib)
    enabled = gc.isenabled()
    gc.disable()  # only the engine's own collection may free the dead engine
    try:
        DeadEngine(gpu, 60 * gib)
        assert gpu.ours == 62 * gib
        n, info = kv_cache.blocks_for_memory(torch.device("cuda:0"), 0.8, 16 * 100_000, gib)
    finally:
        if enabled:
            gc.enable()
    assert gpu.cached == 0 and info["weights_bytes"] == 2 * gib
    assert n == (int(0.8 * 80 * gib) - 2 * gib - gib) // (16 * 100_000)


def test_a_negative_reserve_is_refused():
    with pytest.raises(ConfigError, match="gpu_reserve_gib must be >= 0"):
        load_config([], ["engine.embedded.gpu_reserve_gib=-1"])
