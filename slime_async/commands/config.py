"""`slime-async config`: validate config files and print the resolved config."""

from __future__ import annotations

import argparse
import json

from slime_async.commands import add_config_arguments, config_from_args

HELP = "validate TOML configs plus overrides and print the resolved config as JSON"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--section", help="print only this section (e.g. learner)")


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    data = cfg.model_dump(mode="json")
    if args.section:
        data = data[args.section]
    print(json.dumps(data, indent=2))
    return 0
