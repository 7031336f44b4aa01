"""`slime-async generator`: stream rollouts of the configured plugin from the engines to the buffer."""

from __future__ import annotations

import argparse

from slime_async.commands import add_config_arguments, config_from_args

HELP = "run a generator: JSONL prompts -> rollout plugin on the engines -> rewards -> buffer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # Heavy (transformers, zmq): imported once the config is known to be good.
    from slime_async.actors.generator.process import run_generator

    return run_generator(cfg)
