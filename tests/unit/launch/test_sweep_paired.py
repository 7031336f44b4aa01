"""The sweep's paired summary: differences to a reference seed by seed, 95% intervals, TOST.

The statistics are checked against values computed by hand (Student's t quantiles from tables,
a paired t interval, a TOST p-value), then the whole summary on synthetic run directories: the
Markdown prints the intervals and the verdict, the plot is drawn, and a reference or margin
that cannot work is refused at once.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from slime_async.launch.paired import bootstrap_ci, paired, seeds_needed, t_cdf, t_quantile
from slime_async.launch.sweep import DONE, Sweep, parse_exclude, parse_grid
from slime_async.metrics import MetricsLogger
from slime_async.metrics import names as M


@pytest.mark.parametrize(
    "p, df, table", [(0.975, 2, 4.303), (0.975, 9, 2.262), (0.95, 4, 2.132), (0.9, 30, 1.310)]
)
def test_t_quantiles_match_the_tables(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, abs=1e-3)
    assert t_cdf(table, df) == pytest.approx(p, abs=1e-4)


def test_paired_interval_and_tost_by_hand():
    diffs = [1.0, -0.5, 2.0, 0.3, 1.2]
    r = paired(diffs, list(range(5)), margin=2.0)
    mean, sd = 0.8, statistics.stdev(diffs)
    se = sd / math.sqrt(5)
    assert r.mean == pytest.approx(mean) and r.sd == pytest.approx(sd, abs=1e-6)
    assert r.ci_low == pytest.approx(mean - 2.776445 * se, abs=1e-5)
    assert r.ci_high == pytest.approx(mean + 2.776445 * se, abs=1e-5)
    # TOST: the upper one-sided test binds, t = (0.8 - 2) / se = -2.836 with 4 df
    assert r.tost_p == pytest.approx(t_cdf((mean - 2.0) / se, 4), abs=1e-9)
    assert r.tost_p == pytest.approx(0.0235, abs=5e-4) and r.equivalent
    assert r.boot_low < mean < r.boot_high
    narrow = paired(diffs, list(range(5)), margin=1.0)
    assert not narrow.equivalent  # the 90% interval [-0.10, 1.70] leaves (-1, 1)


def test_bootstrap_is_reproducible_and_seeds_needed_grows_with_the_spread():
    d = [0.5, -1.0, 2.5, 0.0, 1.5, -0.5]
    assert bootstrap_ci(d) == bootstrap_ci(d)
    assert seeds_needed(1.0, 2.0, 0.025, 0.8) < seeds_needed(4.0, 2.0, 0.025, 0.8)
    # the normal-approximation rule of thumb ((1.96 + 0.84) sd / m)^2 = 31.4 at sd 4, m 2
    assert seeds_needed(4.0, 2.0, 0.025, 0.8) in range(32, 36)


def _run(rd, final, seq_ess=0.05):
    rd.mkdir(parents=True)
    with MetricsLogger(rd, "learner") as log:
        for step in (1, 2):
            log.log(step, {M.TOKENS: 10.0, M.SEQ_IW_ESS: seq_ess, M.LOG_RATIO_M2: 0.01})
    with MetricsLogger(rd, "eval") as log:
        log.log(0, {M.EVAL_ACC_SAMPLED: 0.4})
        log.log(2, {M.EVAL_ACC_SAMPLED: final})
    (rd / DONE).write_text("{}\n")


def _sweep(tmp_path, **kw):
    grid = parse_grid(["buffer.fixed_lag=0,8", "algo.loss=ppo_clip,tis"])
    return Sweep(
        ["a.toml"],
        grid,
        seeds=6,
        out=tmp_path,
        metric=M.EVAL_ACC_SAMPLED,
        exclude=parse_exclude(["buffer.fixed_lag=0 algo.loss=tis"]),
        **kw,
    )


def test_the_summary_prints_paired_intervals_and_the_equivalence_verdict(tmp_path):
    s = _sweep(tmp_path, reference="buffer.fixed_lag=0 algo.loss=ppo_clip", equivalence=2.0)
    base = [0.60, 0.55, 0.70, 0.62, 0.58, 0.66]  # a seed effect of +-8 points, shared
    for seed, b in enumerate(base):
        _run(s.run_dir(s.points()[0], seed), b)
        _run(s.run_dir(s.points()[1], seed), b - 0.10 + 0.01 * (seed % 2))  # clearly worse
        _run(s.run_dir(s.points()[2], seed), b + 0.002 * (seed % 3 - 1))  # within 0.2 points
    out = s.summarize()
    rows = {r["point"]: r for r in out["paired"]["rows"]}
    worse, same = rows["fixed_lag-8__loss-ppo_clip"], rows["fixed_lag-8__loss-tis"]
    assert worse["n"] == 6 and worse["mean"] == pytest.approx(-9.5)
    assert worse["ci_high"] < -2 and worse["verdict"] == "worse"
    assert same["equivalent"] and same["verdict"] == "equivalent within ±2"
    assert abs(same["ci_low"]) < 1 and abs(same["ci_high"]) < 1  # pairing removed the seed effect
    assert out["paired"]["by_lag"]["8"] == {
        "closest": "fixed_lag-8__loss-tis",
        "tost_p": same["tost_p"],
        "equivalent": ["fixed_lag-8__loss-tis"],
    }
    md = (tmp_path / "summary.md").read_text()
    assert "95% CI (t)" in md and "TOST p (±2)" in md and "equivalent within ±2" in md
    assert "lag 8: equivalent to the reference: `fixed_lag-8__loss-tis`" in md
    assert json.loads((tmp_path / "summary.json").read_text())["paired"]["margin"] == 2.0
    assert out["points"][1]["seq_ess"] == pytest.approx(0.05)
    from slime_async.launch.sweep_plot import plot_paired

    (path,) = plot_paired(out, tmp_path / "plots")
    assert path.stat().st_size > 1000


def test_a_reference_must_name_one_point_and_a_margin_needs_a_reference(tmp_path):
    with pytest.raises(ValueError, match="names no single grid point"):
        _sweep(tmp_path, reference="buffer.fixed_lag=4 algo.loss=ppo_clip")
    with pytest.raises(ValueError, match="names no single grid point"):
        _sweep(tmp_path, reference="buffer.fixed_lag=8")  # two points match
    with pytest.raises(ValueError, match="--equivalence needs --reference"):
        _sweep(tmp_path, equivalence=2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        _sweep(tmp_path, reference="fixed_lag-0__loss-ppo_clip", equivalence=0.0)
    assert _sweep(tmp_path, reference="fixed_lag-0__loss-ppo_clip").reference_point().name == (
        "fixed_lag-0__loss-ppo_clip"
    )
