"""The sweep's paired plot: each point's mean difference to the reference with its 95% intervals.

`plots/paired_difference.png`: x = the lag (`buffer.fixed_lag`, else the point's position), one
marker series per value of the grid's other keys (the loss), error bars = the paired-t 95%
interval, a thinner bar = the bootstrap one, the equivalence band +-margin shaded. A point whose
interval crosses the band's edge is not shown equivalent, whatever its mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series_name(row: dict[str, Any]) -> str:
    rest = [o for o in row["overrides"] if not o.startswith("buffer.fixed_lag=")]
    return " ".join(o.rsplit(".", 1)[-1] for o in rest) or row["point"]


def plot_paired(summary: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Draw the paired section of a sweep summary; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    section = summary["paired"]
    rows = [r for r in section["rows"] if r["mean"] is not None and r["ci_low"] is not None]
    if not rows:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(_series_name(r), []).append(r)
    xs_all = sorted({r["lag"] for r in rows if r["lag"] is not None})
    position = {lag: i for i, lag in enumerate(xs_all)}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(series), 1)
    for k, (name, mine) in enumerate(sorted(series.items())):
        offset = (k - (len(series) - 1) / 2) * width
        xs = [
            (position[r["lag"]] if r["lag"] is not None else i) + offset for i, r in enumerate(mine)
        ]
        means = [r["mean"] for r in mine]
        t_err = [
            [m - r["ci_low"] for m, r in zip(means, mine, strict=True)],
            [r["ci_high"] - m for m, r in zip(means, mine, strict=True)],
        ]
        b_err = [
            [m - r["boot_low"] for m, r in zip(means, mine, strict=True)],
            [r["boot_high"] - m for m, r in zip(means, mine, strict=True)],
        ]
        bar = ax.errorbar(xs, means, yerr=t_err, fmt="o", capsize=4, label=name)
        ax.errorbar(
            xs, means, yerr=b_err, fmt="none", elinewidth=3, alpha=0.35, color=bar[0].get_color()
        )
    margin = section.get("margin")
    if margin:
        ax.axhspan(-margin, margin, color="green", alpha=0.1, label=f"±{margin:g} points")
    ax.axhline(0.0, color="black", linewidth=0.8)
    if xs_all:
        ax.set_xticks(range(len(xs_all)), [str(x) for x in xs_all])
        ax.set_xlim(-0.6, len(xs_all) - 0.4)
        ax.set_xlabel("lag (buffer.fixed_lag)")
    ax.set_ylabel(f"difference to {section['reference']} (points)")
    ax.set_title(f"final {section['metric']}: paired difference, 95% CI (t; bootstrap shaded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "paired_difference.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
