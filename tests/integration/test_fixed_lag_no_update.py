"""`buffer.fixed_lag` through batches that change nothing, end to end: a real run (buffer,
embedded engine, generator, Megatron-core learner) whose reward is always 0, so no batch has a
gradient and every update is skipped. Each batch must still make a version: the buffer delivers
at version v only the groups generated at v - k, so a learner that kept its version after a
skipped batch waited forever for a batch that was never coming (seen at lag 8 once a policy's
rewards were all 0). `buffer.fixed_lag_timeout_s` bounds that wait now; the run must not need it.
"""

from __future__ import annotations

import re

import pytest

from slime_async.metrics import names as M
from slime_async.metrics import read_metrics
from tests.support.run_config import tiny_run_config
from tests.support.runs import finish, start_run, stop_group, tiny_inputs

STEPS = 5
LAG = 2

pytestmark = pytest.mark.timeout(420)


def test_batches_without_an_update_still_make_the_versions_fixed_lag_waits_for(tmp_path):
    root, model, data = tiny_inputs(tmp_path)
    cfg = tiny_run_config(
        root / "zero.toml",
        model=model,
        data=data,
        run_dir=root / "run",
        buffer={"max_staleness": LAG, "fixed_lag": LAG, "fixed_lag_timeout_s": 60.0},
        generator={"reward": "tests.support.run_config:zero_reward"},
        learner={"num_steps": STEPS, "save_interval": 0},
    )
    proc = start_run(cfg)
    try:
        out = finish(proc, timeout=360)
    finally:
        stop_group(proc)
    learner = read_metrics(root / "run" / "metrics" / "learner.jsonl")
    assert [r["step"] for r in learner] == list(range(1, STEPS + 1)), out[-2000:]
    assert all(r["learner/updates"] == 0 for r in learner)  # nothing was ever applied
    assert [r[M.VERSION] for r in learner] == list(range(1, STEPS + 1))  # yet one version each
    lags = [(r[M.STALENESS_LEARNER_MIN], r[M.STALENESS_LEARNER_MAX]) for r in learner]
    assert lags == [(min(s, LAG), min(s, LAG)) for s in range(STEPS)]
    log = (root / "run" / "logs" / "learner.log").read_text()
    assert "one version a batch: buffer.fixed_lag" in log
    # save_interval = 0 (the default): the run's one checkpoint is its last, logged with its time;
    # no step follows it, so no record carries learner/checkpoint_s.
    assert re.search(rf"checkpoint \S+/step_{STEPS} written in [0-9.]+ s", log), log[-2000:]
    assert log.count(" written in ") == 1
    assert not any(M.CHECKPOINT_S in r for r in learner)
