"""`slime-async plot RUN_DIR` draws PNGs from synthetic metrics files written by MetricsLogger;
what the figures show (log axes, smoothing, bold evaluations, sweep intervals): test_figures.py."""

import subprocess
import sys

import matplotlib.image

from slime_async import metrics as m
from slime_async.metrics import MetricsLogger

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, steps=12):
    with MetricsLogger(run_dir, "learner") as learner:
        for step in range(1, steps + 1):
            staleness = [step % 3, 0, 1, min(step, 4)]
            learner.log(
                step,
                {
                    m.REWARD: step / steps,
                    m.ACCURACY: step / (2 * steps),
                    m.STALENESS_HIST: m.int_histogram(staleness),
                    m.STALENESS_MEAN: m.mean(staleness),
                    m.STALENESS_MAX: max(staleness),
                    m.TRAIN_TOKENS_PER_S: 1000.0 + step,
                    m.LEARNER_WAIT_PCT: 10.0,
                    m.LOSS: 1.0 / step,
                    m.GRAD_NORM: 0.5,
                    m.RESPONSE_LEN: 20.0 + step,
                    m.IW_MEAN: 1.0,
                    m.IW_MAX: 1.5,
                    m.PUSH_S: 0.01,
                },
            )
    with MetricsLogger(run_dir, "generator0") as gen:
        for version in range(steps):
            gen.log(version, {m.GEN_TOKENS_PER_S: 500.0 + version, m.GENERATOR_IDLE_PCT: 2.0})


def test_plot_command_writes_four_pngs(tmp_path):
    write_run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "slime_async", "plot", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert names == ["reward.png", "staleness.png", "throughput.png", "training.png"]
    for name in names:
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        h, w, _ = matplotlib.image.imread(path).shape
        assert h >= 300 and w >= 800
    assert out.stdout.split() == [str(tmp_path / "plots" / n) for n in names]


def test_plot_skips_figures_without_data(tmp_path):
    from slime_async.commands.plot import plot_run

    with MetricsLogger(tmp_path, "learner") as learner:
        learner.log(1, {m.REWARD: 0.1})
        learner.log(2, {m.REWARD: 0.2})
    written = plot_run(tmp_path, tmp_path / "figs")
    assert [p.name for p in written] == ["reward.png"]


def test_plot_without_metrics_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "slime_async", "plot", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "no metrics records" in out.stderr and str(tmp_path) in out.stderr


def _write_lag_run(run_dir, lag, steps=6):
    """A learner at a fixed lag with per-lag importance weights, and pinned evaluations."""
    with MetricsLogger(run_dir, "learner") as learner:
        for step in range(1, steps + 1):
            learner.log(
                step,
                {
                    m.STALENESS_HIST: m.int_histogram([lag] * 8),
                    f"{m.IW_MEAN}/lag_{lag}": 1.0 + 0.01 * lag,
                    f"{m.IW_ESS}/lag_{lag}": 1.0 - 0.02 * lag,
                    f"{m.CLIP_FRAC}/lag_{lag}": 0.01 * lag,
                    f"{m.RATIO_OUTSIDE}/lag_{lag}": 0.02 * lag,
                    m.STEP_SECONDS: 1.0,
                },
            )
    with MetricsLogger(run_dir, "eval") as ev:
        for v in range(0, steps + 1, 3):
            ev.log(v, {m.EVAL_ACC_GREEDY: 0.5 + 0.05 * v, m.EVAL_ACC_SAMPLED: 0.3 + 0.05 * v})


def test_plot_overlays_several_runs(tmp_path):
    runs = [tmp_path / "lag0", tmp_path / "lag4"]
    for rd, lag in zip(runs, (0, 4), strict=True):
        _write_lag_run(rd, lag)
    out = tmp_path / "overlay"
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async", "plot", *map(str, runs), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == [
        "eval_accuracy.png",
        "iw_by_lag.png",
        "staleness_hist.png",
        "trust_region_by_lag.png",
    ]
    for name in names:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # One run alone still gets its own figures, now with the evaluation in reward.png.
    from slime_async.commands.plot import plot_run

    assert [p.name for p in plot_run(runs[0], tmp_path / "one")] == ["reward.png", "staleness.png"]


def test_plot_of_a_sweep_directory_takes_its_finished_runs(tmp_path):
    from slime_async.commands.plot import find_runs

    (tmp_path / "sweep.json").write_text("{}")
    for point in ("fixed_lag-0", "fixed_lag-4"):
        _write_lag_run(tmp_path / point / "seed0", int(point[-1]))
        (tmp_path / point / "seed0" / "SWEEP_DONE").write_text("{}")
    _write_lag_run(tmp_path / "fixed_lag-8" / "seed0", 8)  # unfinished: left out
    assert [label for label, _ in find_runs([tmp_path])] == ["fixed_lag-0", "fixed_lag-4"]
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async", "plot", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert names == [
        "eval_accuracy.png",
        "iw_by_lag.png",
        "staleness_hist.png",
        "sweep_final.png",  # a grid: the last evaluation per point
        "trust_region_by_lag.png",
    ]
