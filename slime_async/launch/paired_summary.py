"""The sweep summary's paired section: every point against the reference, seed by seed, per lag.

`paired_summary` turns the summary's runs into one row per point (the per-seed differences of
its final evaluation to the reference's, in points; `paired.py` for the statistics) plus, per
lag, which point comes closest to the reference (the smallest TOST p-value); `paired_table` is
its Markdown. A verdict is only what the interval supports: "equivalent within +-m" (TOST at
5%), "worse" / "better" (the 95% interval excludes 0), else "inconclusive".
"""

from __future__ import annotations

import statistics
from typing import Any

from slime_async.launch.paired import paired

INTERVALS = (
    "95% CI of the mean paired difference over seeds: paired t, and bootstrap percentile "
    "(10,000 resamples of the seeds); TOST at the margin with two one-sided t tests at 5%"
)


def _lag(point: Any) -> int | None:
    value = dict(point.items).get("buffer.fixed_lag")
    return int(value) if value is not None and str(value).isdigit() else None


def verdict(row: dict[str, Any]) -> str:
    if row["n"] < 2:
        return "too few seeds"
    if row["equivalent"]:
        return f"equivalent within ±{row['margin']:g}"
    if row["ci_high"] < 0:
        return "worse"
    if row["ci_low"] > 0:
        return "better"
    return "inconclusive"


def paired_summary(
    points: list[Any],
    runs: list[dict[str, Any]],
    reference: Any,
    metric: str,
    margin: float | None,
) -> dict[str, Any]:
    """Per point: the paired comparison of its final `metric` with the reference's (points)."""
    final = {
        (r["point"], r["seed"]): 100.0 * r["eval_final"]
        for r in runs
        if r.get("eval_final") is not None
    }
    ref_seeds = sorted(s for (p, s) in final if p == reference.name)
    rows = []
    for point in points:
        if point.name == reference.name:
            continue
        seeds = [s for s in ref_seeds if (point.name, s) in final]
        diffs = [final[(point.name, s)] - final[(reference.name, s)] for s in seeds]
        row = {
            "point": point.name,
            "overrides": point.overrides,
            "lag": _lag(point),
            **paired(diffs, seeds, margin).as_dict(),
        }
        row["verdict"] = verdict(row)
        rows.append(row)
    by_lag: dict[str, Any] = {}
    for lag in sorted({r["lag"] for r in rows if r["lag"] is not None}):
        mine = [r for r in rows if r["lag"] == lag and r["tost_p"] is not None]
        if mine:
            best = min(mine, key=lambda r: r["tost_p"])
            by_lag[str(lag)] = {
                "closest": best["point"],
                "tost_p": best["tost_p"],
                "equivalent": [r["point"] for r in mine if r["equivalent"]],
            }
    ref_values = [final[(reference.name, s)] for s in ref_seeds]
    return {
        "reference": reference.name,
        "metric": metric,
        "units": "points (metric x 100)",
        "margin": margin,
        "intervals": INTERVALS,
        "reference_mean": statistics.fmean(ref_values) if ref_values else None,
        "reference_seeds": ref_seeds,
        "rows": rows,
        "by_lag": by_lag,
    }


def _f(x: float | None, spec: str = "+.1f") -> str:
    return "-" if x is None else format(x, spec)


def paired_table(paired_section: dict[str, Any]) -> str:
    """The paired section as Markdown: one row per point, then the closest point per lag."""
    m = paired_section["margin"]
    ref_mean = paired_section.get("reference_mean")
    head = [
        "point",
        "lag",
        "seeds",
        "mean difference",
        "95% CI (t)",
        "95% CI (bootstrap)",
        f"TOST p (±{m:g})" if m is not None else "TOST p",
        "verdict",
        "seeds for ±m",
    ]
    lines = [
        f"Paired differences of final `{paired_section['metric']}` to "
        f"`{paired_section['reference']}` (mean {_f(ref_mean, '.1f')}%, seeds "
        f"{paired_section['reference_seeds']}), in points. {paired_section['intervals']}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for r in paired_section["rows"]:
        need = "-"
        if r.get("seeds_to_resolve") is not None:
            need = f"{r['seeds_to_resolve']} / {r['seeds_for_equivalence']}"
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{r['point']}`",
                    "-" if r["lag"] is None else str(r["lag"]),
                    str(r["n"]),
                    _f(r["mean"]) + ("" if r["sd"] is None else f" (sd {r['sd']:.1f})"),
                    f"[{_f(r['ci_low'])}, {_f(r['ci_high'])}]",
                    f"[{_f(r['boot_low'])}, {_f(r['boot_high'])}]",
                    _f(r["tost_p"], ".3f"),
                    r["verdict"],
                    need,
                ]
            )
            + " |"
        )
    if paired_section["by_lag"]:
        lines.append("")
        lines.append(
            "Seeds for ±m: to resolve a difference of m (80% power, two-sided 5%) / to show "
            "equivalence within ±m when the true difference is 0 (80% power), at each row's sd."
        )
        for lag, b in paired_section["by_lag"].items():
            eq = ", ".join(f"`{p}`" for p in b["equivalent"]) or "none"
            lines.append(
                f"- lag {lag}: equivalent to the reference: {eq}; closest: `{b['closest']}` "
                f"(TOST p = {b['tost_p']:.3f})"
            )
    return "\n".join(lines)
