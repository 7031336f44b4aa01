"""The sbatch script of `slime-async slurm` run by bash against a fake Slurm (`sbatch`, `srun`,
`scontrol` scripts on PATH) and a fake Ray and `python` that record what they are asked: the
requeue at the time limit and the `--resume` after it, the head that exits or never answers, the
bound on requeues. The script's text and the refusals: test_slurm.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slime_async.cli import main as cli_main
from tests.support.keys import write_curve_toml
from tests.support.repo import REPO

TWO = REPO / "configs" / "cluster" / "ray_two_nodes.toml"
JOB_ID = "42"
WAIT_S = 30.0

# Each fake appends one line per call to $FAKE_LOG and keeps its state in files under $FAKE_STATE;
# every loop is bounded (600 x 0.05 s).
FAKES = {
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1" in
  show) echo n0; echo n1 ;;
  requeue) touch "$FAKE_STATE/requeued" ;;
esac
""",
    "srun": """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
while [[ $# -gt 0 ]]; do case "$1" in -w) shift 2 ;; -*) shift ;; *) break ;; esac; done
exec "$@"
""",
    "hostname": """#!/bin/bash
echo 127.0.0.1
""",
    "ray": """#!/bin/bash
echo "ray $*" >> "$FAKE_LOG"
case "$1" in
  start)
    if [[ " $* " == *" --head "* ]]; then
      [[ -n "${FAKE_HEAD_EXITS:-}" ]] && exit 3
      rm -f "$FAKE_STATE/ray_stopped"
      [[ -z "${FAKE_HEAD_SILENT:-}" ]] && touch "$FAKE_STATE/head_up"
    fi
    for _ in $(seq 600); do [[ -f "$FAKE_STATE/ray_stopped" ]] && exit 0; sleep 0.05; done ;;
  status) [[ -f "$FAKE_STATE/head_up" ]] ;;
  stop) touch "$FAKE_STATE/ray_stopped" ;;
esac
""",
    # `python -` is the wait for every node; `python -m slime_async run ...` the run: a fresh
    # start writes config.json and runs until SIGTERM, a `--resume` completes at once.
    "python": """#!/bin/bash
echo "python $*" >> "$FAKE_LOG"
[[ "$1" == "-" ]] && { cat > /dev/null; exit 0; }
if [[ " $* " == *" --resume "* ]]; then exit 0; fi
for a in "$@"; do
  case "$a" in run.run_dir=*) d="${a#run.run_dir=}"; d="${d//\\"/}" ;; esac
done
mkdir -p "$d" && echo '{}' > "$d/config.json"
trap 'echo "python got TERM" >> "$FAKE_LOG"; exit 143' TERM
touch "$FAKE_STATE/run_started"
for _ in $(seq 600); do sleep 0.05; done
exit 1
""",
    # One job: the script under bash with Slurm's variables, again after each `scontrol
    # requeue` with SLURM_RESTART_COUNT one higher (in a session of its own: the test ends it).
    "sbatch": """#!/bin/bash
echo "sbatch $*" >> "$FAKE_LOG"
setsid bash -c '
  restart=0
  while true; do
    rm -f "$FAKE_STATE/requeued" "$FAKE_STATE/run_started"
    SLURM_JOB_ID=42 SLURM_JOB_NODELIST="n[0-1]" SLURM_RESTART_COUNT=$restart \\
      bash "$0" > "$FAKE_STATE/job-$restart.out" 2>&1 &
    echo $! > "$FAKE_STATE/job.pid"
    code=0; wait $! || code=$?
    echo $code > "$FAKE_STATE/job-$restart.rc"
    [[ -f "$FAKE_STATE/requeued" ]] || break
    restart=$((restart + 1))
  done
  touch "$FAKE_STATE/done"' "$1" &
echo $! > "$FAKE_STATE/sbatch.pid"
echo "Submitted batch job 42"
""",
}


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """The fake Slurm and Ray on PATH; yields (bin dir, state dir, log file); ends the job's
    session at the end."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_STATE", str(state))
    yield bin_dir, state, log
    pid_file = state / "sbatch.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # the session setsid made


def _slurm(tmp_path: Path, bin_dir: Path, *args: str) -> int:
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        return cli_main(
            [
                "slurm",
                str(TWO),
                str(write_curve_toml(tmp_path)),
                f'run.runs_dir="{tmp_path / "runs"}"',
                "--python",
                str(bin_dir / "python"),
                "--nodes",
                "2",
                "--no-plugins",
                *args,
            ]
        )
    finally:
        os.chdir(cwd)


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S}s waiting for {what}"
        time.sleep(0.05)


def _run_script(script: Path, state: Path, restarts: int = 0, **env: str):
    """The script once, as Slurm's batch shell: (exit code, output)."""
    full = {
        **os.environ,
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "n[0-1]",
        "SLURM_RESTART_COUNT": str(restarts),
        **env,
    }
    r = subprocess.run(
        ["bash", str(script)], env=full, capture_output=True, text=True, timeout=WAIT_S
    )
    return r.returncode, r.stdout + r.stderr


def test_time_limit_requeues_and_the_requeued_job_resumes(tmp_path, fake):
    bin_dir, state, log = fake
    assert _slurm(tmp_path, bin_dir) == 0
    _wait_for(state / "run_started", "the first run to start")
    # What Slurm does --signal-before seconds before the time limit (#SBATCH --signal=B:USR1@N).
    os.kill(int((state / "job.pid").read_text()), signal.SIGUSR1)
    _wait_for(state / "done", "the job to end")

    run_dir = tmp_path / "runs" / f"qwen3-4b-ray-2n-{JOB_ID}"
    calls = log.read_text().splitlines()
    runs = [c for c in calls if c.startswith("python -m slime_async run")]
    assert len(runs) == 2, calls
    assert f'run.run_dir="{run_dir}"' in runs[0] and "--resume" not in runs[0]
    assert 'run.ray.address="127.0.0.1:6379"' in runs[0]
    assert runs[1] == (
        f'python -m slime_async run --resume {run_dir} run.ray.address="127.0.0.1:6379"'
    )
    # The order within the first attempt: the run is stopped, Ray is stopped, the job requeued.
    term = calls.index("python got TERM")
    stop = calls.index("ray stop --force")
    requeue = calls.index(f"scontrol requeue {JOB_ID}")
    assert term < stop < requeue < calls.index(runs[1])
    assert (state / "job-0.rc").read_text().strip() == "0"
    assert (state / "job-1.rc").read_text().strip() == "0"
    first = (state / "job-0.out").read_text()
    assert "stopping the run so the requeued job resumes it" in first
    assert f"requeueing job {JOB_ID} (restart 1 of at most 20)" in first
    assert f"restart 1 of job {JOB_ID}: resuming {run_dir}" in (state / "job-1.out").read_text()
    records = [
        json.loads(x) for x in (run_dir / "metrics" / "slurm.jsonl").read_text().split("\n") if x
    ]
    assert [(r["slurm_restart_count"], r["slurm_resumed"]) for r in records] == [(0, 0), (1, 1)]
    assert all(r["slurm_job_id"] == JOB_ID for r in records)


def test_requeues_are_bounded(tmp_path, fake):
    bin_dir, state, log = fake
    assert _slurm(tmp_path, bin_dir, "--dry-run", "--max-requeues", "3") == 0
    script = tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch"
    proc = subprocess.Popen(
        ["bash", str(script)],
        env={
            **os.environ,
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NODELIST": "n[0-1]",
            "SLURM_RESTART_COUNT": "3",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(state / "run_started", "the run to start")
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    assert "not requeued: the job already restarted 3 time(s) (--max-requeues 3)" in out
    assert f"scontrol requeue {JOB_ID}" not in log.read_text()


def test_head_that_exits_stops_the_job_with_a_message(tmp_path, fake):
    bin_dir, state, log = fake
    assert _slurm(tmp_path, bin_dir, "--dry-run") == 0
    code, out = _run_script(
        tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch", state, FAKE_HEAD_EXITS="1"
    )
    assert code == 1, out
    assert "the Ray head on n0 exited (code 3) before it answered at 127.0.0.1:6379" in out
    assert "python -m slime_async run" not in log.read_text()


def test_head_that_never_answers_times_out_with_a_message(tmp_path, fake):
    bin_dir, state, log = fake
    assert _slurm(tmp_path, bin_dir, "--dry-run", "--node-wait-s", "2") == 0
    code, out = _run_script(
        tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch", state, FAKE_HEAD_SILENT="1"
    )
    assert code == 1, out
    assert "the Ray head on n0 did not answer at 127.0.0.1:6379 within 2s (--node-wait-s)" in out
    assert "ray stop --force" in log.read_text()  # the head's step is stopped too
    assert "python -m slime_async run" not in log.read_text()


def test_no_requeue_leaves_the_signal_out(tmp_path, fake):
    bin_dir, _, _ = fake
    assert _slurm(tmp_path, bin_dir, "--dry-run", "--no-requeue") == 0
    text = (tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch").read_text()
    assert "--signal=" not in text and "--requeue" not in text and "scontrol requeue" not in text
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
