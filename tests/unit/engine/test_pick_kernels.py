"""The sampler's pick kernels (pick_kernels.py) against the eager picks of sampling.py, in
Triton's CPU interpreter (the GPU runs the same checks in tests/gpu/test_engine_gpu.py): the
greedy token is torch's first maximum, across chunks and ties; log-probs are log_softmax(x / T)
of the token; draws follow softmax(x / T), banned (-inf) columns never drawn."""

import os

import pytest
import torch

from slime_async.actors.engine.embedded import pick_kernels
from slime_async.actors.engine.embedded.sampling import greedy_pick

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
