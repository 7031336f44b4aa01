"""`slime-async learner`: train on batches from the buffer and push weights to the engines."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from slime_async.commands import add_config_arguments, config_from_args

HELP = "run the Megatron-core learner (under torchrun for several ranks)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from slime_async.actors.learner.process import run_learner

    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else None
    return run_learner(cfg, run_dir, freeze_start_up=True)
