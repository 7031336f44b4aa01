"""Qwen3-MoE on one GPU: the learner's train step and the embedded engine beside HF transformers.

    python bench/bench_moe.py [--layers 4 --batch 4 --seq 1024] [--part learner|engine|both]
    python bench/bench_moe.py --part learner --sides grouped,sequential,hf

A reduced-depth Qwen3-30B-A3B shape (its width and experts, `--layers` layers, random init,
bf16): hidden 2048, 32 heads of 128, 4 kv heads, 128 experts of width 768, top 8 (renormalised),
vocab 151,936, untied embeddings.

- learner: one optimizer step on `--batch` x `--seq` tokens (GRPO, ppo_clip), at EP 1 (one GPU),
  with the experts as grouped GEMMs (`learner.moe_experts = "grouped"`) and, with `sequential`
  in `--sides`, as megatron's SequentialMLP; beside HF transformers doing the same step (its
  log-probs at the response positions, PPO clip, backward, the same fp32-master AdamW; its own
  experts implementation, `grouped_mm` by default in transformers 5). Each side runs in its own
  process, so each has the GPU's memory to itself; each reports the mean step time with its
  spread (min-max over `--steps` steps) and its peak memory.
- engine: the embedded engine (HTTP, greedy, `--new-tokens`) at each of `--batches` concurrent
  requests, beside HF `generate()` on the same prompts (after the engine has exited).

MFU: model FLOPs per second over the dense bf16 peak (`--peak-tflops`, 989 for an H100/H200),
counting 6 x the parameters each token goes through (attention, router, its top-k experts, the
output layer; the embedding is a lookup) plus causal attention, 12 x layers x seq/2 x heads x
head_dim per token, for a train step; 2 x those parameters (and 4 x layers x context x heads x
head_dim) per generated token.

Expert parallelism (one host): `torchrun --nproc-per-node 2 bench/bench_moe.py --part learner
--expert-parallel 2` runs each learner side at EP 2, one GPU a rank, in the ranks' own processes
one side after the other. EP ranks are data-parallel ranks: each trains its own `--batch` rows,
so tokens/s are the world's (`--batch` x `--seq` x ranks a step) and MFU is per GPU; peak memory
is each rank's. After a side is timed, the same weights at EP 1 (data parallel over the same
processes, each the whole model, the same experts implementation) give the log-prob reference:
the side's log-probs at EP N of one batch (the same rows on every rank, before training) against
EP 1's (`logprobs_vs_ep1`, not bit-equal in bf16: the experts' GEMMs see other row counts, and a
near-tie in a router can pick another expert for a token). HF runs on one GPU: not a side at
EP > 1 (`--sides` defaults to grouped there); the engine part neither. Rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
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
    del model  # the sides run in processes of their own: give them this memory back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def active_params(args) -> int:
    """Parameters one token goes through (not the embedding: a lookup)."""
    attn = args.hidden * args.head_dim * (2 * args.heads + 2 * args.kv_heads)
    experts = args.topk * 3 * args.hidden * args.moe_ffn + args.hidden * args.experts
    return args.layers * (attn + experts) + args.hidden * args.vocab


def train_flops_per_token(args) -> float:
    attention = 12 * args.layers * (args.seq / 2) * args.heads * args.head_dim
    return 6 * active_params(args) + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def spread(times: list[float]) -> dict:
    return {
        "step_s_mean": float(np.mean(times)),
        "step_s_min": float(np.min(times)),
        "step_s_max": float(np.max(times)),
    }


def side_cfg(args, model_dir: Path, side: str, expert_parallel: int = 1) -> LearnerConfig:
    return LearnerConfig(
        model_path=str(model_dir),
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        lr=1e-6,
        micro_batch_tokens=args.batch * args.seq,
        moe_experts=side,
        expert_parallel=expert_parallel,
    )


# One PPO update per step, as the HF baseline does (see bench_learner.py).
ALGO = AlgoConfig(loss="ppo_clip", advantage="grpo", mini_batches=1)


def learner_steps(learner, group, args) -> tuple[list[float], list[float]]:
    """(seconds of each step after --warmup, every step's loss): bench_learner's timing."""
    times: list[float] = []
    _, losses = bench_learner.time_learner(learner, [group], args, times=times)
    return times, losses


def run_side(args, model_dir: Path, side: str) -> dict:
    """One side of the learner comparison, in this process (the parent runs each in its own)."""
    on_gpu = torch.cuda.is_available()
    group = bench_learner.make_group(args, np.random.default_rng(0))
    tokens = args.batch * args.seq
    out: dict = {"side": side}
    if side == "hf":
        dev = "cuda" if on_gpu else "cpu"
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
        out["experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
        times = hf_step_times(hf, group, args)
    else:
        learner = Learner(side_cfg(args, model_dir, side), ALGO)
        out["params"] = sum(p.numel() for p in learner.model.parameters())
        times, out["losses"] = learner_steps(learner, group, args)
        learner.close()
    out.update(spread(times))
    out["tokens_per_s"] = tokens / out["step_s_mean"]
    out["mfu"] = mfu(out["tokens_per_s"], train_flops_per_token(args), args.peak_tflops)
    if on_gpu:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def parallel_sides(args, model_dir: Path, rank: int, world: int) -> dict:
    """Under torchrun at --expert-parallel N = world: each learner side in these processes in
    turn, then the same side at EP 1 for the log-prob reference (see the module docstring)."""
    check = bench_learner.make_group(args, np.random.default_rng(0))  # the same rows everywhere
    seqs = [np.concatenate([t.prompt_ids, t.response_ids]).tolist() for t in check]
    group = bench_learner.make_group(args, np.random.default_rng(rank))  # this rank's own rows
    rows = {}
    for side in args.sides.split(","):
        bench_learner.free_cuda()
        learner = Learner(side_cfg(args, model_dir, side, args.expert_parallel), ALGO)
        out: dict = {"side": side, "expert_parallel": learner.parallel.ep_size, "gpus": world}
        out["params_per_rank"] = bench_learner.per_rank(
            world, sum(p.numel() for p in learner.model.parameters())
        )
        logp = torch.stack([lp for lp, _ in learner.compute_logprobs(seqs)])  # [B, L-1]
        times, out["losses"] = learner_steps(learner, group, args)
        out["peak_mem_gb_per_rank"] = bench_learner.per_rank(world, bench_learner.peak_gb())
        learner.close()
        del learner
        bench_learner.free_cuda()
        ref_learner = Learner(side_cfg(args, model_dir, side, 1), ALGO)
        ref = torch.stack([lp for lp, _ in ref_learner.compute_logprobs(seqs)])  # [B, L-1]
        out["ep1_params"] = sum(p.numel() for p in ref_learner.model.parameters())
        ref_learner.close()
        del ref_learner
        out["logprobs_vs_ep1"] = bench_learner.abs_diff(logp, ref)
        out["mean_logp"] = logp.mean().item()
        # The step ends in collectives: rank 0's times are the group's.
        out.update(spread(times))
        out["tokens_per_s"] = args.batch * args.seq * world / out["step_s_mean"]
        out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world
        out["mfu"] = mfu(out["tokens_per_s_per_gpu"], train_flops_per_token(args), args.peak_tflops)
        out["peak_mem_gb"] = bench_learner.largest(out["peak_mem_gb_per_rank"])
        rows[side] = out
        if rank == 0:
            print(f"learner side {side}: {json.dumps(out)}", flush=True)
    return rows


def hf_step_times(model, group, args) -> list[float]:
    """Seconds of each HF step after --warmup: bench_learner's HF baseline (response log-probs,
    PPO clip, backward, the fp32-master AdamW)."""
    import torch.distributed as dist

    from slime_async.utils.procs import free_port

    if not dist.is_initialized():  # MasterAdamW reduces over (one-rank) process groups
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    times: list[float] = []
    bench_learner.hf_train_steps(model, group, args, args.steps, times=times)
    return times


def bench_learner_sides(args, model_dir: Path) -> dict:
    """Each side in a child process of its own; their JSON lines collected."""
    rows = {}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(model_dir)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in shape_args(args).items()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.side_timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"side {side} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        rows[side] = json.loads(lines[-1])
        print(f"learner side {side}: {json.dumps(rows[side])}", flush=True)
    if "hf" in rows:
        for side, row in rows.items():
            if side != "hf":
                row["ratio_over_hf"] = row["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    return rows


def shape_args(args) -> dict:
    keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "experts", "topk")
    keys += ("moe_ffn", "vocab", "batch", "seq", "warmup", "steps", "peak_tflops")
    return {k: getattr(args, k) for k in keys}


def decode_flops_per_token(args, context: int) -> float:
    return 2 * active_params(args) + 4 * args.layers * context * args.heads * args.head_dim


def bench_engine_generate(args, model_dir: Path, work: Path) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    batches = [int(b) for b in args.batches.split(",")]
    child, url = bench_engine.start_engine(
        model_dir, device, dtype, max(batches), work / "engine.log", 0 if device == "cuda" else 1
    )
    flops = decode_flops_per_token(args, args.prompt_len + args.new_tokens // 2)
    rows = []
    try:
        for b in batches:
            prompts = bench_engine.prompts_for(b, args.prompt_len, args.vocab)
            runs = [
                asyncio.run(bench_engine.engine_tokens_per_s(url, prompts, args.new_tokens))
                for _ in range(args.repeats)
            ]
            eng = float(np.mean(runs))
            rows.append(
                {
                    "batch": b,
                    "engine_tokens_per_s": eng,
                    "engine_min_max": [min(runs), max(runs)],
                    "engine_mfu": mfu(eng, flops, args.peak_tflops),
                }
            )
            print(
                f"batch {b}: engine {eng:.0f} tok/s ({min(runs):.0f}-{max(runs):.0f})", flush=True
            )
    finally:
        child.stop()
    graphs = [ln for ln in (work / "engine.log").read_text().splitlines() if "CUDA graph" in ln]
    print(f"engine: {graphs[-1] if graphs else 'no CUDA graph line in its log'}", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    hf.eval()
    for row in rows:
        prompts = bench_engine.prompts_for(row["batch"], args.prompt_len, args.vocab)
        with torch.inference_mode():
            runs = [
                bench_engine.hf_tokens_per_s(hf, prompts, args.new_tokens, device)
                for _ in range(args.repeats)
            ]
        row["hf_tokens_per_s"] = float(np.mean(runs))
        row["hf_min_max"] = [min(runs), max(runs)]
        row["ratio_over_hf"] = row["engine_tokens_per_s"] / row["hf_tokens_per_s"]
        print(f"batch {row['batch']}: HF generate {row['hf_tokens_per_s']:.0f} tok/s", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument(
        "--sides",
        default=None,
        help="learner sides: grouped,sequential,hf (default grouped,hf; grouped at EP > 1)",
    )
    ap.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        help="the learner's EP size, under torchrun --nproc-per-node N (one rank a GPU); the "
        "same weights at EP 1 give the log-prob reference",
    )
    ap.add_argument("--side-timeout", type=float, default=1800.0)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="engine/HF generate runs per batch")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--part", choices=["learner", "engine", "both"], default="both")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: one learner side
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    return ap


def check_args(args: argparse.Namespace, world: int | None = None) -> None:
    """Refuse what cannot run at this EP size and process count; resolve `--sides`."""
    ep = args.expert_parallel
    if ep < 1:
        sys.exit(f"--expert-parallel {ep}: at least 1")
    world = bench_learner.world_size() if world is None else world
    bench_learner.check_world(ep, "--expert-parallel", world, "bench/bench_moe.py")
    if args.experts % ep:
        sys.exit(f"--expert-parallel {ep}: --experts {args.experts} is not a multiple of it")
    sides = (args.sides or ("grouped,hf" if ep == 1 else "grouped")).split(",")
    unknown = set(sides) - {"grouped", "sequential", "hf"}
    if unknown:
        sys.exit(f"--sides: unknown {sorted(unknown)} (grouped, sequential, hf)")
    if ep > 1:
        if "hf" in sides:
            sys.exit(
                f"--sides hf at --expert-parallel {ep}: the HF step runs on one GPU, so its "
                "figure is the one-GPU run's (bench_moe.py --part learner without torchrun)"
            )
        if args.part != "learner":
            sys.exit(
                f"--part {args.part} at --expert-parallel {ep}: the engine part runs on one "
                "GPU; give --part learner"
            )
    args.sides = ",".join(sides)


def main() -> None:
    args = build_parser().parse_args()
    if args.side:
        print(json.dumps(run_side(args, Path(args.model_dir), args.side)), flush=True)
        return
    check_args(args)
    rank, world = bench_learner.init_world()
    try:
        run(args, rank, world)
    finally:
        bench_learner.close_world(world)


def run(args: argparse.Namespace, rank: int, world: int) -> None:
    results: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "shape": {k: v for k, v in vars(args).items() if k not in ("json", "part", "side")},
        "active_params": active_params(args),
        "train_gflop_per_token": train_flops_per_token(args) / 1e9,
        "expert_parallel": args.expert_parallel,
        "gpus": world,
    }
    with bench_learner.shared_tmpdir(world) as tmp:
        model_dir = Path(tmp) / "model"
        bench_learner.on_rank0(world, lambda: make_model_dir(model_dir, args))
        if world > 1:
            results["learner"] = parallel_sides(args, model_dir, rank, world)
        else:
            if args.part in ("learner", "both"):
                results["learner"] = bench_learner_sides(args, model_dir)
            if args.part in ("engine", "both"):
                results["engine"] = bench_engine_generate(args, model_dir, Path(tmp))
    if rank == 0:
        print(json.dumps(results, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
