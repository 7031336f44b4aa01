"""What `slime-async plot`'s figures show, read from the matplotlib objects they draw: a log axis
for a grad-norm spike, reward apart from accuracy, the evaluation bold, labelled axes, smoothing,
and a sweep (docs/staleness/summary.json, real data) as mean ± interval per point, one panel per
loss, integer lag ticks, one colour per lag. `slime-async plot`'s files: test_plot.py."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest

from slime_async import metrics as m
from slime_async.commands import figures
from slime_async.commands.plot import plot_summary
from slime_async.commands.plot_run import reward_figure, training_figure
from slime_async.commands.plot_sweep import layout_of, runs_from_summary
from tests.support.repo import REPO

SUMMARY = REPO / "docs" / "staleness" / "summary.json"


def _learner(steps: int = 200, spike_at: int = 152) -> list[dict]:
    """A quickstart-shaped learner log: small grad norms and one spike of 10,547."""
    return [
        {
            "step": s,
            "time": 1000.0 + s,
            m.REWARD: 0.3 + 0.002 * s,
            m.ACCURACY: 0.4 + 0.002 * s,
            m.GRAD_NORM: 10_547.0 if s == spike_at else 0.5 + 0.01 * (s % 7),
            m.LOSS: -0.01 + 0.0001 * (s % 5),
        }
        for s in range(1, steps + 1)
    ]


def _evals() -> list[dict]:
    return [
        {"step": v, "time": 1000.0 + v, m.EVAL_ACC_GREEDY: 0.9, m.EVAL_ACC_SAMPLED: 0.45 + v / 500}
        for v in range(0, 201, 50)
    ]


def _axes_titled(fig, title: str):
    return [ax for ax in fig.axes if ax.get_title() == title]


def test_a_grad_norm_spike_gets_a_log_axis_and_a_median(tmp_path):
    fig, name, _ = training_figure(plt, _learner(), {}, 1000.0)
    assert name == "training.png"
    (grad,) = _axes_titled(fig, "grad norm")
    assert grad.get_yscale() == "log"
    assert grad.get_ylabel() == "gradient norm (before clipping) (log scale)"
    raw, smooth = grad.lines
    assert max(raw.get_ydata()) == 10_547.0  # the spike is drawn, at its value
    assert max(smooth.get_ydata()) < 1.0  # and the median does not smear it into a plateau
    assert smooth.get_label() == "grad_norm (median of 10)"
    (loss,) = _axes_titled(fig, "loss")
    assert loss.get_yscale() == "linear" and loss.get_ylabel() == "loss per token"
    for ax in fig.axes:
        assert ax.get_xlabel() == "learner step" and ax.get_ylabel()
    plt.close(fig)


def test_reward_has_its_own_panel_and_the_evaluation_is_bold():
    fig, name, _ = reward_figure(plt, _learner(), {"eval": _evals()}, 1000.0)
    assert name == "reward.png"
    rewards, accuracies = (
        _axes_titled(fig, "reward"),
        _axes_titled(fig, "accuracy: training, and the pinned evaluation (bold)"),
    )
    assert len(rewards) == 2 and len(accuracies) == 2  # against step and against wall time
    for ax in rewards:
        labels = [line.get_label() for line in ax.lines]  # the faint every-step line is unnamed
        assert len(labels) == 2 and [x for x in labels if not x.startswith("_")] == [
            "reward (mean of 10)"
        ]
        assert ax.get_ylabel() == "reward (mean per step)"
    for ax in accuracies:
        by_label = {line.get_label(): line for line in ax.lines}
        assert "training accuracy (mean of 10)" in by_label
        for key in (m.EVAL_ACC_GREEDY, m.EVAL_ACC_SAMPLED):
            line = by_label[key]
            assert line.get_linewidth() >= 2.5 and line.get_marker() == "o"
            assert line.get_zorder() > by_label["training accuracy (mean of 10)"].get_zorder()
        assert ax.get_ylabel() == "accuracy (%)" and ax.get_ylim() == (0, 100)
    assert {ax.get_xlabel() for ax in fig.axes} == {"learner step", "wall time (min)"}
    plt.close(fig)


def test_smoothing_and_interval_rules():
    assert figures.smoothing_window(250) == 12 and figures.smoothing_window(10) == 1
    assert figures.rolling_mean([0, 3, 6, 9], 3) == [1.5, 3.0, 6.0, 7.5]  # shrinks at the ends
    assert figures.rolling_median([1, 1, 1000, 1, 1], 3) == [1, 1, 1, 1, 1]
    assert figures.spans_decades([0.5, 0.6, 10_547.0]) and not figures.spans_decades([0.5, 40])
    assert not figures.spans_decades([-1.0, 1000.0])  # a log axis needs positive values
    mean, half = figures.mean_interval([0.6, 0.65, 0.7])
    assert mean == pytest.approx(0.65)
    assert half == pytest.approx(4.303 * 0.05 / math.sqrt(3), rel=1e-3)  # Student t, 2 df
    assert figures.mean_interval([0.5]) == (0.5, 0.0)


def test_the_sweep_summary_reads_as_one_panel_per_loss_with_lags_in_order(tmp_path):
    runs, metric, target = runs_from_summary(SUMMARY)
    assert metric == m.EVAL_ACC_SAMPLED and target == 0.6 and len(runs) == 63
    lay = layout_of(runs)
    assert lay.x_key == "fixed_lag"
    assert list(lay.panels) == [
        "loss = ppo_clip",
        "loss = tis",
        "loss = decoupled_ppo",
        "loss = mis",
    ]
    colours = lay.colours(runs)
    assert sorted(colours, key=int) == ["0", "1", "2", "4", "8", "16"]
    assert len(set(colours.values())) == 6  # no colour repeats

    written = plot_summary(SUMMARY, tmp_path)
    assert [p.name for p in written] == ["eval_accuracy.png", "sweep_final.png"]


def test_the_sweep_figures_draw_mean_and_interval_per_point(tmp_path, monkeypatch):
    """The objects behind sweep_final.png: per panel one mean ± interval per lag, lag ticks
    evenly spaced and labelled by the integer lag."""
    drawn = {}

    def keep(fig, name):
        drawn[name] = fig

    from slime_async.commands.plot_sweep import plot_sweep

    runs, metric, _ = runs_from_summary(SUMMARY)
    plot_sweep(runs, tmp_path, metric, keep)
    final = drawn["sweep_final.png"]
    top = [ax for ax in final.axes if ax.get_title().startswith("loss = ")]
    assert [ax.get_title() for ax in top] == [
        "loss = ppo_clip",
        "loss = tis",
        "loss = decoupled_ppo",
        "loss = mis",
    ]
    ppo = top[0]
    assert [t.get_text() for t in ppo.get_xticklabels()] == ["0", "1", "2", "4", "8", "16"]
    assert ppo.get_xlabel() == "fixed_lag (versions)" and "%" in ppo.get_ylabel()
    # Each lag: the last evaluation (filled) and the first (hollow grey), each with its bar.
    ppo_points = [
        r for r in runs if r.params["loss"] == "ppo_clip" and r.params["fixed_lag"] == "0"
    ]
    want, half = figures.mean_interval([100 * r.curve[-1][2] for r in ppo_points])
    means = [c for c in ppo.containers]  # errorbar containers, in drawing order
    last_lag0 = means[1]
    assert last_lag0.lines[0].get_ydata()[0] == pytest.approx(want)
    assert half > 0
    curves = drawn["eval_accuracy.png"]
    assert all(ax.get_ylim() == (0, 100) for ax in curves.axes if ax.get_visible())
    for fig in drawn.values():
        plt.close(fig)
