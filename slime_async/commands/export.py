"""`slime-async export RUN_DIR [--step N] OUT`: a run's model as a Hugging Face directory.

RUN_DIR is a run directory (its `config.json` says where the checkpoints are), a checkpoints
directory (`step_<n>/` inside) or one checkpoint. The newest complete checkpoint is taken unless
`--step N` names one. OUT gets config.json, safetensors and the tokenizer, and is checked
before the command returns: the written model is loaded in transformers and its per-token
log-probs compared with the learner's (`actors/learner/hf_export.py`). OUT appears only once
complete and checked.

A checkpoint written at any TP/EP exports in one process (dist_checkpointing reshards it); a
model too big for one process exports under torchrun:

    slime-async export runs/quickstart-20261201-225558 hf_out/
    slime-async export runs/big-run --step 400 hf_400/
    torchrun --nproc-per-node 8 -m slime_async export runs/big-run hf/ --tensor-parallel 8 --no-check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "export a run's checkpoint as a complete Hugging Face model directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run directory, a checkpoints directory (step_N/ inside) or one checkpoint",
    )
    p.add_argument("out", metavar="OUT", help="output HF directory (must not exist)")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    p.add_argument(
        "--tensor-parallel", type=int, default=1, help="TP size of the export (torchrun ranks)"
    )
    p.add_argument(
        "--expert-parallel", type=int, default=1, help="EP size of the export (MoE models)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the written tensors (default float32)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip loading the result in transformers to compare log-probs with the learner's",
    )


def checkpoints_of(run_dir: Path) -> Path:
    """The checkpoints directory of RUN_DIR (or RUN_DIR itself when it is one or holds them)."""
    from slime_async.config import ConfigError, SlimeConfig

    if not (run_dir / "config.json").is_file() or (run_dir / "metadata.json").is_file():
        return run_dir
    if any(run_dir.glob("*.safetensors")):
        raise ConfigError(f"{run_dir} is an HF model directory already, not a run directory")
    cfg = SlimeConfig.read_json(run_dir / "config.json")
    cfg.run.run_dir = str(run_dir.resolve())  # the directory may have moved since
    ckpts = cfg.paths().checkpoints
    if ckpts is None:
        raise ConfigError(f"{run_dir}: the run kept no checkpoints (learner.save is unset)")
    return ckpts


def pick_checkpoint(root: Path, step: int | None) -> Path:
    """The checkpoint of `step` under `root`, else the newest; errors list what is there."""
    from slime_async.actors.learner.checkpoint import is_checkpoint
    from slime_async.actors.learner.process import latest_checkpoint

    if is_checkpoint(root):
        if step is not None:
            raise ValueError(f"{root} is one checkpoint: drop --step, or give its run directory")
        return root
    steps = sorted(
        int(p.name.removeprefix("step_"))
        for p in root.glob("step_*")
        if p.name.removeprefix("step_").isdigit() and is_checkpoint(p)
    )
    if not steps:
        raise FileNotFoundError(f"{root}: no complete checkpoint (step_N/ with metadata.json)")
    if step is None:
        found = latest_checkpoint(root)
        assert found is not None
        return found
    if step not in steps:
        shown = ", ".join(map(str, steps[-12:]))
        raise FileNotFoundError(f"{root}: no checkpoint of step {step} (steps there: {shown})")
    return root / f"step_{step}"


def main(args: argparse.Namespace) -> int:
    from slime_async import megatron_compat

    megatron_compat.quiet_library_warnings()
    try:
        ckpt = pick_checkpoint(checkpoints_of(Path(args.run_dir)), args.step)
        out = Path(args.out)
        if out.exists():
            raise FileExistsError(f"{out} exists already")
        return export(
            ckpt, out, args.tensor_parallel, args.expert_parallel, args.dtype, not args.no_check
        )
    except (ValueError, OSError, RuntimeError) as e:  # bad input or a failed check: named
        print(f"slime-async export: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError | OSError) else 1


def export(
    ckpt: Path, out: Path, tensor_parallel: int, expert_parallel: int, dtype: str, check: bool
) -> int:
    """Write and check `out` from checkpoint `ckpt`; rank 0 prints what it did."""
    # Here, not at the top: `slime-async --help` loads neither torch nor megatron.
    from slime_async.actors.learner.hf_export import export_checkpoint

    done = export_checkpoint(
        ckpt,
        out,
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        dtype=dtype,
        check=check,
    )
    if done is not None:
        checked = (
            f"; checked: log-probs within {done['check_max_diff']:.1e} of the learner's"
            if done["check_max_diff"] is not None
            else "; not checked (--no-check)"
        )
        print(
            f"wrote HF directory {done['out']} from {ckpt} (step {done['step']}, policy "
            f"version {done['version']}){checked}"
        )
    return 0
