"""The sampler's pick kernels (pick_kernels.py) against the eager picks of sampling.py, in
Triton's CPU interpreter (the GPU runs the same checks in tests/gpu/test_engine_gpu.py): the
greedy token is torch's first maximum, across chunks and ties; log-probs are log_softmax(x / T)
of the token; draws follow softmax(x / T), banned (-inf) columns never drawn; the top-k/top-p thresholds are
the sort's (`sampling.filter_thresholds`), and filtered draws stay at or above them."""

import os

import pytest
import torch

from slime_async.actors.engine.embedded import pick_kernels
from slime_async.actors.engine.embedded.sampling import (
    filter_thresholds,
    filtered_pick,
    greedy_pick,
)

pytestmark = pytest.mark.skipif(
    pick_kernels.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)


def test_greedy_is_the_first_maximum_across_chunks_and_ties():
    vocab = 2 * pick_kernels.CHUNK + 123  # three chunks, the last one short
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, vocab - 1] = 50.0  # the maximum in the last, partial chunk
    logits[2, [7, pick_kernels.CHUNK + 3]] = 40.0  # a tie across chunks: the first wins
    logits[3, [10, 11]] = 40.0  # a tie inside a chunk
    tok, lp = pick_kernels.greedy_pick(logits)
    want, lp_want = greedy_pick(logits)
    assert tok.tolist() == want.tolist() == [want[0].item(), vocab - 1, 7, 10]
    torch.testing.assert_close(lp, lp_want, atol=1e-5, rtol=0)


def test_draws_follow_softmax_at_temperature_and_never_take_banned_columns():
    n = 4000
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    logits = row.expand(n, -1).contiguous()
    temp = torch.full((n,), 0.8)
    greedy = torch.zeros(n, dtype=torch.bool)
    greedy[::5] = True
    temp[greedy] = 1.0
    tok, lp = pick_kernels.temperature_pick(logits, temp, greedy, torch.Generator().manual_seed(3))
    assert (tok[greedy] == 0).all()
    drawn = tok[~greedy]
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    want = torch.softmax(row / 0.8, -1)
    assert freq[4] == 0
    assert torch.allclose(freq, want, atol=4 * (want * (1 - want) / drawn.numel()).sqrt().max())
    ref = torch.log_softmax(logits / temp[:, None], -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_a_seeded_generator_gives_the_same_draws_and_another_seed_others():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    temp, greedy = torch.ones(64), torch.zeros(64, dtype=torch.bool)
    a, _ = pick_kernels.temperature_pick(logits, temp, greedy, torch.Generator().manual_seed(9))
    b, _ = pick_kernels.temperature_pick(logits, temp, greedy, torch.Generator().manual_seed(9))
    c, _ = pick_kernels.temperature_pick(logits, temp, greedy, torch.Generator().manual_seed(10))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_thresholds_are_the_sorts_across_splits_ties_bans_and_temperatures(dtype):
    vocab = 2 * pick_kernels.CHUNK + 37  # three chunks, the last one short
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(12, vocab, generator=g) * 3).to(dtype)  # bf16/fp16: ties
    logits[2, :300] = logits[2, 5]  # a tie group across the top-p boundary
    logits[3, 100:] = float("-inf")  # a banned tail: top-p within the first 100 tokens
    logits[4] = -logits[4].abs()  # all negative: keys of one sign
    logits[10, 3 * vocab // 4 :] = float("-inf")  # banned splits beside top-k and top-p
    logits[11, 1] = 1e-30 if dtype != torch.float16 else 1e-7  # a tiny (subnormal in fp16) peak
    top_k = torch.tensor([vocab, 10, vocab, 40, vocab, 1, 700, vocab, 3, vocab, 5000, vocab])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.7, 1.0, 0.99, 1.0, 0.2, 0.001, 0.9, 0.6])
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 0.5, 1.0, 2.0, 1.0, 0.9, 1.0])
    inv_t = temp.reciprocal()
    got = pick_kernels.thresholds(logits, inv_t, top_k, top_p)
    want = filter_thresholds(logits.float() * inv_t[:, None], top_k, top_p)
    assert got.tolist() == want.tolist()
    fewer = pick_kernels.thresholds(logits, inv_t, top_k, top_p, pivots=2)  # more, finer passes
    assert fewer.tolist() == want.tolist()
    assert got[7].item() == float("-inf")
    one_stage = torch.arange(12) % 2 == 0  # no row with both filters: the host says so
    k1, p1 = top_k.where(~one_stage | (top_p >= 1), vocab), top_p.where(one_stage, 1.0)
    got = pick_kernels.thresholds(logits, inv_t, k1, p1, two_stage=False)
    assert got.tolist() == filter_thresholds(logits.float() * inv_t[:, None], k1, p1).tolist()


def test_search_passes_narrow_any_interval_to_one_key():
    assert [pick_kernels.search_passes(16, b) for b in (16, 19, 32)] == [4, 5, 8]
    assert pick_kernels.search_passes(8, 16) == 6 and pick_kernels.search_passes(2, 1) == 1


@pytest.mark.timeout(600)  # the interpreter runs every program of some 17 kernels one by one
def test_filtered_draws_stay_in_the_nucleus_and_match_the_eager_distribution():
    n = 1200  # the interpreter runs one program a row, one at a time
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, float("-inf"), 2.5])
    logits = row.bfloat16().expand(n, -1).contiguous()  # exact; bf16: 6 passes a search
    temp = torch.full((n,), 1.0)
    greedy = torch.zeros(n, dtype=torch.bool)
    greedy[::6] = True
    k = torch.full((n,), 8)
    k[1::2] = 2  # top-k 2 of a tie at the second value: three tokens kept
    p = torch.full((n,), 0.8)
    tok, lp = pick_kernels.filtered_pick(
        logits, temp, greedy, k, p, torch.Generator().manual_seed(2)
    )
    assert (tok[greedy] == 0).all()
    for sel in (torch.arange(n) % 2 == 0, torch.arange(n) % 2 == 1):
        rows = sel & ~greedy
        drawn = tok[rows]
        thr = filter_thresholds(row[None], k[sel][:1], p[:1])[0]
        want = torch.softmax(row.masked_fill(row < thr, float("-inf")), -1)
        freq = torch.bincount(drawn, minlength=8).float() / drawn.numel()
        assert (freq[row < thr] == 0).all()
        assert torch.allclose(freq, want, atol=4 * (want * (1 - want) / drawn.numel()).sqrt().max())
    ref = torch.log_softmax(logits.float(), -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    eager, _ = filtered_pick(logits[:4], temp[:4], greedy[:4], k[:4], p[:4], None)
    assert eager[0].item() == 0
