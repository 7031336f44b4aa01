"""The `slime-async` command. Subcommands live in `slime_async/commands/<name>.py`.

Each command module is cheap to import (heavy imports happen inside its `main`) and defines
`HELP` (one line), `add_arguments(parser)` and `main(args) -> int`. `--help` therefore answers
without importing torch, megatron or zmq.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand -> module. A command is listed here only once it works.
COMMANDS: dict[str, str] = {
    "run": "slime_async.commands.run",
    "config": "slime_async.commands.config",
    "engine": "slime_async.commands.engine",
    "generator": "slime_async.commands.generator",
    "learner": "slime_async.commands.learner",
    "buffer": "slime_async.commands.buffer",
    "keygen": "slime_async.commands.keygen",
    "plot": "slime_async.commands.plot",
    "export": "slime_async.commands.export",
    "convert": "slime_async.commands.convert",
    "inspect": "slime_async.commands.inspect",
    "slurm": "slime_async.commands.slurm",
    "sweep": "slime_async.commands.sweep",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-async",
        description="Asynchronous off-policy RL for LLM post-training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    # Here, not at the top: `slime-async --help` answers before pydantic is imported.
    from slime_async.config import ConfigError
    from slime_async.utils.plugins import PluginError

    try:
        return int(args._main(args) or 0)
    except (ConfigError, PluginError) as e:
        print(f"slime-async {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
