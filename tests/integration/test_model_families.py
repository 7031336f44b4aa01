"""GLM-4 and Qwen3-MoE in the learner: log-probs equal HF's (fp32, TP 1 and 2, EP 2, TP 2 x EP 2),
bit-exact HF export at every layout, an EP 2 checkpoint that loads at EP 1, megatron's router
equal to HF's, and routing replay (the learner goes through the recorded experts).

One torchrun job (2 gloo ranks) runs every multi-rank layout in turn (module fixture); the rest
runs in this process. Also the torchrun worker itself
(`python tests/integration/test_model_families.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from slime_async.actors.learner.trainer import Learner
from slime_async.config import AlgoConfig, LearnerConfig
from tests.support.engine_util import greedy_with_runner
from tests.support.repo import REPO, torchrun_two_ranks

SEQS = [[2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 20, 21, 22], [2, 30, 31, 32, 33, 34, 35]]
SHAPES = {
    "glm4": dict(num_layers=2, num_heads=4, num_kv_heads=2),
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: both kinds in one model.
    "qwen3_moe": dict(num_layers=3, num_heads=4, num_kv_heads=2, mlp_only_layers=(1,)),
}
# (name, family, tensor_parallel, expert_parallel) of the two-rank job.
LAYOUTS = [
    ("glm4_tp2", "glm4", 2, 1),
    ("moe_tp2", "qwen3_moe", 2, 1),
    ("moe_ep2", "qwen3_moe", 1, 2),
    ("moe_tp2_ep2", "qwen3_moe", 2, 2),
]


def cfg(model_dir: str | None, **kw) -> LearnerConfig:
    base = dict(model_path=model_dir, lr=1e-3, clip_grad=0.0, micro_batch_tokens=24, seed=7)
    return LearnerConfig(**{**base, **kw})


def algo() -> AlgoConfig:
    return AlgoConfig(
        loss="tests.support.learner_worker:pg_loss",
        advantage="tests.support.learner_worker:centered_adv",
        mini_batches=1,
    )


# ---------------------------------------------------------------- the two-rank worker


def worker(out: Path, dirs: dict[str, str]) -> None:
    for name, fam, tp, ep in LAYOUTS:
        learner = Learner(cfg(dirs[fam], tensor_parallel=tp, expert_parallel=ep), algo(), 0.7)
        res = {"logp": [lp for lp, _ in learner.compute_logprobs(SEQS, with_entropy=True)]}
        res["export"] = {n: t.clone() for b in learner.export_hf_buckets(4096) for n, t in b}
        if name == "moe_tp2":
            # TP ranks get the same data; sequence parallelism, the q/k norms and the router
            # leave partial gradients on each TP rank, summed over TP by the optimizer.
            from tests.support.learner_worker import make_groups

            res["metrics"] = learner.train_step(make_groups(5, 2))
            res["after"] = [lp for lp, _ in learner.compute_logprobs(SEQS)]
            learner.save_checkpoint(out / "ckpt_moe_tp2", extra={})
            # Replicated weights must stay replicas: each TP rank's copy after the update.
            res["replicas"] = {}
            for n, p in learner.model.named_parameters():
                if n.endswith(("layernorm.weight", "router.weight")):
                    copies = [torch.empty_like(p) for _ in range(2)]
                    dist.all_gather(copies, p.detach().contiguous(), group=learner.tp_group)
                    res["replicas"][n] = bool(torch.equal(copies[0], copies[1]))
        if name == "moe_ep2":
            # Each EP rank is a DP rank: different data, gradients reduced per parameter kind.
            from tests.support.learner_worker import make_groups

            groups = make_groups(3, 4)
            mine = groups[:2] if learner.rank == 0 else groups[2:]
            res["metrics"] = learner.train_step(mine)
            learner.save_checkpoint(out / "ckpt_ep2", extra={})
            res["after"] = [lp for lp, _ in learner.compute_logprobs(SEQS)]
        if learner.is_rank0:
            torch.save(res, out / f"{name}.pt")
        learner.close()


# ---------------------------------------------------------------- fixtures and references


def sharpen(model_dir: Path, family: str) -> Path:
    """O(1) weights (random-init ones give near-uniform attention and logits, which would hide
    layout bugs), and a router spread enough that top-k has no near-ties."""
    from transformers import AutoModelForCausalLM

    from slime_async.models.toy import make_tiny_model

    make_tiny_model(model_dir, family=family, **SHAPES[family])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(sum(map(ord, family)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                std = 0.5 if "bias" in name else 1.5 / fan_in**0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(model_dir, safe_serialization=True)
    return Path(model_dir)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: sharpen(root / fam, fam) for fam in SHAPES}


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    args = [str(out), *(f"{k}={v}" for k, v in model_dirs.items())]
    torchrun_two_ranks(__file__, args, out, "the two-rank families job to finish", 300)
    return out


def hf_logprobs(model_dir, temperature=0.7, force=None, seqs=SEQS):
    """Per SEQS row, HF's log p(next) at `temperature`; `force(layer, [T, k]) -> [T, k]` replaces
    the experts HF's routers choose (the probabilities stay the router's own, renormalised)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if force is not None:
        for li, layer in enumerate(hf.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.forward = _forced_router(gate, li, force)
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = hf(torch.tensor([s])).logits[0, :-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def _forced_router(gate, layer_idx, force):
    def forward(hidden):
        hidden = hidden.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden, gate.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx = force(layer_idx, hidden.shape[0])
        extra = hidden.shape[0] - idx.shape[0]  # the last token: recorded nowhere, read by no one
        idx = torch.cat([idx, torch.arange(idx.shape[1]).expand(extra, -1)])
        top = probs.gather(1, idx)
        if gate.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    return forward


def assert_close(got, want, tol=1e-5):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= tol, (a, b)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("family", list(SHAPES))
def test_logprobs_match_hf_at_tp1(model_dirs, family):
    learner = Learner(cfg(str(model_dirs[family])), algo(), 0.7)
    try:
        got = [lp for lp, _ in learner.compute_logprobs(SEQS)]
        if family == "qwen3_moe":
            assert learner.arch.moe_layers == (0, 2) and learner.arch.num_experts == 8
        else:
            assert learner.arch.rotary_percent == 0.5 and learner.arch.rotary_interleaved
    finally:
        learner.close()
    want = hf_logprobs(model_dirs[family])
    assert_close(got, want)
    # Not trivially uniform: the comparison has something to catch.
    assert min(w.min().item() for w in want) < -6.0


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_logprobs_match_hf_on_two_ranks(model_dirs, two_ranks, layout):
    fam = dict((n, f) for n, f, *_ in LAYOUTS)[layout]
    res = torch.load(two_ranks / f"{layout}.pt")
    assert_close(res["logp"], hf_logprobs(model_dirs[fam]))


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_hf_export_is_bit_exact_at_every_layout(model_dirs, two_ranks, layout):
    from safetensors.torch import load_file

    fam = dict((n, f) for n, f, *_ in LAYOUTS)[layout]
    exported = torch.load(two_ranks / f"{layout}.pt")["export"]
    original = load_file(str(model_dirs[fam] / "model.safetensors"))
    assert set(exported) == set(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


def test_moe_training_at_tp2_equals_tp1(model_dirs, two_ranks):
    """One update at TP 2 (sequence parallel) equals one at TP 1: same grad norm and weights."""
    from tests.support.learner_worker import make_groups

    res = torch.load(two_ranks / "moe_tp2.pt")
    # The q/k norms (other heads on each TP rank), and under sequence parallelism every norm
    # and the router (another sequence chunk on each rank), got their gradients summed over TP.
    assert any("q_layernorm" in n for n in res["replicas"]) and all(res["replicas"].values()), res[
        "replicas"
    ]
    learner = Learner(cfg(str(model_dirs["qwen3_moe"])), algo(), 0.7)
    try:
        metrics = learner.train_step(make_groups(5, 2))
        got = [lp for lp, _ in learner.compute_logprobs(SEQS)]
    finally:
        learner.close()
    assert metrics["grad_norm"] == pytest.approx(res["metrics"]["grad_norm"], rel=1e-5)
    # After an Adam step, whose update g / (|g| + eps) turns fp rounding in tiny gradients into
    # visible differences (as in test_learner_logprobs' TP comparison); a TP rank that missed
    # a partial gradient (q/k norms, router, SP norms) would be off by 1e-3 and more.
    assert_close(got, res["after"], tol=1e-4)
    # The TP 2 checkpoint (each TP rank a replica of the norms) loads at TP 1.
    learner = Learner(cfg(None, load=str(two_ranks / "ckpt_moe_tp2")), algo(), 0.7)
    try:
        assert_close([lp for lp, _ in learner.compute_logprobs(SEQS)], res["after"])
    finally:
        learner.close()


def test_ep2_checkpoint_loads_at_ep1(two_ranks):
    res = torch.load(two_ranks / "moe_ep2.pt")
    assert res["metrics"]["learner/updates"] == 1.0
    learner = Learner(cfg(None, load=str(two_ranks / "ckpt_ep2")), algo(), 0.7)
    try:
        got = [lp for lp, _ in learner.compute_logprobs(SEQS)]
    finally:
        learner.close()
    assert_close(got, res["after"])
    # Training moved the weights (the comparison is not of the initial model).
    assert (
        max((a - b).abs().max().item() for a, b in zip(res["after"], res["logp"], strict=True))
        > 1e-4
    )


def test_megatron_router_equals_hf_router():
    """megatron's top-k routing (softmax over the top-k logits; or softmax then top-k) gives HF's
    experts and weights exactly in fp32, with and without norm_topk_prob."""
    from slime_async import megatron_compat

    megatron_compat.apply()
    megatron_compat.patch_moe()
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    # torch.cuda.Stream is still a class (transformers annotates `torch.cuda.Stream | None` in
    # modules it imports later; replacing it with a function broke every later import).
    assert isinstance(torch.cuda.Stream | None, object) and isinstance(torch.cuda.Stream, type)

    gen = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(512, 16, generator=gen)
    for norm in (True, False):
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, 4, dim=-1)
        if norm:
            top = top / top.sum(-1, keepdim=True)
        want = torch.zeros_like(probs).scatter(1, idx, top)
        got, routing_map = topk_routing_with_score_function(logits, 4, use_pre_softmax=not norm)
        assert torch.equal(routing_map, want > 0)
        assert (got - want).abs().max().item() <= 1e-6


def _hf_routing(model_dir, seq):
    """HF's own experts for `seq[:-1]`: [T - 1, moe_layers, k]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: picked.append(o[2].clone()))
        for layer in hf.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        hf(torch.tensor([seq[:-1]]))
    for h in hooks:
        h.remove()
    return torch.stack(picked, dim=1).numpy().astype(np.int32)


def test_routing_replay_goes_through_the_recorded_experts(model_dirs):
    """Replaying HF's own routing changes nothing (no difference counted); replaying other
    experts gives exactly HF's log-probs with those experts forced, and counts the difference."""
    from slime_async.actors.learner.batch import Row, collate

    d = model_dirs["qwen3_moe"]
    learner = Learner(cfg(str(d), routing_replay=True), algo(), 0.7)
    try:
        own = [_hf_routing(d, s) for s in SEQS]
        rng = np.random.default_rng(0)
        other = [
            np.stack([rng.permutation(8)[:2] for _ in range(r.shape[0] * 2)])
            .reshape(r.shape)
            .astype(np.int32)
            for r in own
        ]
        results = {}
        for name, routed in (("own", own), ("other", other)):
            rows = [
                Row(np.asarray(s, dtype=np.int64), 1, {}, 0.7, r.reshape(len(s) - 1, -1))
                for s, r in zip(SEQS, routed, strict=True)
            ]
            got = []
            for i in range(len(rows)):
                mb = collate(rows, [i], learner.device)
                logp, _ = learner.microbatches.forward(learner.model, mb, False)
                got.append(logp[0, : rows[i].response_len].detach())
            results[name] = (got, learner.ppo.take_routing_counts())
    finally:
        learner.close()
    got_own, (diff_own, total_own) = results["own"]
    assert diff_own == 0 and total_own == sum(len(s) - 1 for s in SEQS) * 2
    assert_close(got_own, hf_logprobs(d))
    got_other, (diff_other, total_other) = results["other"]
    assert diff_other > 0 and total_other == total_own
    want = []
    column = {0: 0, 2: 1}  # HF layer -> MoE layer (layer 1 is dense)
    for i, s in enumerate(SEQS):
        r = torch.from_numpy(other[i]).long()  # [T - 1, 2 layers, k]
        want += hf_logprobs(d, force=lambda li, t, r=r: r[:, column[li]], seqs=[s])
    assert_close(got_other, want)


def test_trajectory_carries_routed_experts_compactly():
    """Optional on the wire (absent when off), raw little-endian int32 bytes, validated."""
    import msgpack

    from slime_async.queue.schema import (
        SchemaError,
        Trajectory,
        decode_trajectory,
        encode_trajectory,
    )

    def traj(routed):
        return Trajectory(
            id="t",
            group_id="g",
            group_size=1,
            prompt_ids=np.array([2, 5, 6], np.int32),
            response_ids=np.array([7, 8], np.int32),
            logprobs=np.zeros(2, np.float32),
            loss_mask=np.ones(2, np.uint8),
            versions=np.zeros(2, np.int32),
            reward=1.0,
            routed_experts=routed,
        )

    routed = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)  # [P + R - 1, layers, k]
    blob = encode_trajectory(traj(routed))
    m = msgpack.unpackb(blob, raw=False)
    assert isinstance(m["routed_experts"], bytes) and len(m["routed_experts"]) == routed.size * 4
    for validate in (True, False):
        back = decode_trajectory(blob, validate=validate)
        assert np.array_equal(back.routed_experts, routed.reshape(-1))
    plain = encode_trajectory(traj(None))
    assert "routed_experts" not in msgpack.unpackb(plain, raw=False)
    assert decode_trajectory(plain).routed_experts is None
    with pytest.raises(SchemaError, match=r"routed_experts.*multiple of the 4 routed tokens"):
        decode_trajectory(encode_trajectory(traj(np.arange(6, dtype=np.int32))))
    with pytest.raises(SchemaError, match="routed_experts: negative expert id"):
        decode_trajectory(encode_trajectory(traj(-np.ones(8, dtype=np.int32))))


# ---------------------------------------------------------------- the embedded engine

PROMPTS = [[2, 10, 11, 12, 13], [2, 20, 21], [2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 30]]


@pytest.mark.parametrize("family", list(SHAPES))
def test_engine_greedy_output_and_logprobs_equal_hf(model_dirs, family):
    """Packed prefill, then decode steps over the paged KV cache, against HF's full forward."""
    from transformers import AutoModelForCausalLM

    from slime_async.actors.engine.embedded.model_runner import ModelRunner

    d = model_dirs[family]
    runner = ModelRunner(d, max_slots=8, max_context_len=64, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    toks, logps = greedy_with_runner(runner, PROMPTS, 8)
    seqs = [list(p) + t for p, t in zip(PROMPTS, toks, strict=True)]
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = torch.log_softmax(hf(torch.tensor([seqs[i]])).logits[0].float(), -1)
            steps = range(len(p) - 1, len(seqs[i]) - 1)
            # Greedy: each chosen token is HF's argmax at that position (the output is HF's).
            assert [int(ref[t].argmax()) for t in steps] == seqs[i][len(p) :], f"prompt {i}"
            want = torch.stack([ref[t, seqs[i][t + 1]] for t in steps])
            assert (torch.tensor(logps[i]) - want).abs().max().item() <= 1e-5


def test_engine_loads_per_expert_names_and_returns_routed_experts(model_dirs, two_ranks):
    """The learner's export (checkpoint names, one tensor per expert) loads into HF's fused
    experts; routed experts equal the HF routers' choice."""
    from safetensors.torch import load_file

    from slime_async.actors.engine.embedded.model_runner import ModelRunner

    d = model_dirs["qwen3_moe"]
    runner = ModelRunner(d, max_slots=2, max_context_len=64)
    before = {n: p.clone() for n, p in runner.model.named_parameters()}
    exported = torch.load(two_ranks / "moe_ep2.pt")["export"]
    assert any(".mlp.experts.7.up_proj.weight" in n for n in exported)
    runner.load_weights(list(exported.items()))
    for n, p in runner.model.named_parameters():
        assert torch.equal(p, before[n]), n  # the same weights, through the name mapping
    zeros = [(n, torch.zeros_like(t)) for n, t in exported.items() if ".experts.3.down_proj" in n]
    runner.load_weights(zeros)
    assert float(runner.model.model.layers[0].mlp.experts.down_proj[3].abs().sum()) == 0
    assert float(runner.model.model.layers[0].mlp.experts.down_proj[2].abs().sum()) > 0
    runner.load_from_disk(d)  # back from the checkpoint layout on disk
    assert torch.equal(
        runner.model.model.layers[0].mlp.experts.down_proj,
        before["model.layers.0.mlp.experts.down_proj"],
    )
    ids = SEQS[0]
    got = runner.family.routed_experts(runner.model, ids)
    assert got.shape == (len(ids) - 1, 2, 2) and got.dtype == np.int32
    assert np.array_equal(got, _hf_routing(d, ids))
    assert set(load_file(str(d / "model.safetensors"))) == set(exported)


# ---------------------------------------------------------------- end to end


def test_tiny_moe_run_with_routing_replay_trains_and_pushes(tmp_path):
    """`slime-async run` on a tiny Qwen3-MoE with routing replay: the engine returns each
    token's experts, trajectories carry them through the buffer, the learner replays them, trains
    and pushes weights back to the engine (which loads the per-expert names into fused experts)."""
    import json
    import subprocess

    from examples.arithmetic.task import make_dataset
    from slime_async.metrics import read_metrics
    from slime_async.models.toy import make_tiny_model
    from tests.support.run_config import tiny_run_config

    model = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0, num_layers=2)
    data = make_dataset(tmp_path / "train.jsonl", 50, seed=0)
    cfg = tiny_run_config(
        tmp_path / "moe.toml",
        model=model,
        data=data,
        run_dir=tmp_path / "run",
        run={"name": "moe", "mode": "sync"},
        buffer={"max_staleness": 0, "wal_dir": None},
        engine__embedded={"max_running_requests": 8},
        generator={"max_inflight": 8},
        generator__sampling={"max_new_tokens": 8},
        learner={
            "lr": 1e-3,
            "num_steps": 2,
            "save_interval": None,
            "routing_replay": True,
            "moe_aux_loss_coeff": 0.01,
        },
        algo={"mini_batches": 1},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async", "run", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics" / "learner.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["moe/replay_missing_trajectories"] == 0 for r in records)
    # Every token of every trajectory went through its recorded experts (2 MoE layers).
    assert all(r["moe/replayed_tokens"] > 0 for r in records)
    # Sync mode, one update per batch: the learner's weights are the engine's, so its own router
    # agrees with the recorded routing (float differences between a cached decode and one
    # forward pass may flip a rare near-tie).
    assert all(0.0 <= r["moe/routing_diff_frac"] <= 0.05 for r in records), records
    assert records[-1]["version"] >= 1
    assert all(r["push/seconds"] > 0 for r in records if not r["learner/batch_skipped"])
    final = json.loads((tmp_path / "run" / "buffer_final.json").read_text())
    assert final["counts"]["committed_trajectories"] == 2 * 2 * 4


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out_dir, *pairs = sys.argv[1:]
    worker(Path(out_dir), dict(p.split("=", 1) for p in pairs))
