"""`slime-async slurm`: the sbatch script for the two-node and 16-node examples, line by line (no
Slurm here), the refusals, and the placement of both examples on simulated nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import load_config
from slime_async.launch.ray.placement import HEAD_RESOURCE, bundle_of, check_fits, slots_of
from tests.support.repo import REPO

TWO = REPO / "configs" / "cluster" / "ray_two_nodes.toml"
SIXTEEN = REPO / "configs" / "cluster" / "ray_16_nodes.toml"
PY = "/opt/venv/bin/python"


def _slurm(tmp_path: Path, config: Path, *args: str):
    """`slime-async slurm` in this process (from `tmp_path`): (exit code, stdout, stderr)."""
    import contextlib
    import io

    from slime_async.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(
                ["slurm", str(config), f'run.runs_dir="{tmp_path / "runs"}"', "--python", PY, *args]
            )
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def _expected(config: Path, tmp_path: Path, name: str, nodes: int, learner: int, extra: list[str]):
    runs = tmp_path / "runs"
    ray = "/opt/venv/bin/ray"
    lines = [
        "#!/bin/bash",
        f"# Written by `slime-async slurm`: a Ray cluster on {nodes} node(s) ({learner} for the "
        f"learner, {nodes - learner} for engines), then the job with the Ray launcher.",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive",
        f"#SBATCH --output={runs}/%x-%j.out",
        *extra,
        "set -euo pipefail",
        f"cd {tmp_path}",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'head_ip=$(srun --nodes=1 --ntasks=1 -w "${nodes[0]}" hostname --ip-address '
        "| awk '{print $1}')",
        'export RAY_ADDRESS="$head_ip:6379"',
        f'srun --nodes=1 --ntasks=1 -w "${{nodes[0]}}" {ray} start --head '
        '--node-ip-address="$head_ip" --port=6379 --num-gpus=8 '
        "--resources='{\"learner\": 8}' --block &",
        f'for _ in $(seq 1 300); do {ray} status --address="$RAY_ADDRESS" >/dev/null 2>&1 '
        "&& break; sleep 2; done",
    ]
    if learner > 1:
        lines.append(
            f"for i in $(seq 1 {learner - 1}); do srun --nodes=1 --ntasks=1 "
            f'-w "${{nodes[$i]}}" {ray} start --address="$RAY_ADDRESS" --num-gpus=8 '
            "--resources='{\"learner\": 8}' --block & done"
        )
    lines += [
        f"for i in $(seq {learner} {nodes - 1}); do srun --nodes=1 --ntasks=1 "
        f'-w "${{nodes[$i]}}" {ray} start --address="$RAY_ADDRESS" --num-gpus=8 '
        "--resources='{\"engine\": 8}' --block & done",
        f"{PY} - <<'EOF'",
        "import sys, time, ray",
        'ray.init(address="auto", log_to_driver=False)',
        "deadline = time.monotonic() + 600",
        f'while sum(n["Alive"] for n in ray.nodes()) < {nodes}:',
        "    if time.monotonic() > deadline:",
        f'        sys.exit("timed out after 600s waiting for {nodes} Ray nodes")',
        "    time.sleep(2)",
        "EOF",
        "status=0",
        f"{PY} -m slime_async run {config} 'run.runs_dir=\"{runs}\"' 'run.launcher=\"ray\"' "
        'run.ray.address=\\"$RAY_ADDRESS\\" || status=$?',
        f"{ray} stop --force || true",
        'exit "$status"',
    ]
    return lines


def test_two_node_script_line_by_line(tmp_path):
    code, out, err = _slurm(tmp_path, TWO, "--nodes", "2", "--gpus-per-node", "8", "--dry-run")
    assert code == 0, err
    path = Path(out.strip())
    assert path == tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch"
    got = path.read_text().splitlines()
    want = _expected(TWO, tmp_path, "qwen3-4b-ray-2n", 2, 1, [])
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"line {i + 1}:\n got  {g}\n want {w}"
    assert len(got) == len(want)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid bash


def test_sixteen_node_script_line_by_line(tmp_path):
    code, out, err = _slurm(
        tmp_path,
        SIXTEEN,
        "--nodes",
        "16",
        "--partition",
        "gpu",
        "--time",
        "48:00:00",
        "--account",
        "rl",
        "--dry-run",
    )
    assert code == 0, err
    got = Path(out.strip()).read_text().splitlines()
    extra = ["#SBATCH --partition=gpu", "#SBATCH --time=48:00:00", "#SBATCH --account=rl"]
    want = _expected(SIXTEEN, tmp_path, "qwen3-32b-ray-16n", 16, 4, extra)
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"line {i + 1}:\n got  {g}\n want {w}"
    assert len(got) == len(want)


def test_refusals(tmp_path, monkeypatch):
    # Too few nodes for 48 engines of 2 GPUs next to 4 learner nodes.
    code, _, err = _slurm(tmp_path, SIXTEEN, "--nodes", "8", "--dry-run")
    assert code == 2
    assert "need 96 GPUs; the 4 node(s) left after 4 learner node(s) hold 32: raise --nodes" in err
    # Without --dry-run and without Slurm: the script is written, the error says sbatch is missing.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2")
    assert code == 2
    assert "sbatch not found on PATH" in err
    assert (tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch").is_file()


@pytest.mark.parametrize(("config", "nodes", "learner_nodes"), [(TWO, 2, 1), (SIXTEEN, 16, 4)])
def test_examples_fit_the_nodes_the_script_starts(config, nodes, learner_nodes):
    """The resources the script gives each node hold every bundle of the example's placement."""
    cfg = load_config([config])
    slots = slots_of(cfg)
    bundles = [bundle_of(s, cfg.run.ray) for s in slots]
    node = {"CPU": 64.0, "GPU": 8.0}
    cluster = [{"Resources": {**node, "learner": 8.0, HEAD_RESOURCE: 1.0}}]
    cluster += [{"Resources": {**node, "learner": 8.0}} for _ in range(learner_nodes - 1)]
    cluster += [{"Resources": {**node, "engine": 8.0}} for _ in range(nodes - learner_nodes)]
    check_fits(slots, bundles, cluster)
    n_engines = sum(s.kind == "engine" for s in slots)
    assert n_engines * cfg.run.ray.gpus_per_engine == 8 * (nodes - learner_nodes)
