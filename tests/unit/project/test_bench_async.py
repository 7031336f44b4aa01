"""bench/bench_async.py starts on every shipped single-machine config at its defaults: pinned
evaluation on where the config has held-out data, off (with a note) where it has none."""

import importlib.util

import pytest

from slime_async.config import load_config
from tests.support.repo import REPO

spec = importlib.util.spec_from_file_location("bench_async", REPO / "bench" / "bench_async.py")
bench_async = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_async)

CONFIGS = sorted(
    str(p.relative_to(REPO))
    for p in [*REPO.glob("configs/*.toml"), *REPO.glob("configs/staleness/*.toml")]
)


@pytest.mark.parametrize("config", CONFIGS)
def test_default_eval_interval_is_one_the_config_accepts(config, capsys):
    n = bench_async.eval_interval([config], [], None)
    cfg = load_config([REPO / config], [f"eval.interval={n}"])
    assert (n > 0) == (cfg.eval.data is not None)
    if cfg.eval.data is None:
        assert "no eval.data" in capsys.readouterr().out


def test_an_asked_interval_is_kept():
    assert bench_async.eval_interval(["configs/quickstart.toml"], [], 3) == 3


def test_a_versions_time_is_the_step_that_made_it_not_its_evaluations_end(tmp_path):
    """Evaluation runs beside training: a slow evaluation must not make its version look late."""
    import json
    import os

    from slime_async.metrics import names as m

    (tmp_path / "ready").mkdir()
    (tmp_path / "metrics").mkdir()
    ready = tmp_path / "ready" / "learner"
    ready.touch()
    os.utime(ready, (100.0, 100.0))
    learner = [
        {"step": s, "time": 100.0 + 2 * s, m.VERSION: s, m.REWARD: 0.5, m.LEARNER_WAIT_S: 0.5}
        | {m.TOKENS: 10, m.RESPONSE_LEN: 4, m.RESPONSE_LEN_MAX: 6}
        for s in range(1, 5)
    ]
    evals = [  # each evaluation ends 30 s after its version was made
        {"step": 0, "time": 130.0, m.EVAL_ACC_SAMPLED: 0.5},
        {"step": 2, "time": 134.0, m.EVAL_ACC_SAMPLED: 0.9},
        {"step": 4, "time": 138.0, m.EVAL_ACC_SAMPLED: 0.95},
    ]
    for name, recs in (("learner", learner), ("eval", evals)):
        (tmp_path / "metrics" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )
    s = bench_async.summarize(tmp_path, 10.0)
    assert s["eval_curve"] == [(0, 0.0, 0.5), (2, 4.0, 0.9), (4, 8.0, 0.95)]
    assert s["eval_done_s"] == [30.0, 34.0, 38.0]
    assert s["wall_s"] == 8.0 and s["learner_idle_pct"] == pytest.approx(25.0)


def test_time_to_a_share_of_syncs_gain_when_async_misses_syncs_final_by_noise():
    """Near a ceiling async may never reach sync's last figure; the 90%-of-gain target (from
    sync's first evaluation to its last) still dates both runs."""
    s = {"eval_curve": [(0, 0.0, 0.48), (10, 24.0, 0.968), (20, 44.0, 0.99), (29, 64.0, 0.992)]}
    a = {"eval_curve": [(0, 0.0, 0.484), (10, 19.0, 0.952), (20, 35.0, 0.988), (29, 51.0, 0.989)]}
    t = bench_async.time_to_accuracy(s, a, 0.9)
    assert t["async_s"] is None and "async never reached sync's final accuracy" in t["lines"][2]
    assert t["gain_target"] == pytest.approx(0.48 + 0.9 * (0.992 - 0.48))
    assert (t["gain_sync_s"], t["gain_async_s"]) == (24.0, 19.0)
    assert t["lines"][3].endswith("sync 24 s, async 19 s: 1.26x")
