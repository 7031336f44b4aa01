"""Drawing rules shared by `slime-async plot`'s figures, so every figure reads the same way.

- A per-step series is drawn twice: every step as a thin faint line, and its rolling mean over
  `smoothing_window(n)` steps (about 5% of the run, at least 1, at most 25) as a bold line; the
  legend names the window.
- A quantity whose positive values span two decades or more (a gradient-norm spike over a run of
  small norms) gets a log axis, said in the axis label, and a rolling median instead of the mean:
  a mean smears one spike into a plateau as wide as the window; the raw line keeps the spike.
- Maxima and other integer counts are not smoothed (a mean of maxima is no step's maximum).
- Evaluations are bold lines with large markers, above the training curves.
- Spread across seeds is a 95% Student-t interval of the mean (`mean_interval`); with one seed
  there is none, and the legend says how many seeds each line has.
- Ordered values (lags) take colours along one colour map, the same value the same colour in
  every panel; unordered labels take distinct colours (tab10, or evenly spaced hues past ten).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Two-sided 95% Student-t quantiles by degrees of freedom (1-30); past 30 the normal's 1.96.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

RAW = {"linewidth": 0.8, "alpha": 0.35}
"""How every-step values are drawn under their rolling mean."""
EVAL = {"linewidth": 2.5, "marker": "o", "markersize": 7, "zorder": 5}
"""How evaluations are drawn: bold, above the training curves."""


def smoothing_window(n: int) -> int:
    """Steps of the rolling mean for a series of `n` points (about 5% of them)."""
    return max(1, min(25, n // 20))


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean; the window shrinks at the ends instead of shifting the curve."""
    n, half = len(values), window // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling median, the window shrinking at the ends."""
    import statistics

    n, half = len(values), window // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(n)]


def spans_decades(values: Sequence[float], decades: float = 2.0) -> bool:
    """True when every value is positive and the largest is >= 10**decades times the smallest."""
    if not values or min(values) <= 0:
        return False
    return max(values) / min(values) >= 10**decades


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student-t interval); the half-width is 0 for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return mean, t * sd / math.sqrt(n)


def plot_smoothed(
    ax: Any,
    xs: Sequence[float],
    ys: Sequence[float],
    label: str,
    colour: Any,
    how: str = "mean",
) -> None:
    """Every point thin and faint, its rolling `how` ("mean", "median") bold, in one colour;
    `how="none"`: the points alone, as a step line."""
    w = smoothing_window(len(ys))
    if how == "none":
        ax.step(xs, ys, where="mid", color=colour, linewidth=1.0, label=label)
        return
    if w == 1:
        ax.plot(xs, ys, color=colour, linewidth=1.5, marker=".", label=label)
        return
    smooth = rolling_median(ys, w) if how == "median" else rolling_mean(ys, w)
    ax.plot(xs, ys, color=colour, **RAW)
    ax.plot(xs, smooth, color=colour, linewidth=2, label=f"{label} ({how} of {w})")


def log_if_spread(ax: Any, values: Sequence[float], label: str) -> str:
    """Set a log y axis when `values` span decades; return the axis label to use."""
    if spans_decades(values):
        ax.set_yscale("log")
        return f"{label} (log scale)"
    return label


def ordered_colours(values: Sequence[Any]) -> dict[Any, Any]:
    """One colour per value, along viridis in the values' order (the yellow end left out)."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    vals = list(dict.fromkeys(values))
    span = max(len(vals) - 1, 1)
    return {v: cmap(0.85 * i / span) for i, v in enumerate(vals)}


def distinct_colours(labels: Sequence[str]) -> dict[str, Any]:
    """One distinct colour per label: tab10 up to ten, evenly spaced hues beyond."""
    import matplotlib.pyplot as plt

    labs = list(dict.fromkeys(labels))
    if len(labs) <= 10:
        cmap = plt.get_cmap("tab10")
        return {lab: cmap(i) for i, lab in enumerate(labs)}
    cmap = plt.get_cmap("hsv")
    return {lab: cmap(i / len(labs)) for i, lab in enumerate(labs)}


def integer_ticks(ax: Any, axis: str = "x") -> None:
    """Only integer ticks on `axis` (lags, versions, staleness)."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))
