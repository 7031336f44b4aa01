"""The learner's grouped experts against megatron's SequentialMLP (TP 1 in this process, EP 2 over
two gloo ranks) and its MoE auxiliary losses against transformers' own (fp32, CPU).

One torchrun job (2 gloo ranks, `tests/support/learner_worker.py`'s `moe_ep2` task) runs the
EP 2 layouts (module fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_async.actors.learner.batch import Row, collate
from slime_async.actors.learner.trainer import Learner
from tests.support.learner_worker import (
    algo_cfg,
    capture_grads,
    learner_cfg,
    make_groups,
    run_two_ranks,
)

SEQS = [[2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 20, 21, 22], [2, 30, 31, 32, 33, 34, 35]]
SHAPE = dict(num_layers=3, num_heads=4, num_kv_heads=2, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.integration.test_model_families import SHAPES, sharpen

    assert SHAPES["qwen3_moe"] == SHAPE
    return sharpen(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_two_ranks")
    run_two_ranks("moe_ep2", out, [str(model_dir)], timeout=900)
    return out


def _train_grads(learner: Learner) -> dict[str, torch.Tensor]:
    """Gradients of one PPO loss on fixed groups, keyed by HF name (layout independent)."""
    from slime_async.models import convert

    grads = capture_grads(learner)
    learner.train_step(make_groups(3, 4))
    return {
        hf: g
        for name, grad in grads.items()
        for hf, g in convert.megatron_shards_to_hf(name, [grad], learner.arch)
    }


def test_grouped_experts_equal_sequential_mlp_at_tp1(model_dir):
    """Log-probs and every parameter's gradient of one PPO step are the same function whether
    the experts run as grouped GEMMs or as megatron's SequentialMLP."""
    out = {}
    for experts in ("grouped", "sequential"):
        learner = Learner(learner_cfg(str(model_dir), moe_experts=experts), algo_cfg(), 0.7)
        try:
            names = [n for n, _ in learner.model.named_parameters() if ".experts." in n]
            stacked = any(n.endswith("experts.weight1") for n in names)
            assert stacked == (experts == "grouped"), names
            logp = [lp for lp, _ in learner.compute_logprobs(SEQS)]
            out[experts] = (logp, _train_grads(learner))
        finally:
            learner.close()
    (lp_g, gr_g), (lp_s, gr_s) = out["grouped"], out["sequential"]
    for a, b in zip(lp_g, lp_s, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    assert gr_g.keys() == gr_s.keys()
    assert any(".mlp.experts.5.down_proj" in n for n in gr_g)
    for n in gr_g:
        assert torch.allclose(gr_g[n], gr_s[n], atol=1e-6, rtol=1e-5), n
    # The experts did get a gradient (the comparison has something to catch).
    assert float(gr_g["model.layers.0.mlp.experts.3.up_proj.weight"].abs().sum()) > 0


@pytest.mark.timeout(900)  # its fixture trains two EP 2 learners: minutes on a loaded machine
def test_grouped_experts_equal_sequential_mlp_at_ep2(two_ranks):
    """At EP 2 (megatron's all-to-all dispatcher, two gloo ranks) the grouped experts give the
    same log-probs, the same update and the same exported weights as SequentialMLP."""
    g = torch.load(two_ranks / "ep2_grouped.pt")
    s = torch.load(two_ranks / "ep2_sequential.pt")
    for key in ("logp", "after"):
        for a, b in zip(g[key], s[key], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0), key
    assert g["export"].keys() == s["export"].keys()
    for n, t in g["export"].items():
        assert torch.allclose(t, s["export"][n], atol=1e-6, rtol=1e-5), n
    # The update moved the weights (the "after" comparison has something to catch).
    assert (
        max(float((a - b).abs().max()) for a, b in zip(g["logp"], g["after"], strict=True)) > 1e-4
    )


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _router_grads_of(learner: Learner) -> dict[int, torch.Tensor]:
    out = {}
    for n, p in learner.model.named_parameters():
        if n.endswith("mlp.router.weight"):
            out[int(n.split(".")[2])] = p.grad.clone()
    return out


@pytest.mark.parametrize("which", ["aux", "z"])
def test_moe_losses_equal_transformers(model_dir, which):
    """The load-balancing loss equals transformers' `load_balancing_loss_func` (pooled over the
    MoE layers, padding masked by the attention mask) and the z-loss the mean of
    logsumexp(router logits)^2 over layers and real tokens; both values and their gradients on
    every router weight, from a padded micro-batch of rows of different lengths."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coeff = 0.37
    kw = {"moe_aux_loss_coeff": coeff} if which == "aux" else {"moe_z_loss_coeff": coeff}
    learner = Learner(learner_cfg(str(model_dir), **kw), algo_cfg(), 0.7)
    try:
        rows = [Row(np.asarray(s, dtype=np.int64), prompt_len=1) for s in SEQS]
        mb = collate(rows, [0, 1, 2], learner.device)
        learner.model.zero_grad(set_to_none=True)
        logp, _ = learner.microbatches.forward(learner.model, mb, False, aux_weight=1.0)
        (logp.sum() * 0.0).backward()  # only the attached losses give gradients
        learner.microbatches.end_aux(learner.model)
        got_grads = _router_grads_of(learner)
        from slime_async.models.moe_layer import losses_of

        aux, z, n = losses_of(learner.model).take()
        got = aux if which == "aux" else z
        assert n == 1
    finally:
        learner.close()
    hf = _hf_model(model_dir)
    width = max(len(s) - 1 for s in SEQS)
    ids = torch.zeros(len(SEQS), width, dtype=torch.long)
    mask = torch.zeros(len(SEQS), width, dtype=torch.long)
    for i, s in enumerate(SEQS):
        ids[i, : len(s) - 1] = torch.tensor(s[:-1])
        mask[i, : len(s) - 1] = 1
    out = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    logits = tuple(out.router_logits)  # one per MoE layer, [B * S, E]
    cfg_hf = hf.config
    if which == "aux":
        want = load_balancing_loss_func(
            logits, cfg_hf.num_experts, cfg_hf.num_experts_per_tok, mask
        )
    else:
        flat = mask.reshape(-1).float()
        lse2 = [torch.logsumexp(g, -1).square() for g in logits]
        want = sum((v * flat).sum() for v in lse2) / (len(logits) * flat.sum())
    (coeff * want).backward()
    assert abs(got - float(want)) <= 1e-6 * max(1.0, abs(float(want))), (got, float(want))
    assert float(want) > 0
    layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    assert sorted(got_grads) == layers
    for i in layers:
        want_g = hf.model.layers[i].mlp.gate.weight.grad
        assert float(want_g.abs().sum()) > 0
        assert torch.allclose(got_grads[i], want_g, atol=1e-6, rtol=1e-4), i


def test_routing_replay_takes_sglangs_every_layer_layout(model_dir):
    """SGLang reports routing for every decoder layer (dense ones hold nothing useful): the
    learner keeps the MoE layers' columns; a width that fits neither layout is refused."""
    learner = Learner(learner_cfg(str(model_dir), routing_replay=True), algo_cfg(), 0.7)
    try:
        k, moe = learner.arch.moe_topk, list(learner.arch.moe_layers)
        assert learner.arch.num_layers == 3 and moe == [0, 2]
        every = np.arange(8 * 3 * k, dtype=np.int32).reshape(8, 3, k) % learner.arch.num_experts
        row = Row(np.arange(9, dtype=np.int64), prompt_len=2, routed=every.reshape(8, -1))
        out = learner.ppo.check_routed([row])
        assert out["moe/replay_missing_trajectories"] == 0.0
        assert np.array_equal(row.routed, every[:, moe].reshape(8, -1))
        bad = Row(np.arange(9, dtype=np.int64), prompt_len=2, routed=every.reshape(8, -1)[:, :5])
        with pytest.raises(ValueError, match="do not fit 2 MoE layers"):
            learner.ppo.check_routed([bad])
    finally:
        learner.close()
