"""`slime-async inspect` from the log's index and the learner's token records: the step table
with each step's gradient norm, per-token advantage / learner log-prob / ratio / gradient, and
`--top-grad` / `--top-ratio` finding the tokens behind a gradient spike.

The index itself: tests/unit/queue/test_wal_index.py; the records the learner writes:
tests/unit/learner/test_token_record.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import numpy as np
import pytest

from slime_async.actors.learner import token_record
from slime_async.cli import main as cli_main
from slime_async.config import SlimeConfig
from slime_async.metrics import GRAD_NORM, MetricsLogger
from slime_async.models.toy import make_tiny_model
from slime_async.queue import wal_index
from slime_async.testing.wal_runs import write_run_wal
from slime_async.utils.procs import python_module
from tests.support.repo import REPO

SPIKE_STEP, SPIKE_POS = 4, 3


def inspect(run_dir, *args):
    """The command in this process (what `slime-async inspect` runs), its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["inspect", str(run_dir), *args])
    assert code == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory: config, a 6-step log, grad norms with a spike at step 4, and token
    records whose step-4 record has one token of huge gradient and ratio."""
    root = tmp_path_factory.mktemp("inspect")
    model = make_tiny_model(root / "model", "qwen3")
    run_dir = root / "run"
    (run_dir / "logs").mkdir(parents=True)
    cfg = SlimeConfig.model_validate(
        {
            "run": {"run_dir": str(run_dir)},
            "buffer": {"wal_dir": "wal"},
            "generator": {"tokenizer_path": str(model)},
        }
    )
    cfg.write_json(run_dir / "config.json")
    wal_dir = write_run_wal(run_dir / "wal", steps=6, groups_per_step=2, group_size=2)
    with MetricsLogger(run_dir, "learner") as m:
        for s in range(1, 7):
            m.log(s, {GRAD_NORM: 1.0e4 if s == SPIKE_STEP else 1.0 + s / 10})
    index = wal_index.load_index(wal_dir)
    spike = None
    for s, info in index.steps.items():
        groups = wal_index.read_groups(wal_dir, index, info.group_ids)
        trajs = [t for g in info.group_ids for t in groups[g]]
        values = []
        for t in trajs:
            mask = t.loss_mask.astype(np.float32)
            v = {
                "behavior_logp": t.logprobs.astype(np.float32),
                "prox_logp": (t.logprobs - 0.01).astype(np.float32),
                "logp": (t.logprobs - 0.02).astype(np.float32),
                "advantage": np.full(len(mask), 0.5, np.float32) * mask,
                "grad": (-1e-3 * mask).astype(np.float32),
                "loss_mask": t.loss_mask.astype(np.uint8),
            }
            values.append(v)
        if s == SPIKE_STEP:
            spike = trajs[1]
            values[1]["grad"][SPIKE_POS] = -50.0
            values[1]["logp"][SPIKE_POS] = -9.0
        rec = {
            "ids": np.asarray([t.id for t in trajs], dtype=str),
            "offsets": np.concatenate([[0], np.cumsum([len(v["logp"]) for v in values])]),
            "grad_norms": np.asarray([1.0], np.float32),
            **{k: np.concatenate([v[k] for v in values]) for k in values[0]},
        }
        token_record.write(run_dir, s, s, rec, keep=0)
    return run_dir, spike


def test_table_shows_each_steps_grad_norm_and_points_at_the_spike(run):
    run_dir, _ = run
    out = inspect(run_dir)
    assert "grad norm" in out.splitlines()[1]
    assert f"largest grad norm: 1e+04 at step {SPIKE_STEP}" in out
    rows = json.loads(inspect(run_dir, "--json"))["steps"]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[SPIKE_STEP - 1]["grad_norm"] == 1.0e4
    assert all(r["trajectories"] == 4 and r["groups"] == 2 for r in rows)


def test_top_grad_and_top_ratio_find_the_spikes_token(run):
    run_dir, spike = run
    for view in ("--top-grad", "--top-ratio"):
        got = json.loads(inspect(run_dir, view, "3", "--json"))["tokens"]
        assert len(got) == 3
        first = got[0]
        assert (first["step"], first["trajectory"], first["pos"]) == (
            SPIKE_STEP,
            spike.id,
            SPIKE_POS,
        )
        assert first["step_grad_norm"] == 1.0e4
        assert first["token_id"] == int(spike.response_ids[SPIKE_POS])
        assert first["ratio"] == pytest.approx(np.exp(-9.0 - spike.logprobs[SPIKE_POS]), rel=1e-5)
        assert first["learner_logprob"] == -9.0 and first["advantage"] == 0.5
    text = inspect(run_dir, "--step", str(SPIKE_STEP), "--top-grad", "2")
    assert f"top 2 model tokens of step {SPIKE_STEP}" in text and spike.id in text


def test_group_view_shows_learner_values_per_token(run):
    run_dir, spike = run
    rec = json.loads(inspect(run_dir, "--group", spike.group_id, "--json"))
    traj = next(t for t in rec["trajectories"] if t["id"] == spike.id)
    tok = traj["tokens"][SPIKE_POS]
    assert tok["learner_logprob"] == -9.0 and tok["grad"] == -50.0
    assert tok["grad_size"] == pytest.approx(50.0 * (1 - np.exp(-9.0)))
    env = [t for t in traj["tokens"] if not t["loss_mask"]]
    assert env and all(t["ratio"] is None for t in env)
    text = inspect(run_dir, "--group", spike.group_id)
    assert "learner    ratio  advantage  grad size" in text
    step = inspect(run_dir, "--step", str(SPIKE_STEP))
    assert "grad norm 1e+04" in step and "ratio pi/mu max" in step


def test_top_views_name_the_missing_records(tmp_path, run):
    run_dir, _ = run
    bare = tmp_path / "bare"
    (bare / "logs").mkdir(parents=True)
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["run"]["run_dir"] = str(bare)
    (bare / "config.json").write_text(json.dumps(cfg))
    write_run_wal(bare / "wal", steps=2, groups_per_step=2, group_size=2)
    r = subprocess.run(
        python_module("slime_async", "inspect", str(bare), "--top-grad", "5"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2 and "learner.token_record_interval" in r.stderr
