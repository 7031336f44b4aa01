"""The examples' shared `python -m examples.<task>.<module> --out DIR` data command."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path


def write_splits(
    make_dataset: Callable[[Path, int, int], Path],
    task: str,
    out: str,
    n_train: int,
    n_eval: int,
    argv: Sequence[str] | None = None,
) -> int:
    """Parse --out/--train/--eval/--seed and write train.jsonl (seed) and eval.jsonl (seed + 1)."""
    ap = argparse.ArgumentParser(description=f"write the {task} task's train/eval JSONL")
    ap.add_argument("--out", default=out, help="output directory")
    ap.add_argument("--train", type=int, default=n_train, help="training prompts")
    ap.add_argument("--eval", type=int, default=n_eval, help="evaluation prompts")
    ap.add_argument("--seed", type=int, default=0, help="seed (eval uses seed + 1)")
    args = ap.parse_args(argv)
    make_dataset(Path(args.out) / "train.jsonl", args.train, args.seed)
    make_dataset(Path(args.out) / "eval.jsonl", args.eval, args.seed + 1)
    return 0
