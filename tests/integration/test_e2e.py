"""The whole pipeline for a few steps on CPU: `slime-async run` with the real buffer, an embedded
engine, the generator and the Megatron-core learner (tiny random model, no learning asserted).

Asserts that weights were pushed, versions advanced at the engines, staleness stayed within the
bound, and nothing was lost: every trajectory the buffer acknowledged was trained on, dropped
with a counted reason, or is still held by the buffer.
"""

import json
import re
import subprocess
import sys

import pytest

import slime_async.metrics.names as M
from slime_async.metrics import read_metrics
from tests.support.repo import REPO
from tests.support.run_config import E2E_MAX_STALENESS as MAX_STALENESS
from tests.support.run_config import E2E_STEPS as STEPS
from tests.support.run_config import e2e_run_config as _config
from tests.support.tensorboard_events import read_scalars


def _versions_follow_updates(records: list[dict]) -> None:
    """One version per batch with an applied update, none for a skipped one; never backwards."""
    previous = records[0]["version"] - (0 if records[0]["learner/batch_skipped"] else 1)
    for r in records:
        assert r["version"] == previous + (0 if r["learner/batch_skipped"] else 1), r
        previous = r["version"]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(root / "model", "qwen3", seed=0)
    data = make_dataset(root / "train.jsonl", 200, seed=0)
    return root, model, data


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_pipeline_runs_pushes_and_loses_nothing(tiny_setup, mode):
    root, model, data = tiny_setup
    cfg = _config(root, model, data, mode)
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async", "run", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    run_dir = root / f"run-{mode}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert [r["step"] for r in learner] == list(range(1, STEPS + 1))
    assert learner[0]["version"] <= 1
    _versions_follow_updates(learner)
    assert learner[-1]["version"] >= STEPS - 1  # rewards vary: (almost) no batch is skipped
    # Weights went to the engine after every step that made a new version ...
    assert all(r["push/seconds"] > 0 for r in learner if not r["learner/batch_skipped"])
    # ... made of several mini-batch updates per batch (PPO's inner loop).
    assert sum(r["learner/updates"] for r in learner) > STEPS
    # ... and the engine served them: the generator saw the advancing versions.
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")
    assert max(r["step"] for r in gen) >= STEPS - 1
    # A healthy engine: no call failed over, none failed for good (both counted in every record).
    assert all(r["gen/engine_failovers"] == 0 and r["gen/engine_errors"] == 0 for r in gen)
    # the producer client's retries are in the generator's records; the buffer was up all run,
    # so no send waited on a full queue
    assert all(r["gen/buffer_send_waits"] == 0 for r in gen), gen[-1]
    assert all(r["gen/buffer_resends"] >= 0 and r["gen/buffer_busy_replies"] >= 0 for r in gen)
    # The staleness bound held end to end (sync mode: 0), on the buffer's clock (the version
    # the engines hold) and on the learner's own (push.interval = 1: the same bound), which does
    # not depend on the buffer's bookkeeping; no token crossed it, so none was kept over it.
    bound = 0 if mode == "sync" else MAX_STALENESS
    assert all(r["staleness/max"] <= bound for r in learner)
    assert all(r["staleness/learner_max"] <= bound for r in learner)
    assert all(r["stale/over_bound_tokens"] == 0 for r in learner)
    # Stale drops are reported (none here: stale_policy "keep" never drops; admission throttled).
    assert all(r["buffer/dropped_stale_groups"] == 0 for r in learner)

    # Nothing lost: acknowledged = trained + dropped (by reason) + still held.
    final = json.loads((run_dir / "buffer_final.json").read_text())
    trained = sum(r["trajectories"] for r in learner)
    assert trained == STEPS * 2 * 4
    assert final["counts"]["committed_trajectories"] == trained
    dropped = sum(final["dropped_trajectories"].values())
    acknowledged = final["counts"]["trajectories_in"]
    assert acknowledged == trained + dropped + final["trajectories_held"], final
    assert set(final["dropped_trajectories"]) <= {"stale", "late_member_of_dropped_group"}
    assert final["dropped_stale"]["policy"] == "keep" and final["dropped_stale"]["groups"] == 0

    # At the defaults on a machine without a visible GPU, every role was forked from the fork
    # server, which ended with the run.
    log = (run_dir / "logs" / "supervisor.log").read_text()
    for role in ("buffer", "engine0", "generator0", "learner"):
        assert re.search(rf"started {role} \(pid \d+, fork, log ", log), log
    assert "was not forked" not in log and "the fork server exited" not in log
    assert json.loads((run_dir / "children.json").read_text()) == {}
    # The engine and learner processes froze their start-up heap out of the garbage collector's
    # sight before serving / training, and the learner's records time its collections.
    for role, context in (("engine0", "engine start-up"), ("learner", "learner rank 0 start-up")):
        role_log = (run_dir / "logs" / f"{role}.log").read_text()
        assert re.search(rf"{context}: \d+ objects frozen out of the garbage collector", role_log)
    assert all(r["learner/gc_s"] >= 0 and r["learner/gc_long"] >= 0 for r in learner)


@pytest.mark.slow
def test_interrupted_run_resumes_without_loss_or_repeat(tiny_setup):
    """Ctrl-C mid-run, then `run --resume`: the learner continues from its last checkpoint, the
    buffer (WAL) hands back the batches trained after it, and every step is trained once more.
    Both halves land in one wandb run (offline) and one TensorBoard directory."""
    import os
    import signal
    import time

    root, model, data = tiny_setup
    cfg = _config(root, model, data, "async")
    total = 12  # the interrupt lands after step 4: eight steps before the run could end
    steps = [
        f"learner.num_steps={total}",
        "learner.save_interval=3",
        f"run.run_dir={root / 'resume'}",
        'run.trackers=["wandb", "tensorboard"]',
        "run.wandb=offline",
    ]
    run_dir = root / "resume"
    console = root / "resume-first.out"
    with console.open("wb") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "slime_async", "run", str(cfg), *steps],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    metrics = run_dir / "metrics" / "learner.jsonl"
    try:
        deadline = time.monotonic() + 240
        checkpoint = run_dir / "checkpoints" / "step_3"  # renamed into place once complete
        while not (checkpoint.is_dir() and len(metrics.read_text().splitlines()) >= 4):
            assert first.poll() is None, "first run ended early:\n" + console.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 3 after 240 s"
            time.sleep(0.1)  # polling the run's files: the readiness signal here
        os.kill(first.pid, signal.SIGINT)
        assert first.wait(120) == 130
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    done_before = len(read_metrics(metrics))
    assert 4 <= done_before < total

    again = subprocess.run(
        [sys.executable, "-m", "slime_async", "run", "--resume", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    learner = read_metrics(metrics)  # a step trained twice keeps its last record
    assert [r["step"] for r in learner] == list(range(1, total + 1))
    # The version never goes back: the resumed learner continues from the newest version the
    # buffer announced (the engines held it, tokens carry it), not from its older checkpoint.
    versions = [r["version"] for r in learner]
    assert versions == sorted(versions), versions
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed at step" in log
    # Each save is logged with its time and carried by the next step's record (saves at 6 and 9
    # of the resumed learner; the last, at 12, in the log only).
    assert re.search(rf"checkpoint \S+/step_{total} written in [0-9.]+ s", log), log[-2000:]
    saved_after = [r["step"] - 1 for r in learner if M.CHECKPOINT_S in r]
    assert set(range(6, total, 3)) <= set(saved_after), saved_after
    assert all(r[M.CHECKPOINT_S] > 0 for r in learner if M.CHECKPOINT_S in r)
    final = json.loads((run_dir / "buffer_final.json").read_text())
    # Every batch up to the last checkpoint committed once; what was trained after it came back.
    assert final["counts"]["committed_trajectories"] >= (total - 3) * 8
    assert final["batches_delivered_uncommitted"] == 0

    # One wandb run: the resumed supervisor continued the first one's run id.
    run_id = json.loads((run_dir / "tracking.json").read_text())["wandb_id"]
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and all(s.name.endswith(f"-{run_id}") for s in segments)
    assert f"wandb run {run_id}" in again.stdout
    # One TensorBoard directory with the learner's and the generator's scalars of both halves,
    # every record forwarded once, on the policy version.
    scalars = read_scalars(run_dir / "tensorboard")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [v for v, _ in scalars["learner/version"]] == [r["version"] for r in lines]
    assert [v for v, _ in scalars["learner/reward"]] == [r["version"] for r in lines]
    gen_lines = [
        json.loads(x) for x in (run_dir / "metrics" / "generator0.jsonl").read_text().splitlines()
    ]
    gen_tb = scalars["generator0/gen/tokens_per_s"]
    assert [v for v, _ in gen_tb] == [
        r["step"] for r in gen_lines if isinstance(r["gen/tokens_per_s"], int | float)
    ]
    assert max(v for v, _ in gen_tb) >= versions[-1] - 2
