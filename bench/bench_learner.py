"""The Megatron-core learner on a GPU: train-step tokens/s next to an HF baseline, bf16 log-prob agreement.

    python bench/bench_learner.py [--hidden 1024 --layers 28 ...] [--json out.json]

Builds a random-init Qwen3-shaped model (default about 0.5B parameters: hidden 1024, 28 layers,
16 heads, 8 kv heads, intermediate 3072, vocab 151936, tied embeddings), saves it as an HF
directory and loads it into the learner (bf16 parameters, fp32 master weights and moments).

- Throughput: one optimizer step on `--batch` sequences of `--seq` tokens (one group, GRPO
  advantages, the ppo_clip loss), timed over `--steps` after `--warmup` steps. The baseline,
  in the same run, is the HF transformers model of the same weights (its default sdpa
  attention) doing the same work: log-probs of the same tokens, a PPO-clip loss, backward,
  the same fp32-master AdamW. Printed as tokens/s and the ratio learner / HF.
- Agreement: per-token log-probs of the same batch from the learner (bf16) against the HF
  model in bf16 and in fp32 (same bf16 weights), mean and max absolute difference; the HF
  bf16 vs fp32 difference shows bf16's own noise.

Needs a CUDA GPU (on CPU use a tiny shape: --hidden 64 --layers 2 --vocab 128 ...).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.optim import MasterAdamW
from slime_async.actors.learner.trainer import Learner
from slime_async.config import AlgoConfig, LearnerConfig
from slime_async.queue.schema import Trajectory
from slime_async.testing.models import char_tokenizer, save_tokenizer, tiny_config


def make_model_dir(out: Path, args) -> Path:
    cfg = tiny_config(
        "qwen3",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    )
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(char_tokenizer(), out)
    return out


def make_group(args, rng: np.random.Generator) -> TrainGroup:
    prompt_len = args.seq // 8
    prompt = rng.integers(10, args.vocab, size=prompt_len).astype(np.int32)
    group = []
    for k in range(args.batch):
        r = args.seq - prompt_len
        group.append(
            Trajectory(
                id=f"b{k}",
                group_id="g",
                group_size=args.batch,
                prompt_ids=prompt,
                response_ids=rng.integers(10, args.vocab, size=r).astype(np.int32),
                # About what a random-init model gives: log(1 / vocab).
                logprobs=np.full(r, -float(np.log(args.vocab)), dtype=np.float32),
                loss_mask=np.ones(r, dtype=np.uint8),
                versions=np.zeros(r, dtype=np.int32),
                reward=float(rng.random()),
            )
        )
    return TrainGroup(tuple(group))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, L-1] log p(tokens[:, t+1] | tokens[:, :t+1]) in fp32."""
    logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]


def hf_train_steps(model, group: TrainGroup, args, n: int) -> float:
    """Seconds per step of the HF baseline: log-probs, PPO clip, backward, fp32-master AdamW."""
    opt = MasterAdamW(model, LearnerConfig(lr=1e-6))
    dev = next(model.parameters()).device
    tokens = torch.tensor(np.stack([np.concatenate([t.prompt_ids, t.response_ids]) for t in group]))
    tokens = tokens.long().to(dev)
    p = len(group.trajectories[0].prompt_ids)
    rewards = torch.tensor([t.reward for t in group], device=dev)
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6))[:, None]
    behavior = torch.tensor(np.stack([t.logprobs for t in group]), device=dev)
    model.train()
    times = []
    for i in range(args.warmup + n):
        sync()
        t0 = time.perf_counter()
        logp = hf_logprobs(model, tokens)[:, p - 1 :]
        ratio = torch.exp(logp - behavior)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        opt.step(1e-6, None)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return float(np.mean(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    rng = np.random.default_rng(0)
    group = make_group(args, rng)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", args)
        cfg = LearnerConfig(
            model_path=str(model_dir),
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
            lr=1e-6,
            micro_batch_tokens=args.batch * args.seq,
        )
        learner = Learner(cfg, AlgoConfig(loss="ppo_clip", advantage="grpo"))
        results["params"] = sum(p.numel() for p in learner.model.parameters())
        seqs = [np.concatenate([t.prompt_ids, t.response_ids]).tolist() for t in group]

        # Agreement first, on the starting weights shared with the HF model.
        ours = torch.stack([lp for lp, _ in learner.compute_logprobs(seqs)])  # [B, L-1]
        dev = learner.device
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
        tokens = torch.tensor(seqs, device=dev)
        with torch.no_grad():
            hf_bf16 = hf_logprobs(hf.eval(), tokens).cpu()
            hf_fp32 = hf_logprobs(hf.float(), tokens).cpu()
        hf.to(torch.bfloat16)
        for name, ref in (("learner_vs_hf_bf16", hf_bf16), ("learner_vs_hf_fp32", hf_fp32)):
            d = (ours - ref).abs()
            results[name] = {"mean_abs": d.mean().item(), "max_abs": d.max().item()}
        d = (hf_bf16 - hf_fp32).abs()
        results["hf_bf16_vs_hf_fp32"] = {"mean_abs": d.mean().item(), "max_abs": d.max().item()}
        results["mean_logp"] = ours.mean().item()

        times, losses = [], []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            m = learner.train_step([group])
            sync()
            losses.append(m["loss"])
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        tokens_per_step = args.batch * args.seq
        results["learner_tokens_per_s"] = tokens_per_step / float(np.mean(times))
        results["learner_losses"] = losses
        results["version"] = learner.version
        if torch.cuda.is_available():
            results["learner_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        # The baseline runs while the learner's process group still exists (its optimizer
        # computes the grad norm through torch.distributed).
        results["hf_tokens_per_s"] = tokens_per_step / hf_train_steps(hf, group, args, args.steps)
        learner.close()
        results["ratio_learner_over_hf"] = (
            results["learner_tokens_per_s"] / results["hf_tokens_per_s"]
        )

    print(json.dumps(results, indent=2))
    print(
        f"\ntrain step, batch {args.batch} x {args.seq}, {results['params'] / 1e9:.2f}B params on "
        f"{results['device']}: learner {results['learner_tokens_per_s']:,.0f} tokens/s, "
        f"HF baseline {results['hf_tokens_per_s']:,.0f} tokens/s, "
        f"ratio {results['ratio_learner_over_hf']:.2f}x"
    )
    a = results["learner_vs_hf_bf16"]
    print(f"bf16 log-prob |learner - HF bf16|: mean {a['mean_abs']:.2e}, max {a['max_abs']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
