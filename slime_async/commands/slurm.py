"""`slime-async slurm CONFIG... --nodes N`: an sbatch script that starts a Ray cluster inside the
allocation and runs the job on it with the Ray launcher; submitted with `sbatch` unless
`--dry-run`. The script itself is built by `slime_async/launch/slurm.py` (its docstring says what
it does, node by node, and how it requeues and resumes at the time limit).

Before anything is written or submitted, the config gets the checks `slime-async run` makes, so a
job does not fail after its queue wait: it must name the Ray launcher (`run.launcher = "ray"`) and
Ray must be installed where the script starts it; the buffer will bind its node's network address,
so it needs CurveZMQ keys (or `buffer.allow_non_loopback = true`); every plug-in is imported and
checked (`--no-plugins` skips that); the nodes must hold the job, and all of them be used.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from slime_async.commands import add_config_arguments

HELP = "write (and submit) an sbatch script: a Ray cluster over N nodes, then the job on it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from slime_async.launch.slurm import NODE_WAIT_S

    add_config_arguments(p)
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of each node (default 8)")
    p.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs of each node's task (#SBATCH --cpus-per-task; also Ray's --num-cpus)",
    )
    p.add_argument("--mem", help="memory per node, e.g. 500G (#SBATCH --mem; 0: all of it)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time", help="time limit, e.g. 24:00:00")
    p.add_argument("--account", help="Slurm account")
    p.add_argument(
        "--no-exclusive", action="store_true", help="share the nodes (no #SBATCH --exclusive)"
    )
    p.add_argument(
        "--sbatch-line",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more #SBATCH option, e.g. --sbatch-line=--qos=high (repeatable)",
    )
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line run before Ray starts, e.g. 'module load cuda/12.4' or "
        "'source /shared/venv/bin/activate' (repeatable, in order)",
    )
    p.add_argument(
        "--setup-file",
        help="a file of shell lines inserted where --setup lines go (after them)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variable exported for every node's processes, e.g. NCCL_IB_HCA=mlx5 (repeatable)",
    )
    p.add_argument(
        "--no-requeue",
        action="store_true",
        help="do not requeue at the time limit (default: stop the run, requeue, resume)",
    )
    p.add_argument(
        "--signal-before",
        type=int,
        default=600,
        metavar="S",
        help="seconds before the time limit at which the run is stopped and requeued (default 600)",
    )
    p.add_argument(
        "--max-requeues",
        type=int,
        default=20,
        help="most time-limit requeues of one job (default 20)",
    )
    p.add_argument(
        "--node-wait-s",
        type=int,
        default=NODE_WAIT_S,
        help=f"how long to wait for the Ray head, then for every node (default {NODE_WAIT_S})",
    )
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
    p.add_argument(
        "--no-plugins", action="store_true", help="do not import and check the plug-ins here"
    )
    p.add_argument("--dry-run", action="store_true", help="write the script, do not submit it")


def main(args: argparse.Namespace) -> int:
    from slime_async.commands.config import check_plugins
    from slime_async.config import ConfigError, load_config, split_cli_args
    from slime_async.launch.slurm import SlurmOptions, build_script, plan_nodes

    files, overrides = split_cli_args(args.config)
    if not files:
        raise ConfigError("name at least one CONFIG.toml")
    cfg = load_config(files, overrides)  # validated here, before anything is written
    check_cluster(cfg, args.python)
    if not args.no_plugins:
        check_plugins(cfg)
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--env {item!r}: expected KEY=VALUE with KEY a variable name")
        env.append((key, value))
    setup = list(args.setup)
    if args.setup_file:
        setup_file = Path(args.setup_file)
        if not setup_file.is_file():
            raise ConfigError(f"--setup-file {setup_file}: not found")
        setup += setup_file.read_text().splitlines()
    if not 0 < args.signal_before < 65536:
        raise ConfigError(f"--signal-before {args.signal_before}: Slurm takes 1-65535 seconds")
    opts = SlurmOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        learner_nodes=args.learner_nodes,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        partition=args.partition,
        time=args.time,
        account=args.account,
        exclusive=not args.no_exclusive,
        sbatch_lines=tuple(args.sbatch_line),
        setup=tuple(setup),
        env=tuple(env),
        requeue=not args.no_requeue,
        signal_before_s=args.signal_before,
        max_requeues=args.max_requeues,
        node_wait_s=args.node_wait_s,
        ray_port=args.ray_port,
        python=args.python,
        workdir=str(Path.cwd()),
    )
    script = build_script(cfg, [str(Path(f).resolve()) for f in files], overrides, opts)
    plan = plan_nodes(cfg, args.nodes, args.gpus_per_node, args.learner_nodes)
    print(f"[slime-async slurm] {plan.words}", file=sys.stderr, flush=True)
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


def check_cluster(cfg, python: str) -> None:
    """What the job needs from its config on a Slurm allocation, refused here in words."""
    from slime_async.config import ConfigError

    if cfg.run.launcher != "ray":
        raise ConfigError(
            f"run.launcher = {cfg.run.launcher!r}: `slime-async slurm` runs the job with the Ray "
            'launcher over the allocation\'s nodes; set run.launcher = "ray" and place the roles '
            "with [run.ray] (configs/cluster/ray_two_nodes.toml is an example)"
        )
    if not (cfg.buffer.curve.server_secret_key or cfg.buffer.allow_non_loopback):
        raise ConfigError(
            f"buffer.producer_endpoint = {cfg.buffer.producer_endpoint!r}: on the allocation the "
            "buffer binds its node's network address, and without CurveZMQ keys it refuses to; "
            "run `slime-async keygen DIR > curve.toml` and add curve.toml to the configs, or set "
            "buffer.allow_non_loopback = true on a trusted network"
        )
    if "/" not in python:
        return  # found on PATH on the nodes, after the --setup lines: nothing to check here
    this = Path(python).resolve() == Path(sys.executable).resolve()
    if this and importlib.util.find_spec("ray") is None:
        from slime_async.launch.ray import RAY_EXTRA

        raise ConfigError(
            f"run.launcher = 'ray' needs Ray, which is not installed in {python}; install "
            f"the extra: {RAY_EXTRA}"
        )
    ray = Path(python).parent / "ray"
    if Path(python).exists() and not ray.exists():
        raise ConfigError(
            f"the script starts Ray as {ray}, which does not exist: install Ray into the "
            f"environment of --python {python} (pip install 'slime_async[ray]')"
        )
