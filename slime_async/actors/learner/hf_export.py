"""A checkpoint out as a Hugging Face model directory, checked against the learner.

`export_checkpoint(ckpt, out)` builds the model alone (no optimizer, no buffer, no engines) at
the TP/EP layout of this process group, loads the checkpoint's weights into it
(dist_checkpointing reshards a checkpoint written at any TP/EP), gathers them to rank 0 with HF
names (`export.py`), and writes config, safetensors and tokenizer into `<out>.partial`, renamed
to `out` only once complete: an interrupted export leaves no directory that looks like a model.
The check then loads the written directory in transformers and compares its per-token
log-probs with the learner's own on a few fixed token sequences; a difference beyond the
dtype's tolerance fails the export and removes the directory.

Every rank calls it (alone, or under torchrun with world size = TP x EP); only rank 0 writes.
Memory: the model's shard, one gathered bucket (`bucket_bytes`) on rank 0 and, for the check,
the HF model on rank 0 (`check=False` skips it for a model that does not fit twice).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime_async import megatron_compat
from slime_async.actors.learner import checkpoint as learner_ckpt
from slime_async.actors.learner import export as learner_export
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.models import convert
from slime_async.models.arch import ModelArch

CHECK_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}
"""Largest |log-prob difference| the check accepts, per dtype. fp32 agrees to ~1e-6 (the tests
hold 1e-5); bf16 rounding alone moves log-probs by ~1e-2, while a layout error (a swapped head,
a transposed shard) moves them by O(1)."""
CHECK_SEQUENCES = 3
CHECK_LEN = 24


class ExportCheckFailed(RuntimeError):
    """The written HF model scores tokens unlike the learner; the message has the figures."""


def hf_config_for(hf_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The checkpoint's HF config with the dtype of the tensors written."""
    config = dict(hf_config)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    return config


def write_hf(
    model: torch.nn.Module,
    arch: ModelArch,
    layout: ParallelLayout,
    hf_config: dict[str, Any],
    tokenizer_dir: Path | None,
    out_dir: Path,
    dtype: str,
    bucket_bytes: int = 1 << 30,
) -> Path | None:
    """The model as a complete HF directory at `out_dir`; every rank calls it, rank 0 writes.

    Written under `<out_dir>.partial` and renamed: `out_dir` exists only once complete."""
    tensors = (
        t for bucket in learner_export.hf_buckets(model, arch, layout, bucket_bytes) for t in bucket
    )
    if not layout.is_rank0:
        for _ in tensors:  # the gathers are collectives: step through them with rank 0
            pass
        return None
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert.write_hf_dir(tmp, tensors, hf_config_for(hf_config, dtype), tokenizer_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(out_dir)
    return out_dir


def check_sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Fixed pseudo-random token sequences for the check (the same on every rank)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, CHECK_LEN - 4 * i).tolist() for i in range(CHECK_SEQUENCES)]


def hf_logprobs(hf_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """log p(seq[t+1] | seq[:t+1]) [L-1] per sequence from the HF model at `hf_dir`, in fp32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load says nothing to the user here
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = hf(torch.tensor([s])).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            out.append(logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    del hf
    return out


def check_export(
    hf_dir: Path, learner_logp: list[torch.Tensor], sequences: list[list[int]], dtype: str
) -> float:
    """Max |log-prob difference| between the HF model at `hf_dir` and the learner's
    `learner_logp`; raises ExportCheckFailed past the dtype's tolerance."""
    want = hf_logprobs(hf_dir, sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(learner_logp, want, strict=True))
    tol = CHECK_TOLERANCE[dtype]
    if not diff <= tol:  # NaN fails too
        raise ExportCheckFailed(
            f"{hf_dir}: the HF model's log-probs differ from the learner's by up to {diff:.3g} "
            f"(tolerance {tol:g} for {dtype}) on {len(sequences)} token sequences: the "
            "conversion of this architecture is wrong; please report it with the config.json"
        )
    return diff


def export_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    dtype: str = "float32",
    check: bool = True,
) -> dict[str, Any] | None:
    """Checkpoint -> complete HF directory; every rank calls it. Rank 0 returns what was done
    (`out`, `step`, `version`, `check_max_diff`), the others None.

    Fails before writing anything when `out_dir` exists; a failed check removes `out_dir`."""
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists already")
    if dtype not in CHECK_TOLERANCE:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(CHECK_TOLERANCE)}")
    layout = ParallelLayout(tensor_parallel, expert_parallel)
    try:
        world = dist.get_world_size()
        if world != tensor_parallel * expert_parallel:
            raise ValueError(
                f"export runs on TP x EP = {tensor_parallel * expert_parallel} processes, this "
                f"job has {world}: start it with torchrun --nproc-per-node "
                f"{tensor_parallel * expert_parallel}"
            )
        return _export(layout, ckpt, out, dtype, check)
    finally:
        layout.close()


def _export(
    layout: ParallelLayout, ckpt: Path, out: Path, dtype: str, check: bool
) -> dict[str, Any] | None:
    from slime_async.actors.learner.microbatches import MicroBatches
    from slime_async.models.megatron import build_gpt_model

    common = learner_ckpt.read_common(ckpt)
    arch = ModelArch(**common["arch"])
    on_cpu = megatron_compat.cpu_mode()
    model = build_gpt_model(arch, getattr(torch, dtype), init=False, on_cpu=on_cpu)
    learner_ckpt.load(ckpt, model, None)
    model.eval()
    written = write_hf(
        model, arch, layout, common["hf_config"], learner_ckpt.tokenizer_dir(ckpt), out, dtype
    )
    diff = None
    if check:
        sequences = check_sequences(arch.vocab_size)
        mb = MicroBatches(
            layout,
            arch,
            micro_batch_tokens=CHECK_LEN * CHECK_SEQUENCES,
            pack_min_padding=None,
            attention="sdpa",
            logprob_kernel="torch",
            logprob_chunk_tokens=4096,
            routing_replay=False,
            temperature=1.0,
        )
        with torch.no_grad():
            learner_logp = [lp for lp, _ in mb.compute_logprobs(model, sequences)]
        failure: BaseException | None = None
        if written is not None:
            try:
                diff = check_export(written, learner_logp, sequences, dtype)
            except Exception as e:
                shutil.rmtree(written, ignore_errors=True)
                failure = e
        # Every rank learns the outcome, so a failed check fails the whole job, not rank 0 alone.
        failed = torch.tensor([float(failure is not None)], device=layout.device)
        dist.broadcast(failed, src=0)
        if failure is not None:
            raise failure
        if float(failed) > 0:
            raise ExportCheckFailed("rank 0's check of the exported HF model failed")
    if written is None:
        return None
    return {
        "out": str(written),
        "step": int(common["step"]),
        "version": int(common["version"]),
        "check_max_diff": diff,
    }
