"""One wandb run and one TensorBoard directory per job, from every role's metrics records, on
the policy version, continued on resume; trackers are imported only when listed.

A whole `slime-async run` and its `--resume` with both trackers: tests/integration/test_e2e.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from slime_async import metrics as m
from slime_async.config import SlimeConfig
from slime_async.metrics import MetricsLogger
from slime_async.metrics.trackers import JobTracker, check_trackers
from tests.support.tensorboard_events import histogram_tags, read_scalars


def write_steps(run_dir, steps, gen_versions):
    with MetricsLogger(run_dir, "learner") as learner:
        for s in steps:
            learner.log(
                s, {m.REWARD: s / 10, m.VERSION: s, m.STALENESS_HIST: m.int_histogram([0, 1, 1])}
            )
    with MetricsLogger(run_dir, "generator0") as gen:
        for v in gen_versions:
            gen.log(v, {m.GEN_TOKENS_PER_S: 100.0 * v})


@pytest.fixture()
def quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_roles_and_a_resume_land_in_one_wandb_run_and_one_tensorboard_dir(tmp_path, quiet_wandb):
    both = ["wandb", "tensorboard"]
    write_steps(tmp_path, [1, 2], [0, 1])
    first = JobTracker(tmp_path, both, wandb_mode="offline", project="p", config={"a": 1})
    assert first.poll() == 4
    assert first.poll() == 0  # nothing new: nothing sent twice
    first.close()
    run_id = json.loads((tmp_path / "tracking.json").read_text())["wandb_id"]

    # The resumed job: the same files grow, a new tracker continues where the first stopped.
    write_steps(tmp_path, [3, 4], [2, 3])
    second = JobTracker(tmp_path, both, wandb_mode="offline", project="p")
    assert second._wandb_run.id == run_id
    second.close()

    segments = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(segments) == 2
    # wandb names a segment offline-run-<time>-<id>, adding -1 when a segment of that second
    # exists already (both segments here start within one second on a fast machine)
    assert all(re.fullmatch(rf"offline-run-\d+_\d+-{run_id}(-\d+)?", s.name) for s in segments)
    assert all((seg / f"run-{run_id}.wandb").is_file() for seg in segments)
    assert json.loads((tmp_path / "tracking.json").read_text())["wandb_step"] == 8

    scalars = read_scalars(tmp_path / "tensorboard")
    # Each record once, on the policy version, whichever process forwarded it.
    # (TensorBoard stores float32.)
    assert scalars["learner/reward"] == [(s, pytest.approx(s / 10)) for s in (1, 2, 3, 4)]
    assert scalars["learner/version"] == [(s, float(s)) for s in (1, 2, 3, 4)]
    gen = scalars[f"generator0/{m.GEN_TOKENS_PER_S}"]
    assert gen == [(v, 100.0 * v) for v in (0, 1, 2, 3)]
    assert histogram_tags(tmp_path / "tensorboard") == {f"learner/{m.STALENESS_HIST}"}


def test_a_torn_last_line_waits_for_the_next_poll(tmp_path):
    (tmp_path / "metrics").mkdir()
    path = tmp_path / "metrics" / "learner.jsonl"
    path.write_text(json.dumps({"step": 1, "time": 1.0, "reward": 0.5}) + "\n" + '{"step": 2, "ti')
    tracker = JobTracker(tmp_path, ["tensorboard"])
    assert tracker.poll() == 1
    with path.open("a") as f:
        f.write('me": 2.0, "reward": 0.7}\n')
    assert tracker.poll() == 1
    tracker.close()
    assert read_scalars(tmp_path / "tensorboard")["learner/reward"] == [
        (1, 0.5),
        (2, pytest.approx(0.7)),
    ]


def test_unlisted_trackers_are_never_imported(tmp_path):
    code = (
        "import sys\n"
        "from slime_async.metrics.trackers import JobTracker\n"
        "from slime_async.metrics import MetricsLogger\n"
        f"log = MetricsLogger({str(tmp_path)!r}, 'gen0'); log.log(1, {{'x': 1.0}}); log.close()\n"
        f"t = JobTracker({str(tmp_path)!r}, ['wandb'], wandb_mode='disabled')\n"
        "assert t.poll() == 0; t.close()\n"
        "print('wandb' in sys.modules, 'torch.utils.tensorboard' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_trackers_are_a_validated_list():
    assert SlimeConfig().run.trackers == ["wandb"]  # the default keeps wandb, offline
    with pytest.raises(ValueError, match="trackers"):
        SlimeConfig.model_validate({"run": {"trackers": ["mlflow"]}})
    with pytest.raises(ValueError, match="name each tracker once"):
        SlimeConfig.model_validate({"run": {"trackers": ["wandb", "wandb"]}})
    check_trackers(["wandb", "tensorboard"])  # both installed here


def test_a_missing_tracker_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'slime_async\[tensorboard\]'"):
        check_trackers(["tensorboard"])


def test_wandb_is_not_required_when_its_mode_is_disabled(monkeypatch):
    """`run.wandb = "disabled"` never imports wandb, so a machine without it may still run with
    the default trackers (seen on a GPU image that has no wandb)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    check_trackers(["wandb"], "disabled")
    with pytest.raises(ValueError, match="pip install wandb"):
        check_trackers(["wandb"], "offline")
