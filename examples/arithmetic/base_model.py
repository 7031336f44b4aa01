"""The quickstart's base model: a tiny Qwen3-shaped model warmed up with the learner's SFT mode.

No model hub is reachable, so the project makes its own starting point: a random-init tiny model
with the char tokenizer (slime_async/models/toy.py), then a short supervised warm-up on worked
solutions of the arithmetic task (examples/arithmetic/task.py), through the same Megatron-core
learner that does RL. The quickstart's problems add 2-8 one-digit numbers (the number of operands
has a long tail, so response lengths do too).

The demonstrations are noisy: a fraction `SLIP_PROB` of running sums is written wrong, as in human
data. The warm-up model then knows the right sum (greedy decoding is mostly right) but puts real
probability on slips, so answers *sampled* at temperature 1 are often wrong, and more so the longer
the work. RL with an exact-match reward is what removes the slips: measured on 100 eval problems
after 400 warm-up steps with SLIP_PROB 0.25, sampled accuracy was 46% against 88% greedy.

    python -m examples.arithmetic.base_model --out .cache/arithmetic-base   # ~1 min on 2 cores

The result is cached: `prepare(cfg)` (the quickstart's `run.prepare` hook) builds the dataset and
the model in its own cache, `<repo>/.cache/arithmetic/train.jsonl` and `<repo>/.cache/arithmetic-base`
(what configs/quickstart.toml names), only when they are missing. It never writes to a path the
config names: a `generator.dataset` or `learner.model_path` that points elsewhere is the user's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

from slime_async.config import AlgoConfig, LearnerConfig, SlimeConfig

SHAPE = dict(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    max_position_embeddings=512,
)
SHAPE_GPU = dict(
    hidden_size=1536,
    num_layers=24,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=4096,
    max_position_embeddings=512,
)
"""configs/gpu_one_h200.toml's base model: 0.60B parameters, sized for one GPU (warmed up there)."""
SHAPES = {"tiny": SHAPE, "0.6b": SHAPE_GPU}
DONE = "WARMUP_DONE"
CACHE = Path(__file__).resolve().parents[2] / ".cache"
"""The repository's cache directory (git-ignored); the hook writes only in it."""
DATASET = CACHE / "arithmetic" / "train.jsonl"
"""The quickstart's training prompts, written by `prepare` when missing."""
MODEL = CACHE / "arithmetic-base"
"""The quickstart's warmed-up base model, built by `prepare` when missing."""
EVAL = CACHE / "arithmetic" / "eval.jsonl"
"""The quickstart's held-out problems (eval.data; another seed than the training prompts)."""
EVAL_LARGE = CACHE / "arithmetic" / "eval_large.jsonl"
"""A larger held-out set (2,000 problems, a third seed) for evaluations that must resolve small
differences: `eval.data` pointing here with `eval.max_examples` up to 2,000."""
MODEL_GPU = CACHE / "arithmetic-base-0.6b"
"""configs/gpu_one_h200.toml's base model, built by `prepare_gpu` when missing."""
GPU_WARMUP = dict(steps=400, batch=64, lr=3e-4)
"""The 0.6B model's warm-up (a lower learning rate than the tiny model's 3e-3)."""
SLIP_PROB = 0.3


def quickstart_difficulty():
    """The quickstart's problems: 2-8 one-digit operands, mostly 2 (task.OPERAND_WEIGHTS)."""
    from examples.arithmetic.task import Difficulty

    return Difficulty(digits={1: 1.0})


def build_base_model(
    out_dir: str | Path,
    steps: int = 400,
    batch: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    shape: dict | None = None,
    dtype: str = "float32",
) -> Path:
    """Random-init model of `shape` (default the tiny `SHAPE`) + `steps` SFT steps of `batch`
    worked solutions -> HF dir. On a GPU where one is visible, in `dtype`."""
    from examples.arithmetic.task import sft_examples
    from slime_async.actors.learner.trainer import Learner
    from slime_async.models.tokenizer import load_tokenizer
    from slime_async.models.toy import make_tiny_model

    # megatron-core warns that Transformer Engine and Apex are absent: expected on a CPU.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
    out = Path(out_dir)
    init = out.with_name(out.name + ".init")
    shutil.rmtree(init, ignore_errors=True)
    make_tiny_model(init, "qwen3", seed=seed, **(shape or SHAPE))
    tok = load_tokenizer(init)
    cfg = LearnerConfig(
        model_path=str(init),
        lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=min(20, steps // 10),
        lr_decay_steps=steps,
        clip_grad=1.0,
        micro_batch_tokens=8192,
        seed=seed,
        dtype=dtype,
    )
    learner = Learner(cfg, AlgoConfig())
    # The warm-up's problems use another seed than the RL prompts (seed 0 in task.main).
    examples = sft_examples(
        steps * batch,
        seed=10_000 + seed,
        tokenizer=tok,
        difficulty=quickstart_difficulty(),
        slip_prob=SLIP_PROB,
    )
    t0 = time.perf_counter()
    try:
        for i in range(steps):
            m = learner.sft_step(examples[i * batch : (i + 1) * batch])
            if (i + 1) % 50 == 0 or i == 0:
                nll = m.get("nll", m.get("loss", float("nan")))
                print(
                    f"warm-up step {i + 1}/{steps}: nll {nll:.3f} ({time.perf_counter() - t0:.0f}s)"
                )
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        learner.save_hf(tmp)
    finally:
        learner.close()
    meta = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "slip_prob": SLIP_PROB}
    meta.update(shape=shape or SHAPE, dtype=dtype)
    (tmp / DONE).write_text(json.dumps(meta))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(init, ignore_errors=True)
    return out


def _datasets() -> None:
    from examples.arithmetic.task import make_dataset

    if not DATASET.exists():
        make_dataset(DATASET, 4000, seed=0, difficulty=quickstart_difficulty())
    if not EVAL.exists():
        make_dataset(EVAL, 200, seed=1, difficulty=quickstart_difficulty())
    if not EVAL_LARGE.exists():
        make_dataset(EVAL_LARGE, 2000, seed=2, difficulty=quickstart_difficulty())


def prepare(cfg: SlimeConfig) -> None:
    """`run.prepare` hook: build the quickstart's dataset and base model in the hook's own cache
    (`DATASET`, `MODEL`) unless they are there; never write to a path the config names."""
    _datasets()
    if not (MODEL / DONE).exists():
        print(f"building the quickstart's base model in {MODEL} (cached for later runs)")
        build_base_model(MODEL)
    _check_named(cfg, MODEL)


def prepare_gpu(cfg: SlimeConfig) -> None:
    """`run.prepare` hook of configs/gpu_one_h200.toml: the quickstart's prompts and a 0.6B base
    model (`SHAPE_GPU`) warmed up on the GPU in bf16, in `MODEL_GPU` unless it is there.

    The warm-up runs in a child process, so `slime-async run` (which calls this hook) holds no
    CUDA context of its own on the GPU its roles share."""
    _datasets()
    if not (MODEL_GPU / DONE).exists():
        print(f"building the 0.6B arithmetic base model on the GPU in {MODEL_GPU} (cached)")
        w = GPU_WARMUP
        cmd = [sys.executable, "-m", "examples.arithmetic.base_model", "--out", str(MODEL_GPU)]
        cmd += ["--shape", "0.6b", "--dtype", "bfloat16", "--require-gpu"]
        cmd += ["--steps", str(w["steps"]), "--batch", str(w["batch"]), "--lr", str(w["lr"])]
        done = subprocess.run(cmd, cwd=CACHE.parent)
        if done.returncode != 0:
            raise SystemExit(f"building {MODEL_GPU} failed (exit {done.returncode}): {cmd}")
    _check_named(cfg, MODEL_GPU)


def _check_named(cfg: SlimeConfig, model: Path) -> None:
    named = (
        ("generator.dataset", cfg.generator.dataset, DATASET),
        ("learner.model_path", cfg.learner.model_path, model),
        ("eval.data", cfg.eval.data, EVAL),
    )
    for key, value, own in named:
        if key == "eval.data" and value and Path(value).resolve() == EVAL_LARGE:
            continue
        if value and Path(value).resolve() != own and not Path(value).exists():
            print(f"run.prepare: {key} = {value} does not exist; this hook builds only {own}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".cache/arithmetic-base")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--require-gpu", action="store_true", help="refuse to warm up on a CPU")
    args = ap.parse_args(argv)
    if args.require_gpu:
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--shape {args.shape} is warmed up on a GPU, and none is visible")
    build_base_model(
        args.out, args.steps, args.batch, args.lr, args.seed, SHAPES[args.shape], args.dtype
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
