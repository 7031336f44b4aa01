"""The launch table of `slime-async run` as the launch tests read it: planned on OS-chosen ports,
each role's config as its child process would load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_async.config import SlimeConfig, load_config, split_cli_args
from slime_async.launch import table as launch
from slime_async.launch.run_dir import RunDir
from slime_async.launch.supervisor import RoleSpec

FREE_PORTS = [
    "buffer.producer_endpoint=tcp://127.0.0.1:0",
    "buffer.consumer_endpoint=tcp://127.0.0.1:0",
    "engine.port=0",
    "engine.router_port=0",
]


def planned(
    tmp_path: Path, *overrides: str, **plan: Any
) -> tuple[SlimeConfig, RunDir, list[list[RoleSpec]]]:
    """The default config with `overrides`, its run directory under `tmp_path`, its launch table
    (`plan`: more arguments of `plan_roles`)."""
    cfg = load_config([], [*FREE_PORTS, *overrides])
    run_dir = RunDir.create(tmp_path, "t", tmp_path / "run")
    cfg.run.run_dir = str(run_dir.path)
    cfg.write_json(run_dir.config_json)
    return cfg, run_dir, launch.plan_roles(cfg, run_dir, **plan)


def names(stages: list[list[RoleSpec]]) -> list[list[str]]:
    return [[s.name for s in stage] for stage in stages]


def child_config(run_dir: RunDir, argv: list[str]) -> SlimeConfig:
    """The config a child sees: config.json plus the overrides on its command line."""
    i = argv.index(str(run_dir.config_json))
    files, overrides = split_cli_args(argv[i:])
    assert files == [str(run_dir.config_json)]
    return load_config(files, overrides)
