"""Learner checkpoints through megatron-core's dist_checkpointing (torch_dist format).

A checkpoint directory holds the model and optimizer as ShardedTensors (so it loads at any TP
size), per-rank RNG states (restored only when the world size matches), and a common part
written by rank 0: step, policy version, the architecture, the HF config and the caller's
`extra` dict (the buffer consumer's commit cursor). `tokenizer/` beside it holds the tokenizer
files, so `slime-async export` writes a complete HF directory from the checkpoint alone. With
`learner.save_hf_interval`, `hf/` holds that complete HF directory (config, safetensors,
tokenizer), written before the rename. The directory is written under a temporary name and
renamed when complete: a crash mid-save never leaves a directory that looks like a checkpoint,
nor an `hf/` without its weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_async import megatron_compat
from slime_async.models.convert import copy_tokenizer_files

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

COMMON_KEY = "learner"
TOKENIZER_DIR = "tokenizer"
"""The checkpoint's tokenizer files (and generation config), for exports."""
HF_DIR = "hf"
"""A complete HF export of the checkpoint's weights (`learner.save_hf_interval`)."""


def tokenizer_dir(path: str | Path) -> Path | None:
    """Where checkpoint `path` keeps its tokenizer files, or None when it has none.

    Checkpoints written before `tokenizer/` existed kept them in `hf/` (without weights)."""
    for name in (TOKENIZER_DIR, HF_DIR):
        d = Path(path) / name
        if d.is_dir():
            return d
    return None


def is_checkpoint(path: str | Path) -> bool:
    """A complete megatron-core distributed checkpoint: its `metadata.json` names the backend.

    Only that file: megatron-core up to 0.16 also writes `common.pt`, later versions keep the
    common part inside the torch_dist files (0.19 writes no `common.pt`)."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "sharded_backend" in meta


def read_common(path: str | Path) -> dict[str, Any]:
    """The common part (step, version, arch, hf_config, extra, world_size) without loading weights."""
    from megatron.core import dist_checkpointing

    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path}: not a torch_dist checkpoint (no metadata.json naming its backend)"
        )
    return dist_checkpointing.load_common_state_dict(str(path))[COMMON_KEY]


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "cpu": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _state_dict(
    model, optimizer, common: dict | None, with_rng: bool, loading: bool = False
) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = model.sharded_state_dict()
    if loading and hasattr(optimizer, "sharded_state_dict_for_load"):
        opt_sd = optimizer.sharded_state_dict_for_load(model_sd)  # megatron's optimizer
    else:
        opt_sd = optimizer.sharded_state_dict(model_sd)
    sd: dict[str, Any] = {"model": model_sd, "optimizer": opt_sd}
    if common is not None:
        sd[COMMON_KEY] = common
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        sd["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return sd


def save(
    path: str | Path,
    model,
    optimizer,
    common: dict[str, Any],
    tokenizer_dir: str | Path | None,
    write_hf: Callable[[Path], Any] | None = None,
) -> Path:
    """Every rank calls it. Fails (before writing) if `path` already exists.

    `write_hf(dir)`, called on every rank before the rename, writes the complete HF export into
    `dir` (the checkpoint's `hf/`)."""
    from megatron.core import dist_checkpointing

    final = Path(path).absolute()
    tmp = final.with_name(final.name + ".partial")
    if final.exists():  # every rank sees it and fails alike, before any collective
        raise FileExistsError(f"{final}: checkpoint directory exists already")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    common = {**common, "world_size": dist.get_world_size()}
    megatron_compat.write_results_in_process()
    dist_checkpointing.save(_state_dict(model, optimizer, common, with_rng=True), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0 and tokenizer_dir is not None:
        tok = tmp / TOKENIZER_DIR
        tok.mkdir()
        copy_tokenizer_files(tokenizer_dir, tok)
    if write_hf is not None:
        write_hf(tmp / HF_DIR)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp.rename(final)
    dist.barrier()
    return final


def load(path: str | Path, model, optimizer) -> dict[str, Any]:
    """Load model (any TP), optimizer (if given) and, at the same world size, RNG; returns common."""
    from megatron.core import dist_checkpointing

    common = read_common(path)
    same_world = common.get("world_size") == dist.get_world_size()
    if optimizer is None:
        sd = {"model": model.sharded_state_dict()}
    else:
        sd = _state_dict(model, optimizer, None, with_rng=same_world, loading=True)
    loaded = dist_checkpointing.load(sd, str(path))
    model.load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        optimizer.load_sharded(loaded["optimizer"], step=common["step"])
        if same_world:
            _set_rng_state(loaded["rng"])
    return common
