"""Qwen3-MoE on one GPU: the learner's train step and the embedded engine beside HF transformers.

    python bench/bench_moe.py [--layers 4 --batch 4 --seq 1024] [--part learner|engine|both]

A reduced-depth Qwen3-30B-A3B shape (its width and experts, `--layers` layers, random init,
bf16): hidden 2048, 32 heads of 128, 4 kv heads, 128 experts of width 768, top 8 (renormalised),
vocab 151,936, untied embeddings.

- learner: one optimizer step on `--batch` x `--seq` tokens (GRPO, ppo_clip), at EP 1 (one GPU:
  EP 2 needs two), tokens/s and peak memory, beside HF transformers doing the same step (its
  log-probs, PPO clip, backward, the same fp32-master AdamW) in the same process.
- engine: the embedded engine (HTTP, greedy, `--new-tokens`) at each of `--batches` concurrent
  requests, beside HF `generate()` on the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import bench_engine
import bench_learner
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.learner.trainer import Learner
from slime_async.config import AlgoConfig, LearnerConfig
from slime_async.models.toy import char_tokenizer, save_tokenizer, tiny_config


def make_model_dir(out: Path, args) -> Path:
    cfg = tiny_config(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        moe_intermediate_size=args.moe_ffn,
        max_position_embeddings=max(4096, args.seq),
        rope_theta=1000000.0,
    )
    cfg.head_dim = args.head_dim
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():  # HF initialises routers to zero: every token would tie
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(char_tokenizer(), out)
    return out


def bench_learner_step(args, model_dir: Path) -> dict:
    on_gpu = torch.cuda.is_available()
    out: dict = {}
    group = bench_learner.make_group(args, np.random.default_rng(0))
    cfg = LearnerConfig(
        model_path=str(model_dir),
        dtype="bfloat16" if on_gpu else "float32",
        lr=1e-6,
        micro_batch_tokens=args.batch * args.seq,
    )
    # One PPO update per step, as the HF baseline does (see bench_learner.py).
    learner = Learner(cfg, AlgoConfig(loss="ppo_clip", advantage="grpo", mini_batches=1))
    out["params"] = sum(p.numel() for p in learner.model.parameters())
    times = []
    for i in range(args.warmup + args.steps):
        bench_learner.sync()
        t0 = time.perf_counter()
        learner.train_step([group])
        bench_learner.sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    out["learner_tokens_per_s"] = tokens / float(np.mean(times))
    if on_gpu:
        out["learner_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    dev = learner.device
    # The learner's memory goes before HF's model comes (one GPU holds one at a time).
    learner.model.to("cpu")
    # megatron's DDP holds the gradient buffers
    learner.updates.optimizer = learner.updates.train_model = None
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
    out["hf_tokens_per_s"] = tokens / bench_learner.hf_train_steps(hf, group, args, args.steps)
    if on_gpu:
        out["hf_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    learner.close()
    out["ratio_learner_over_hf"] = out["learner_tokens_per_s"] / out["hf_tokens_per_s"]
    return out


def bench_engine_generate(args, model_dir: Path, work: Path) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    batches = [int(b) for b in args.batches.split(",")]
    child, url = bench_engine.start_engine(
        model_dir, device, dtype, max(batches), work / "engine.log", 0 if device == "cuda" else 1
    )
    rows = []
    try:
        for b in batches:
            prompts = bench_engine.prompts_for(b, args.prompt_len, args.vocab)
            eng = asyncio.run(bench_engine.engine_tokens_per_s(url, prompts, args.new_tokens))
            rows.append({"batch": b, "engine_tokens_per_s": eng})
            print(f"batch {b}: engine {eng:.0f} tok/s", flush=True)
    finally:
        child.stop()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    hf.eval()
    for row in rows:
        prompts = bench_engine.prompts_for(row["batch"], args.prompt_len, args.vocab)
        with torch.inference_mode():
            ref = bench_engine.hf_tokens_per_s(hf, prompts, args.new_tokens, device)
        row["hf_tokens_per_s"] = ref
        print(f"batch {row['batch']}: HF generate {ref:.0f} tok/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=6144)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--part", choices=["learner", "engine", "both"], default="both")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    results: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "shape": {k: v for k, v in vars(args).items() if k not in ("json", "part")},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", args)
        if args.part in ("learner", "both"):
            results["learner"] = bench_learner_step(args, model_dir)
            print(json.dumps(results["learner"]), flush=True)
        if args.part in ("engine", "both"):
            results["engine"] = bench_engine_generate(args, model_dir, Path(tmp))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
