"""The learner's fast paths on the CPU (fp32, exact): chunked log-probs, SDPA attention, packing.

- `chunked_logprobs` against the unchunked math (full-vocabulary log_softmax through autograd):
  values, entropy and the gradients of the hidden states and of the output weight.
- A packed micro-batch (several rows in one, per-document causal attention and RoPE) gives the
  padded micro-batch's log-probs and, after one training step, the same weights; SDPA attention
  equals megatron's own DotProductAttention.
- The fused Triton kernels equal the torch chunks (Triton's CPU interpreter, where Triton is
  installed; CI has none, the GPU tests run them on CUDA).
- Options that cannot work here are refused at construction, naming the keys.
megatron's DDP at DP 2 on gloo is in tests/integration/test_learner_data_parallel.py; the GPU
paths (megatron's DistributedOptimizer, the varlen kernel, recomputation) in
tests/gpu/test_learner_gpu.py.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from slime_async.actors.learner.batch import Row, collate_packed, plan_packs
from slime_async.actors.learner.logprobs import chunked_logprobs
from slime_async.models.attention import block_causal_mask
from tests.support.learner_worker import SEQS, algo_cfg, learner_cfg, make_groups, make_sharp_model


def _reference(hidden, weight, labels, temp):
    z = (hidden @ weight.t()) / temp[:, None]
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _problem(seed: int, n: int, v: int, h: int = 8):
    """Hidden states, output weight, labels, per-token temperatures and upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    hidden0 = 2 * torch.randn(n, h, generator=gen)
    weight0 = torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    temp = 0.5 + torch.rand(n, generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return hidden0, weight0, labels, temp, g_lp, g_ent


def _chunked_with_grads(problem, with_entropy: bool, chunk: int, **kw):
    """(logp, entropy, d hidden, d weight) of `chunked_logprobs` on fresh leaf copies."""
    hidden0, weight0, labels, temp, g_lp, g_ent = problem
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    logp, ent = chunked_logprobs(hidden, weight, labels, temp, with_entropy, chunk, **kw)
    loss = (logp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    loss.backward()
    return logp, ent, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_logprobs_equal_the_unchunked_math_with_gradients(chunk, with_entropy):
    problem = _problem(chunk, n=13, v=50)
    hidden0, weight0, labels, temp, g_lp, g_ent = problem
    logp, ent, hidden_grad, weight_grad = _chunked_with_grads(problem, with_entropy, chunk)

    rh, rw = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    ref_lp, ref_ent = _reference(rh, rw, labels, temp)
    ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0.0)
    ref_loss.backward()

    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    else:
        assert ent is None
    torch.testing.assert_close(hidden_grad, rh.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight_grad, rw.grad, atol=1e-5, rtol=1e-5)


def fused_equals_torch(with_entropy: bool) -> None:
    """The Triton kernels (`logprobs_triton.py`) against the torch path: same log-probs,
    entropy and gradients, with a vocabulary that is no multiple of the kernel's block, a chunk
    that does not divide the tokens, and per-token temperatures (run by the test below)."""
    problem = _problem(3, n=11, v=4100)
    got = [_chunked_with_grads(problem, with_entropy, 4, fused=fused) for fused in (False, True)]
    for a, b in zip(*got, strict=True):
        if a is None:
            assert b is None
            continue
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_fused_triton_chunks_equal_the_torch_chunks(repo_root):
    """`fused_equals_torch` in Triton's CPU interpreter, in a fresh process: TRITON_INTERPRET
    must be set before anything imports triton (megatron-core does)."""
    code = (
        f"from {__name__} import fused_equals_torch"
        "; fused_equals_torch(False); fused_equals_torch(True)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def test_auto_packing_packs_only_mini_batches_that_padding_would_waste():
    """`pack_sequences` unset on a GPU: a mini-batch is packed when its padded micro-batches
    would be at least `pack_min_padding` padding (H200: packed 0.85x of padded at equal lengths,
    1.35-1.39x at RL lengths); true packs always (share 0), false never (None)."""
    from slime_async.actors.learner.microbatches import plan_rows

    def plan(lens, min_padding):
        return plan_rows(lens, 64, min_padding)

    equal, mixed = [16] * 8, [4, 30, 10, 16, 28, 6, 12, 20]  # mixed: 15% padding when padded
    assert plan(equal, 0.1) == ([[0, 1, 2, 3], [4, 5, 6, 7]], False)
    got, packed = plan(mixed, 0.1)
    assert packed and sorted(i for p in got for i in p) == list(range(8))
    assert all(sum(mixed[i] for i in p) <= 64 for p in got)
    assert plan(mixed, 0.2)[1] is False  # below the share: padded
    assert plan(equal, 0.0)[1] is True  # pack_sequences = true
    assert plan(mixed, None)[1] is False  # pack_sequences = false


def test_plan_packs_fills_each_pack_up_to_the_budget():
    lens = [7, 3, 9, 2, 5, 12, 1]
    packs = plan_packs(lens, 12)
    assert sorted(i for p in packs for i in p) == list(range(len(lens)))
    assert all(sum(lens[i] for i in p) <= 12 for p in packs)
    assert len(packs) == 4  # 39 tokens: at least 4 packs of 12
    assert plan_packs([20, 3], 12) == [[0], [1]]  # a row over the budget gets its own pack


def test_packed_micro_batch_locates_every_response_token():
    rows = [
        Row(np.array([1, 2, 3, 4, 5]), 2, {"loss_mask": np.ones(3, np.float32)}),
        Row(np.array([6, 7, 8]), 1, {"loss_mask": np.ones(2, np.float32)}),
    ]
    mb = collate_packed(rows, [0, 1], torch.device("cpu"))
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 6, 7]]
    assert mb.labels.tolist() == [[2, 3, 4, 5, 7, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert mb.packed.cu_seqlens_q.tolist() == [0, 4, 6]
    # the labels at each row's response positions are its response tokens
    picked = mb.labels.reshape(-1)[mb.flat_index()] * mb.resp_valid
    assert picked.tolist() == [[3, 4, 5], [7, 8, 0]]
    mask = block_causal_mask(mb.packed.cu_seqlens_q, 6)
    assert mask[5].tolist() == [False, False, False, False, True, True]
    assert mask[3].tolist() == [True, True, True, True, False, False]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("fast") / "qwen3", "qwen3")


def _step_and_logprobs(model_dir, **kw):
    """(log-probs of SEQS before, loss of one step, log-probs after) for one learner config."""
    from slime_async.actors.learner.trainer import Learner

    learner = Learner(learner_cfg(str(model_dir), micro_batch_tokens=40, **kw), algo_cfg(), 0.7)
    try:
        before = [lp for lp, _ in learner.compute_logprobs(SEQS)]
        loss = learner.train_step(make_groups(3, 4))["loss"]
        after = [lp for lp, _ in learner.compute_logprobs(SEQS)]
        return before, loss, after, learner.pack, learner.attention
    finally:
        learner.close()


def test_packing_and_sdpa_equal_padded_megatron_attention(qwen3_dir):
    base = _step_and_logprobs(qwen3_dir, attention="local", pack_sequences=False)
    assert base[3:] == (False, "local")
    for kw in (dict(attention="sdpa", pack_sequences=False), dict(pack_sequences=True)):
        got = _step_and_logprobs(qwen3_dir, **kw)
        assert got[3] == kw["pack_sequences"] and got[4] == "sdpa"
        for a, b in zip(got[0] + got[2], base[0] + base[2], strict=True):
            # fp32 after one update: a few ulps of log-probs up to ~10 in magnitude
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-5, msg=str(kw))
        assert got[1] == pytest.approx(base[1], rel=1e-5), kw


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(optimizer="megatron"), 'learner.optimizer = "megatron" needs a GPU'),
        (dict(recompute="full"), 'learner.recompute = "full" needs a GPU'),
        (dict(attention="local", pack_sequences=True), "pack_sequences = true is not possible"),
        (dict(attention="te"), "Transformer Engine does not import"),
        (dict(overlap_grad_reduce=True), "learner.overlap_grad_reduce is set"),
        (dict(logprob_kernel="triton"), 'learner.logprob_kernel = "triton" needs a GPU'),
        (dict(swiglu_kernel="triton"), 'learner.swiglu_kernel = "triton" needs a GPU'),
        (dict(cuda_graphs="on"), 'learner.cuda_graphs = "on" is not possible with the CPU'),
    ],
)
def test_options_that_cannot_work_here_are_refused(qwen3_dir, changes, message):
    from slime_async.actors.learner.trainer import Learner

    with pytest.raises(ValueError, match=message):
        Learner(learner_cfg(str(qwen3_dir), **changes), algo_cfg())


@pytest.mark.parametrize(
    "changes, arch, tp, attention, optimizer, why",
    [
        ({}, "dense", 1, "sdpa", "megatron", None),
        ({}, "dense", "dp2", "sdpa", "megatron", "data parallel 2"),
        ({}, "moe", 1, "sdpa", "megatron", "a MoE model"),
        ({}, "dense", 2, "sdpa", "megatron", "learner.tensor_parallel = 2"),
        ({}, "dense", 1, "sdpa", "master_adamw", 'optimizer resolving to "master_adamw"'),
        (dict(overlap_grad_reduce=True), "dense", 1, "sdpa", "megatron", "overlap_grad_reduce"),
        ({}, "dense", 1, "te", "megatron", 'attention resolving to "te"'),
        (dict(recompute="selective"), "dense", 1, "sdpa", "megatron", 'recompute = "selective"'),
    ],
)
def test_cuda_graphs_resolve_where_their_capture_holds(
    qwen3_dir, caplog, changes, arch, tp, attention, optimizer, why
):
    """The conditions of `learner.cuda_graphs` on a GPU (resolved without one: the rule reads
    only the config and the model): "auto" is on exactly where all hold and logs the first that
    fails, "on" is refused with it (but takes data parallel > 1), "off" is off."""
    from types import SimpleNamespace

    from slime_async.actors.learner.options import resolve_cuda_graphs

    shape = SimpleNamespace(is_moe=arch == "moe")
    dp = 2 if tp == "dp2" else 1
    resolve = functools.partial(
        resolve_cuda_graphs,
        arch=shape,
        tp=1 if tp == "dp2" else tp,
        on_cpu=False,
        attention=attention,
        optimizer=optimizer,
        dp=dp,
    )
    auto = learner_cfg(str(qwen3_dir), **changes)
    assert auto.cuda_graphs == "auto"  # the default
    with caplog.at_level(logging.INFO, logger="slime_async.learner"):
        assert resolve(auto) is (why is None)
    if why is None or dp > 1:  # "on" takes DP > 1
        assert resolve(learner_cfg(str(qwen3_dir), cuda_graphs="on", **changes)) is True
        assert why is None or why in caplog.text
    else:
        assert why in caplog.text
        with pytest.raises(ValueError, match=re.escape(why)):
            resolve(learner_cfg(str(qwen3_dir), cuda_graphs="on", **changes))
    assert resolve(learner_cfg(str(qwen3_dir), cuda_graphs="off", **changes)) is False


@pytest.mark.parametrize(
    "kernel, compile, ops, want",
    [
        ("auto", "auto", "triton", "triton"),
        ("auto", "auto", "failed", "megatron"),
        ("auto", "auto", None, "eager"),
        ("auto", "off", None, "eager"),
        ("megatron", "auto", "triton", "megatron"),
        ("megatron", "off", None, "eager"),
        ("triton", "auto", "triton", "triton"),
        ("triton", "auto", "failed", "its kernels, which failed their check"),
        ("triton", "auto", None, "the compiled layer ops, which failed their check"),
        ("triton", "off", None, 'learner.torch_compile = "auto"'),
    ],
)
def test_swiglu_kernel_resolves_from_the_compiled_ops_in_use(kernel, compile, ops, want):
    """`learner.swiglu_kernel` on a GPU (resolved without one: the rule reads the config and the
    compiled ops, `fused_ops.Compiled` with its `swiglu` None where the Triton kernels failed
    their check): "auto" takes the Triton kernels where they passed, megatron's fusion where they
    did not, eager layers without compiled ops; "triton" is refused, naming the key and why,
    where it cannot run."""
    from types import SimpleNamespace

    from slime_async.actors.learner.options import resolve_swiglu_kernel
    from slime_async.models.swiglu_triton import megatron_swiglu

    checked = megatron_swiglu if ops == "triton" else None
    compiled = None if ops is None else SimpleNamespace(swiglu=checked)
    cfg = learner_cfg(swiglu_kernel=kernel, torch_compile=compile)
    if want in ("triton", "megatron", "eager"):
        assert resolve_swiglu_kernel(cfg, False, compiled) == want
    else:
        with pytest.raises(ValueError, match=re.escape(want)) as refused:
            resolve_swiglu_kernel(cfg, False, compiled)
        assert str(refused.value).startswith('learner.swiglu_kernel = "triton" needs')


def test_cuda_graphs_count_every_eager_micro_batch_and_survive_a_failed_capture(caplog):
    """`ModelGraphs` where no capture can succeed (the CPU: no CUDA stream): a shape's first
    micro-batch runs eagerly as `first_seen`; its second tries the capture, which fails, logged
    with the error; from then on every micro-batch runs eagerly as `capture_failed`, with the
    eager function's own result. Every micro-batch is counted, and the counts reset per step."""
    from slime_async.actors.learner.graphs import ModelGraphs

    w = torch.nn.Parameter(torch.randn(4, 8))
    w.main_grad = torch.zeros_like(w)
    graphs = ModelGraphs(torch.device("cpu"), [w], max_shapes=4)
    run = lambda ids, pos: w[ids] + pos[..., None]  # noqa: E731
    ids = torch.randint(0, 4, (2, 5))
    pos = torch.arange(5).expand(2, -1)
    with caplog.at_level(logging.WARNING, logger="slime_async.learner"):
        outs = [graphs.hidden(run, ids, pos) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, run(ids, pos), rtol=0, atol=0)
    assert graphs.take_counts() == {
        "replays": 0.0,
        "captures": 0.0,
        "eager/first_seen": 1.0,
        "eager/capture_failed": 2.0,
    }
    assert graphs.failed and "capture of micro-batch shape (2, 64) failed" in caplog.text
    graphs.hidden(run, torch.randint(0, 4, (3, 70)), torch.arange(70).expand(3, -1))
    assert graphs.take_counts() == {"replays": 0.0, "captures": 0.0, "eager/capture_failed": 1.0}
    with pytest.raises(ValueError, match="main_grad on every trained parameter"):
        ModelGraphs(torch.device("cpu"), [torch.nn.Parameter(torch.zeros(2))], max_shapes=1)
