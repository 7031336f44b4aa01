"""`slime-async slurm`: the sbatch script for the two-node and 16-node examples (no Slurm here),
the refusals, and the placement of both examples on simulated nodes. The script run against a
fake Slurm (requeue, resume, the head's failures): test_slurm_requeue.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import load_config
from slime_async.launch.ray.placement import HEAD_RESOURCE, bundle_of, check_fits, slots_of
from tests.support.keys import write_curve_toml
from tests.support.repo import REPO

TWO = REPO / "configs" / "cluster" / "ray_two_nodes.toml"
SIXTEEN = REPO / "configs" / "cluster" / "ray_16_nodes.toml"
PY = "/opt/venv/bin/python"


def _slurm(tmp_path: Path, config: Path, *args: str, curve: bool = True, overrides=()):
    """`slime-async slurm` in this process (from `tmp_path`): (exit code, stdout, stderr)."""
    import contextlib
    import io

    from slime_async.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = Path.cwd()
    os.chdir(tmp_path)
    keys = [str(write_curve_toml(tmp_path))] if curve else []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(
                [
                    "slurm",
                    str(config),
                    *keys,
                    f'run.runs_dir="{tmp_path / "runs"}"',
                    *overrides,
                    "--python",
                    PY,
                    "--no-plugins",
                    *args,
                ]
            )
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def _header(runs: Path, name: str, nodes: int, extra: list[str]) -> list[str]:
    return [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        *extra,
    ]


def _ray_start(node: str, join: str, resource: str, cpus: str = "") -> str:
    step = f" --cpus-per-task={cpus}" if cpus else ""
    num = f" --num-cpus={cpus}" if cpus else ""
    return (
        f'srun --nodes=1 --ntasks=1{step} -w "{node}" /opt/venv/bin/ray start {join}{num} '
        f"--num-gpus=8 --resources='{{\"{resource}\": 8}}' --block"
    )


HEAD = '--head --node-ip-address="$head_ip" --port=6379'
WORKER = '--address="$RAY_ADDRESS"'


def test_two_node_script(tmp_path):
    code, out, err = _slurm(tmp_path, TWO, "--nodes", "2", "--gpus-per-node", "8", "--dry-run")
    assert code == 0, err
    path = Path(out.strip())
    assert path == tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch"
    got = path.read_text().splitlines()
    runs = tmp_path / "runs"
    assert got[0] == "#!/bin/bash"
    sbatch = [line for line in got if line.startswith("#SBATCH")]
    assert sbatch == _header(
        runs,
        "qwen3-4b-ray-2n",
        2,
        [
            "#SBATCH --exclusive",
            f"#SBATCH --output={runs}/%x-%j.out",
            "#SBATCH --requeue",
            "#SBATCH --signal=B:USR1@600",
        ],
    )
    # The node arithmetic, in words, in the script and on stderr.
    words = (
        "Node 0: the learner; node 1: the engines; buffer, router and generators on node 0 (the "
        "head). The learner's run.learner_procs = 8 rank(s) x run.ray.gpus_per_learner_rank = 1 "
        "GPU = 8 GPU(s) on 1 node(s), engine.num_engines = 8 x run.ray.gpus_per_engine = 1 GPU(s) "
        "= 8 GPU(s) on 1 node(s) of 8 GPUs each: 2 node(s) in all."
    )
    assert f"# {words}" in got and words in err
    assert f"{_ray_start('${nodes[0]}', HEAD, 'learner')} &" in got
    assert f"for i in $(seq 1 1); do {_ray_start('${nodes[$i]}', WORKER, 'engine')} & done" in got
    curve = tmp_path / "curve.toml"
    assert (
        f"    {PY} -m slime_async run {TWO} {curve} 'run.runs_dir=\"{runs}\"' "
        '"run.ray.address=\\"$RAY_ADDRESS\\"" "run.run_dir=\\"$run_dir\\"" &'
    ) in got
    assert (
        f'    {PY} -m slime_async run --resume "$run_dir" "run.ray.address=\\"$RAY_ADDRESS\\"" &'
        in got
    )
    assert f'run_dir={runs}/qwen3-4b-ray-2n-"$SLURM_JOB_ID"' in got
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid bash


def test_sixteen_node_script_with_cluster_flags(tmp_path):
    setup = tmp_path / "env.sh"
    setup.write_text("source /shared/venv/bin/activate\nexport NCCL_DEBUG=WARN\n")
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
        "--cpus-per-task",
        "96",
        "--mem",
        "1800G",
        "--sbatch-line=--qos=high",
        "--sbatch-line",
        "#SBATCH --constraint=h200",
        "--setup",
        "module load cuda/12.4",
        "--setup-file",
        str(setup),
        "--env",
        "NCCL_IB_HCA=mlx5_0,mlx5_1",
        "--env",
        "NCCL_SOCKET_IFNAME=ib0",
        "--signal-before",
        "900",
        "--dry-run",
    )
    assert code == 0, err
    path = Path(out.strip())
    got = path.read_text().splitlines()
    runs = tmp_path / "runs"
    sbatch = [line for line in got if line.startswith("#SBATCH")]
    assert sbatch == _header(
        runs,
        "qwen3-32b-ray-16n",
        16,
        [
            "#SBATCH --cpus-per-task=96",
            "#SBATCH --mem=1800G",
            "#SBATCH --exclusive",
            f"#SBATCH --output={runs}/%x-%j.out",
            "#SBATCH --partition=gpu",
            "#SBATCH --time=48:00:00",
            "#SBATCH --account=rl",
            "#SBATCH --requeue",
            "#SBATCH --signal=B:USR1@900",
            "#SBATCH --qos=high",
            "#SBATCH --constraint=h200",
        ],
    )
    # The environment comes before Ray starts, in the order given; values are quoted.
    env = [
        "module load cuda/12.4",
        "source /shared/venv/bin/activate",
        "export NCCL_DEBUG=WARN",
        "export NCCL_IB_HCA=mlx5_0,mlx5_1",
        "export NCCL_SOCKET_IFNAME=ib0",
    ]
    first = got.index(env[0])
    assert got[first : first + len(env)] == env
    head = f"{_ray_start('${nodes[0]}', HEAD, 'learner', '96')} &"
    assert first < got.index(head)
    learners = _ray_start("${nodes[$i]}", WORKER, "learner", "96")
    engines = _ray_start("${nodes[$i]}", WORKER, "engine", "96")
    assert f"for i in $(seq 1 3); do {learners} & done" in got
    assert f"for i in $(seq 4 15); do {engines} & done" in got
    assert "Nodes 0-3: the learner; nodes 4-15: the engines" in err
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_refusals(tmp_path, monkeypatch):
    # Too few nodes for 48 engines of 2 GPUs next to 4 learner nodes: the arithmetic in words.
    code, _, err = _slurm(tmp_path, SIXTEEN, "--nodes", "4", "--dry-run")
    assert code == 2
    assert (
        "--nodes 4 is too few: the learner's run.learner_procs = 32 rank(s) x "
        "run.ray.gpus_per_learner_rank = 1 GPU = 32 GPU(s) on 4 node(s), engine.num_engines = 48 "
        "x run.ray.gpus_per_engine = 2 GPU(s) = 96 GPU(s) on 12 node(s) of 8 GPUs each: 16 "
        "node(s) in all; raise --nodes to 16"
    ) in err
    assert "-" + "12 node(s) left" not in err
    # Nodes no role would use.
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "3", "--dry-run")
    assert code == 2 and "--nodes 3 is 1 more than the job uses" in err
    code, _, err = _slurm(tmp_path, SIXTEEN, "--nodes", "16", "--learner-nodes", "2", "--dry-run")
    assert code == 2 and "--learner-nodes 2:" in err and "need 4 node(s)" in err
    # The buffer would refuse to bind its node's address without keys: refused before writing.
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2", "--dry-run", curve=False)
    assert code == 2
    assert "buffer.producer_endpoint='tcp://0.0.0.0:5555' is not a loopback address" in err
    loop = [
        'buffer.producer_endpoint="tcp://127.0.0.1:5555"',
        'buffer.consumer_endpoint="tcp://127.0.0.1:5556"',
    ]
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2", "--dry-run", curve=False, overrides=loop)
    assert code == 2
    assert "on the allocation the buffer binds its node's network address" in err
    assert "buffer.producer_endpoint = 'tcp://127.0.0.1:5555'" in err
    # A config for one machine: the Ray launcher is not silently switched on.
    code, _, err = _slurm(
        tmp_path, REPO / "configs" / "quickstart.toml", "--nodes", "1", "--dry-run"
    )
    assert (
        code == 2 and "run.launcher = 'local': `slime-async slurm` runs the job with the Ray" in err
    )
    assert not (tmp_path / "runs").exists()  # nothing written by a refused command
    # Flags that cannot work.
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2", "--env", "NCCL IB=1", "--dry-run")
    assert code == 2 and "--env 'NCCL IB=1'" in err
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2", "--sbatch-line", "qos=high", "--dry-run")
    assert code == 2 and "--sbatch-line 'qos=high'" in err
    # Without --dry-run and without Slurm: the script is written, the error says sbatch is missing.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    code, _, err = _slurm(tmp_path, TWO, "--nodes", "2")
    assert code == 2
    assert "sbatch not found on PATH" in err
    assert (tmp_path / "runs" / "qwen3-4b-ray-2n.sbatch").is_file()


def test_config_refuses_what_the_buffer_would(tmp_path):
    """`slime-async config` on a cluster config without keys: the key named, before any queue."""
    r = subprocess.run(
        [sys.executable, "-m", "slime_async", "config", str(TWO), "--no-plugins"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout
    assert "buffer.producer_endpoint='tcp://0.0.0.0:5555' is not a loopback address" in r.stderr
    assert "slime-async keygen" in r.stderr


@pytest.mark.parametrize(("config", "nodes", "learner_nodes"), [(TWO, 2, 1), (SIXTEEN, 16, 4)])
def test_examples_fit_the_nodes_the_script_starts(config, nodes, learner_nodes, tmp_path):
    """The resources the script gives each node hold every bundle of the example's placement."""
    cfg = load_config([config, write_curve_toml(tmp_path)])
    slots = slots_of(cfg)
    bundles = [bundle_of(s, cfg.run.ray) for s in slots]
    node = {"CPU": 64.0, "GPU": 8.0}
    cluster = [{"Resources": {**node, "learner": 8.0, HEAD_RESOURCE: 1.0}}]
    cluster += [{"Resources": {**node, "learner": 8.0}} for _ in range(learner_nodes - 1)]
    cluster += [{"Resources": {**node, "engine": 8.0}} for _ in range(nodes - learner_nodes)]
    check_fits(slots, bundles, cluster)
    n_engines = sum(s.kind == "engine" for s in slots)
    assert n_engines * cfg.run.ray.gpus_per_engine == 8 * (nodes - learner_nodes)
