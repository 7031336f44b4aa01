"""Subcommands of `slime-async`; helpers shared by them."""

from __future__ import annotations

import argparse


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """CONFIG.toml files (composed left to right) and section.key=value overrides."""
    p.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG|KEY=VALUE",
        help="TOML config files (later ones override earlier ones) and dotted overrides, "
        "e.g. configs/quickstart.toml learner.lr=1e-5",
    )


def config_from_args(args: argparse.Namespace):
    """The validated `SlimeConfig` named by the command's positional arguments."""
    from slime_async.config import load_config, split_cli_args

    files, overrides = split_cli_args(args.config)
    return load_config(files, overrides)
