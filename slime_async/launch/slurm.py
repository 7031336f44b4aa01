"""The sbatch script `slime-async slurm` writes: a Ray cluster over the allocation, then the job.

    #SBATCH lines       nodes, GPUs, CPUs and memory per node, partition, time, requeue, the
                        time-limit signal, and the user's own lines (--sbatch-line)
    environment         the user's setup lines (module load, venv activation) and variables (NCCL)
    Ray                 node 0: `ray start --head` in its own srun step; the script waits for it
                        to answer (bounded; a head that exits or never answers stops the job with
                        a message); the other nodes: `ray start --address`; then a bounded wait
                        until every node joined (naming those that did not)
    the run             `slime-async run CONFIG...` on node 0 with the Ray launcher, in a fixed
                        run directory `<run.runs_dir>/<run.name>-<job id>`; after a requeue
                        (SLURM_RESTART_COUNT > 0) `slime-async run --resume` of that directory
    the time limit      Slurm sends USR1 `--signal-before` seconds before it; the trap stops the
                        run (SIGTERM: the supervisor stops every role), stops Ray and requeues the
                        job (`scontrol requeue`), which then resumes; `--max-requeues` bounds it

Each start of the job appends a record to `<run_dir>/metrics/slurm.jsonl` (job id, restart
count, whether it resumed) and every decision is logged to the job's output file.

Why a plain script and not submitit: submitit submits pickled Python callables, one per task, and
checkpoints by pickling them again; this job is a different command per node (the Ray head, the
workers, the driver) and resumes from its own run directory, so its pieces would not be used, and a
plain script is what a cluster user reads, edits and resubmits.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from slime_async.config import ConfigError
from slime_async.metrics import names as m

NODE_WAIT_S = 600
"""How long the script waits for the Ray head to answer, and then for every node to join."""


@dataclass(frozen=True)
class NodePlan:
    """How the job's roles fill the allocation's nodes."""

    nodes: int
    gpus_per_node: int
    learner_nodes: int
    engine_nodes: int
    words: str
    """The arithmetic in words, for the script's header and the command's output."""


def plan_nodes(cfg, nodes: int, gpus_per_node: int, learner_nodes: int | None) -> NodePlan:
    """Learner nodes first, then engine nodes; ConfigError, in words, when the nodes do not hold
    the job or some would hold nothing."""
    rc = cfg.run.ray
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: need at least 1 node")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: need 0 or more")

    def nodes_for(gpus: int) -> int:
        return math.ceil(gpus / gpus_per_node) if gpus_per_node else 0

    ranks, per_rank = cfg.run.learner_procs, rc.gpus_per_learner_rank
    learner_gpus = ranks * per_rank
    learner_what = (
        f"the learner's run.learner_procs = {ranks} rank(s) x run.ray.gpus_per_learner_rank = "
        f"{per_rank} GPU = {learner_gpus} GPU(s)"
    )
    need_learner = max(1, nodes_for(learner_gpus))
    if learner_nodes is None:
        learner_nodes = need_learner
    elif learner_nodes < need_learner:
        raise ConfigError(
            f"--learner-nodes {learner_nodes}: {learner_what} need {need_learner} node(s) of "
            f"{gpus_per_node} GPUs; raise --learner-nodes to {need_learner} or leave it out"
        )
    n_engines = cfg.engine.num_engines if cfg.engine.kind == "embedded" else 0
    engine_gpus = n_engines * rc.gpus_per_engine
    engine_what = (
        f"engine.num_engines = {n_engines} x run.ray.gpus_per_engine = {rc.gpus_per_engine} "
        f"GPU(s) = {engine_gpus} GPU(s)"
        if cfg.engine.kind == "embedded"
        else "no engines (engine.kind = 'external': the engines run outside the allocation)"
    )
    need_engine = nodes_for(engine_gpus)
    if gpus_per_node == 0 and engine_gpus:
        raise ConfigError(f"--gpus-per-node 0: {engine_what} need GPUs")
    need = learner_nodes + need_engine
    arithmetic = (
        f"{learner_what} on {learner_nodes} node(s), {engine_what} on {need_engine} node(s) "
        f"of {gpus_per_node} GPUs each: {need} node(s) in all"
    )
    if nodes < need:
        raise ConfigError(f"--nodes {nodes} is too few: {arithmetic}; raise --nodes to {need}")
    if nodes > need:
        raise ConfigError(
            f"--nodes {nodes} is {nodes - need} more than the job uses ({arithmetic}), and Ray "
            f"would place no role on the rest; pass --nodes {need}, or raise engine.num_engines"
        )
    cpu_where = (
        "node 0 (the head)"
        if rc.cpu_nodes in (None, "head")
        else f"node 0 (resource {rc.cpu_nodes!r})"
    )
    last = learner_nodes - 1
    words = f"Nodes 0-{last}: the learner" if last else "Node 0: the learner"
    if need_engine:
        span = f"nodes {learner_nodes}-{nodes - 1}" if need_engine > 1 else f"node {nodes - 1}"
        words += f"; {span}: the engines"
    words += (
        f"; buffer, router and generators on {cpu_where}. {arithmetic[0].upper()}{arithmetic[1:]}."
    )
    return NodePlan(nodes, gpus_per_node, learner_nodes, need_engine, words)


@dataclass(frozen=True)
class SlurmOptions:
    """What `slime-async slurm` was asked for besides the config."""

    nodes: int
    gpus_per_node: int = 8
    learner_nodes: int | None = None
    cpus_per_task: int | None = None
    """CPUs of each node's one task (`#SBATCH --cpus-per-task`; Ray's `--num-cpus`)."""
    mem: str | None = None
    """Memory per node (`#SBATCH --mem`, e.g. 500G; 0: all of it)."""
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    exclusive: bool = True
    sbatch_lines: tuple[str, ...] = ()
    """Extra `#SBATCH` lines, as given (`--qos=high`)."""
    setup: tuple[str, ...] = ()
    """Shell lines run first on node 0 (module load, venv activation); srun steps inherit it."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables exported before anything starts (NCCL_*), inherited by every srun step."""
    requeue: bool = True
    signal_before_s: int = 600
    max_requeues: int = 20
    node_wait_s: int = NODE_WAIT_S
    ray_port: int = 6379
    python: str = "python"
    workdir: str = "."


def sbatch_line(text: str) -> str:
    """`--qos=high` or `#SBATCH --qos=high` -> `#SBATCH --qos=high` (one line, an option)."""
    body = text.strip().removeprefix("#SBATCH").strip()
    if not body.startswith("-") or "\n" in body:
        raise ConfigError(
            f"--sbatch-line {text!r}: expected one sbatch option such as '--qos=high'"
        )
    return f"#SBATCH {body}"


def build_script(cfg, files: list[str], overrides: list[str], opts: SlurmOptions) -> str:
    """The sbatch script's text (ConfigError, in words, when the nodes cannot hold the job)."""
    plan = plan_nodes(cfg, opts.nodes, opts.gpus_per_node, opts.learner_nodes)
    rc = cfg.run.ray
    q = shlex.quote
    ray = q(str(Path(opts.python).parent / "ray")) if "/" in opts.python else "ray"
    py = q(opts.python)
    runs = Path(opts.workdir) / cfg.run.runs_dir
    cpus = f" --cpus-per-task={opts.cpus_per_task}" if opts.cpus_per_task else ""
    num_cpus = f" --num-cpus={opts.cpus_per_task}" if opts.cpus_per_task else ""

    def resources(kind: str, head: bool) -> str:
        res: dict[str, int] = {}
        rule = rc.learner_nodes if kind == "learner" else rc.engine_nodes
        if rule is not None:
            res[rule] = max(opts.gpus_per_node, 1)
        if head and rc.cpu_nodes not in (None, "head"):
            res[rc.cpu_nodes] = 1
        return f" --resources={q(json.dumps(res))}" if res else ""

    def ray_start(where: str, kind: str, head: bool) -> str:
        join = (
            f'--head --node-ip-address="$head_ip" --port={opts.ray_port}'
            if head
            else '--address="$RAY_ADDRESS"'
        )
        return (
            f'srun --nodes=1 --ntasks=1{cpus} -w "{where}" {ray} start {join}{num_cpus} '
            f"--num-gpus={opts.gpus_per_node}{resources(kind, head)} --block"
        )

    sbatch = [
        f"#SBATCH --job-name={cfg.run.name}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={opts.gpus_per_node}",
    ]
    if opts.cpus_per_task:
        sbatch.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}")
    if opts.mem:
        sbatch.append(f"#SBATCH --mem={opts.mem}")
    if opts.exclusive:
        sbatch.append("#SBATCH --exclusive")
    sbatch.append(f"#SBATCH --output={runs}/%x-%j.out")
    for flag, value in (
        ("partition", opts.partition),
        ("time", opts.time),
        ("account", opts.account),
    ):
        if value:
            sbatch.append(f"#SBATCH --{flag}={value}")
    if opts.requeue:
        sbatch += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{opts.signal_before_s}"]
    sbatch += [sbatch_line(line) for line in opts.sbatch_lines]

    run_argv = " ".join(q(a) for a in [*files, *overrides])
    wait = opts.node_wait_s
    lines = [
        "#!/bin/bash",
        f"# Written by `slime-async slurm`: a Ray cluster on {plan.nodes} node(s), then the job "
        "with the Ray launcher.",
        f"# {plan.words}",
        *sbatch,
        "set -euo pipefail",
        f"cd {q(opts.workdir)}",
        'log() { echo "[slime-async slurm $(date -u +%Y-%m-%dT%H:%M:%SZ)] $*"; }',
    ]
    if opts.setup or opts.env:
        lines.append("# environment: inherited by every srun step and the run")
        lines += list(opts.setup)
        lines += [f"export {k}={q(v)}" for k, v in opts.env]
    lines += [
        f'run_dir={q(str(runs / cfg.run.name))}-"$SLURM_JOB_ID"',
        'restarts="${SLURM_RESTART_COUNT:-0}"',
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f"if (( ${{#nodes[@]}} != {plan.nodes} )); then",
        f'  log "error: the allocation has ${{#nodes[@]}} node(s), the job was planned for '
        f'{plan.nodes}"; exit 1',
        "fi",
        'head_ip=$(srun --nodes=1 --ntasks=1 -w "${nodes[0]}" hostname --ip-address '
        "| awk '{print $1}')",
        f'export RAY_ADDRESS="$head_ip:{opts.ray_port}"',
        f"stop_ray() {{ {ray} stop --force >/dev/null 2>&1 || true; }}",
        "requeue=0; run_pid=; status=0",
    ]
    if opts.requeue:
        # Installed before anything starts: USR1's default action would end the script.
        lines += [
            "on_time_limit() {",
            f'  log "the time limit is {opts.signal_before_s}s away (USR1): stopping the run so '
            'the requeued job resumes it"',
            '  requeue=1; [[ -n "$run_pid" ]] && kill -TERM "$run_pid" 2>/dev/null || true',
            "}",
            "trap on_time_limit USR1",
        ]
    lines += [
        f"{ray_start('${nodes[0]}', 'learner', True)} &",
        "head_pid=$!",
        "waited=0",
        f'until {ray} status --address="$RAY_ADDRESS" >/dev/null 2>&1; do',
        '  if ! kill -0 "$head_pid" 2>/dev/null; then',
        '    code=0; wait "$head_pid" || code=$?',
        '    log "error: the Ray head on ${nodes[0]} exited (code $code) before it answered at '
        '$RAY_ADDRESS; its output is above"',
        "    stop_ray; exit 1",
        "  fi",
        f"  if (( waited >= {wait} )); then",
        '    log "error: the Ray head on ${nodes[0]} did not answer at $RAY_ADDRESS within '
        f'{wait}s (--node-wait-s)"',
        "    stop_ray; exit 1",
        "  fi",
        "  sleep 2; waited=$((waited + 2))",
        "done",
        'log "the Ray head answers at $RAY_ADDRESS (node ${nodes[0]}, after ${waited}s)"',
    ]
    if plan.learner_nodes > 1:
        lines.append(
            f"for i in $(seq 1 {plan.learner_nodes - 1}); do "
            f"{ray_start('${nodes[$i]}', 'learner', False)} & done"
        )
    if plan.engine_nodes > 0:
        lines.append(
            f"for i in $(seq {plan.learner_nodes} {plan.nodes - 1}); do "
            f"{ray_start('${nodes[$i]}', 'engine', False)} & done"
        )
    lines += [
        f"{py} - \"${{nodes[@]}}\" <<'EOF' || {{ stop_ray; exit 1; }}",
        "import sys, time, ray",
        'ray.init(address="auto", log_to_driver=False)',
        f"deadline = time.monotonic() + {wait}",
        "while True:",
        '    alive = [n["NodeManagerHostname"] for n in ray.nodes() if n["Alive"]]',
        f"    if len(alive) >= {plan.nodes}:",
        "        break",
        "    if time.monotonic() > deadline:",
        '        missing = [h for h in sys.argv[1:] if not any(a.split(".")[0] == h.split(".")[0] '
        "for a in alive)]",
        f'        sys.exit(f"timed out after {wait}s waiting for {plan.nodes} Ray nodes: '
        "{len(alive)} joined; not joined: {', '.join(missing) or '?'}\")",
        "    time.sleep(2)",
        "EOF",
        'log "all ${#nodes[@]} node(s) joined the Ray cluster"',
        'mkdir -p "$run_dir/metrics"',
        "resumed=0",
        'if (( restarts > 0 )) && [[ -f "$run_dir/config.json" ]]; then resumed=1; fi',
        f'printf \'{{"time": %s, "{m.SLURM_JOB_ID}": "%s", "{m.SLURM_RESTART_COUNT}": %s, '
        f'"{m.SLURM_RESUMED}": %s}}\\n\' "$(date +%s)" "$SLURM_JOB_ID" "$restarts" "$resumed" '
        '>> "$run_dir/metrics/slurm.jsonl"',
    ]
    address = '"run.ray.address=\\"$RAY_ADDRESS\\""'
    lines += [
        "if (( requeue )); then",
        '  status=143; log "the time limit came before the run started"',
        "else",
        "  if (( resumed )); then",
        '    log "restart $restarts of job $SLURM_JOB_ID: resuming $run_dir"',
        f'    {py} -m slime_async run --resume "$run_dir" {address} &',
        "  else",
        '    log "starting the run in $run_dir"',
        f'    {py} -m slime_async run {run_argv} {address} "run.run_dir=\\"$run_dir\\"" &',
        "  fi",
        "  run_pid=$!",
        '  if (( requeue )); then kill -TERM "$run_pid" 2>/dev/null || true; fi',
        "  while true; do",
        '    code=0; wait "$run_pid" || code=$?',
        # `wait` also returns (128 + N) when a trapped signal interrupts it; the run lives on then.
        '    if ! kill -0 "$run_pid" 2>/dev/null; then status=$code; break; fi',
        "  done",
        "fi",
        "stop_ray",
    ]
    if opts.requeue:
        lines += [
            "if (( requeue )) && (( status != 0 )); then",
            f"  if (( restarts >= {opts.max_requeues} )); then",
            f'    log "not requeued: the job already restarted $restarts time(s) '
            f"(--max-requeues {opts.max_requeues}); resume it with: slime-async run --resume "
            '$run_dir"',
            '    exit "$status"',
            "  fi",
            '  log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most '
            f'{opts.max_requeues}); it resumes $run_dir"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "  exit 0",
            "fi",
        ]
    lines += ['log "the run ended (exit $status); its directory: $run_dir"', 'exit "$status"']
    return "\n".join(lines) + "\n"
