"""The sampler draws from the top-k/top-p filtered distribution and reports SGLang's log-probs:
log_softmax(logits / T) over the full vocabulary, before filtering; SGLang params validated."""

import math

import pytest
import torch

from slime_async.actors.engine.embedded.sampling import (
    SamplingParams,
    filter_thresholds,
    murmur_hash32,
    sample,
    thresholds_hold,
)
from tests.support import sglang_wheel as sw


def _row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_returns_argmax_and_raw_log_softmax():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    tok, lp = sample(logits, torch.zeros(5), torch.full((5,), -1), torch.ones(5))
    assert tok.tolist() == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)


def test_temperature_logprob_is_log_softmax_of_scaled_logits():
    logits = torch.randn(64, 17, generator=torch.Generator().manual_seed(1))
    temp = torch.full((64,), 0.7)
    tok, lp = sample(
        logits, temp, torch.full((64,), -1), torch.ones(64), torch.Generator().manual_seed(2)
    )
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)


def test_top_k_draws_from_the_k_best_and_reports_the_unfiltered_log_softmax():
    logits = _row([0.0, 3.0, 1.0, 2.0, -1.0]).repeat(200, 1)
    n = logits.shape[0]
    tok, lp = sample(
        logits,
        torch.full((n,), 0.5),
        torch.full((n,), 2),
        torch.ones(n),
        torch.Generator().manual_seed(3),
    )
    assert set(tok.tolist()) == {1, 3}
    # SGLang: log_softmax(logits / T) over the whole vocabulary, not renormalised over the top 2.
    full = torch.log_softmax(logits[0] / 0.5, -1)
    for t, v in zip(tok.tolist(), lp.tolist(), strict=True):
        assert v == pytest.approx(full[t].item(), abs=1e-5)
    z = math.log(math.exp(6.0) + math.exp(4.0))
    assert lp[tok == 1][0].item() != pytest.approx(6.0 - z, abs=1e-3)  # the old, filtered value


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7, 0.5+0.3 crosses).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(300, 1)
    n = logits.shape[0]
    tok, lp = sample(
        logits,
        torch.ones(n),
        torch.full((n,), -1),
        torch.full((n,), 0.7),
        torch.Generator().manual_seed(4),
    )
    assert set(tok.tolist()) == {0, 1}
    for t, v in zip(tok.tolist(), lp.tolist(), strict=True):
        assert v == pytest.approx(math.log(probs[t].item()), abs=1e-5)  # not / 0.8


def test_top_k_then_top_p_on_the_renormalised_top_k():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None].repeat(300, 1)
    n = logits.shape[0]
    # top-k 2 -> {0.4, 0.3} renormalised to {4/7, 3/7}; top_p 0.5 keeps only the first.
    tok, lp = sample(
        logits,
        torch.ones(n),
        torch.full((n,), 2),
        torch.full((n,), 0.5),
        torch.Generator().manual_seed(5),
    )
    assert set(tok.tolist()) == {0}
    torch.testing.assert_close(lp, torch.full((n,), math.log(0.4)))


def test_mixed_rows_use_their_own_params():
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(6))
    tok, lp = sample(
        logits,
        torch.tensor([0.0, 1.0, 1.0]),
        torch.tensor([-1, 1, -1]),
        torch.tensor([1.0, 1.0, 1.0]),
        torch.Generator().manual_seed(7),
    )
    assert tok[0].item() == logits[0].argmax().item()
    assert tok[1].item() == logits[1].argmax().item()
    assert lp[1].item() == pytest.approx(torch.log_softmax(logits[1], -1).max().item(), abs=1e-6)
    assert lp[2].item() == pytest.approx(torch.log_softmax(logits[2], -1)[tok[2]].item(), abs=1e-6)


def test_sampling_params_defaults_and_sglang_names():
    p = SamplingParams.from_request(
        {
            "max_new_tokens": 7,
            "temperature": 0,
            "top_k": 5,
            "top_p": 0.9,
            "stop_token_ids": [1],
            "stop": "x",
            "n": 1,
        },
        vocab_size=10,
    )
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p) == (7, 0.0, 5, 0.9)
    assert p.stop_token_ids == (1,) and p.stop == ("x",)
    assert SamplingParams.from_request(None, 10).max_new_tokens == 128
    # Fields SGLang has and slime's rollouts send: served, not refused.
    q = SamplingParams.from_request(
        {"max_new_tokens": 0, "sampling_seed": 3, "spaces_between_special_tokens": False}, 10
    )
    assert (q.max_new_tokens, q.sampling_seed, q.spaces_between_special_tokens) == (0, 3, False)


def test_sampling_seed_gives_the_same_tokens_whatever_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8))
    ones, k, p = torch.ones(4), torch.full((4,), -1), torch.ones(4)
    a, _ = sample(logits, ones, k, p, torch.Generator().manual_seed(1), [(0, 42, 7)])
    b, _ = sample(logits, ones, k, p, torch.Generator().manual_seed(99), [(0, 42, 7)])
    assert a[0].item() == b[0].item()
    # the same row elsewhere in another batch: the same token
    c, _ = sample(logits[[2, 0]], ones[:2], k[:2], p[:2], None, [(1, 42, 7)])
    assert c[1].item() == a[0].item()
    # restricted (top-k, top-p) rows too, and the token stays in the allowed set
    k3, p9 = torch.full((4,), 3), torch.full((4,), 0.9)
    r1, _ = sample(logits, ones, k3, p9, torch.Generator().manual_seed(1), [(0, 5, 1), (3, 6, 1)])
    r2, _ = sample(logits, ones, k3, p9, torch.Generator().manual_seed(2), [(0, 5, 1), (3, 6, 1)])
    assert r1[[0, 3]].tolist() == r2[[0, 3]].tolist()
    for row in (0, 3):
        assert r1[row].item() in logits[row].topk(3).indices.tolist()


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3 x86 32 as published (Appleby), whole 4-byte blocks and the tail."""
    m = 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m  # noqa: E731
    h, n = seed, len(data)
    for i in range(0, n - n % 4, 4):
        k = rotl((int.from_bytes(data[i : i + 4], "little") * 0xCC9E2D51) & m, 15)
        h = rotl(h ^ ((k * 0x1B873593) & m), 13)
        h = (h * 5 + 0xE6546B64) & m
    tail = data[n - n % 4 :]
    if tail:
        k = rotl((int.from_bytes(tail, "little") * 0xCC9E2D51) & m, 15)
        h ^= (k * 0x1B873593) & m
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_the_seed_hash_is_murmur3_of_seed_position_and_column():
    """The reference against the published vectors, then the engine's hash against the reference
    on the 16 bytes SGLang's kernel hashes (seed low, seed high, position, column)."""
    assert _murmur3_x86_32(b"hello") == 613153351
    assert _murmur3_x86_32(b"foo") == (-156908512) & 0xFFFFFFFF
    seeds = torch.tensor([0, 42, 2**40 + 7, -3])
    positions = torch.tensor([0, 9, 123456, 5])
    cols = torch.tensor([0, 1, 77, 151935])
    got = murmur_hash32(seeds, positions, cols)
    for i, (sd, pos) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        for j, col in enumerate(cols.tolist()):
            msg = b"".join((v & 0xFFFFFFFF).to_bytes(4, "little") for v in (sd, sd >> 32, pos, col))
            assert got[i, j].item() == _murmur3_x86_32(msg), (sd, pos, col)


def test_sglangs_seed_hash_has_these_constants():
    """The wheel's kernel (kernels/ops/sampling/murmur_hash.py) mixes with the constants and
    block order the engine's hash uses, and its sampler adds the noise to float64 log-probs."""
    api = sw.api_or_skip()
    kernel = api.files.read("kernels/ops/sampling/murmur_hash.py")
    for const in ("0xCC9E2D51", "0x1B873593", "0xE6546B64", "0x85EBCA6B", "0xC2B2AE35"):
        assert const in kernel, const
    for order in ("h = murmur3_mix(h, k)", "h = murmur3_mix(h, pos)", "h = murmur3_mix(h, col)"):
        assert order in kernel
    assert "h ^= 16" in kernel and "r1: tl.constexpr = 15" in kernel
    sampler = api.files.read("srt/layers/sampler.py")
    assert "hashed.to(torch.float64) / torch.iinfo(torch.uint32).max" in sampler
    assert "else forward_batch.seq_lens - 1" in api.files.read("srt/model_executor/model_runner.py")


def test_seeded_draws_follow_the_distribution():
    """Over many seeds the seeded Gumbel-max draws follow softmax(logits / T), filtered."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    n = 6000
    rows = logits.expand(n, -1)
    ones, k, p = torch.ones(n), torch.full((n,), -1), torch.ones(n)
    seeded = [(i, 1000 + i, 3) for i in range(n)]
    tok, _ = sample(rows, ones, k, p, None, seeded)
    freq = torch.bincount(tok, minlength=5).float() / n
    want = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, want, atol=4 * (want * (1 - want) / n).sqrt().max().item())
    tok2, _ = sample(rows, ones, torch.full((n,), 2), p, None, seeded)  # top-k 2, renormalised
    freq2 = torch.bincount(tok2, minlength=5).float() / n
    want2 = torch.softmax(logits[0, :2], -1)
    assert freq2[2:].sum() == 0 and abs(freq2[0] - want2[0]) < 0.03


def test_unfiltered_draws_follow_the_distribution_with_greedy_rows_mixed_in():
    """The one-pass draw (no top-k/top-p, no seed): each temperature row follows
    softmax(logits / T) and reports its log_softmax; greedy rows in the same batch take the
    argmax with log_softmax at T = 1; -inf columns (min_new_tokens' bans) are never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    n = 8000
    rows = logits.expand(n, -1)
    temp = torch.full((n,), 0.8)
    temp[::4] = 0.0  # every fourth row greedy
    k, p = torch.full((n,), -1), torch.ones(n)
    tok, lp = sample(rows, temp, k, p, torch.Generator().manual_seed(5))
    greedy = temp == 0
    assert (tok[greedy] == 0).all()
    torch.testing.assert_close(lp[greedy], torch.log_softmax(logits[0], -1)[0].expand(n // 4))
    drawn = tok[~greedy]
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    want = torch.softmax(logits[0] / 0.8, -1)
    assert freq[4] == 0
    assert torch.allclose(freq, want, atol=4 * (want * (1 - want) / drawn.numel()).sqrt().max())
    torch.testing.assert_close(lp[~greedy], torch.log_softmax(logits[0] / 0.8, -1)[drawn])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bf16_logits_are_sampled_as_their_fp32_values(temperature):
    """The engine hands the sampler logits in the model's dtype: the result is that of the
    same values upcast (the upcast is exact), greedy and at a temperature alike."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)).bfloat16()
    temp, k, p = torch.full((6,), temperature), torch.full((6,), -1), torch.ones(6)
    a = sample(logits, temp, k, p, torch.Generator().manual_seed(4))
    b = sample(logits.float(), temp, k, p, torch.Generator().manual_seed(4))
    assert a[0].tolist() == b[0].tolist() and a[1].dtype == torch.float32
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"max_new_tokens": -3}, "max_new_tokens must be >= 0"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop_token_ids": [99]}, "outside the vocabulary"),
        ({"bogus": 1}, "unknown sampling_params field 'bogus'"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_sampling_params_errors_name_the_field(raw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams.from_request(raw, vocab_size=10)


def _brute_thresholds(x: torch.Tensor, k: int, p: float) -> float:
    """The keep rule by its definition, value by value: top-k keeps x >= the k-th largest
    value; top-p keeps x >= the largest value v whose tokens (within top-k) hold >= p of the
    top-k mass. Python floats in float64."""
    vals = sorted(x.tolist(), reverse=True)
    tk = vals[min(k, len(vals)) - 1]
    kept = [v for v in vals if v >= tk]
    top = kept[0]
    z = sum(math.exp(v - top) for v in kept)
    for v in sorted(set(kept), reverse=True):
        if sum(math.exp(u - top) for u in kept if u >= v) >= p * z:
            return v
    raise AssertionError("the lowest kept value always holds all the mass")


def test_filter_thresholds_follow_the_rule_and_keep_every_tied_token():
    g = torch.Generator().manual_seed(11)
    # bf16-rounded logits: many exact ties, some at the boundaries
    x = (torch.randn(40, 300, generator=g) * 2).bfloat16().float()
    x[3, :50] = x[3, 0]  # a tie group large enough to hold the top-k and the top-p boundary
    x[4, 7] = float("-inf")  # a banned column
    ks = torch.randint(1, 300, (40,), generator=g)
    ps = torch.rand(40, generator=g).clamp_min(0.05)
    ks[::5], ps[1::5] = 300, 1.0  # top-p only / top-k only rows
    thr = filter_thresholds(x, ks, ps)
    for r in range(40):
        assert thr[r].item() == _brute_thresholds(x[r], int(ks[r]), float(ps[r])), r
    free = filter_thresholds(x[:2], torch.full((2,), 300), torch.ones(2))
    assert free.tolist() == [float("-inf")] * 2
    # a tie at the k-th value keeps all of it: top-k 2 of [3, 1, 1, 0] keeps three tokens
    tied = filter_thresholds(_row([3.0, 1.0, 1.0, 0.0]), torch.tensor([2]), torch.ones(1))
    assert tied.item() == 1.0


def test_top_p_draws_follow_the_renormalised_nucleus_among_many_tokens():
    """Rows long enough that the nucleus holds hundreds of tokens: the draws stay inside it and
    follow the renormalised distribution (binned by rank), log-probs unfiltered."""
    logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(12)) * 2
    n = 6000
    rows = logits.expand(n, -1)
    temp, k, p = torch.full((n,), 0.9), torch.full((n,), -1), torch.full((n,), 0.8)
    tok, lp = sample(rows, temp, k, p, torch.Generator().manual_seed(13))
    x = logits[0] / 0.9
    thr = filter_thresholds(x[None], torch.tensor([2000]), torch.tensor([0.8]))[0]
    kept = x >= thr
    assert kept[tok].all() and 50 < int(kept.sum()) < 2000
    want = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
    order = want.argsort(descending=True)
    bins = torch.zeros(2000, dtype=torch.long)
    bins[order] = torch.arange(2000) * 8 // int(kept.sum())  # 8 bins by rank inside the nucleus
    got = torch.bincount(bins[tok], minlength=9)[:8].float() / n
    exp = torch.zeros(9).index_add_(0, bins.clamp(max=8), want)[:8]
    assert torch.allclose(got, exp, atol=4 * (exp * (1 - exp) / n).sqrt().max().item())
    torch.testing.assert_close(lp, torch.log_softmax(x, -1)[tok])


def test_thresholds_hold_takes_the_sorts_boundary_and_refuses_its_neighbours():
    """The check the GPU kernels are held to: the rule's thresholds pass it; the next value
    above or below a boundary fails, as does a value not in the row."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(30, 500, generator=g) * 3
    k = torch.randint(1, 500, (30,), generator=g)
    k[::3] = 500
    p = torch.rand(30, generator=g).clamp(0.05, 0.99)
    p[1::3] = 1.0
    thr = filter_thresholds(x, k, p)
    assert thresholds_hold(x, thr, k, p).all()
    s = x.sort(-1, descending=True).values
    rank = (s >= thr[:, None]).sum(-1) - 1  # the boundary's rank
    for step in (-1, 1):  # the value just above / just below the boundary
        r = (rank + step).clamp(0, 499)
        moved = s.gather(1, r[:, None])[:, 0]
        changed = moved != thr
        assert not thresholds_hold(x, moved, k, p)[changed].any()
    assert not thresholds_hold(x, thr + 1e-3, k, p)[~torch.isneginf(thr)].any()


def test_the_threshold_kernel_refuses_a_pivot_count_that_is_not_a_power_of_two():
    """Checked before any kernel runs (so on a machine without Triton too)."""
    from slime_async.actors.engine.embedded import pick_kernels

    x, k, p = torch.zeros(1, 8), torch.full((1,), 8), torch.full((1,), 0.5)
    for bad in (1, 6, 0):
        with pytest.raises(ValueError, match="power of 2"):
            pick_kernels.thresholds(x, torch.ones(1), k, p, pivots=bad)


@pytest.mark.parametrize(
    "top_k, top_p, both",
    [
        ([3, 300, 300], [1.0, 0.9, 0.5], False),  # top-k on one row, top-p on others
        ([3, 300, 50], [1.0, 0.9, 0.5], True),  # a row with both
        ([0, 300, 300], [1.0, 0.9, 1.0], False),  # top_k 0 (no limit)
    ],
)
def test_sample_tells_the_filtered_draw_whether_a_row_has_both_filters(top_k, top_p, both):
    """The kernels search for top-p among the top-k again only when told a row has both
    (`two_stage`, decided on the host from the rows' parameters: no device sync)."""
    from slime_async.actors.engine.embedded.sampling import Picks, filtered_pick

    seen = []

    def spy(*args):
        seen.append(args[-1])
        return filtered_pick(*args)

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    tok, _ = sample(
        logits,
        torch.ones(3),
        torch.tensor(top_k),
        torch.tensor(top_p),
        torch.Generator().manual_seed(1),
        picks=Picks(filtered=spy),
    )
    assert seen == [both] and tok.shape == (3,)
