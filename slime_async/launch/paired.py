"""Paired comparisons of sweep points: mean difference to a reference, its interval, and TOST.

The design: every point runs the same seeds, and seed s of every point shares the data order,
the initial weights and the evaluation's sampler seeds (`run.seed` = s seeds them all), so the
difference d_s = x_point,s - x_reference,s removes what seed s does to both. Over the n seeds
that both finished:

    mean d, sd d, se = sd / sqrt(n)
    95% CI (paired t):    mean +- t_{0.975, n-1} se
    95% CI (bootstrap):   2.5% and 97.5% percentiles of the mean of n seeds resampled with
                          replacement (10,000 resamples, fixed generator: the same every time)
    TOST at margin m:     p = max(P(T_{n-1} >= (mean + m) / se), P(T_{n-1} <= (mean - m) / se)),
                          equivalent at 5% when p < 0.05, i.e. when the 90% t interval lies
                          inside (-m, m)

and the seeds a difference of that size needs: n with t_{0.975} + t_{0.8} <= m sqrt(n) / sd
(80% power for a two-sided test at 5%), and, for equivalence when the true difference is 0,
n with t_{0.95} + t_{0.9} <= m sqrt(n) / sd (80% power for TOST).

No scipy here: Student's t distribution comes from the regularised incomplete beta function
(continued fraction), its quantiles by bisection.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on `t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass
class Paired:
    """A point's paired comparison with the reference (differences in the metric's units)."""

    n: int
    mean: float | None
    sd: float | None
    ci_low: float | None
    """95% paired-t interval."""
    ci_high: float | None
    boot_low: float | None
    """95% bootstrap (percentile) interval."""
    boot_high: float | None
    tost_p: float | None
    """TOST p-value at the margin (None: no margin, or fewer than 2 seeds)."""
    equivalent: bool | None
    """tost_p < 0.05: the difference lies within +-margin at 95% confidence."""
    margin: float | None
    seeds_to_resolve: int | None
    """Seeds a difference of `margin` needs (80% power, two-sided 5%), from this sd."""
    seeds_for_equivalence: int | None
    """Seeds TOST at `margin` needs to pass when the true difference is 0 (80% power)."""
    seeds: list[int]

    def as_dict(self) -> dict:
        return asdict(self)


def bootstrap_ci(
    diffs: list[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean of `diffs` resampled with replacement."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    lo = means[math.floor((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, math.ceil((1 + level) / 2 * resamples) - 1)]
    return lo, hi


def seeds_needed(sd: float, margin: float, alpha_side: float, power: float) -> int | None:
    """Smallest n >= 2 with t_{1 - alpha_side, n-1} + t_{power, n-1} <= margin sqrt(n) / sd."""
    if sd <= 0:
        return 2
    for n in range(2, 10_001):
        need = t_quantile(1 - alpha_side, n - 1) + t_quantile(power, n - 1)
        if need <= margin * math.sqrt(n) / sd:
            return n
    return None


def paired(
    diffs: list[float], seeds: list[int], margin: float | None, level: float = 0.95
) -> Paired:
    """The paired comparison of one point from its per-seed differences to the reference."""
    n = len(diffs)
    empty = Paired(n, None, None, None, None, None, None, None, None, margin, None, None, seeds)
    if n == 0:
        return empty
    mean = statistics.fmean(diffs)
    if n == 1:
        empty.mean = mean
        return empty
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    boot = bootstrap_ci(diffs, level)
    tost_p = equivalent = to_resolve = for_equivalence = None
    if margin is not None:
        if se > 0:
            p_low = 1.0 - t_cdf((mean + margin) / se, n - 1)  # H0: d <= -margin
            p_high = t_cdf((mean - margin) / se, n - 1)  # H0: d >= +margin
            tost_p = max(p_low, p_high)
        else:
            tost_p = 0.0 if abs(mean) < margin else 1.0
        equivalent = tost_p < 0.05
        to_resolve = seeds_needed(sd, margin, 0.025, 0.8)
        for_equivalence = seeds_needed(sd, margin, 0.05, 0.9)
    return Paired(
        n,
        mean,
        sd,
        mean - half,
        mean + half,
        boot[0],
        boot[1],
        tost_p,
        equivalent,
        margin,
        to_resolve,
        for_equivalence,
        seeds,
    )
