"""Cost of the built-in losses (with their per-lag metrics) next to a bare PPO-clip baseline.

    .venv/bin/python bench/algos_loss.py [--batch 16] [--seq 2048] [--repeat 20] [--device cpu]

Each iteration: the loss on one `[batch, seq]` micro-batch and its backward to the log-probs.
The baseline is the shortest correct PPO clip (masked token mean, no metrics). The losses do
the same work plus masking, the importance weights and per-version-lag metrics (one host sync);
pi_prox is a given tensor (as from the learner's forward at the start of the batch), and the KL
case adds the importance-weighted KL penalty against a reference.
Printed: milliseconds per micro-batch and the ratio to the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch


def baseline(logp, behavior, adv, mask, denom):
    ratio = torch.exp(logp - behavior)
    clipped = ratio.clamp(0.8, 1.2)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    return (per_token * mask).sum() / denom


def timed(fn, repeat: int, device: str) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from slime_async.algos import LOSSES, LossInput
    from slime_async.config import AlgoConfig

    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq)
    logp = (-torch.rand(shape, generator=g) * 3).to(args.device).requires_grad_()
    behavior = (logp.detach() + 0.2 * torch.randn(shape, generator=g).to(args.device)).detach()
    adv = torch.randn(args.batch, 1, generator=g).expand(shape).contiguous().to(args.device)
    mask = (torch.rand(shape, generator=g) > 0.1).float().to(args.device)
    versions = (10 - torch.randint(0, 5, shape, generator=g)).to(args.device)
    prox = (logp.detach() + 0.05 * torch.randn(shape, generator=g).to(args.device)).detach()
    ref = (logp.detach() + 0.1 * torch.randn(shape, generator=g).to(args.device)).detach()
    denom = float(mask.sum())

    def run_baseline():
        baseline(logp, behavior, adv, mask, denom).backward()
        logp.grad = None

    def run_loss(name, cfg):
        fn = LOSSES.resolve(name)

        def go():
            inp = LossInput(
                logp=logp,
                behavior_logp=behavior,
                advantages=adv,
                loss_mask=mask,
                versions=versions,
                current_version=10,
                token_denominator=denom,
                seq_denominator=float(args.batch),
                prox_logp=prox,
                ref_logp=ref if cfg.kl_coef > 0 else None,
            )
            fn(inp, cfg).loss.backward()
            logp.grad = None

        return go

    base_ms = timed(run_baseline, args.repeat, args.device)
    print(f"device={args.device} threads={args.threads} micro-batch={args.batch}x{args.seq}")
    print(f"{'loss':<34}{'ms/micro-batch':>16}{'x baseline':>12}")
    print(f"{'baseline (bare ppo clip)':<34}{base_ms:>16.2f}{1.0:>12.2f}")
    cases = [
        ("ppo_clip", AlgoConfig(loss="ppo_clip")),
        ("decoupled_ppo (default)", AlgoConfig()),
        ("mis sequence + veto", AlgoConfig(is_level="sequence", is_veto=1e-4)),
        ("aipo", AlgoConfig(loss="aipo")),
        ("gspo", AlgoConfig(loss="gspo")),
        ("decoupled_gspo", AlgoConfig(loss="decoupled_gspo")),
        ("decoupled_ppo + kl (k3, weighted)", AlgoConfig(kl_coef=0.01)),
    ]
    for label, cfg in cases:
        name = cfg.loss if "mis" not in label else "mis"
        ms = timed(run_loss(name, cfg), args.repeat, args.device)
        print(f"{label:<34}{ms:>16.2f}{ms / base_ms:>12.2f}")


if __name__ == "__main__":
    main()
