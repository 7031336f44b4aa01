"""The slot-cache model runner and the scheduler reproduce HF transformers' greedy decoding."""

import threading

import pytest
import torch
from engine_util import hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import SamplingParams
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.testing.models import make_tiny_model

PROMPTS = [[2, 10, 11, 12, 13], [2, 20, 21], [2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 30]]


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batched_prefill_and_decode_match_hf(tmp_path, family):
    d = make_tiny_model(
        tmp_path / family, family=family, seed=3, tie_word_embeddings=family == "qwen2"
    )
    runner = ModelRunner(d, max_slots=8, max_context_len=64)
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    logits = runner.prefill(list(range(len(PROMPTS))), PROMPTS)  # [n, V]
    lens = [len(p) for p in PROMPTS]
    got_tokens = [[] for _ in PROMPTS]
    got_logps = [[] for _ in PROMPTS]
    for _ in range(12):
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
        for i in range(len(PROMPTS)):
            got_tokens[i].append(tok[i].item())
            got_logps[i].append(lp[i].item())
        logits = runner.decode(tok.tolist(), lens)
        lens = [n + 1 for n in lens]
    for i, p in enumerate(PROMPTS):
        ref_tokens, ref_logps = hf_greedy(hf, p, 12)
        assert got_tokens[i] == ref_tokens, f"prompt {i}"
        torch.testing.assert_close(
            torch.tensor(got_logps[i]), torch.tensor(ref_logps), atol=1e-4, rtol=0
        )


def test_unsupported_family_is_named(tmp_path):
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not served"):
        ModelRunner(tmp_path / "gpt2")


def _run_all(sched: Scheduler, prompts, params) -> list[Request]:
    done = threading.Semaphore(0)
    reqs = [Request(f"r{i}", p, params[i], lambda r: done.release()) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=60)
    return reqs


def test_scheduler_compacts_slots_when_requests_of_different_lengths_leave(tmp_path):
    """Requests leave at different steps (slot compaction) and every one still equals HF greedy."""
    d = make_tiny_model(tmp_path / "m", family="qwen3", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    sched = Scheduler(ModelRunner(d, max_slots=3, max_context_len=64))  # fewer slots than requests
    sched.start()
    try:
        lengths = [3, 9, 1, 6, 12, 4]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
        params = [
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths
        ]
        reqs = _run_all(sched, prompts, params)
    finally:
        sched.stop()
    for r, p, n in zip(reqs, prompts, lengths, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, p, n)
        assert r.output_ids == ref_tokens and r.finish_reason == {"type": "length", "length": n}
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), torch.tensor(ref_logps), atol=1e-4, rtol=0
        )


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
        stopped, ignored = _run_all(sched, [PROMPTS[0], PROMPTS[0]], params)
    finally:
        sched.stop()
    # As SGLang: the matched stop token stays in the output; ignore_eos disables stop_token_ids.
    assert stopped.output_ids == ref[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    assert ignored.output_ids == ref and ignored.finish_reason["type"] == "length"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_runner_on_gpu_matches_hf_before_and_after_a_weight_load(tmp_path, graphs):
    """Eager and CUDA-graph decoding equal HF greedy; graphs see weights loaded in place."""
    d0 = make_tiny_model(tmp_path / "m0", family="qwen3", seed=8)
    d1 = make_tiny_model(tmp_path / "m1", family="qwen3", seed=9)
    runner = ModelRunner(d0, device="cuda", max_slots=4, max_context_len=64)
    if graphs:
        assert runner.capture_cuda_graphs() == [1, 2, 4]
    sched = Scheduler(runner)
    sched.start()
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)] * len(
        PROMPTS[:3]
    )
    try:
        before = _run_all(sched, PROMPTS[:3], params)  # 3 rows: the size-4 graph pads one row
        sched.call(lambda: runner.load_from_disk(d1)).result(timeout=60)
        after = _run_all(sched, PROMPTS[:3], params)
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
