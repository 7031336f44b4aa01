"""A synthetic task for throughput runs of randomly initialised models (no learning expected).

Prompts are short random strings; each record names a target response length drawn from a
log-normal distribution (median ~`median_len`, a long tail to `max_len`), and the rollout
generates exactly that many tokens (`ignore_eos`), so response lengths vary as in reasoning runs
even though a random model never emits EOS on purpose. The reward is a cheap function of the
sampled token ids (the fraction of even ids), so the learner has a real gradient to follow.

    generator.rollout = "examples.synthetic.task:rollout"
    run.prepare = "examples.synthetic.task:prepare"     # dataset + random-init model, cached
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any


def make_dataset(
    path: str | Path, n: int, seed: int, median_len: int = 128, max_len: int = 1024
) -> Path:
    """`n` records {prompt, length}: random prompts, log-normal target lengths."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(
                rng.choice("abcdefghij0123456789+ ") for _ in range(rng.randint(8, 32))
            )
            length = min(max_len, max(8, int(rng.lognormvariate(math.log(median_len), 0.8))))
            f.write(json.dumps({"prompt": prompt, "length": length}) + "\n")
    return path


async def rollout(ctx: Any, sample: Any):
    """One generation of exactly `sample.metadata["length"]` tokens, scored by its token ids."""
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    n = int(sample.metadata["length"])
    gen = await ctx.generate(t.ids, {"max_new_tokens": n, "ignore_eos": True})
    t.add_model(gen)
    ids = gen.token_ids
    t.reward = sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)
    return t


CACHE = Path(__file__).resolve().parents[2] / ".cache"
"""The repository's cache directory (git-ignored): `prepare` writes only in it."""
DATASET = CACHE / "synthetic" / "train.jsonl"
MODEL = CACHE / "qwen3-0.5b-random"


def prepare(cfg: Any) -> None:
    """`run.prepare` hook: the dataset and a random-init Qwen3-shaped ~0.5B model, built in the
    hook's own cache (`DATASET`, `MODEL`: what configs/gpu_two_h200.toml names) when missing;
    never written to a path the config names."""
    from slime_async.models.toy import QWEN3_05B_SHAPE, make_tiny_model

    if not DATASET.exists():
        make_dataset(DATASET, 20000, seed=0, max_len=cfg.generator.sampling.max_new_tokens)
    if not (MODEL / "config.json").exists():
        print(f"writing a random-init Qwen3-shaped ~0.5B model to {MODEL}")
        make_tiny_model(MODEL, "qwen3", seed=0, **QWEN3_05B_SHAPE)
