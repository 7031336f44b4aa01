"""Versions that still name one set of weights after a restart, on real `slime-async run`s
(buffer with its WAL, a strict embedded engine, the generator, the Megatron-core learner; tiny
model; `buffer.stale_policy = "keep"`, so nothing beyond the bound is hidden by a drop).

Three ways to lose the learner's last steps: SIGKILL of the supervisor (every role dies) and
`run --resume`; SIGKILL of the learner (the supervisor restarts it); SIGKILL of the learner while
its weight push has the engine paused. After each, the learner continues from a checkpoint older
than the versions the run had used. Checked on the records the run leaves:

- every version names one set of weights: a restarted learner's first version is past every
  version an earlier life used (or is its checkpoint's own, when nothing was left behind);
- the staleness bound means something again: tokens trained beyond `max_staleness` are those of
  batches that hold superseded tokens (groups generated across the restart, counted in
  `stale/superseded_tokens`), not a restarted engine's base model at staleness 15, nor groups of
  the run's line left waiting behind superseded ones;
- nothing lost: acknowledged = trained + dropped (by reason) + held, and every step trained.

The figures of each run (stored, trained, dropped, held; the share of trained tokens beyond the
bound) are written to `figures.json` in its run directory.
"""

import json
import time
import urllib.request
from pathlib import Path

import pytest

from slime_async.launch.run_dir import RunDir
from slime_async.metrics import read_metrics
from slime_async.utils.procs import group_alive
from tests.support.run_config import tiny_run_config
from tests.support.runs import (
    engine_url,
    finish,
    kill_role,
    pid_of,
    raw_records,
    start_run,
    steps_done,
    stop_group,
    wait_for,
)
from tests.support.standins import await_watchdog, supervisor_watchdog

STEPS = 10
SAVE_INTERVAL = 3
MAX_STALENESS = 2
GROUPS_PER_STEP = 2
GROUP_SIZE = 4
KILL_AFTER = 5
"""Records written before the kill: past the checkpoint of step 3, before the one of step 6, so
the dead learner's versions 4..5 (at least) are left behind."""
OVER_BOUND_SHARE = 0.02
"""Most trained tokens beyond the bound in batches that hold no superseded token (a clean run has
about 0.4%: groups granted in time that finished late, kept by the stale policy)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("versions")
    return (
        root,
        make_tiny_model(root / "model", "qwen3", seed=0),
        make_dataset(root / "train.jsonl", 400, seed=0),
    )


def _config(root: Path, model: Path, data: Path, name: str, **push) -> tuple[Path, Path]:
    run_dir = root / name
    cfg = tiny_run_config(
        root / f"{name}.toml",
        model=model,
        data=data,
        run_dir=run_dir,
        buffer={"max_staleness": MAX_STALENESS, "stale_policy": "keep"},
        learner={
            "num_steps": STEPS,
            "groups_per_step": GROUPS_PER_STEP,
            "save_interval": SAVE_INTERVAL,
        },
        generator={"group_size": GROUP_SIZE},
        push={"interval": 1, **push},
    )
    return cfg, run_dir


def _past_checkpoint(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints" / f"step_{SAVE_INTERVAL}"
    return ckpt.is_dir() and steps_done(run_dir) >= KILL_AFTER


def _lives(records: list[dict]) -> list[list[dict]]:
    """The learner's records split by life: a restarted learner starts again at an earlier step."""
    lives: list[list[dict]] = []
    for r in records:
        if not lives or r["step"] <= lives[-1][-1]["step"]:
            lives.append([])
        lives[-1].append(r)
    return lives


def _check_versions(records: list[dict]) -> list[tuple[int, int]]:
    """Each later life starts with a version no earlier life used for other weights; within a
    life versions never go back. Returns (start version, start step) of each life."""
    lives = _lives(records)
    starts = []
    for k, life in enumerate(lives):
        versions = [r["version"] for r in life]
        assert versions == sorted(versions), f"life {k}: versions go back: {versions}"
        first = life[0]
        start = first["version"] - (0 if first["learner/batch_skipped"] else 1)
        starts.append((start, first["step"] - 1))
        if k == 0:
            continue
        earlier = [r for lf in lives[:k] for r in lf]
        same_step = [r["version"] for r in earlier if r["step"] == first["step"] - 1]
        used = max(r["version"] for r in earlier)
        # Either the checkpoint's own version (nothing was left behind) or a fresh one.
        assert start in same_step[-1:] or start > used, (
            f"life {k} starts at step {first['step'] - 1} with version {start}, which the run "
            f"had used up to {used} for other weights (that step's version was {same_step})"
        )
    return starts


def _figures(run_dir: Path) -> dict:
    """What the run stored, trained, dropped and holds, and the share of trained tokens beyond
    the bound (the surviving record of each step: the steps the final weights descend from)."""
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    final = json.loads((run_dir / "buffer_final.json").read_text())
    tokens = sum(r["tokens"] for r in learner)
    over = sum(r.get("stale/over_bound_tokens", 0) for r in learner)
    superseded = sum(r.get("stale/superseded_tokens", 0) for r in learner)
    # Batches with groups made across the restart: their fresh tokens waited for the restart too.
    across = [r for r in learner if r.get("stale/superseded_tokens", 0) > 0]
    over_elsewhere = sum(r.get("stale/over_bound_tokens", 0) for r in learner if r not in across)
    counts = final["counts"]
    fig = {
        "trajectories_stored": counts["trajectories_in"],
        "trajectories_trained": counts["committed_trajectories"],
        "trajectories_dropped": final["dropped_trajectories"],
        "trajectories_held": final["trajectories_held"],
        "groups_trained": counts.get("committed_groups", 0),
        "groups_dropped": final["dropped"],
        "groups_held": final["groups_pending"] + final["groups_ready"],
        "tokens_trained": tokens,
        "tokens_over_bound": over,
        "tokens_superseded": superseded,
        "share_over_bound": over / max(tokens, 1),
        "share_over_bound_not_superseded": (over - superseded) / max(tokens, 1),
        "share_over_bound_in_batches_without_superseded": over_elsewhere / max(tokens, 1),
        "steps_with_superseded": [r["step"] for r in across],
        "staleness_learner_max": max(r.get("staleness/learner_max", 0) for r in learner),
        "lineage": final.get("lineage"),
        "engine_behind": max(
            (
                r.get("gen/engine_behind", 0)
                for r in raw_records(run_dir / "metrics" / "generator0.jsonl")
            ),
            default=0,
        ),
    }
    (run_dir / "figures.json").write_text(json.dumps(fig, indent=2) + "\n")
    return fig


def _check_run(run_dir: Path) -> dict:
    fig = _figures(run_dir)
    records = raw_records(run_dir / "metrics" / "learner.jsonl")
    starts = _check_versions(records)
    assert len(starts) >= 2, f"the learner never restarted: {starts}"
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert [r["step"] for r in learner] == list(range(1, STEPS + 1))
    # Nothing lost, nothing twice: every step's groups committed once; the rest accounted for.
    final = json.loads((run_dir / "buffer_final.json").read_text())
    assert fig["trajectories_trained"] == STEPS * GROUPS_PER_STEP * GROUP_SIZE, fig
    assert final["batches_delivered_uncommitted"] == 0
    dropped = sum(fig["trajectories_dropped"].values())
    assert (
        fig["trajectories_stored"]
        == fig["trajectories_trained"] + dropped + fig["trajectories_held"]
    ), fig
    # The bound holds for the tokens of batches made on the run's line, but for at most one batch
    # after the restart: groups granted before it wait out the restart and its redelivered batches
    # (seen: 5-10% of the run's tokens, one batch, in about half the full-suite runs on 2 cores).
    # A batch that holds groups generated across the restart (some tokens superseded) is counted
    # apart.
    batch = max(r["tokens"] for r in read_metrics(run_dir / "metrics" / "learner.jsonl"))
    allowed = OVER_BOUND_SHARE + batch / max(fig["tokens_trained"], 1)
    assert fig["share_over_bound_in_batches_without_superseded"] <= allowed, fig
    assert fig["staleness_learner_max"] <= 2 * MAX_STALENESS, fig
    return fig


def test_supervisor_kill_and_resume_keeps_versions_and_the_bound(tiny):
    """The supervisor alone is SIGKILLed mid-run: no role survives it, nor anything in the
    roles' process groups (the roles die with it; the watchdog stops what remains, and says so
    in supervisor.log only when something did: tests/integration/test_supervisor_owner.py,
    where a stand-in's child ignores SIGTERM), `run --resume` refuses nothing and finishes."""
    root, model, data = tiny
    cfg, run_dir = _config(root, model, data, "kill-supervisor")
    first = start_run(cfg)
    try:
        wait_for(lambda: _past_checkpoint(run_dir), 300, f"step {KILL_AFTER}", first)
        roles = RunDir(run_dir).read_children()
        assert {"buffer", "engine0", "generator0", "learner"} <= set(roles)
        pids = [pid for pid, _ in roles.values()]
        watchdog = supervisor_watchdog(first.pid)
        first.kill()  # the supervisor itself: its roles die with it (PR_SET_PDEATHSIG)
        first.communicate(timeout=60)
        await_watchdog(watchdog, lambda: not any(map(group_alive, pids)), "the roles' groups")
    finally:
        stop_group(first)
    again = start_run("--resume", run_dir)
    try:
        finish(again)
    finally:
        stop_group(again)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed at step" in log
    _check_run(run_dir)
    final = json.loads((run_dir / "buffer_final.json").read_text())
    assert final["producers_live"] == 0  # written as the buffer stopped, after the generators
    assert "Traceback" not in (run_dir / "logs" / "buffer.log").read_text()


def test_learner_kill_keeps_versions_and_the_bound(tiny):
    """The learner alone is SIGKILLed: the supervisor restarts it (no `--resume`), it resumes
    from its checkpoint under a weight group of a fresh name (the dead one's destroyed first)
    and the run finishes."""
    root, model, data = tiny
    cfg, run_dir = _config(root, model, data, "kill-learner")
    proc = start_run(cfg)
    try:
        wait_for(lambda: _past_checkpoint(run_dir), 300, f"step {KILL_AFTER}", proc)
        kill_role(run_dir, "learner")
        out = finish(proc)
    finally:
        stop_group(proc)
    assert "restarting learner" in (run_dir / "logs" / "supervisor.log").read_text(), out[-3000:]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed at step" in log
    names = {
        line.split("weight-update group ")[1].split()[0]
        for line in log.splitlines()
        if "weight-update group slime_async" in line
    }
    assert len(names) >= 2, names
    _check_run(run_dir)


def _paused(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=2) as r:
            return bool(json.loads(r.read()).get("paused"))
    except OSError:
        return False


def test_learner_killed_during_a_push_keeps_versions_and_the_bound(tiny):
    root, model, data = tiny
    # Small buckets: the push takes long enough (many update calls) to be caught while the
    # engine is paused for it.
    cfg, run_dir = _config(root, model, data, "kill-in-push", bucket_bytes=1024)
    proc = start_run(cfg)
    try:
        wait_for(lambda: _past_checkpoint(run_dir), 300, f"step {KILL_AFTER}", proc)
        url = engine_url(run_dir)
        learner = pid_of(run_dir, "learner")
        deadline = time.monotonic() + 120
        while not _paused(url):  # the engine is paused only while a push is under way
            assert proc.poll() is None, "the run ended before a push was caught"
            assert time.monotonic() < deadline, "no push caught in 120 s"
        kill_role(run_dir, "learner")
        out = finish(proc)
    finally:
        stop_group(proc)
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert f"learner (pid {learner})" in sup and "restarting learner" in sup, out[-3000:]
    _check_run(run_dir)
