"""TokenStats against the definitions, computed token by token in Python."""

import math
from collections import defaultdict

import pytest
import torch

from slime_async.algos.metrics import TokenStats


def _reference(mask, lag, x, w_pos, seq_x, log_w) -> dict[str, float]:
    """The raw metrics of `count`, `mean`, `weight`, `per_sequence(with_max)` and
    `sequence_weight`, from loops over the tokens and rows."""
    out: dict[str, float] = defaultdict(float)
    present = set()
    B, T = mask.shape
    rows = []
    for b in range(B):
        lags = [int(lag[b, t]) for t in range(T) if mask[b, t]]
        if lags:
            rows.append((b, max(lags)))
        for t in range(T):
            if not mask[b, t]:
                continue
            k = int(lag[b, t])
            present.add(k)
            for key in ("", f"/lag_{k}"):
                out[f"tokens{key}|cnt"] += 1
                out[f"x{key}|sum"] += float(x[b, t])
                out[f"x{key}|n"] += 1
                v = float(w_pos[b, t])
                out[f"w{key}|sum"] += v
                out[f"w{key}|n"] += 1
                out[f"w{key}|sq"] += v * v
                out[f"w{key}|max"] = max(out.get(f"w{key}|max", -math.inf), v)
    for b, k in rows:
        w = math.exp(min(max(float(log_w[b]), -300.0), 300.0))
        for key in ("", f"/lag_{k}"):
            s = float(seq_x[b])
            out[f"s{key}|sum"] += s
            out[f"s{key}|n"] += 1
            out[f"s{key}|max"] = max(out.get(f"s{key}|max", -math.inf), s)
            out[f"q{key}|sum"] += w
            out[f"q{key}|n"] += 1
            out[f"q{key}|sq"] += w * w
    for k in present:  # a bucket with tokens but no row of its lag: zero sums, a max of 0
        for key in ("s/lag_{}|sum", "s/lag_{}|n", "s/lag_{}|max", "q/lag_{}|sum", "q/lag_{}|n"):
            out[key.format(k)] += 0.0
        out[f"q/lag_{k}|sq"] += 0.0
    if not present:  # totals of nothing are reported as zeros; maxima of nothing are left out
        for key in ("tokens|cnt", "x|sum", "x|n", "w|sum", "w|n", "w|sq", "s|sum", "s|n"):
            out[key] = 0.0
        out.update({"q|sum": 0.0, "q|n": 0.0, "q|sq": 0.0})
    return dict(out)


def _stats(mask, lag, x, w_pos, seq_x, log_w) -> dict[str, float]:
    st = TokenStats(mask, lag)
    st.count()
    st.mean("x", x)
    st.weight("w", w_pos)
    st.per_sequence("s", seq_x, with_max=True)
    st.sequence_weight("q", log_w)
    return st.raw()


@pytest.mark.parametrize("seed", range(6))
def test_token_stats_equal_the_definitions(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 9
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[1] = False  # a row without tokens counts in no per-sequence statistic
    lag = torch.randint(0, 4, (B, T), generator=g)
    lag[lag == 1] = 2  # a lag bucket without tokens is left out
    x = torch.randn(B, T, generator=g)
    w_pos = torch.rand(B, T, generator=g) * 3
    seq_x = torch.randn(B, generator=g)
    log_w = torch.randn(B, generator=g) * 400  # beyond the clamp at +-300
    got = _stats(mask, lag, x, w_pos, seq_x, log_w)
    want = _reference(mask, lag, x, w_pos, seq_x, log_w)
    assert set(got) == set(want)
    assert not any("lag_1" in k for k in got)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_token_stats_of_an_empty_mask_report_zero_totals_and_no_buckets():
    B, T = 3, 4
    mask = torch.zeros(B, T, dtype=torch.bool)
    lag = torch.zeros(B, T, dtype=torch.long)
    args = (mask, lag, torch.ones(B, T), torch.ones(B, T), torch.ones(B), torch.zeros(B))
    got = _stats(*args)
    assert got == _reference(*args)
    assert not any("lag_" in k or "|max" in k for k in got)


def test_token_stats_of_no_tokens_at_all():
    mask = torch.zeros(2, 0, dtype=torch.bool)
    st = TokenStats(mask, torch.zeros(2, 0, dtype=torch.long))
    st.count()
    assert st.raw() == {"tokens|cnt": 0.0}


def test_a_lag_ahead_of_the_learner_is_refused_and_unmasked_ones_are_ignored():
    mask = torch.tensor([[True, False]])
    with pytest.raises(ValueError, match=r"ahead of the learner's current_version \(lag -1\)"):
        TokenStats(mask, torch.tensor([[-1, 0]]))
    TokenStats(mask, torch.tensor([[0, -5]]))  # the masked-out token's lag does not matter
