"""`slime-async run`: the whole job, every role a supervised child process of this machine
(`run.launcher = "local"`) or of a Ray actor on its node of a Ray cluster (`"ray"`)."""

from __future__ import annotations

import argparse

from slime_async.commands import add_config_arguments

HELP = (
    "start buffer, engines, generators and learner on this machine (or on a Ray cluster: "
    "run.launcher=ray) and supervise them"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run from its directory (its config.json; KEY=VALUE overrides "
        "still apply, e.g. learner.num_steps=200)",
    )


def main(args: argparse.Namespace) -> int:
    from slime_async.config import ConfigError, load_config, split_cli_args
    from slime_async.launch.gpu_memory import gpu_shares, reserve_gib, shared_gpus
    from slime_async.launch.progress import ProgressDisplay
    from slime_async.launch.run_dir import RunDir, RunDirBusy
    from slime_async.launch.supervisor import WATCHDOG_GRACE_S, Supervisor, cleanup_leftovers
    from slime_async.launch.table import plan_roles
    from slime_async.metrics import metrics_path, read_metrics
    from slime_async.metrics.trackers import check_trackers, job_tracker

    files, overrides = split_cli_args(args.config)
    if args.resume:
        if files:
            raise ConfigError(f"--resume takes the run's own config.json; drop {files}")
        try:
            run_dir = RunDir.existing(args.resume)
            # One owner: refuse a directory whose supervisor lives; stop what a dead one left.
            run_dir.lock(wait_s=WATCHDOG_GRACE_S + 10)
        except (FileNotFoundError, RunDirBusy) as e:
            raise ConfigError(str(e)) from None
        left = cleanup_leftovers(run_dir, grace_s=WATCHDOG_GRACE_S)
        if left:
            print(
                f"[slime-async] stopped processes the previous supervisor left: pids {left}",
                flush=True,
            )
        cfg = load_config([run_dir.config_json], overrides)
        _check_launcher(cfg)
    else:
        if not files:
            raise ConfigError("name at least one CONFIG.toml (or use --resume RUN_DIR)")
        cfg = load_config(files, overrides)
        _check_launcher(cfg)
        run_dir = None  # created once every check below passed: a refused start leaves nothing
    from slime_async.commands.config import check_plugins

    check_plugins(cfg)  # import and check every plug-in before any process starts
    try:
        check_trackers(cfg.run.trackers, cfg.run.wandb)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.run.prepare:
        from slime_async.utils.plugins import import_object

        import_object(cfg.run.prepare, "run.prepare")(cfg)
    if cfg.run.launcher == "local":  # on a cluster the inputs may live on other nodes' disks
        from slime_async.config.paths import missing_inputs

        missing = missing_inputs(cfg)
        if missing:
            raise ConfigError(
                "inputs not found (a relative path is relative to the config file "
                "that sets it):\n  " + "\n  ".join(missing)
            )
    shares = []
    if shared_gpus(cfg):  # local runs only; the estimate imports the model package
        from slime_async.models.memory import estimate_learner_memory

        # refuses several engines on the learner's GPU
        shares = gpu_shares(cfg, estimate_learner_memory(cfg))
    if run_dir is None:
        try:
            run_dir = RunDir.create(cfg.run.runs_dir, cfg.run.name, cfg.run.run_dir)
            run_dir.lock()
        except (FileExistsError, RunDirBusy) as e:
            raise ConfigError(str(e)) from None
    cfg.run.run_dir = str(run_dir.path)  # every role finds the run directory here
    cfg.write_json(run_dir.config_json)
    print(f"[slime-async] run directory {run_dir.path}", flush=True)
    for share in shares:
        print(f"[slime-async] {share.note()}", flush=True)

    done = read_metrics(metrics_path(run_dir.path, "learner")) if args.resume else []
    progress = ProgressDisplay(
        cfg.learner.num_steps,
        mode=cfg.run.progress,
        start_step=done[-1]["step"] if done else 0,
    )
    tracker = job_tracker(cfg, run_dir.path)  # one wandb run / TensorBoard dir for the job
    for line in tracker.describe():
        print(f"[slime-async] {line}", flush=True)
    try:
        if cfg.run.launcher == "ray":
            from slime_async.launch.ray.launcher import run_on_ray

            code = run_on_ray(
                cfg, run_dir, resume=bool(args.resume), progress=progress, tracker=tracker
            )
        else:
            supervisor = Supervisor(
                run_dir,
                plan_roles(
                    cfg,
                    run_dir,
                    gpu_reserve={s.engine: reserve_gib(s) for s in shares if s.learner},
                ),
                resume=bool(args.resume),
                restart_failed=cfg.run.restart_failed,
                ready_timeout_s=cfg.run.ready_timeout_s,
                stop_grace_s=cfg.run.stop_grace_s,
                poll_interval_s=cfg.run.poll_interval_s,
                progress=progress,
                liveness=cfg.engine.liveness,
                api_key=cfg.engine.api_key,
                tracker=tracker,
                preload=_preload(cfg),
            )
            code = supervisor.run()
    finally:
        tracker.close()
    verdict = "completed" if code == 0 else "stopped"
    print(f"[slime-async] run {verdict} (exit {code}); logs in {run_dir.logs_dir}", flush=True)
    summaries = (
        summarize_eval(read_metrics(metrics_path(run_dir.path, "eval"))),
        summarize_run(read_metrics(metrics_path(run_dir.path, "learner"))),
        summarize_restarts(read_metrics(metrics_path(run_dir.path, "supervisor"))),
    )
    for summary in filter(None, summaries):
        print(f"[slime-async] {summary}", flush=True)
    return code


def summarize_eval(records: list[dict]) -> str:
    """Held-out accuracy at the first and the last evaluated version (pinned evaluation)."""
    from slime_async.metrics import names as m

    rows = [r for r in records if isinstance(r.get(m.EVAL_VERSION), int)]
    if len(rows) < 2:
        return ""
    first, last = rows[0], rows[-1]
    parts = []
    for key, label in ((m.EVAL_ACC_GREEDY, "greedy"), (m.EVAL_ACC_SAMPLED, "sampled")):
        if isinstance(first.get(key), int | float) and isinstance(last.get(key), int | float):
            a, b = 100.0 * first[key], 100.0 * last[key]
            parts.append(f"{label} {a:.1f} -> {b:.1f} ({b - a:+.1f} points)")
    if not parts:
        return ""
    steps = ""
    if first.get(m.EVAL_POSITION) is not None and last.get(m.EVAL_POSITION) is not None:
        a, b = first[m.EVAL_POSITION], last[m.EVAL_POSITION]
        if (a, b) != (first[m.EVAL_VERSION], last[m.EVAL_VERSION]):  # a restart left versions
            steps = f" ({b - a} updates apart)"
    return (
        f"eval accuracy, version {first[m.EVAL_VERSION]} -> {last[m.EVAL_VERSION]}{steps}: "
        + ", ".join(parts)
    )


def summarize_restarts(records: list[dict]) -> str:
    """The roles that failed during the run and how often each was restarted."""
    from slime_async.metrics import names as m

    if not records:
        return ""
    last = records[-1]  # counts are cumulative (per supervisor; a resume starts again)
    per_role = {
        k.removeprefix(m.SUP_ROLE_RESTARTS): v
        for k, v in last.items()
        if k.startswith(m.SUP_ROLE_RESTARTS)
    }
    roles = ", ".join(f"{name} {n}x" for name, n in sorted(per_role.items())) or "none"
    return (
        f"role failures: {last[m.SUP_FAILURES]}; restarted: {roles} "
        "(reasons in logs/supervisor.log, counts in metrics/supervisor.jsonl)"
    )


def _check_launcher(cfg) -> None:
    """Ray must be importable before anything starts when the run is to use it."""
    if cfg.run.launcher == "ray":
        from slime_async.launch.ray import import_ray

        import_ray()


def summarize_run(records: list[dict], window: int = 10) -> str:
    """Accuracy (or reward) over the first and the last `window` learner steps."""
    from slime_async.metrics import names as m

    key = m.ACCURACY if any(m.ACCURACY in r for r in records) else m.REWARD
    values = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    if len(values) < 2:
        return ""
    w = max(1, min(window, len(values) // 2))
    first = sum(v for _, v in values[:w]) / w
    last = sum(v for _, v in values[-w:]) / w
    scale, unit = (100.0, " points") if key == m.ACCURACY else (1.0, "")
    return (
        f"{key}: start {first * scale:.1f} (steps {values[0][0]}-{values[w - 1][0]}) -> "
        f"end {last * scale:.1f} (steps {values[-w][0]}-{values[-1][0]}): "
        f"{(last - first) * scale:+.1f}{unit}"
    )


def _preload(cfg) -> list[str] | None:
    """The fork server's imports, or None (every role a fresh interpreter) with the reason."""
    from slime_async.launch import preload

    if not cfg.run.fork_server:
        return None
    gpu = preload.gpu_visible()
    if gpu is not None:
        print(
            f"[slime-async] roles start as fresh interpreters: a GPU is visible ({gpu}), "
            "and no role that may use CUDA is forked from a process that imported torch",
            flush=True,
        )
        return None
    return preload.modules()
