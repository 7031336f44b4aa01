"""`slime-async sweep`: a grid x seeds of real runs, resumable, with a summary table
and overlaid plots; `slime-async plot` of several runs.

Here: the table's arithmetic on synthetic metrics, the resume rules, and the scheduling of points
(jobs, SIGTERM, the time limit) with stand-in processes instead of runs. The end to end part, the
shared two-point sweep of real runs, is in tests/integration/test_staleness_sweep.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from slime_async.launch.sweep import DONE, Point, Sweep, parse_exclude, parse_grid, run_summary
from slime_async.metrics import MetricsLogger
from slime_async.metrics import names as M


# ------------------------------------------------------------------------------ without runs
def test_grid_points_and_their_directory_names():
    grid = parse_grid(["buffer.fixed_lag=0,8", "algo.loss=ppo_clip,decoupled_ppo"])
    s = Sweep(["a.toml"], grid, seeds=2)
    names = [p.name for p in s.points()]
    assert names == [
        "fixed_lag-0__loss-ppo_clip",
        "fixed_lag-0__loss-decoupled_ppo",
        "fixed_lag-8__loss-ppo_clip",
        "fixed_lag-8__loss-decoupled_ppo",
    ]
    assert all("=" not in n for n in names)  # "=" would read as an override on a command line
    assert Point((("learner.lr", "1e-4"),)).overrides == ["learner.lr=1e-4"]
    with pytest.raises(ValueError, match=r"section\.key=v1,v2"):
        parse_grid(["fixed_lag"])
    with pytest.raises(ValueError, match="same name"):
        Sweep(["a.toml"], parse_grid(["buffer.seed=1", "learner.seed=2"]))


def test_excluded_points_are_left_out():
    """--exclude: at lag 0 every loss is the same objective, so the grid runs one of them."""
    grid = parse_grid(["buffer.fixed_lag=0,8", "algo.loss=ppo_clip,decoupled_ppo,mis"])
    s = Sweep(
        ["a.toml"], grid, exclude=parse_exclude(["buffer.fixed_lag=0 algo.loss=decoupled_ppo,mis"])
    )
    assert [p.name for p in s.points()] == [
        "fixed_lag-0__loss-ppo_clip",
        "fixed_lag-8__loss-ppo_clip",
        "fixed_lag-8__loss-decoupled_ppo",
        "fixed_lag-8__loss-mis",
    ]
    assert s.describe()["exclude"] == [
        [["buffer.fixed_lag", ["0"]], ["algo.loss", ["decoupled_ppo", "mis"]]]
    ]
    with pytest.raises(ValueError, match="not a --grid key"):
        Sweep(["a.toml"], grid, exclude=parse_exclude(["learner.lr=1e-4"]))


def _fake_run(rd, accuracies, tokens=100.0, step_s=1.0):
    with MetricsLogger(rd, "learner") as log:
        for step in range(1, 7):
            log.log(
                step,
                {
                    M.TOKENS: tokens,
                    M.GROUPS_GIVEN: 4.0,
                    M.STEP_SECONDS: step_s,
                    M.IW_MEAN: 1.0,
                    M.IW_ESS: 0.9,
                    M.BUFFER_DROPPED_ALL: 1.0,
                    M.STALENESS_LEARNER_MIN: 2,
                    M.STALENESS_LEARNER_MAX: 2,
                },
            )
    with MetricsLogger(rd, "eval") as log:
        for v, acc in zip((0, 3, 6), accuracies, strict=True):
            log.log(v, {M.EVAL_ACC_GREEDY: acc})


def test_run_summary_time_and_tokens_to_target(tmp_path):
    _fake_run(tmp_path, [0.2, 0.65, 0.7])
    r = run_summary(tmp_path, M.EVAL_ACC_GREEDY, 0.6)
    assert r["eval_first"] == 0.2 and r["eval_final"] == 0.7 and r["eval_final_version"] == 6
    assert r["tokens_to_target"] == 300.0  # reached at version 3: steps 1-3
    assert r["time_to_target_s"] is not None and r["time_to_target_s"] >= 0
    assert r["trained_tokens"] == 600.0
    assert r["dropped_share"] == pytest.approx(1 / 25)
    assert (r["lag_min"], r["lag_max"]) == (2, 2)
    assert run_summary(tmp_path, M.EVAL_ACC_GREEDY, 0.9)["time_to_target_s"] is None
    assert r["iw_truncated"] is None  # neither truncated nor masked weights logged


def test_run_summary_counts_masked_weights_as_cut(tmp_path):
    """mis zeroes the weights outside the bound (is_dropped_frac) instead of clamping them
    (is_truncated_frac): the table's "IW cut at bound" shows either."""
    with MetricsLogger(tmp_path, "learner") as log:
        for step, dropped in ((1, 0.02), (2, 0.04)):
            log.log(step, {M.TOKENS: 10.0, M.IW_MEAN: 0.9, M.IS_DROPPED_FRAC: dropped})
    assert run_summary(tmp_path, M.EVAL_ACC_GREEDY, None)["iw_truncated"] == pytest.approx(0.03)


def test_an_unfinished_point_is_moved_aside_and_run_again(tmp_path, monkeypatch):
    s = Sweep(["a.toml"], parse_grid(["buffer.fixed_lag=0,2"]), out=tmp_path)
    done, unfinished = s.points()
    (s.run_dir(done, 0)).mkdir(parents=True)
    (s.run_dir(done, 0) / DONE).write_text("{}")
    s.run_dir(unfinished, 0).mkdir(parents=True)  # a killed sweep left it
    ran = []

    def fake(point, seed, rd, tag, log):
        ran.append(point.name)
        rd.mkdir(parents=True)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(s, "_launch", fake)
    counts = s.run(log=lambda text: None)
    assert counts == {"ran": 1, "skipped": 1, "failed": 0, "restarted": 1}
    assert ran == ["fixed_lag-2"]
    assert (tmp_path / "fixed_lag-2" / "seed0.failed-1").is_dir()
    assert (s.run_dir(unfinished, 0) / DONE).exists()
    with pytest.raises(ValueError, match="other configs"):
        Sweep(["b.toml"], parse_grid(["buffer.fixed_lag=0"]), out=tmp_path).check_resume()


def test_jobs_run_points_at_once_and_the_summary_keeps_grid_order(tmp_path, monkeypatch):
    """--jobs 3 over four points: three start at once, the fourth when one has ended; the first
    point ends last (it waits for a file written once the sweep has seen the fourth and the second
    end), and the summary still lists the points in grid order."""
    s = Sweep(["a.toml"], parse_grid(["buffer.fixed_lag=0,1,2,4"]), out=tmp_path, jobs=3)
    release = tmp_path / "released"
    all_three = tmp_path / "three-started"  # the first three wait for it: none ends too early

    def wait(path, what):
        return (
            f"import pathlib, time; t = time.time() + 120\n"
            f"while not pathlib.Path({str(path)!r}).exists():\n"
            f"    assert time.time() < t, {what!r}; time.sleep(0.05)"
        )

    code = {
        "fixed_lag-0": wait(release, "the fourth point never ran"),
        "fixed_lag-1": wait(all_three, "the third point never started"),
        "fixed_lag-2": "pass",
        "fixed_lag-4": "pass",
    }
    logged = []

    def log(text):
        logged.append(text)
        ended = " ".join(logged)
        # The first point ends last: released once the fourth and the second have both ended
        # (the second's interpreter may start late on a loaded machine).
        if "fixed_lag-4 seed 0: exit" in ended and "fixed_lag-1 seed 0: exit" in ended:
            release.touch()

    def fake(point, seed, rd, tag, log):
        _fake_run(rd, [0.1, 0.5, 0.9])
        proc = subprocess.Popen([sys.executable, "-c", code[point.name]])
        if point.name == "fixed_lag-2":
            all_three.touch()
        return proc

    monkeypatch.setattr(s, "_launch", fake)
    assert s.run(log=log) == {"ran": 4, "skipped": 0, "failed": 0, "restarted": 0}
    info = {p.name: json.loads((s.run_dir(p, 0) / DONE).read_text()) for p in s.points()}
    first3 = [info[f"fixed_lag-{k}"] for k in (0, 1, 2)]
    assert max(d["started"] for d in first3) <= min(d["finished"] for d in first3)
    assert info["fixed_lag-4"]["started"] >= min(d["finished"] for d in first3)
    ended = [line.split("]")[1].split()[0] for line in logged if ": exit 0 after" in line]
    assert ended[-1] == "fixed_lag-0"  # not in grid order
    summary = s.summarize()
    names = [p.name for p in s.points()]
    assert [r["point"] for r in summary["points"]] == names
    assert [r["point"] for r in summary["runs"]] == names
    assert [r["eval_final"] for r in summary["points"]] == [0.9] * 4
    with pytest.raises(ValueError, match="--jobs"):
        Sweep(["a.toml"], parse_grid(["buffer.fixed_lag=0"]), jobs=0)


def test_sigterm_stops_every_running_point_and_the_sweep(tmp_path, monkeypatch):
    """SIGTERM to a sweep with two points running: both are stopped (their supervisors would stop
    their roles), the third is never started, nothing is marked finished, and the sweep exits
    saying why; the same command resumes it."""
    s = Sweep(["a.toml"], parse_grid(["buffer.fixed_lag=0,1,2"]), out=tmp_path, jobs=2)
    procs = []
    previous = signal.getsignal(signal.SIGTERM)

    def fake(point, seed, rd, tag, log):
        rd.mkdir(parents=True)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        if len(procs) == 2:  # both running: SIGTERM this process (the sweep's handler takes it)
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return procs[-1]

    monkeypatch.setattr(s, "_launch", fake)
    with pytest.raises(SystemExit, match="got SIGTERM"):
        s.run(log=lambda text: None)
    assert len(procs) == 2 and all(p.returncode == -signal.SIGTERM for p in procs)
    assert not list(tmp_path.glob(f"*/*/{DONE}"))
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_time_limit_stops_the_sweep_and_keeps_what_finished(tmp_path, monkeypatch):
    """--time-limit on a lent machine: a point that ends in time counts; points still running
    at the limit are stopped (SIGTERM, left unfinished for a resume) and the rest never start;
    the sweep returns normally so its summary covers the finished point. A second sweep whose
    finished run took longer than the time left starts nothing more."""
    s = Sweep(
        ["a.toml"], parse_grid(["buffer.fixed_lag=0,1,2,4"]), out=tmp_path, jobs=2, time_limit_s=6.0
    )
    procs = {}
    sleep = {"fixed_lag-0": 0.2, "fixed_lag-1": 120, "fixed_lag-2": 120, "fixed_lag-4": 120}

    def fake(point, seed, rd, tag, log):
        if point.name == "fixed_lag-0":
            _fake_run(rd, [0.1, 0.5, 0.9])
        else:
            rd.mkdir(parents=True)
        code = f"import time; time.sleep({sleep[point.name]})"
        procs[point.name] = subprocess.Popen([sys.executable, "-c", code])
        return procs[point.name]

    monkeypatch.setattr(s, "_launch", fake)
    logged = []
    t0 = time.time()
    counts = s.run(log=logged.append)
    assert 6.0 <= time.time() - t0 < 60
    assert counts == {
        "ran": 1,
        "skipped": 0,
        "failed": 0,
        "restarted": 0,
        "stopped": 2,
        "not_started": 1,
    }
    assert sorted(procs) == ["fixed_lag-0", "fixed_lag-1", "fixed_lag-2"]
    assert procs["fixed_lag-1"].returncode == -signal.SIGTERM
    assert any("time limit of 6 s reached" in line for line in logged)
    assert [p.name for p in s.points() if (s.run_dir(p, 0) / DONE).exists()] == ["fixed_lag-0"]
    assert [r["runs"] for r in s.summarize()["points"]] == [1, 0, 0, 0]

    # resumed with a limit shorter than the finished run: the time left cannot hold another one
    s2 = Sweep(
        ["a.toml"], parse_grid(["buffer.fixed_lag=0,1,2,4"]), out=tmp_path / "b", time_limit_s=3.0
    )
    sleep["fixed_lag-0"] = 2.0
    monkeypatch.setattr(s2, "_launch", fake)
    logged.clear()
    counts = s2.run(log=logged.append)
    assert counts["ran"] == 1 and counts["not_started"] == 3 and counts["stopped"] == 0
    assert any("3 point(s) not started" in line for line in logged)
    with pytest.raises(ValueError, match="--time-limit"):
        Sweep(["a.toml"], parse_grid(["buffer.fixed_lag=0"]), time_limit_s=0)
