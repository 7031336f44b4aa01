"""The shared two-point sweep of tests/support/staleness_runs.py, end to end: `slime-async sweep
--jobs 2` over `buffer.fixed_lag = 0, 2` (one seed, a few steps, both runs at once), each point a
complete `slime-async run` (real buffer, embedded engine, generator, Megatron-core learner).

- The sweep writes its summary table and plots, and a resumed sweep skips the finished points.
- `buffer.fixed_lag = k`: every batch was trained exactly k versions after the policy that
  generated it, read from the learner's records: `staleness/learner_min` and
  `staleness/learner_max` are the learner's own version before the step minus the newest and the
  oldest per-token version (the engines' weight_versions spans) of what it trained on.
- Pinned evaluation: every evaluation ran on one policy version, and the learner pushed version
  v + 1 only after the evaluation of v had finished (its hold, from the files' times).

The unit tests of each piece: tests/unit/launch/test_sweep.py, tests/unit/queue/test_fixed_lag.py,
tests/unit/generator/test_eval.py.
"""

from __future__ import annotations

import json

import pytest

from slime_async.launch.sweep import DONE
from slime_async.metrics import names as M
from slime_async.metrics import read_metrics
from slime_async.utils.eval_pin import read_result
from tests.support.staleness_runs import (
    EVAL_INTERVAL,
    LAGS,
    STEPS,
    TIMEOUT_S,
    run_dir,
    run_group,
    shared_sweep,
)

PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(TIMEOUT_S)  # the shared sweep's runs, under load


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = shared_sweep(tmp_path_factory)
    proc = out["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def sweep_dir(sweep):
    return sweep["out"]


def test_a_two_point_sweep_writes_its_table_and_plots(sweep):
    out = sweep["out"]
    for k in LAGS:
        assert (run_dir(out, k) / DONE).exists()
        assert (run_dir(out, k) / "metrics" / "learner.jsonl").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [p["point"] for p in summary["points"]] == [f"fixed_lag-{k}" for k in LAGS]
    for row, k in zip(summary["points"], LAGS, strict=True):
        assert row["runs"] == 1 and row["seeds"] == 1
        assert row["eval_final"] is not None and row["eval_final_sd"] == 0.0
        assert row["tokens_per_s"] > 0 and row["iw_mean"] > 0 and 0 < row["iw_ess"] <= 1.0001
        assert row["dropped_share"] == 0.0
        assert (row["lag_min"], row["lag_max"]) == (0, k)
        assert row["reached_target"] == 1  # target 0.0: reached at the first evaluation
        assert row["time_to_target_s"] >= 0 and row["tokens_to_target"] == 0  # at version 0
    # --jobs 2: the two runs (own supervisor, ports, run directory) overlapped in time
    done = [json.loads((run_dir(out, k) / DONE).read_text()) for k in LAGS]
    assert max(d["started"] for d in done) < min(d["finished"] for d in done)
    table = (out / "summary.md").read_text()
    assert table.startswith("| point | runs | final eval/accuracy_greedy (%)")
    assert "`fixed_lag-2`" in table and "| 0-2 |" in table
    for name in ("eval_accuracy.png", "staleness_hist.png", "iw_by_lag.png"):
        assert (out / "plots" / name).read_bytes()[:8] == PNG


def test_a_resumed_sweep_skips_the_finished_points(sweep):
    out = sweep["out"]
    before = {k: (run_dir(out, k) / DONE).stat().st_mtime for k in LAGS}
    proc = run_group(sweep["argv"], 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("finished before, skipped") == len(LAGS)
    assert "'ran': 0, 'skipped': 2" in proc.stdout
    assert {k: (run_dir(out, k) / DONE).stat().st_mtime for k in LAGS} == before


# ------------------------------------------------------------------------------ buffer.fixed_lag
@pytest.mark.parametrize("k", LAGS)
def test_the_learner_trained_every_batch_exactly_k_versions_late(sweep_dir, k):
    learner = read_metrics(run_dir(sweep_dir, k) / "metrics" / "learner.jsonl")
    assert [r["step"] for r in learner] == list(range(1, STEPS + 1))
    lags = [(r[M.STALENESS_LEARNER_MIN], r[M.STALENESS_LEARNER_MAX]) for r in learner]
    # The first k steps ramp 0, 1, ..., k-1 (there is no policy older than the first); then k.
    assert lags == [(min(s, k), min(s, k)) for s in range(STEPS)]
    assert all(r[M.BUFFER_DROPPED_ALL] == 0 for r in learner)
    # Generation never ran ahead of the lag: the buffer granted one batch per version.
    final = json.loads((run_dir(sweep_dir, k) / "buffer_final.json").read_text())
    assert final["fixed_lag"]["k"] == k
    assert final["counts"]["granted"] <= (k + 1 + STEPS) * 2


# ------------------------------------------------------------------------------ pinned evaluation
@pytest.mark.parametrize("k", LAGS)
def test_each_evaluation_ran_on_one_version_while_the_learner_held_its_push(sweep_dir, k):
    rd = run_dir(sweep_dir, k)
    evals = read_metrics(rd / "metrics" / "eval.jsonl")
    due = sorted({*range(0, STEPS + 1, EVAL_INTERVAL), STEPS})
    assert [r["step"] for r in evals] == due  # versions 0, 2, 4 and the last one
    for r in evals:
        assert r[M.EVAL_VERSION] == r["step"]
        assert r[M.EVAL_DISCARDED] == 0 and r[M.EVAL_RERUNS] == 0
        assert 0.0 <= r[M.EVAL_ACC_GREEDY] <= 1.0 and 0.0 <= r[M.EVAL_ACC_SAMPLED] <= 1.0
        assert read_result(rd, r["step"])["status"] == "done"
    # The pin: the learner logs step v + 1 after pushing version v + 1, which it did only once
    # the evaluation of version v had its result.
    learner = {r["step"]: r for r in read_metrics(rd / "metrics" / "learner.jsonl")}
    for v in due[:-1]:
        done_at = (rd / "eval" / f"result_v{v}.json").stat().st_mtime
        assert done_at <= learner[v + 1]["time"], (v, done_at, learner[v + 1]["time"])
        assert learner[v + 1][M.EVAL_VERSION] == v  # the result rode on that step's record
