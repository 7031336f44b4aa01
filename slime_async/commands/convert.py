"""`slime-async convert SRC DST`: HF model directory <-> megatron-core torch_dist checkpoint.

The low-level command under `slime-async export` (which finds a run's checkpoint for you). The
direction follows SRC: an HF directory (config.json + safetensors) becomes a learner checkpoint
(model, fresh optimizer state, step 0, version 0) that `learner.load` resumes from; a torch_dist
checkpoint (written at any TP size) becomes a complete HF directory (config, safetensors,
tokenizer files), checked against the learner's log-probs as `export` does. Runs alone, or under
torchrun for a TP- or EP-sharded conversion (a mixture-of-experts model's experts split over
`--expert-parallel` ranks):

    torchrun --nproc-per-node 2 -m slime_async convert ckpt/ hf_out/ --tensor-parallel 2
    torchrun --nproc-per-node 2 -m slime_async convert Qwen3-30B-A3B/ ckpt/ --expert-parallel 2

A checkpoint written at one TP/EP layout loads at any other (dist_checkpointing reshards).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "convert an HF model directory to a torch_dist learner checkpoint, or back"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF model directory, or torch_dist checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--tensor-parallel", type=int, default=1, help="TP size of this conversion (torchrun ranks)"
    )
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        help="EP size of this conversion (MoE models; carved out of the torchrun ranks)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="parameter dtype of the model while converting (and of the written tensors)",
    )


def main(args: argparse.Namespace) -> int:
    from slime_async import megatron_compat

    megatron_compat.quiet_library_warnings()
    try:
        return _convert(
            Path(args.src), Path(args.dst), args.tensor_parallel, args.dtype, args.expert_parallel
        )
    except (ValueError, OSError, RuntimeError) as e:  # bad input or a failed check: named
        print(f"slime-async convert: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError | OSError) else 1


def _convert(
    src: Path, dst: Path, tensor_parallel: int, dtype: str, expert_parallel: int = 1
) -> int:
    if dst.exists():
        raise FileExistsError(f"{dst} exists already")
    # Here, not at the top: the CLI imports every command module to build its parser, and
    # `slime-async --help` loads neither torch nor pydantic.
    from slime_async.actors.learner import checkpoint as learner_ckpt
    from slime_async.actors.learner.trainer import Learner
    from slime_async.config import AlgoConfig, LearnerConfig

    if learner_ckpt.is_checkpoint(src):
        to_hf = True
    elif (src / "config.json").is_file():
        to_hf = False
    else:
        raise FileNotFoundError(
            f"{src} is neither an HF model directory (config.json) "
            "nor a torch_dist checkpoint (metadata.json)"
        )

    if to_hf:
        from slime_async.commands.export import export

        return export(src, dst, tensor_parallel, expert_parallel, dtype, check=True)
    cfg = LearnerConfig(
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        dtype=dtype,
        model_path=str(src),
    )
    learner = Learner(cfg, AlgoConfig())
    try:
        learner.save_checkpoint(dst, extra={})
    finally:
        learner.close()
    if learner.is_rank0:
        print(f"wrote torch_dist checkpoint {dst}")
    return 0
