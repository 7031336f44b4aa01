"""The paged-KV model runner and the scheduler reproduce HF transformers' greedy decoding on the CPU
(the CUDA paths: tests/gpu/test_engine_gpu.py)."""

import logging
import os
import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slime_async.actors.engine.embedded import attention
from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import SamplingParams
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import PROMPTS, greedy_with_runner, hf_greedy, random_paged, run_all


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("m") / "qwen3", family="qwen3", seed=5)
    return d, AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()


@pytest.mark.parametrize(
    "family,math_path",
    [("llama", "hf"), ("qwen2", "hf"), ("qwen3", "hf"), ("qwen3", "fused"), ("qwen2", "fused")],
)
def test_packed_prefill_and_paged_decode_match_hf(tmp_path, family, math_path):
    d = make_tiny_model(
        tmp_path / family, family=family, seed=3, tie_word_embeddings=family == "qwen2"
    )
    # block_size 4: prompts span several blocks, handed out in an interleaved order.
    runner = ModelRunner(
        d, max_slots=8, max_context_len=64, block_size=4, fused=math_path == "fused", compile=False
    )
    runner.pool.allocate(3)  # tables do not start at block 1
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    toks, lps = greedy_with_runner(runner, PROMPTS, 12)
    for i, p in enumerate(PROMPTS):
        ref_tokens, ref_logps = hf_greedy(hf, p, 12)
        assert toks[i] == ref_tokens, f"prompt {i}"
        torch.testing.assert_close(torch.tensor(lps[i]), torch.tensor(ref_logps), atol=1e-4, rtol=0)


def test_fused_weights_are_views_so_updates_reach_them(qwen3, tmp_path):
    """FusedLayerMath packs q|k|v and gate|up; a weight load must change the packed tensors."""
    d, _ = qwen3
    runner = ModelRunner(d, max_slots=2, max_context_len=32, fused=True, compile=False)
    layer = runner.layers[0]
    new = torch.randn_like(layer.self_attn.k_proj.weight)
    runner.load_weights([("model.layers.0.self_attn.k_proj.weight", new)])
    q_rows = layer.self_attn.q_proj.weight.shape[0]
    packed = runner.math.w[0]["qkv"]
    torch.testing.assert_close(packed[q_rows : q_rows + new.shape[0]], new)


def test_unsupported_family_is_named(tmp_path):
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not served"):
        ModelRunner(tmp_path / "gpt2")


def _assert_hf(hf, reqs, prompts, lengths):
    for r, p, n in zip(reqs, prompts, lengths, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, p, n)
        assert r.output_ids == ref_tokens and r.finish_reason == {"type": "length", "length": n}
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), torch.tensor(ref_logps), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_leaving_at_different_steps_free_blocks_and_equal_hf(qwen3, overlap):
    """More requests than slots; they leave at different steps and their blocks are reused."""
    d, hf = qwen3
    runner = ModelRunner(d, max_slots=3, max_context_len=64, block_size=4)
    sched = Scheduler(runner, overlap=overlap, prefix_sharing=False)
    sched.start()
    try:
        lengths = [3, 9, 1, 6, 12, 4]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
        params = [
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths
        ]
        reqs = run_all(sched, prompts, params)
    finally:
        sched.stop()
    _assert_hf(hf, reqs, prompts, lengths)
    assert runner.pool.in_use() == 0  # every block came back


def test_requests_arriving_mid_decode_are_prefilled_behind_the_step_in_flight(qwen3):
    """A request submitted while another decodes does not stop the pipeline: its prefill is
    launched with the decode step still unread, the next decode step takes its first token from
    the prefill's output and the running request's from that step (both still unread), and
    every output equals HF greedy."""
    d, hf = qwen3
    runner = ModelRunner(d, max_slots=4, max_context_len=64, block_size=4)
    sched = Scheduler(runner, prefix_sharing=False)
    in_flight = []  # the kinds of the unread steps at each decode launch
    decode = runner.decode

    def spy(ids, positions, block_tables):
        in_flight.append(tuple(step.kind for step in sched._inflight))
        return decode(ids, positions, block_tables)

    runner.decode = spy
    started = threading.Event()
    done = threading.Semaphore(0)
    prompts, lengths = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [16, 6, 5]
    reqs = [
        Request(
            f"r{i}",
            p,
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
            lambda r: done.release(),
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    reqs[0].on_token = lambda r: len(r.output_ids) == 3 and started.set()
    sched.start()
    try:
        sched.submit(reqs[0])
        assert started.wait(timeout=60), "the first request produced no third token"
        sched.submit(reqs[1])
        sched.submit(reqs[2])
        for _ in reqs:
            assert done.acquire(timeout=60), "a request did not finish"
    finally:
        sched.stop()
    _assert_hf(hf, reqs, prompts, lengths)
    assert ("decode", "prefill") in in_flight  # the late requests joined the running batch
    assert sched.stats()["prefill_batches"] >= 2 and runner.pool.in_use() == 0


def test_a_full_cache_retracts_and_recomputes(qwen3):
    """A cache too small for every running request: the newest is retracted (counted), re-queued,
    recomputed, and every output still equals HF greedy."""
    d, hf = qwen3
    # 4 requests x (9 + 14 tokens) need 24 blocks of 4; the cache has 12 (+ scratch).
    runner = ModelRunner(d, max_slots=4, max_context_len=64, block_size=4, num_blocks=13)
    sched = Scheduler(runner, prefix_sharing=False)
    sched.start()
    try:
        prompts = [PROMPTS[2]] * 4
        params = [SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)] * 4
        reqs = run_all(sched, prompts, params)
    finally:
        sched.stop()
    _assert_hf(hf, reqs, prompts, [14] * 4)
    assert sched.retractions >= 1
    stats = sched.stats()
    # The loop's timing: wall time of its working iterations; device events only on a GPU.
    assert stats["loop_s"] > 0 and stats["retractions"] == sched.retractions
    assert stats["decode_steps_timed"] == 0 and stats["decode_device_s"] == 0


def test_shared_prompts_are_prefilled_once_and_flushed_with_new_weights(qwen3, tmp_path):
    """Twins in one batch share a prefill; a later request takes the cached full blocks; a weight
    load forgets them (its KV is recomputed under the new weights and equals HF of those)."""
    d, hf = qwen3
    prompt = [2, *range(10, 20)]  # 11 tokens: two full blocks of 4 and a partial one
    runner = ModelRunner(d, max_slots=8, max_context_len=64, block_size=4)
    sched = Scheduler(runner)
    sched.start()
    try:
        params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * 3
        twins = run_all(sched, [prompt] * 3, params)
        assert sched.prefill_tokens == len(prompt)  # one prefill for the three
        assert sched.stats()["prefill_batches"] == 1 and sched.stats()["prefill_s"] > 0
        assert [r.cached_tokens for r in twins] == [0, len(prompt), len(prompt)]
        (later,) = run_all(sched, [[*prompt, 40, 41]], params[:1])
        assert later.cached_tokens == 8 and sched.prefill_tokens == len(prompt) + 5
        d1 = make_tiny_model(tmp_path / "m1", family="qwen3", seed=9)
        sched.call(lambda: runner.load_from_disk(d1)).result(timeout=60)
        (after,) = run_all(sched, [prompt], params[:1])
        assert after.cached_tokens == 0
    finally:
        sched.stop()
    _assert_hf(hf, twins, [prompt] * 3, [5] * 3)
    _assert_hf(hf, [later], [[*prompt, 40, 41]], [5])
    hf1 = AutoModelForCausalLM.from_pretrained(d1, local_files_only=True).eval()
    _assert_hf(hf1, [after], [prompt], [5])


def test_stop_token_kept_and_min_new_tokens(tmp_path):
    d = make_tiny_model(tmp_path / "m", family="llama", seed=6)
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    ref, _ = hf_greedy(hf, PROMPTS[0], 6)
    stop = ref[2]
    sched = Scheduler(ModelRunner(d, max_slots=4, max_context_len=64))
    sched.start()
    try:
        first = ref.index(stop)
        params = [
            SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)),
            SamplingParams(
                max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True
            ),
        ]
        stopped, ignored = run_all(sched, [PROMPTS[0], PROMPTS[0]], params)
    finally:
        sched.stop()
    # As SGLang: the matched stop token stays in the output; ignore_eos disables stop_token_ids.
    assert stopped.output_ids == ref[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    assert ignored.output_ids == ref and ignored.finish_reason["type"] == "length"


def test_packed_prefill_padding_rows_leave_token_zero_alone(qwen3):
    """A packed prefill pads each sequence's queries to the longest; the padding rows (query row
    0) must not overwrite token 0's output. Found: they did whenever the sequences' new-token
    counts differed, unless token 0 happened to give the same output (same first token at
    position 0, no prefix hit): a lead with a prefix-index hit, or a first prompt whose first
    token differs from the others', got a wrong first row (its K/V in later layers too)."""
    d, _ = qwen3
    runner = ModelRunner(d, max_slots=4, max_context_len=64, block_size=4)
    a, b = [2, *range(10, 20)], [7, 20, 21, 22, 23]  # a: 8 cached + 3 new; b: 5 new, no BOS

    def prefill(*seqs):
        """Each (tokens, cached) prefilled in one packed pass after its cached prefix."""
        tables = []
        for toks, cached in seqs:
            t = runner.pool.allocate(-(-len(toks) // 4))
            if cached:
                runner.prefill([(toks[:cached], 0, t)])
            tables.append(t)
        return runner.prefill([(toks[c:], c, t) for (toks, c), t in zip(seqs, tables, strict=True)])

    alone_a, alone_b = prefill((a, 8))[0], prefill((b, 0))[0]
    for seqs, refs in (
        ([(a, 8), (b, 0)], [alone_a, alone_b]),
        ([(b, 0), (a, 8)], [alone_b, alone_a]),
    ):
        got = prefill(*seqs)
        for row, ref in zip(got, refs, strict=True):
            torch.testing.assert_close(row, ref, atol=1e-5, rtol=0)


def test_varlen_operands_give_the_gathered_attention(qwen3):
    """The prefill plan's operands of the varlen kernel (each sequence's keys end to end at
    `kv_packed`, cumulative query and key counts) under the kernel's semantics, written out per
    sequence here (causality aligned to the sequence's last key: new token j of m over L keys
    sees keys 0 .. L - m + j), equal the gathered path's attention: a cached prefix, a whole
    prompt, a single token. The kernel itself is CUDA-only (tests/gpu/test_engine_gpu.py)."""
    import torch.nn.functional as F

    d, _ = qwen3
    runner = ModelRunner(d, max_slots=4, max_context_len=64, block_size=4)
    assert runner.prefill_attention == "gathered"  # the CPU
    with pytest.raises(ValueError, match="prefill_attention = 'varlen' needs a CUDA device"):
        ModelRunner(d, max_slots=4, max_context_len=64, prefill_attention="varlen")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = runner.num_heads, runner.num_kv_heads, runner.head_dim
    kc, vc = (torch.randn(12, 4, kv_heads, dim, generator=g) for _ in "kv")
    lens, starts, tables = [5, 9, 1], [6, 0, 4], [[3, 1, 7], [5, 8, 2], [9, 4, 0]]
    plan = runner._prefill_plan(lens, starts, tables, "varlen")
    q = torch.randn(sum(lens), heads, dim, generator=g)
    gathered = runner._prefill_plan(lens, starts, tables, "gathered")
    want = runner._prefill_attend(gathered, "gathered")(q, kc, vc)
    assert "kv_packed" not in gathered and "q_rows" not in plan  # each path's operands only
    k_all = kc.view(-1, kv_heads, dim)[plan["kv_packed"]]
    v_all = vc.view(-1, kv_heads, dim)[plan["kv_packed"]]
    cu_q, cu_k = plan["cu_q"].tolist(), plan["cu_k"].tolist()
    assert cu_k == [0, 11, 20, 25] and cu_q == [0, 5, 14, 15]
    got = []
    for i in range(len(lens)):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ki, vi = (x[cu_k[i] : cu_k[i + 1]].transpose(0, 1) for x in (k_all, v_all))
        m, n_keys = qi.shape[1], ki.shape[1]
        sees = torch.arange(n_keys)[None, :] <= torch.arange(m)[:, None] + (n_keys - m)
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=sees, enable_gqa=True, scale=runner._scale
        )
        got.append(o.transpose(0, 1))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def test_a_failed_start_up_check_is_refused_when_forced_and_logged_otherwise(caplog):
    from slime_async.actors.engine.embedded.model_runner import _passed

    assert _passed(None, True, "the kernel", "the other path")
    with pytest.raises(RuntimeError, match="the kernel failed its check: relative error 1"):
        _passed("relative error 1", True, "the kernel", "the other path")
    with caplog.at_level(logging.ERROR):
        assert not _passed("relative error 1", False, "the kernel", "the other path")
    assert "the kernel failed its check (relative error 1): the other path instead" in caplog.text


def test_gathered_attention_gathers_its_output_back_by_token():
    """The GPU prefill's attention (gathered_attention, run here on CPU) and the CPU path's
    (gather_plan + attend_gathered) agree, padding rows included, with a per-sequence SDPA."""
    g = torch.Generator().manual_seed(2)
    bs, hkv, h, dim = 4, 2, 4, 8
    kc, vc = torch.randn(10, bs, hkv, dim, generator=g), torch.randn(10, bs, hkv, dim, generator=g)
    lens_new, starts = [2, 5], [6, 0]  # sequence 0: 6 cached keys, 2 new queries; 1: 5 new
    q = torch.randn(sum(lens_new), h, dim, generator=g)
    table = torch.tensor([[3, 1, 0], [5, 2, 0]])
    m, total = max(lens_new), [s + n for s, n in zip(starts, lens_new, strict=True)]
    j = torch.arange(m)
    valid = j[None] < torch.tensor(lens_new)[:, None]
    offs = torch.tensor([0, lens_new[0]])
    q_rows = torch.where(valid, offs[:, None] + j, 0)
    q_pos = torch.where(valid, torch.tensor(starts)[:, None] + j, 0)
    kp = torch.arange(max(total))
    kv_slots = table[:, kp // bs] * bs + kp % bs
    tok_rows = torch.tensor([0, 1, m, m + 1, m + 2, m + 3, m + 4])
    kv_len = torch.tensor(total)
    got = attention.gathered_attention(q, kc, vc, q_rows, q_pos, kv_slots, kv_len, 0.3, tok_rows)
    plan = attention.gather_plan(kv_slots, q_pos, kv_len, q_rows, tok_rows)
    torch.testing.assert_close(attention.attend_gathered(q, kc, vc, plan, 0.3), got)
    flat_k, flat_v = kc.view(-1, hkv, dim), vc.view(-1, hkv, dim)
    for i in range(2):
        keys = kv_slots[i, : total[i]]
        k, v = flat_k[keys].transpose(0, 1), flat_v[keys].transpose(0, 1)
        qi = q[offs[i] : offs[i] + lens_new[i]].transpose(0, 1)
        mask = kp[None, : total[i]] <= torch.tensor(starts[i]) + j[: lens_new[i], None]
        ref = torch.nn.functional.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, enable_gqa=True, scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(got[offs[i] : offs[i] + lens_new[i]], ref)


def test_cpu_decode_plan_equals_the_reference():
    """The CPU decode path (one plan for every layer, index_select) = decode_reference."""
    q, kc, vc, bt, lens = random_paged("cpu", torch.float32)
    pos = lens.long() - 1
    span = int(pos.max()) + 1
    kp = torch.arange(span)
    plan = attention.gather_plan(bt.long()[:, kp // 16] * 16 + kp % 16, pos[:, None], pos + 1)
    got = attention.attend_gathered(q, kc, vc, plan, 32**-0.5)
    ref = attention.decode_reference(q, kc, vc, bt, lens, 32**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(
    attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)
@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize("bs", [16, 8])
def test_paged_decode_kernel_in_triton_interpreter(splits, bs):
    """The Triton kernel (CPU interpreter) equals the gathered reference in fp32: keys read in
    tiles of several blocks, cut into splits (some of them empty for the short rows) and
    combined; lengths inside a block, at a block's end, of one token, over several tiles."""
    q, kc, vc, bt, lens = random_paged("cpu", torch.float32, bs=bs)
    got = attention.paged_decode(q, kc, vc, bt, lens, 32**-0.5, splits=splits)
    ref = attention.decode_reference(q, kc, vc, bt, lens, 32**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(1)
    nb, per = 48, 200 // bs + 1
    kc, vc = torch.randn(2, nb, bs, 2, 32, generator=g)
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:per] + 1 for _ in range(3)]).int()
    lens = torch.tensor([200, 65, 129], dtype=torch.int32)
    q = torch.randn(3, 4, 32, generator=g)
    got = attention.paged_decode(q, kc, vc, bt, lens, 32**-0.5, splits=splits)
    ref = attention.decode_reference(q, kc, vc, bt, lens, 32**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)
def test_store_kv_kernel_in_triton_interpreter():
    """The one-kernel K/V store (CPU interpreter) writes what the two index copies write, from
    k and v as the layer hands them over: strided views of one q|k|v output."""
    g = torch.Generator().manual_seed(2)
    T, hkv, d = 5, 2, 32
    qkv = torch.randn(T, (4 + 2 * hkv) * d, generator=g)
    _, k, v = qkv.split([4 * d, hkv * d, hkv * d], -1)
    k, v = k.reshape(T, hkv, d), v.view(T, hkv, d)
    slots = torch.tensor([17, 3, 40, 4, 31])
    got = [torch.zeros(6, 8, hkv, d) for _ in range(2)]
    want = [torch.zeros(6, 8, hkv, d) for _ in range(2)]
    attention.write_kv(*got, slots, k, v, kernel=True)
    for cache, x in zip(want, (k, v), strict=True):
        cache.view(-1, hkv, d).index_copy_(0, slots, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _keyed(sched: Scheduler, prompt: list[int], params: SamplingParams, *keys) -> list[Request]:
    """One request of `prompt` per extra_key, admitted together (submitted while paused)."""
    done = threading.Semaphore(0)
    reqs = [
        Request(f"r{i}", list(prompt), params, lambda r: done.release(), extra_key=k)
        for i, k in enumerate(keys)
    ]
    sched.call(lambda: sched.pause("retract")).result(timeout=60)
    for r in reqs:
        sched.submit(r)
    sched.call(sched.resume).result(timeout=60)
    for _ in reqs:
        assert done.acquire(timeout=60)
    return reqs


@pytest.mark.parametrize("strict", [False, True])
def test_requests_share_cached_prefixes_only_under_one_extra_key(qwen3, strict):
    """SGLang's extra_key: the same prompt under another key is prefilled again (cached_tokens 0),
    in one batch (no twins) and across batches (no index match); under the same key it is shared.
    Strict mode (SGLang's failures) keys the same way."""
    d, hf = qwen3
    prompt = [2, *range(10, 20)]  # 11 tokens: two full blocks of 4
    runner = ModelRunner(d, max_slots=8, max_context_len=64, block_size=4)
    sched = Scheduler(runner, strict=strict)
    sched.start()
    p = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        first = _keyed(sched, prompt, p, "weights-0", "weights-1", None)  # three namespaces
        assert [r.cached_tokens for r in first] == [0, 0, 0]
        assert sched.prefill_tokens == 3 * len(prompt)
        again = _keyed(sched, prompt, p, "weights-1", "weights-2")
        assert [r.cached_tokens for r in again] == [8, 0]  # two full blocks of weights-1's
        twins = _keyed(sched, prompt, p, "weights-3", "weights-3")  # one key: one prefill
        assert [r.cached_tokens for r in twins] == [0, len(prompt)]
    finally:
        sched.stop()
    _assert_hf(hf, first + again + twins, [prompt] * 7, [3] * 7)


def test_the_sampling_kernels_are_eager_on_a_cpu_and_fall_back_to_eager_when_compiles_fail(
    qwen3, caplog
):
    """A GPU runner compiles the seeded draw and the unfiltered picks at start; a compile that
    fails is logged and that kernel stays eager (the same tokens, only slower), so no request
    ever meets the error."""
    from slime_async.actors.engine.embedded.sampling import EAGER_PICKS, Picks, seeded_argmax

    runner = ModelRunner(qwen3[0], max_slots=2, max_context_len=32)
    assert runner.seeded_draw is seeded_argmax and runner.warm_sampling() is False
    assert runner.picks is EAGER_PICKS

    def broken(*_args):
        raise RuntimeError("no compiler for this device")

    runner.seeded_draw = broken
    runner.picks = Picks(broken, broken)
    assert runner.warm_sampling() is False
    assert runner.seeded_draw is seeded_argmax and runner.picks is EAGER_PICKS
    assert "compiling the seeded draw failed" in caplog.text
    assert "compiling the sampler's picks failed" in caplog.text
    # top-k/top-p kernels that fail alone: the unfiltered picks keep theirs, top-p sorts eagerly
    # stand-ins for working kernels (the eager math under other names)
    kept = (lambda x: EAGER_PICKS.greedy(x)), (lambda *a: EAGER_PICKS.temperature(*a))
    runner.picks = Picks(*kept, broken)
    assert runner.warm_sampling() is True
    assert (runner.picks.greedy, runner.picks.temperature) == kept
    assert runner.picks.filtered is EAGER_PICKS.filtered
    assert "the top-k/top-p kernels failed their check" in caplog.text
    # what /server_info reports: only the failed kernel shows as eager
    assert runner.sampling_kernels() == {
        "greedy": "triton",
        "temperature": "triton",
        "filtered": "eager",
        "seeded": "eager",
    }
