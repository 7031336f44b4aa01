"""The embedded engine on a CUDA GPU: the Triton paged-decode kernel, the fused and compiled
runner with CUDA graphs against HF greedy decoding, and many concurrent requests equal to one at a
time. The CPU paths are in tests/unit/engine/test_engine_runner.py."""

import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.embedded import attention, pick_kernels, shared_prefix
from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import (
    SamplingParams,
    filter_thresholds,
    greedy_pick,
    sample,
    seeded_argmax,
    thresholds_hold,
)
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import PROMPTS, hf_greedy, random_paged, run_all

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("splits", [None, 1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_cuda
def test_paged_decode_kernel_on_gpu(dtype, splits):
    q, kc, vc, bt, lens = random_paged("cuda", dtype, bs=16, hkv=8, h=16, d=128, seed=1)
    got = attention.paged_decode(q, kc, vc, bt, lens, 128**-0.5, splits=splits).float()
    ref = attention.decode_reference(q.float(), kc.float(), vc.float(), bt, lens, 128**-0.5)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    # Long rows over many tiles, split or not
    g = torch.Generator(device="cuda").manual_seed(3)
    kc = torch.randn(300, 16, 8, 128, generator=g, device="cuda").to(dtype)
    vc = torch.randn(kc.shape, generator=g, device="cuda").to(dtype)
    bt = torch.stack([torch.randperm(299, device="cuda")[:80] + 1 for _ in range(3)]).int()
    lens = torch.tensor([1280, 1, 777], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 16, 128, generator=g, device="cuda").to(dtype)
    got = attention.paged_decode(q, kc, vc, bt, lens, 128**-0.5, splits=splits).float()
    ref = attention.decode_reference(q.float(), kc.float(), vc.float(), bt, lens, 128**-0.5)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.gpu
@needs_cuda
def test_filter_kernels_find_the_sorts_thresholds_at_qwens_vocabulary():
    """Top-k/top-p without a sort, 256 rows of bf16 logits at 151,936 columns: each row's
    threshold is the sort's (`filter_thresholds`) except where the mass at the boundary is within
    fp32 summation rounding of top_p; the draws stay at or above it; log-probs unfiltered."""
    n, vocab = 256, 151_936
    g = torch.Generator(device="cuda").manual_seed(6)
    logits = (torch.randn(n, vocab, generator=g, device="cuda") * 4).bfloat16()
    r = torch.arange(n, device="cuda")
    top_k = torch.where(r % 3 == 0, 50, vocab)
    top_k[1::7] = 2000
    top_p = torch.where(r % 3 == 1, 1.0, 0.95 - 0.003 * (r % 100))
    temp = 0.6 + 0.01 * (r % 50)
    inv_t = temp.reciprocal()
    got = pick_kernels.thresholds(logits, inv_t, top_k, top_p)
    x = logits.float() * inv_t[:, None]
    want = filter_thresholds(x, top_k, top_p)
    assert (
        thresholds_hold(x, got, top_k, top_p).all() and thresholds_hold(x, want, top_k, top_p).all()
    )
    assert int((got != want).sum()) <= 2  # rows whose boundary mass is within rounding of top_p
    greedy = r % 5 == 0
    tok, lp = pick_kernels.filtered_pick(logits, temp, greedy, top_k, top_p, g)
    assert (x.gather(1, tok[:, None])[:, 0] >= got).all()
    assert torch.equal(tok[greedy], logits.float()[greedy].argmax(-1))
    ref = torch.log_softmax(x, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_pick_kernels_equal_the_eager_picks_on_bf16_logits():
    """The runner's pick kernels (one pass over bf16 logits at Qwen's vocabulary): the greedy
    token is the eager argmax (ties in bf16 included), every log-prob is log_softmax(x / T) of
    its token, and draws at a small vocabulary follow softmax(x / T)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(256, 151_936, generator=g, device="cuda") * 4).bfloat16()
    (ta, la), (tb, lb) = greedy_pick(logits), pick_kernels.greedy_pick(logits)
    assert torch.equal(ta, tb)
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)
    temp = torch.full((256,), 0.7, device="cuda")
    greedy = torch.arange(256, device="cuda") % 4 == 0
    temp[greedy] = 1.0
    tok, lp = pick_kernels.temperature_pick(logits, temp, greedy, g)
    assert torch.equal(tok[greedy], ta[greedy])
    ref = torch.log_softmax(logits.float() / temp[:, None], -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
    n, row = 20_000, torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")], device="cuda")
    tok, _ = pick_kernels.temperature_pick(
        row.expand(n, -1).contiguous(),
        torch.full((n,), 0.8, device="cuda"),
        torch.zeros(n, dtype=torch.bool, device="cuda"),
        g,
    )
    freq = torch.bincount(tok, minlength=5).float().cpu() / n
    want = torch.softmax(row.cpu() / 0.8, -1)
    assert freq[4] == 0 and torch.allclose(
        freq, want, atol=4 * (want * (1 - want) / n).sqrt().max()
    )


@pytest.mark.gpu
@needs_cuda
def test_store_kv_kernel_on_gpu():
    """The engine's K/V store (one Triton kernel on CUDA) equals two index copies, bf16."""
    g = torch.Generator(device="cuda").manual_seed(4)
    qkv = torch.randn(37, 32 * 128, generator=g, device="cuda").bfloat16()
    _, k, v = qkv.split([16 * 128, 8 * 128, 8 * 128], -1)
    k, v = k.reshape(37, 8, 128), v.view(37, 8, 128)
    slots = torch.randperm(64 * 16, device="cuda")[:37]
    got = [torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    want = [c.clone() for c in got]
    attention.write_kv(*got, slots, k, v)
    for cache, x in zip(want, (k, v), strict=True):
        cache.view(-1, 8, 128).index_copy_(0, slots, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.gpu
@needs_cuda
def test_seeded_draws_on_the_gpu_equal_the_cpus(top_p):
    """A seeded request draws the same tokens on a GPU as on the CPU, eager and compiled (the
    runner's draw on a GPU): the noise is an integer hash of seed, position and column, so a
    pinned evaluation is the same on either. A 151k vocabulary (several hashing chunks) and a
    64-token one (one chunk), two batch sizes each (the compiled draw's shapes are dynamic)."""
    compiled = torch.compile(seeded_argmax, dynamic=True)
    for vocab, n in ((151_936, 160), (151_936, 37), (64, 256), (64, 5)):
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 4
        temperature, top_k = torch.full((n,), 0.8), torch.zeros(n, dtype=torch.long)
        seeded = [(r, 1000 + r // 8, 7 + r % 8) for r in range(n)]
        args = (temperature, top_k, torch.full((n,), top_p))
        cpu_tok, cpu_logp = sample(logits, *args, seeded=seeded)
        for draw in (seeded_argmax, compiled):
            tok, logp = sample(logits.cuda(), *args, seeded=seeded, seeded_draw=draw)
            assert torch.equal(tok.cpu(), cpu_tok), (vocab, n, draw)
            # float32 log-softmax over the vocabulary: the two devices sum in different orders
            torch.testing.assert_close(logp.cpu(), cpu_logp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_runner_on_gpu_matches_hf_before_and_after_a_weight_load(tmp_path, graphs):
    """Fused + compiled layers, the Triton kernel and CUDA graphs equal HF greedy in fp32; the
    graphs see weights loaded in place."""
    d0 = make_tiny_model(tmp_path / "m0", family="qwen3", seed=8)
    d1 = make_tiny_model(tmp_path / "m1", family="qwen3", seed=9)
    runner = ModelRunner(d0, device="cuda", max_slots=4, max_context_len=64, num_blocks=64)
    assert runner.decode_attention == "triton"
    if graphs:
        assert runner.capture_cuda_graphs() == [1, 2, 4]
    sched = Scheduler(runner)
    sched.start()
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    try:
        before = run_all(sched, PROMPTS[:3], params)  # 3 rows: the size-4 graph pads one row
        sched.call(lambda: runner.load_from_disk(d1)).result(timeout=60)
        after = run_all(sched, PROMPTS[:3], params)
    finally:
        sched.stop()
    for reqs, d in ((before, d0), (after, d1)):
        hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
        for r, p in zip(reqs, PROMPTS, strict=False):
            ref_tokens, ref_logps = hf_greedy(hf, p, 10)
            assert r.output_ids == ref_tokens
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), torch.tensor(ref_logps), atol=1e-3, rtol=0
            )


@pytest.mark.gpu
@needs_cuda
def test_gpu_many_concurrent_equal_one_at_a_time(tmp_path):
    """64 concurrent greedy requests (graphs, kernel, overlap, shared prompts) = one at a time."""
    d = make_tiny_model(tmp_path / "m", family="qwen3", seed=4)
    runner = ModelRunner(d, device="cuda", max_slots=64, max_context_len=128)
    runner.capture_cuda_graphs()
    sched = Scheduler(runner)
    sched.start()
    g = torch.Generator().manual_seed(0)
    prompts = [
        [2, *torch.randint(5, 60, (int(n),), generator=g).tolist()]
        for n in torch.randint(1, 30, (64,), generator=g)
    ]
    prompts[1] = prompts[0]  # a shared prompt too
    lengths = [int(n) for n in torch.randint(1, 40, (64,), generator=g)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    try:
        together = run_all(sched, prompts, params)
        alone = [run_all(sched, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    finally:
        sched.stop()
    for a, b in zip(together, alone, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.gpu
@needs_cuda
def test_gpu_requests_arriving_mid_decode_equal_one_at_a_time(tmp_path):
    """Requests that arrive while others decode (each submitted by its predecessor's second
    token, in waves of 4) are prefilled behind the decode step in flight and join the next
    step from the device: their greedy outputs equal the same requests run one at a time."""
    d = make_tiny_model(tmp_path / "m", family="qwen3", seed=4)
    runner = ModelRunner(d, device="cuda", max_slots=32, max_context_len=128)
    runner.capture_cuda_graphs()
    sched = Scheduler(runner)
    g = torch.Generator().manual_seed(1)
    prompts = [
        [2, *torch.randint(5, 60, (int(n),), generator=g).tolist()]
        for n in torch.randint(1, 40, (32,), generator=g)
    ]
    lengths = [int(n) for n in torch.randint(4, 40, (32,), generator=g)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    done = threading.Semaphore(0)
    reqs = [
        Request(f"r{i}", p, s, lambda r: done.release())
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]

    def submit_at_second_token(wave: list[Request]):
        def on_token(r: Request) -> None:
            if len(r.output_ids) == 2:
                for w in wave:
                    sched.submit(w)

        return on_token

    for i in range(0, len(reqs) - 4, 4):  # the wave after i's starts at i's second token
        reqs[i].on_token = submit_at_second_token(reqs[i + 4 : i + 8])
    sched.start()
    try:
        for r in reqs[:4]:
            sched.submit(r)
        for _ in reqs:
            assert done.acquire(timeout=60), "a request did not finish"
        arrived = sched.stats()["prefill_batches"]
        alone = [run_all(sched, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    finally:
        sched.stop()
    assert arrived >= 8  # one prefill a wave at least
    for a, b in zip(reqs, alone, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_cuda
def test_shared_prompt_keys_read_once_on_gpu(dtype, splits, monkeypatch):
    """GRPO's shape in small: 6 prompts of 2-20 blocks x 8 samples with their own suffixes, a
    row alone; the prefix kernel merged with the rows' own keys equals attention over all."""
    g = torch.Generator(device="cuda").manual_seed(6)
    hkv, h, d, bs = 8, 16, 128, 16
    kc = torch.randn(600, bs, hkv, d, generator=g, device="cuda").to(dtype)
    vc = torch.randn(kc.shape, generator=g, device="cuda").to(dtype)
    free = iter(range(100, 600))
    tables, lens = [], []
    for p, blocks in enumerate((2, 20, 5, 16, 9, 3)):
        prompt = list(range(1 + p * 16, 1 + p * 16 + blocks))
        for s in range(8):
            own = 1 + (s * 7 + p) % 5
            tables.append(prompt + [next(free) for _ in range(own)])
            lens.append(blocks * bs + (own - 1) * bs + 1 + s)
    tables.append([next(free) for _ in range(3)])
    lens.append(40)
    width = max(len(t) for t in tables)
    bt_np = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    found = shared_prefix.find_groups(bt_np, np.array(lens), bs)
    assert len(found.tokens) == 6 and (found.start[:-1] > 0).all() and found.start[-1] == 0
    shared = shared_prefix.SharedPrefix(*(torch.from_numpy(a).cuda() for a in found))
    bt = torch.from_numpy(bt_np).cuda()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), h, d, generator=g, device="cuda").to(dtype)
    monkeypatch.setattr(attention, "decode_splits", lambda *a: splits)
    prefix = shared_prefix.prefix_partials(q, kc, vc, bt, shared, d**-0.5)
    got = attention.paged_decode(q, kc, vc, bt, lens_t, d**-0.5, prefix=prefix).float()
    ref = attention.decode_reference(q.float(), kc.float(), vc.float(), bt, lens_t, d**-0.5)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.gpu
@needs_cuda
def test_gpu_samples_of_shared_prompts_equal_with_and_without_reading_them_once(tmp_path):
    """8 greedy samples of each of 6 prompts (2-4 blocks), CUDA graphs: the same tokens and
    log-probs whether decode reads the shared prompt blocks once or per request; the shared
    graphs ran."""
    d = make_tiny_model(tmp_path / "m", family="qwen3", seed=4)
    g = torch.Generator().manual_seed(1)
    prompts = [
        [2, *torch.randint(5, 60, (int(n),), generator=g).tolist()]
        for n in torch.randint(33, 70, (6,), generator=g)
    ]
    prompts = [p for p in prompts for _ in range(8)]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    out = {}
    for mode in ("on", "off"):
        runner = ModelRunner(
            d, "cuda", max_slots=64, max_context_len=128, num_blocks=400, decode_shared_prefix=mode
        )
        runner.capture_cuda_graphs()
        sched = Scheduler(runner)
        sched.start()
        try:
            out[mode] = run_all(sched, prompts, params)
        finally:
            sched.stop()
        assert (runner.graphs.shared_steps > 0) == (mode == "on")
    for a, b in zip(out["on"], out["off"], strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.gpu
@needs_cuda
def test_varlen_prefill_equals_the_gathered_path_on_gpu(tmp_path):
    """bf16 (the engine's GPU dtype): prefills run through torch's varlen flash kernel by
    default, and its last-token logits equal SDPA over gathered blocks for whole prompts of 1-70
    tokens and for the same prompts behind a cached prefix (the new tokens only: queries
    shorter than keys), several sequences in one call."""
    d = make_tiny_model(tmp_path / "m", family="qwen3", seed=4)
    runner = ModelRunner(d, "cuda", dtype=torch.bfloat16, max_slots=8, max_context_len=128)
    assert runner.prefill_attention == "varlen"
    bs = runner.block_size
    g = torch.Generator().manual_seed(3)
    prompts = [[2, *torch.randint(5, 60, (n,), generator=g).tolist()] for n in (0, 15, 40, 69)]
    tables = [runner.pool.allocate(-(-len(p) // bs)) for p in prompts]
    whole = [(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    # behind a cached prefix: the whole prompts' K/V stay in their blocks; a prefill from each
    # prompt's last whole block on recomputes the rest
    cut = [max(0, (len(p) - 1) // bs) * bs for p in prompts]
    tail = [(p[c:], c, t) for p, c, t in zip(prompts, cut, tables, strict=True)]
    logits = {}
    for kind in ("varlen", "gathered"):
        runner.prefill_attention = kind
        logits[kind] = [runner.prefill(whole).float(), runner.prefill(tail).float()]
    for a, b in zip(logits["varlen"], logits["gathered"], strict=True):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
