"""Metrics records -> JSONL, reducers, idle accounting, the progress display (the trackers:
test_trackers.py)."""

import io
import json
import math

import pytest

from slime_async import metrics as m
from slime_async.launch.progress import ProgressDisplay, summary_text
from slime_async.metrics import IdleMeter, MetricsLogger, MetricsTail, Stopwatch


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_log_writes_one_json_line_per_step(tmp_path):
    with MetricsLogger(tmp_path, "learner") as log:
        log.log(1, {m.REWARD: 0.5, m.STALENESS_HIST: m.int_histogram([0, 1, 1, 3]), "ok": True})
        log.log(2, {m.LOSS: float("nan"), m.GRAD_NORM: 2})
    lines = (tmp_path / "metrics" / "learner.jsonl").read_text().splitlines()
    first, second = (json.loads(x) for x in lines)
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert first[m.REWARD] == 0.5 and first["ok"] == 1
    assert first[m.STALENESS_HIST] == {"values": [0, 1, 3], "counts": [1, 2, 1]}
    assert second[m.LOSS] is None  # NaN kept as an event, written as valid JSON
    assert second[m.GRAD_NORM] == 2


def test_log_appends_across_loggers_and_read_keeps_last_of_a_step(tmp_path):
    with MetricsLogger(tmp_path, "learner") as log:
        log.log(1, {m.REWARD: 0.1})
        log.log(2, {m.REWARD: 0.2})
    with MetricsLogger(tmp_path, "learner") as log:  # a resumed run
        log.log(2, {m.REWARD: 0.25})
        log.log(3, {m.REWARD: 0.3})
    recs = m.read_metrics(m.metrics_path(tmp_path, "learner"))
    assert [(r["step"], r[m.REWARD]) for r in recs] == [(1, 0.1), (2, 0.25), (3, 0.3)]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"loss": "high"}, "metric 'loss': expected a number"),
        ({"step": 3}, "metric 'step': the logger sets it"),
        ({"h": {"values": [1, 2], "counts": [1]}}, "metric 'h': histogram has 2 values, 1 counts"),
        ({"h": {"edges": [0, 1], "counts": [1, 2]}}, "metric 'h': histogram needs len"),
        ({"h": {"counts": [1]}}, "metric 'h': a histogram dict needs"),
    ],
)
def test_bad_values_are_named(tmp_path, record, match):
    with MetricsLogger(tmp_path, "learner") as log:
        with pytest.raises(ValueError, match=match):
            log.log(1, record)
        log.log(2, {"fine": 1.0})
    # Nothing half-written for the rejected record.
    assert [r["step"] for r in m.read_metrics(log.path)] == [2]


def test_role_name_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"metrics role '\.\./x'"):
        MetricsLogger(tmp_path, "../x")


def test_reducers():
    assert m.mean([1, 2, 3]) == 2 and math.isnan(m.mean([]))
    assert m.summarize("len", [3, 1, 2]) == {"len/mean": 2.0, "len/min": 1.0, "len/max": 3.0}
    assert all(math.isnan(v) for v in m.summarize("len", []).values())
    h = m.histogram([0.0, 0.1, 0.5, 1.0, 5.0], bins=2, lo=0.0, hi=1.0)
    assert h == {"edges": [0.0, 0.5, 1.0], "counts": [2, 2]}  # 5.0 is outside [0, 1]
    merged = m.merge_int_histograms([m.int_histogram([0, 1]), m.int_histogram([1, 4, 4])])
    assert merged == {"values": [0, 1, 4], "counts": [1, 2, 2]}


def test_stopwatch_sums_sections_until_taken():
    clock = FakeClock()
    sw = Stopwatch(clock=clock)
    for dt in (1.0, 2.0):
        with sw("push"):
            clock.t += dt
    with sw("wait"):
        clock.t += 0.5
    assert sw.take() == {"time/push": 3.0, "time/wait": 0.5}
    assert sw.take() == {}


def test_idle_meter_counts_overlapping_waits_once():
    clock = FakeClock()
    idle = IdleMeter(clock=clock)
    clock.t += 2.0  # busy
    with idle.waiting():
        clock.t += 1.0
        with idle.waiting():  # a second coroutine waits at the same time
            clock.t += 1.0
        clock.t += 1.0
    clock.t += 5.0  # busy
    assert idle.take_pct() == pytest.approx(30.0)
    with idle.waiting():  # a wait spanning two windows is split between them
        clock.t += 4.0
        assert idle.take_pct() == pytest.approx(100.0)
        clock.t += 1.0
    clock.t += 1.0
    assert idle.take_pct() == pytest.approx(50.0)


def test_tail_reads_only_finished_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []  # no file yet
    with open(path, "w") as f:
        f.write('{"step": 1}\n{"step": 2')
        f.flush()
        assert tail.read_new() == [{"step": 1}]
        f.write('}\nnot json\n{"step": 3}\n')
        f.flush()
        assert tail.read_new() == [{"step": 2}, {"step": 3}]  # the torn line is skipped
        assert tail.read_new() == []


def test_plain_progress_lines_and_throttle():
    out = io.StringIO()  # not a TTY: auto picks plain lines
    p = ProgressDisplay(total_steps=4, mode="auto", stream=out, min_interval_s=3600)
    assert p.mode == "plain"
    p.update(1, {m.REWARD: 0.25, m.GEN_TOKENS_PER_S: 1234.0, m.STALENESS_MEAN: None})
    p.update(2, {m.ACCURACY: 0.5})  # throttled
    p.message("engine0 restarted")
    p.update(4, {m.TRAIN_TOKENS_PER_S: 56.0})  # the last step always prints
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/4 (25%) | eta ")
    assert "reward 0.250" in lines[0] and "gen 1.2k tok/s" in lines[0]
    assert lines[1] == "engine0 restarted"
    assert lines[2].startswith("step 4/4 (100%)")
    assert "accuracy 0.500" in lines[2] and "train 56 tok/s" in lines[2]
    assert len(lines) == 3


def test_rich_progress_renders_key_numbers():
    out = io.StringIO()
    p = ProgressDisplay(total_steps=10, mode="rich", stream=out)
    p.update(3, {m.REWARD: 0.75})
    p.message("learner is ready")
    p.close()
    text = out.getvalue()
    assert "learner is ready" in text and "reward 0.750" in text and "3/10" in text


def test_summary_text_skips_missing_and_nonfinite():
    assert summary_text({m.REWARD: float("nan"), m.ACCURACY: 1.0}) == "accuracy 1.000"
