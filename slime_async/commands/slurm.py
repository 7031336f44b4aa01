"""`slime-async slurm CONFIG... --nodes N`: an sbatch script that starts a Ray cluster inside the
allocation and runs the job on it with the Ray launcher; submitted with `sbatch` unless
`--dry-run`.

The script: node 0 runs `ray start --head`, the others `ray start --address` (each `--block` in
its own `srun` step), waits until N nodes are alive, then runs `slime-async run CONFIG...
run.launcher="ray" run.ray.address=<head>:<port>` on node 0 and stops Ray when it ends. The first
`learner_nodes` nodes (enough GPUs for `run.learner_procs` ranks) get the `run.ray.learner_nodes`
resource, the others the `run.ray.engine_nodes` resource, so the config's placement rules find
them; the CPU roles run on the head (node 0) unless `run.ray.cpu_nodes` names a resource, which
the head then gets.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from slime_async.commands import add_config_arguments

HELP = "write (and submit) an sbatch script: a Ray cluster over N nodes, then the job on it"

NODE_WAIT_S = 600
"""How long the script waits for every node's raylet to join."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of each node (default 8)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time", help="time limit, e.g. 24:00:00")
    p.add_argument("--account", help="Slurm account")
    p.add_argument(
        "--learner-nodes",
        type=int,
        help="nodes for the learner's ranks (default: enough for run.learner_procs)",
    )
    p.add_argument("--ray-port", type=int, default=6379, help="the head's Ray port (default 6379)")
    p.add_argument(
        "--script", help="where to write the script (default: <run.runs_dir>/<run.name>.sbatch)"
    )
    p.add_argument(
        "--python", default=sys.executable, help="the interpreter on the nodes (default: this one)"
    )
    p.add_argument("--dry-run", action="store_true", help="write the script, do not submit it")


def main(args: argparse.Namespace) -> int:
    from slime_async.config import ConfigError, load_config, split_cli_args

    files, overrides = split_cli_args(args.config)
    if not files:
        raise ConfigError("name at least one CONFIG.toml")
    overrides = [*overrides, 'run.launcher="ray"']
    cfg = load_config(files, overrides)  # validated here, before anything is written
    script = build_script(
        cfg,
        [str(Path(f).resolve()) for f in files],
        overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        learner_nodes=args.learner_nodes,
        partition=args.partition,
        time=args.time,
        account=args.account,
        ray_port=args.ray_port,
        python=args.python,
        workdir=str(Path.cwd()),
    )
    path = Path(args.script or Path(cfg.run.runs_dir) / f"{cfg.run.name}.sbatch").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.run.runs_dir).mkdir(parents=True, exist_ok=True)  # Slurm writes its output there
    path.write_text(script)
    path.chmod(0o755)
    print(path, flush=True)
    if args.dry_run:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            f"sbatch not found on PATH: this is not a Slurm login node; the script is {path} "
            "(submit it with `sbatch` there, or pass --dry-run to only write it)"
        )
    return subprocess.run([sbatch, str(path)], check=False).returncode


def build_script(
    cfg,
    files: list[str],
    overrides: list[str],
    *,
    nodes: int,
    gpus_per_node: int,
    learner_nodes: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    ray_port: int = 6379,
    python: str = "python",
    workdir: str = ".",
) -> str:
    """The sbatch script's text (ConfigError when the nodes cannot hold the job)."""
    from slime_async.config import ConfigError

    rc = cfg.run.ray
    if nodes < 1 or gpus_per_node < 0:
        raise ConfigError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: need nodes >= 1")
    learner_gpus = cfg.run.learner_procs * rc.gpus_per_learner_rank
    if learner_nodes is None:
        learner_nodes = math.ceil(learner_gpus / gpus_per_node) if gpus_per_node else 1
    learner_nodes = max(1, learner_nodes)
    engine_gpus = (
        cfg.engine.num_engines * rc.gpus_per_engine if cfg.engine.kind == "embedded" else 0
    )
    if learner_gpus > learner_nodes * gpus_per_node:
        raise ConfigError(
            f"run.learner_procs = {cfg.run.learner_procs} ranks need {learner_gpus} GPUs; "
            f"{learner_nodes} learner node(s) x {gpus_per_node} GPUs hold {learner_nodes * gpus_per_node}"
        )
    engine_nodes = nodes - learner_nodes
    if engine_gpus > engine_nodes * gpus_per_node:
        raise ConfigError(
            f"engine.num_engines = {cfg.engine.num_engines} x run.ray.gpus_per_engine = "
            f"{rc.gpus_per_engine} need {engine_gpus} GPUs; the {engine_nodes} node(s) left after "
            f"{learner_nodes} learner node(s) hold {engine_nodes * gpus_per_node}: raise --nodes"
        )

    def resources(kind: str, head: bool) -> str:
        res: dict[str, int] = {}
        rule = rc.learner_nodes if kind == "learner" else rc.engine_nodes
        if rule is not None:
            res[rule] = max(gpus_per_node, 1)
        if head and rc.cpu_nodes not in (None, "head"):
            res[rc.cpu_nodes] = 1
        return f" --resources={shlex.quote(json.dumps(res))}" if res else ""

    ray = shlex.quote(str(Path(python).parent / "ray")) if "/" in python else "ray"
    py = shlex.quote(python)
    run_argv = [*files, *overrides, 'run.ray.address="$RAY_ADDRESS"']
    run_args = " ".join(
        shlex.quote(a) if "$RAY_ADDRESS" not in a else 'run.ray.address=\\"$RAY_ADDRESS\\"'
        for a in run_argv
    )
    sbatch = [
        f"#SBATCH --job-name={cfg.run.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={Path(workdir) / cfg.run.runs_dir}/%x-%j.out",
    ]
    if partition:
        sbatch.append(f"#SBATCH --partition={partition}")
    if time:
        sbatch.append(f"#SBATCH --time={time}")
    if account:
        sbatch.append(f"#SBATCH --account={account}")
    lines = [
        "#!/bin/bash",
        f"# Written by `slime-async slurm`: a Ray cluster on {nodes} node(s) ({learner_nodes} for "
        f"the learner, {engine_nodes} for engines), then the job with the Ray launcher.",
        *sbatch,
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_ip=$(srun --nodes=1 --ntasks=1 -w \"${nodes[0]}\" hostname --ip-address | awk '{print $1}')",
        f'export RAY_ADDRESS="$head_ip:{ray_port}"',
        f'srun --nodes=1 --ntasks=1 -w "${{nodes[0]}}" {ray} start --head --node-ip-address="$head_ip" '
        f"--port={ray_port} --num-gpus={gpus_per_node}{resources('learner', True)} --block &",
        f"for _ in $(seq 1 {NODE_WAIT_S // 2}); do "
        f'{ray} status --address="$RAY_ADDRESS" >/dev/null 2>&1 && break; sleep 2; done',
    ]
    if learner_nodes > 1:
        lines.append(
            f"for i in $(seq 1 {learner_nodes - 1}); do "
            f'srun --nodes=1 --ntasks=1 -w "${{nodes[$i]}}" {ray} start --address="$RAY_ADDRESS" '
            f"--num-gpus={gpus_per_node}{resources('learner', False)} --block & done"
        )
    if engine_nodes > 0:
        lines.append(
            f"for i in $(seq {learner_nodes} {nodes - 1}); do "
            f'srun --nodes=1 --ntasks=1 -w "${{nodes[$i]}}" {ray} start --address="$RAY_ADDRESS" '
            f"--num-gpus={gpus_per_node}{resources('engine', False)} --block & done"
        )
    lines += [
        f"{py} - <<'EOF'",
        "import sys, time, ray",
        'ray.init(address="auto", log_to_driver=False)',
        f"deadline = time.monotonic() + {NODE_WAIT_S}",
        f'while sum(n["Alive"] for n in ray.nodes()) < {nodes}:',
        "    if time.monotonic() > deadline:",
        f'        sys.exit("timed out after {NODE_WAIT_S}s waiting for {nodes} Ray nodes")',
        "    time.sleep(2)",
        "EOF",
        "status=0",
        f"{py} -m slime_async run {run_args} || status=$?",
        f"{ray} stop --force || true",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
