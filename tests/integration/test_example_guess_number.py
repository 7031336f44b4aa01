"""The third example end to end: `slime-async run examples/guess_number/config.toml` for a few
steps (multi-turn game, async reward from the judge service its lifecycle plug-in starts), then
`slime-async inspect` on the run directory: what the learner trained, decoded."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.guess_number import game, judge
from slime_async.metrics import read_metrics
from tests.support.repo import REPO

STEPS = 3
HINTS = {
    "<user>higher<eos><assistant>",
    "<user>lower<eos><assistant>",
    "<user>a number please<eos><assistant>",
}


def test_judge_scores_the_final_guess():
    assert judge.score(37, "I say 40 no 37") == {"correct": 1.0, "closeness": 0.1}
    assert judge.score(37, "47")["correct"] == 0.0
    assert judge.score(37, "47")["closeness"] == pytest.approx(0.09)
    assert judge.score(37, "no idea") == {"correct": 0.0, "closeness": 0.0}
    assert game.last_number("12 then 13") == 13 and game.last_number("x") is None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("guess") / "run"
    cmd = [
        sys.executable,
        "-m",
        "slime_async",
        "run",
        "examples/guess_number/config.toml",
        f"run.run_dir={str(out)!r}",
        "run.progress=plain",
        "run.ready_timeout_s=240",
        f"learner.num_steps={STEPS}",
        "learner.groups_per_step=2",
        "learner.save_interval=0",
        "generator.max_inflight=16",
    ]
    # A flaky judge: every 7th call answers 503, as a real judge under load sometimes does.
    env = {**os.environ, game.JUDGE_ARGS_ENV: "--fail-every 7"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540, env=env)
    logs = out / "logs"
    tails = (
        "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for p in sorted(logs.glob("*.log"))
        )
        if logs.exists()
        else ""
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + tails
    return out


def _inspect(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime_async", "inspect", str(run_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_example_runs_through_a_flaky_judge_that_lives_as_long_as_the_generator(run_dir):
    steps = [r["step"] for r in read_metrics(run_dir / "metrics" / "learner.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    gen_log = (run_dir / "logs" / "generator0.log").read_text()
    assert "Unclosed client session" not in gen_log and " ERROR " not in gen_log
    retried = [ln for ln in gen_log.splitlines() if "retry" in ln and " WARNING " in ln]
    assert retried and "examples.guess_number.game:reward' on sample gen0/e" in retried[0]
    assert "ClientResponseError" in retried[0]  # the judge's 503, named, traceback below
    calls = [
        ln
        for ln in (run_dir / "logs" / "judge.log").read_text().splitlines()
        if ln.startswith("score ")
    ]
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")[-1]
    assert len(calls) >= gen["gen/trajectories_pushed"] > 0  # the judge scored every pushed one
    # Its failures were retried, not dropped: the run went on (Found 2).
    assert gen["gen/reward_retries"] > 0 and gen["gen/groups_dropped"] == 0


def test_inspect_shows_what_the_learner_trained(run_dir):
    r = _inspect(run_dir, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS + 1))
    assert all(s["groups"] == 2 and s["trajectories"] == 8 for s in summary["steps"])
    for step in range(1, STEPS + 1):
        r = _inspect(run_dir, "--step", str(step), "--json")
        assert r.returncode == 0, r.stderr
        rec = json.loads(r.stdout)
        assert rec["staleness_max"] is not None and rec["staleness_max"] <= 2
        for g in rec["group_records"]:
            assert g["staleness"] == rec["delivered_at_version"] - min(
                t["oldest_version"] for t in g["trajectories"]
            )
            for t in g["trajectories"]:
                kinds = [s["kind"] for s in t["segments"]]
                assert kinds[0] == "model" and kinds[-1] == "model"
                assert all(a != b for a, b in itertools.pairwise(kinds))  # alternate
                assert {s["text"] for s in t["segments"] if s["kind"] == "env"} <= HINTS
                assert kinds.count("model") == t["metadata"]["guesses"] <= game.MAX_TURNS
                assert set(t["reward_parts"]) == {"correct", "closeness"}
                assert t["reward"] == pytest.approx(sum(t["reward_parts"].values()))
                assert t["temperature"] == 1.0
                versions = [tk["version"] for tk in t["tokens"]]
                assert versions == sorted(versions)  # per-token versions, monotone
                assert all(
                    (tk["logprob"] < 0) == bool(tk["loss_mask"]) or tk["logprob"] == 0
                    for tk in t["tokens"]
                )
                assert t["prompt"] == "<user>Guess my number, 1 to 100.<eos><assistant>"
    gid = rec["group_records"][0]["group_id"]
    text = _inspect(run_dir, "--group", gid)
    assert text.returncode == 0, text.stderr
    assert f"group {gid}: trained at step {STEPS}" in text.stdout
    assert "[prompt," in text.stdout and "[model," in text.stdout and "log-prob" in text.stdout
    table = _inspect(run_dir)
    assert table.returncode == 0 and "staleness mean/max" in table.stdout
