"""The Megatron-core learner on a GPU: train-step tokens/s and MFU next to an HF baseline, bf16 log-prob agreement.

    python bench/bench_learner.py [--hidden 1024 --layers 28 ...] [--full] [--json out.json]
    python bench/bench_learner.py --hidden 2560 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --ffn 9728

Builds a random-init Qwen3-shaped model (default about 0.5B parameters: hidden 1024, 28 layers,
16 heads, 8 kv heads, intermediate 3072, vocab 151936, tied embeddings; head_dim hidden / heads
unless `--head-dim`), saves it as an HF directory and loads it into the learner (bf16
parameters, fp32 master weights and moments).

- Throughput: one optimizer step on `--batch` sequences of `--seq` tokens (one group, GRPO
  advantages, the ppo_clip loss), timed over `--steps` after `--warmup` steps, with the
  learner's activation recomputation `--recompute` (none, selective, full; GPU only). The
  baseline (`--baseline hf`) is the HF transformers model of the same weights (its default sdpa
  attention) doing the same work: log-probs of the same response tokens (its LM head on the
  response positions only, `logits_to_keep`, as the learner), a PPO-clip loss (no entropy or
  KL on either side), backward, an fp32-master AdamW; with `--recompute full` HF's gradient
  checkpointing (each layer recomputed, as the learner's "full"). It runs in a child process of
  its own, after the learner has been closed and this process's CUDA memory released (the
  memory this process still holds then is printed): each side has the GPU's memory to itself
  (the child with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set).
  An HF step that runs out of memory is reported as such (with the child's peak), not raised.
  Printed as tokens/s, MFU and the ratio learner / HF; `--baseline none` skips it.
- MFU: model FLOPs per token (bench/roofline.py, `train_flops_per_token`): 6 x non-embedding
  parameters + 6 x vocab x hidden x response_len / seq_len (the output layer on the response
  positions) + 12 x layers x heads x head_dim x (seq_len + 1) / 2 (causal attention, forward and
  backward; GQA's kv heads only shrink the K/V projections, counted in the parameters), over
  the dense bf16 peak `--peak-tflops` (default 989, an H100/H200). Peak memory is the CUDA
  allocator's peak (`torch.cuda.max_memory_allocated`) of each part alone.
- Agreement: per-token log-probs of the same batch from the learner (bf16) against the HF
  model in bf16 and in fp32 (same bf16 weights), mean and max absolute difference; the HF
  bf16 vs fp32 difference shows bf16's own noise.

With `--full`, also (each printed beside its baseline): the learner without its fast paths
(`OLD`: megatron's unfused attention over padded rows, MasterAdamW), a plain megatron-core
forward/backward + optimizer step on the same tokens (GPTModel's own cross-entropy), activation
recomputation (selective, full), and an RL-shaped batch (4 groups x 8, 128-token prompts,
log-normal response lengths cut to 64..1,024) with the defaults (auto packing), packed and
padded, in real tokens/s. `--variants` (with or without `--full`) adds learner runs with other
`[learner]` keys (e.g. `logprob_kernel=torch`, `torch_compile=off`), each in turn on the same
batch; `--options` sets `[learner]` keys for every learner of the run (an option's A/B in
processes of their own: the step time of a process varies more between processes than within
one). `--profile DIR` writes torch.profiler tables of one learner step and one plain megatron
step (CUDA kernels by self time) and the learner step's Chrome trace. The learner's training
micro-batches run through CUDA graphs by default on a GPU (`learner.cuda_graphs`): a shape is
captured at its second micro-batch, so `--warmup` should be at least 2; the allocator's peak
reservation is printed beside the peak allocation (the graphs' pool stays reserved).

Tensor parallelism (one host): `torchrun --nproc-per-node 2 bench/bench_learner.py
--tensor-parallel 2 ...` runs the learner at TP 2, one GPU a rank (the world is the TP group:
data parallel 1, every rank the same batch). Tokens/s are the whole group's; MFU is per GPU (the
FLOPs over the number of GPUs x `--peak-tflops`); peak memory is each rank's (the figure printed
is the largest). Rank 0 writes the model directory, prints and writes the JSON. After the timed
learner is closed, the same weights are loaded at TP 1 (data parallel over the same processes,
each the whole model) and its bf16 log-probs of the same batch are compared with TP 2's
(`learner_vs_tp1`): not bit-equal (TP 2 sums each row-parallel layer's two halves in another
order), of the order of bf16's own noise, and `learner_vs_hf_fp32` is given for both sizes
(`tp1_vs_hf_fp32`): TP 2's error should be TP 1's. The HF baseline runs on one GPU, so at TP > 1
it is not run (`--baseline` defaults to none there; its row is the one-GPU run's); `--full` and
`--profile` are one-GPU parts too and refused at TP > 1.

Needs a CUDA GPU for its figures; on CPU it runs at a tiny shape (--hidden 64 --layers 2
--vocab 128 ...), float32, as a dry run of the same path (at TP 2 over gloo too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import roofline
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.optim import MasterAdamW
from slime_async.actors.learner.trainer import Learner
from slime_async.config import AlgoConfig, LearnerConfig
from slime_async.models.toy import char_tokenizer, save_tokenizer, tiny_config
from slime_async.queue.schema import Trajectory
from slime_async.utils.procs import free_port


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
    cfg.head_dim = head_dim(args)
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(char_tokenizer(), out)
    del model  # the learner and the HF child load it from disk: give this memory back
    free_cuda()
    return out


def head_dim(args) -> int:
    return args.head_dim or args.hidden // args.heads


def train_shape(args) -> roofline.TrainShape:
    return roofline.TrainShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=head_dim(args),
        ffn=args.ffn,
        vocab=args.vocab,
    )


def step_flops(args, groups: list[TrainGroup]) -> float:
    """Model FLOPs of one train step on `groups` (each trajectory at its own length)."""
    shape, total = train_shape(args), 0.0
    for g in groups:
        for t in g:
            n, r = len(t.prompt_ids) + len(t.response_ids), len(t.response_ids)
            total += roofline.train_flops_per_token(shape, n, r) * n
    return total


def random_group(gid: str, prompt, lengths, vocab: int, rng: np.random.Generator) -> TrainGroup:
    """One group sharing `prompt`, a random response of each length in `lengths`, log-probs
    about what a random-init model gives (log 1/vocab), a random reward each."""
    group = []
    for k, r in enumerate(lengths):
        group.append(
            Trajectory(
                id=f"{gid}-{k}",
                group_id=gid,
                group_size=len(lengths),
                prompt_ids=prompt,
                response_ids=rng.integers(10, vocab, size=r).astype(np.int32),
                logprobs=np.full(r, -float(np.log(vocab)), dtype=np.float32),
                loss_mask=np.ones(r, dtype=np.uint8),
                versions=np.zeros(r, dtype=np.int32),
                reward=float(rng.random()),
            )
        )
    return TrainGroup(tuple(group))


def make_group(args, rng: np.random.Generator) -> TrainGroup:
    prompt_len = args.seq // 8
    prompt = rng.integers(10, args.vocab, size=prompt_len).astype(np.int32)
    return random_group("g", prompt, [args.seq - prompt_len] * args.batch, args.vocab, rng)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_logprobs(model, tokens: torch.Tensor, first: int = 1) -> torch.Tensor:
    """[B, L - first] log p(tokens[:, t]) for t >= first, fp32. Only the positions that predict
    them go through the LM head (HF's `logits_to_keep`), as the learner keeps only response
    positions: the same output-layer work on both sides."""
    keep = tokens.shape[1] - first + 1
    logits = model(tokens, logits_to_keep=keep).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, first:, None])[..., 0]


def hf_train_steps(model, group: TrainGroup, args, n: int, times: list | None = None) -> float:
    """Seconds per step of the HF baseline: the response tokens' log-probs (fp32 log-softmax
    of the LM head's logits at the response positions only), the PPO-clip loss on them (no
    entropy, no KL: the learner's algo has entropy_coef = kl_coef = 0 too), backward, and the
    fp32-master AdamW (`MasterAdamW`, the learner's CPU optimizer). `times` gets each step's."""
    opt = MasterAdamW(model, LearnerConfig(lr=1e-6))
    dev = next(model.parameters()).device
    tokens = torch.tensor(np.stack([np.concatenate([t.prompt_ids, t.response_ids]) for t in group]))
    tokens = tokens.long().to(dev)
    p = len(group.trajectories[0].prompt_ids)
    rewards = torch.tensor([t.reward for t in group], device=dev)
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6))[:, None]
    behavior = torch.tensor(np.stack([t.logprobs for t in group]), device=dev)
    model.train()
    times = [] if times is None else times
    for i in range(args.warmup + n):
        sync()
        t0 = time.perf_counter()
        logp = hf_logprobs(model, tokens, p)  # [B, response]
        ratio = torch.exp(logp - behavior)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        opt.step(1e-6, None)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return float(np.mean(times))


def make_rl_groups(args, rng: np.random.Generator) -> list[TrainGroup]:
    """`--rl-groups` groups of `--rl-group-size` trajectories, one shared `--rl-prompt`-token
    prompt each, response lengths log-normal (median `--rl-median`, sigma 0.7) cut to [64, 1024]."""
    groups = []
    for g in range(args.rl_groups):
        prompt = rng.integers(10, args.vocab, size=args.rl_prompt).astype(np.int32)
        lengths = [
            int(np.clip(rng.lognormal(np.log(args.rl_median), 0.7), 64, 1024))
            for _ in range(args.rl_group_size)
        ]
        groups.append(random_group(f"rl{g}", prompt, lengths, args.vocab, rng))
    return groups


def real_tokens(groups: list[TrainGroup]) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) - 1 for g in groups for t in g)


class Results(dict):
    """The figures, each printed (flushed) the moment it is set, and the whole record rewritten
    to `path` (marked partial until `finish`): a run stopped by a timeout still shows and
    leaves everything it measured."""

    def __init__(self, path: str | None = None, echo: bool = True, **kw):
        super().__init__(**kw)
        self.path = Path(path) if path else None
        self.echo = echo  # False on ranks other than 0: one rank prints

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if isinstance(value, float) and self.echo:
            shown = f"{value:,.3f}" if abs(value) >= 1e-3 else f"{value:.3g}"
            print(f"[bench_learner] {key} = {shown}", flush=True)
        self.write(partial=True)

    def write(self, partial: bool) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            record = {**self, "partial": partial}
            self.path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def peak_reserved_gb() -> float | None:
    """The caching allocator's peak reservation: with CUDA graphs, their memory pool stays
    reserved between replays while the allocated figure counts it only during capture."""
    return torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None


# ---- more than one GPU (torchrun) -------------------------------------------------------------


def world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world(parallel: int, flag: str, world: int, script: str) -> None:
    """Refuse a parallel size the process count does not match, naming the command that fits:
    the benches run one rank a GPU and the whole world is the one parallel group."""
    if parallel > 1 and world != parallel:
        sys.exit(
            f"{flag} {parallel} runs on {parallel} processes, one a GPU, and WORLD_SIZE is "
            f"{world}: start it as torchrun --nproc-per-node {parallel} {script} "
            f"{flag} {parallel} ..."
        )
    if parallel == 1 and world > 1:
        sys.exit(
            f"WORLD_SIZE is {world} but {flag} is 1: under torchrun give {flag} {world} (every "
            "process is a rank of it), or run the bench without torchrun"
        )
    if parallel > 1 and torch.cuda.is_available() and torch.cuda.device_count() < parallel:
        sys.exit(
            f"{flag} {parallel}: {torch.cuda.device_count()} CUDA GPU(s) visible on this host, "
            f"one a rank needs {parallel}"
        )


def init_world() -> tuple[int, int]:
    """(rank, world). Under torchrun (WORLD_SIZE > 1): this rank's GPU (LOCAL_RANK) and the
    process group every learner of the run joins (NCCL on GPUs, gloo on the CPU; torchrun's
    env:// rendezvous); a collective that waits past 20 minutes fails with torch's message.
    Alone: (0, 1) and nothing started (each learner starts and ends a group of its own)."""
    world = world_size()
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=20))
    return dist.get_rank(), world


def close_world(world: int) -> None:
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def shared_tmpdir(world: int):
    """A temporary directory every rank of this host sees: made by rank 0, its path broadcast;
    removed by rank 0 once every rank is done with it (at once on an error)."""
    if world == 1:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
        return
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="bench_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield Path(holder[0])
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


def on_rank0(world: int, make) -> None:
    """`make()` on rank 0 while the other ranks wait (e.g. writing the model directory)."""
    if world == 1 or dist.get_rank() == 0:
        make()
    if world > 1:
        dist.barrier()


def per_rank(world: int, value):
    """[value of rank 0, rank 1, ...] (every rank gets the list)."""
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def largest(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item()}


def time_learner(learner, groups, args, steps=None, metrics: bool = False, times=None):
    """Seconds per train_step on `groups` (after --warmup steps) and every step's loss (and,
    with `metrics`, the last step's metrics). `times` gets each timed step's seconds."""
    times = [] if times is None else times
    losses = []
    for i in range(args.warmup + (steps or args.steps)):
        sync()
        t0 = time.perf_counter()
        m = learner.train_step(groups)
        sync()
        losses.append(m["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if metrics:
        return float(np.mean(times)), losses, m
    return float(np.mean(times)), losses


def profile_table(fn, path: Path | None, label: str, trace: bool = False) -> dict:
    """One call of `fn` under torch.profiler (after the timed runs: warm); its CUDA kernels by
    self time, top 30, written to `path` (with `trace`: also its Chrome trace beside it) and
    summarised: kernel time vs the call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort = "self_device_time_total"
    table = events.table(sort_by=sort, row_limit=30, max_name_column_width=70)
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    if path is not None and trace:
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
    if path is not None:
        path.write_text(f"{label}: wall {wall * 1e3:.1f} ms (under the profiler)\n{table}\n")
    print(
        f"[bench_learner] profile {label}: wall {wall * 1e3:.1f} ms, device time "
        f"{kernel_us / 1e3:.1f} ms",
        flush=True,
    )
    return {"wall_ms": wall * 1e3, "device_ms": kernel_us / 1e3}


def time_plain_megatron(learner, group: TrainGroup, args) -> float:
    """Seconds per step of a plain megatron-core step on the same tokens: GPTModel's own
    vocab-parallel cross-entropy (labels given), mean, backward, the learner's optimizer."""
    tokens = torch.tensor(
        np.stack([np.concatenate([t.prompt_ids, t.response_ids]) for t in group]),
        device=learner.device,
    ).long()
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    mask = None
    if learner.attention == "local":
        from slime_async.megatron_compat import causal_mask

        mask = causal_mask(ids.shape[1], ids.device)
    from slime_async.models.attention import set_packed

    set_packed(learner.model, None)  # the learner's last step may have left packed documents set
    opt = learner.optimizer

    def step():
        opt.zero_grad()
        if hasattr(opt, "begin"):
            opt.begin(1)
        loss = learner.train_model(ids, pos, mask, labels=labels).float().mean()
        loss.backward()
        opt.reduce_gradients(learner.dp_group, learner.tp_group, learner.expert_dp_group)
        norm = opt.grad_norm(learner.tp_group, learner.ep_group)
        opt.step(1e-6, learner.tp_group, norm=norm)

    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if args.profile and torch.cuda.is_available():
        profile_table(step, Path(args.profile) / "profile_plain.txt", "plain megatron step")
    return float(np.mean(times))


# The learner without its fast paths (megatron's unfused attention over padded rows,
# MasterAdamW), measured in the same run as the baseline of the defaults.
OLD = dict(attention="local", pack_sequences=False, optimizer="master_adamw")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument(
        "--head-dim", type=int, default=None, help="width of a head (default hidden / heads)"
    )
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="the learner's activation recomputation (GPU only); with full the HF baseline uses "
        "gradient checkpointing",
    )
    ap.add_argument(
        "--baseline",
        choices=["hf", "none"],
        default=None,
        help="hf: the HF transformers step in a child process of its own; none: no baseline "
        "(default hf at --tensor-parallel 1, none above: the HF step runs on one GPU)",
    )
    ap.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="the learner's TP size, under torchrun --nproc-per-node N (one rank a GPU, the "
        "world is the TP group); the same weights at TP 1 give the log-prob reference",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=roofline.H200_BF16_TFLOPS,
        help="the peak of the MFU figures, TFLOP/s (default: dense bf16 of an H100/H200, 989)",
    )
    ap.add_argument(
        "--hf-timeout", type=float, default=1200.0, help="seconds the HF child may take"
    )
    ap.add_argument("--hf-child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    ap.add_argument(
        "--full",
        action="store_true",
        help="also: the old options, recomputation, the RL-length batch packed vs "
        "padded, and a plain megatron-core step",
    )
    ap.add_argument("--rl-groups", type=int, default=4)
    ap.add_argument("--rl-group-size", type=int, default=8)
    ap.add_argument("--rl-prompt", type=int, default=128)
    ap.add_argument("--rl-median", type=float, default=300.0)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--profile",
        help="a folder: torch.profiler tables of one learner step and "
        "one plain megatron step (CUDA kernels by self time) are written there",
    )
    ap.add_argument(
        "--options",
        default="",
        help="[learner] keys for every learner of the run, key=value separated by ';' (e.g. "
        "cuda_graphs=off: the A/B of an option in processes of their own)",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated extra learner variants on the 8 x seq batch, each "
        "key=value of [learner] (e.g. logprob_kernel=torch;logprob_chunk_tokens=4096"
        "), separated by commas, keys of one variant by ';'",
    )
    return ap


def check_args(args: argparse.Namespace, world: int | None = None) -> None:
    """Refuse, naming the option, what cannot run here or would measure nothing; resolve
    `--baseline`. `world`: the number of processes (default: torchrun's WORLD_SIZE, else 1)."""
    if args.recompute != "none" and not torch.cuda.is_available():
        sys.exit(
            f"--recompute {args.recompute}: megatron's recomputation saves the CUDA RNG state; "
            "it needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if args.steps < 1:
        sys.exit(f"--steps {args.steps}: at least one timed step")
    if args.seq < 8:
        sys.exit(f"--seq {args.seq}: at least 8 tokens (the prompt is seq / 8)")
    if args.peak_tflops <= 0:
        sys.exit(f"--peak-tflops {args.peak_tflops}: must be positive")
    if args.hidden % args.heads and args.head_dim is None:
        sys.exit(
            f"--hidden {args.hidden} is not a multiple of --heads {args.heads}: give --head-dim"
        )
    if args.hf_child:  # the baseline itself: one GPU, outside any world
        return
    tp = args.tensor_parallel
    if tp < 1:
        sys.exit(f"--tensor-parallel {tp}: at least 1")
    world = world_size() if world is None else world
    check_world(tp, "--tensor-parallel", world, "bench/bench_learner.py")
    if tp > 1:
        if args.baseline == "hf":
            sys.exit(
                f"--baseline hf at --tensor-parallel {tp}: the HF step runs on one GPU, so its "
                "figure is the one-GPU run's (bench_learner.py --baseline hf without torchrun); "
                "leave --baseline out or give none here"
            )
        for flag in ("full", "profile"):
            if getattr(args, flag):
                sys.exit(
                    f"--{flag} at --tensor-parallel {tp}: its extra rows are one-GPU figures; "
                    "run it without torchrun at --tensor-parallel 1"
                )
    if args.baseline is None:
        args.baseline = "hf" if tp == 1 else "none"


SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab", "batch", "seq")


def hf_child(args: argparse.Namespace) -> None:
    """The HF baseline, in this child process (`--hf-child MODEL_DIR`): one JSON line on stdout
    with its tokens/s and peak memory, or `oom` with the peak it reached."""
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():  # MasterAdamW reduces over (one-rank) process groups
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    group = make_group(args, np.random.default_rng(0))  # the parent's batch: same seed, same shape
    out: dict = {"side": "hf", "gradient_checkpointing": args.recompute == "full"}
    free_cuda()
    try:
        hf = AutoModelForCausalLM.from_pretrained(args.hf_child, dtype=torch.bfloat16)
        hf = hf.to("cuda" if on_gpu else "cpu")
        if args.recompute == "full":
            hf.gradient_checkpointing_enable()
        sec = hf_train_steps(hf, group, args, args.steps)
        out["step_s"] = sec
        out["tokens_per_s"] = args.batch * args.seq / sec
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = str(e).splitlines()[0][:300]
    out["peak_mem_gb"] = peak_gb()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_hf_child(args: argparse.Namespace, model_dir: Path) -> dict:
    """The HF baseline in a child process of its own; its JSON line, or `error` with the
    child's exit code and the tail of its stderr."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-child", str(model_dir)]
    keys = (*SHAPE_KEYS, "warmup", "steps", "recompute")
    cmd += [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys if getattr(args, k) is not None
    ]
    print(f"[bench_learner] HF baseline in its own process: {' '.join(cmd)}", flush=True)
    # Growable segments: less fragmentation where the HF step comes close to the GPU's memory.
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.hf_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the HF child ran past --hf-timeout {args.hf_timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"the HF child exited {proc.returncode}: {proc.stderr[-3000:]}"}
    return {**json.loads(lines[-1]), "alloc_conf": alloc}


def main() -> None:
    args = build_parser().parse_args()
    check_args(args)
    # A timeout's SIGTERM unwinds (finally blocks, subprocess.run's kill): no child process of
    # this bench outlives it holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.hf_child:
        hf_child(args)
        return
    rank, world = init_world()
    try:
        run(args, rank, world)
    finally:
        close_world(world)


def run(args: argparse.Namespace, rank: int, world: int) -> None:
    """The bench on this rank (every rank runs every learner; rank 0 prints and writes)."""
    results = Results(
        args.json if rank == 0 else None,
        echo=rank == 0,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    results["tensor_parallel"] = args.tensor_parallel
    results["gpus"] = world
    rng = np.random.default_rng(0)
    group = make_group(args, rng)
    tokens_per_step = args.batch * args.seq
    flops_token = step_flops(args, [group]) / tokens_per_step
    results["flops_per_token"] = flops_token
    results["peak_tflops"] = args.peak_tflops
    results["recompute"] = args.recompute

    def mfu(tokens_per_s: float, flops: float = flops_token) -> float:
        # per GPU: the whole group's tokens/s over `world` GPUs' peak
        return roofline.mfu(tokens_per_s / world, flops, args.peak_tflops)

    with shared_tmpdir(world) as tmp:
        model_dir = Path(tmp) / "model"
        on_rank0(world, lambda: make_model_dir(model_dir, args))
        base = dict(
            model_path=str(model_dir),
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
            lr=1e-6,
            micro_batch_tokens=args.batch * args.seq,
            **learner_keys(args.options),
        )
        # One PPO update per step, as the HF baseline does (the default of 4 mini-batches would
        # add 3 optimizer steps and a pi_prox forward pass to the learner's side).
        algo = AlgoConfig(loss="ppo_clip", advantage="grpo", mini_batches=1)
        free_cuda()
        tp = dict(tensor_parallel=args.tensor_parallel)
        learner = Learner(LearnerConfig(**base, **tp, recompute=args.recompute), algo)
        results["options"] = {
            "attention": learner.attention,
            "packing": "never"
            if not learner.pack
            else f"from {learner.pack_min_padding:.0%} padding"
            if learner.pack_min_padding
            else "always",
            "optimizer": learner.optimizer_kind,
            "logprob_kernel": learner.logprob_kernel,
            "recompute": args.recompute,
            "layer_ops": "compiled" if learner.compiled_ops else "eager",
            "swiglu_kernel": learner.swiglu_kernel,
            "cuda_graphs": learner.cuda_graphs,
        }
        local_params = sum(p.numel() for p in learner.model.parameters())
        if world == 1:
            results["params"] = local_params
        else:  # each rank holds a shard: the whole model's count (tied embeddings)
            results["params"] = train_shape(args).non_embedding_params + args.vocab * args.hidden
            results["params_per_rank"] = per_rank(world, local_params)
        seqs = [np.concatenate([t.prompt_ids, t.response_ids]).tolist() for t in group]

        # Agreement first, on the starting weights shared with the HF model (every rank takes
        # part in the learner's log-probs; the HF model runs on rank 0 alone).
        ours = torch.stack([lp for lp, _ in learner.compute_logprobs(seqs)])  # [B, L-1]
        hf_fp32 = None
        if rank == 0:
            dev = learner.device
            tokens = torch.tensor(seqs, device=dev)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
            with torch.no_grad():
                hf_bf16 = hf_logprobs(hf.eval(), tokens).cpu()
                hf_fp32 = hf_logprobs(hf.float(), tokens).cpu()
            del hf, tokens
            results["learner_vs_hf_bf16"] = abs_diff(ours, hf_bf16)
            results["learner_vs_hf_fp32"] = abs_diff(ours, hf_fp32)
            results["hf_bf16_vs_hf_fp32"] = abs_diff(hf_bf16, hf_fp32)
            results["mean_logp"] = ours.mean().item()
        if world > 1:
            dist.barrier()

        free_cuda()
        step_s: list[float] = []
        sec, losses, last = time_learner(learner, [group], args, metrics=True, times=step_s)
        results["learner_last_step_cuda_graphs"] = {
            k: v for k, v in last.items() if k.startswith("learner/cuda_graphs/")
        }
        results["learner_step_s"] = step_s
        results["learner_tokens_per_s"] = tokens_per_step / sec
        results["learner_tokens_per_s_per_gpu"] = tokens_per_step / sec / world
        results["learner_mfu"] = mfu(results["learner_tokens_per_s"])
        results["learner_losses"] = losses
        results["version"] = learner.version
        results["learner_peak_mem_gb_per_rank"] = per_rank(world, peak_gb())
        results["learner_peak_reserved_gb_per_rank"] = per_rank(world, peak_reserved_gb())
        results["learner_peak_mem_gb"] = largest(results["learner_peak_mem_gb_per_rank"])
        results["learner_peak_reserved_gb"] = largest(results["learner_peak_reserved_gb_per_rank"])
        if args.profile and torch.cuda.is_available():
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            results["profile_learner"] = profile_table(
                lambda: learner.train_step([group]),
                Path(args.profile) / "profile_learner.txt",
                "learner RL step",
                trace=True,
            )
        if args.full:
            free_cuda()
            results["plain_megatron_tokens_per_s"] = tokens_per_step / time_plain_megatron(
                learner, group, args
            )
            results["plain_megatron_mfu"] = mfu(results["plain_megatron_tokens_per_s"])
            results["plain_megatron_peak_mem_gb"] = peak_gb()
            results["ratio_learner_over_plain_megatron"] = (
                results["learner_tokens_per_s"] / results["plain_megatron_tokens_per_s"]
            )
            rl = make_rl_groups(args, np.random.default_rng(1))
            rl_tokens = real_tokens(rl)
            results["rl_batch"] = {
                "trajectories": sum(len(g) for g in rl),
                "tokens": rl_tokens,
                "padded_tokens_if_one_row_each": sum(len(g) for g in rl)
                * max(len(t.prompt_ids) + len(t.response_ids) - 1 for g in rl for t in g),
                "flops_per_step": step_flops(args, rl),
            }
            learner.close()
            del learner
            for name, extra in (
                ("rl_default", {}),  # auto: packed where padding would waste pack_min_padding
                ("rl_packed", dict(pack_sequences=True)),
                ("rl_padded", dict(pack_sequences=False)),
            ):
                free_cuda()
                lr_ = Learner(LearnerConfig(**{**base, "micro_batch_tokens": 8192, **extra}), algo)
                sec, _, last = time_learner(lr_, rl, args, metrics=True)
                results[f"{name}_tokens_per_s"] = rl_tokens / sec
                results[f"{name}_mfu"] = roofline.mfu(
                    1 / sec, results["rl_batch"]["flops_per_step"], args.peak_tflops
                )
                results[f"{name}_packed_micro_batches"] = last.get("learner/packed_micro_batches")
                results[f"{name}_padding_frac"] = last.get("padding_frac")
                results[f"{name}_peak_mem_gb"] = peak_gb()
                lr_.close()
                del lr_
            variants = [*user_variants(args), ("old_options", OLD)]
            if torch.cuda.is_available():  # megatron's recomputation needs CUDA's RNG
                variants = [
                    ("recompute_selective", dict(recompute="selective")),
                    ("recompute_full", dict(recompute="full")),
                    *variants,
                ]
        else:
            learner.close()
            del learner
            variants = user_variants(args)
        for name, extra in variants:
            free_cuda()
            lr_ = Learner(LearnerConfig(**{**base, **tp, **extra}), algo)
            step_s = []
            sec, _ = time_learner(lr_, [group], args, times=step_s)
            results[f"{name}_step_s"] = step_s
            results[f"{name}_tokens_per_s"] = tokens_per_step / sec
            results[f"{name}_mfu"] = mfu(results[f"{name}_tokens_per_s"])
            results[f"{name}_peak_mem_gb"] = largest(per_rank(world, peak_gb()))
            results[f"{name}_peak_reserved_gb"] = largest(per_rank(world, peak_reserved_gb()))
            lr_.close()
            del lr_
        if args.tensor_parallel > 1:
            # The same weights at TP 1 (data parallel over these ranks, each the whole model):
            # the log-prob reference of the TP run, on the batch it was measured on.
            free_cuda()
            ref_learner = Learner(LearnerConfig(**base, tensor_parallel=1), algo)
            ref = torch.stack([lp for lp, _ in ref_learner.compute_logprobs(seqs)])  # [B, L-1]
            ref_learner.close()
            del ref_learner
            if rank == 0:
                results["learner_vs_tp1"] = abs_diff(ours, ref)
                results["tp1_vs_hf_fp32"] = abs_diff(ref, hf_fp32)
        if args.baseline == "hf":
            # After every learner here is closed and this process's CUDA memory released: the
            # child has the GPU to itself but for what is printed as still held.
            free_cuda()
            held = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            results["parent_cuda_allocated_gb_during_hf"] = held
            hf_out = run_hf_child(args, model_dir)
            results["hf"] = hf_out
            if "tokens_per_s" in hf_out:
                results["hf_tokens_per_s"] = hf_out["tokens_per_s"]
                results["hf_mfu"] = mfu(hf_out["tokens_per_s"])
                results["hf_peak_mem_gb"] = hf_out["peak_mem_gb"]
                results["ratio_learner_over_hf"] = (
                    results["learner_tokens_per_s"] / results["hf_tokens_per_s"]
                )
            else:
                why = hf_out.get("oom") or hf_out.get("error")
                print(f"[bench_learner] HF baseline: no figure: {why}", flush=True)

    if rank == 0:
        print(json.dumps(results, indent=2))
        print_table(results, args)
        results.write(partial=False)


def user_variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """`--variants` as (name, [learner] keys): "a=1;b=x,c=2" -> variant_a=1+b=x, variant_c=2."""
    return [
        ("variant_" + spec.replace(";", "+"), learner_keys(spec))
        for spec in filter(None, args.variants.split(","))
    ]


def learner_keys(spec: str) -> dict:
    """ "a=1;b=x" -> {"a": 1, "b": "x"} ([learner] keys of `--options` and `--variants`)."""
    out: dict = {}
    for kv in filter(None, spec.split(";")):
        k, _, v = kv.partition("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def print_table(r: dict, args) -> None:
    """Each figure with its MFU beside its baseline (`OLD` ran 28.2k tokens/s = 0.57x HF, 56.5 GB
    on an H200)."""
    gb = lambda x: "-" if x is None else f"{x:.1f} GB"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    print(
        f"\n{r['params'] / 1e9:.2f}B params on {r['device']}, batch {args.batch} x {args.seq}; "
        f"learner options {r['options']}"
    )
    print(
        f"MFU: {r['flops_per_token'] / 1e9:.2f} GFLOP a token (6 x non-embedding params + output "
        f"layer on the response + causal attention) over {r['peak_tflops']:g} TFLOP/s"
        + (f" per GPU ({r['gpus']} GPUs)" if r["gpus"] > 1 else "")
    )
    if r.get("learner_step_s"):
        st = np.array(r["learner_step_s"]) * 1e3
        print(
            f"learner step: {st.mean():.1f} ms, min {st.min():.1f}, max {st.max():.1f} "
            f"over {len(st)} steps"
        )
    print(f"{'what':44s} {'tokens/s':>10s} {'MFU':>6s} {'peak mem':>10s}   baseline")
    hf = r.get("hf", {})
    if "hf_tokens_per_s" in r:
        vs_hf = (
            f"HF step {r['hf_tokens_per_s']:,.0f}/s: {r['ratio_learner_over_hf']:.2f}x "
            "(goal >= 1.3x)"
        )
    elif args.baseline == "none":
        vs_hf = "no baseline (--baseline none)"
    else:
        vs_hf = f"HF step: no figure ({(hf.get('oom') or hf.get('error') or '?')[:120]})"
    rows = [
        (
            f"learner RL step (recompute {args.recompute})",
            r["learner_tokens_per_s"],
            r.get("learner_mfu"),
            r["learner_peak_mem_gb"],
            vs_hf,
        )
    ]
    if "hf_tokens_per_s" in r:
        ckpt = ", gradient checkpointing" if hf.get("gradient_checkpointing") else ""
        rows.append(
            (
                f"HF transformers step (same work{ckpt})",
                r["hf_tokens_per_s"],
                r.get("hf_mfu"),
                r.get("hf_peak_mem_gb"),
                f"own process; the bench's own held {r['parent_cuda_allocated_gb_during_hf']:.2f} GB",
            )
        )
    elif "oom" in hf:
        rows.append(("HF transformers step: out of memory", 0.0, None, hf.get("peak_mem_gb"), ""))
    if "old_options_tokens_per_s" in r:
        rows += [
            (
                "learner, old options (local attn, MasterAdamW)",
                r["old_options_tokens_per_s"],
                r.get("old_options_mfu"),
                r["old_options_peak_mem_gb"],
                "28.2k/s, 56.5 GB on an H200",
            ),
            (
                "plain megatron-core fwd/bwd + optimizer",
                r["plain_megatron_tokens_per_s"],
                r.get("plain_megatron_mfu"),
                r["plain_megatron_peak_mem_gb"],
                f"RL step / plain = {r['ratio_learner_over_plain_megatron']:.2f}x (goal >= 0.9x)",
            ),
            *[
                (
                    f"recompute {k}",
                    r[f"recompute_{k}_tokens_per_s"],
                    r.get(f"recompute_{k}_mfu"),
                    r[f"recompute_{k}_peak_mem_gb"],
                    "vs the learner RL step above",
                )
                for k in ("selective", "full")
                if f"recompute_{k}_tokens_per_s" in r
            ],
            (
                f"RL lengths, packed ({r['rl_batch']['tokens']:,} real tokens)",
                r["rl_packed_tokens_per_s"],
                r.get("rl_packed_mfu"),
                r["rl_packed_peak_mem_gb"],
                f"padded: {r['rl_padded_tokens_per_s']:,.0f}/s: packed "
                f"{r['rl_packed_tokens_per_s'] / r['rl_padded_tokens_per_s']:.2f}x",
            ),
            (
                "RL lengths, padded (real tokens/s)",
                r["rl_padded_tokens_per_s"],
                r.get("rl_padded_mfu"),
                r["rl_padded_peak_mem_gb"],
                f"padding {r['rl_padded_padding_frac']:.0%}",
            ),
            (
                "RL lengths, default (auto packing)",
                r["rl_default_tokens_per_s"],
                r.get("rl_default_mfu"),
                r["rl_default_peak_mem_gb"],
                f"{r['rl_default_packed_micro_batches']:.0f} packed micro-batches",
            ),
        ]
    rows += [
        (
            k[len("variant_") : -len("_tokens_per_s")][:44],
            v,
            r.get(k[: -len("_tokens_per_s")] + "_mfu"),
            r.get(k[: -len("_tokens_per_s")] + "_peak_mem_gb"),
            f"vs the learner RL step {r['learner_tokens_per_s']:,.0f}/s: "
            f"{v / r['learner_tokens_per_s']:.2f}x",
        )
        for k, v in r.items()
        if k.startswith("variant_") and k.endswith("_tokens_per_s")
    ]
    for what, tps, m, mem, note in rows:
        print(f"{what:44s} {tps:>10,.0f} {pct(m):>6s} {gb(mem):>10s}   {note}")
    if r.get("learner_peak_reserved_gb") is not None:
        print(
            f"allocator peak reservation of the learner step: {r['learner_peak_reserved_gb']:.1f} "
            f"GB (CUDA graphs {'on' if r['options']['cuda_graphs'] else 'off'}: their memory pool "
            "stays reserved between replays)"
        )
    a = r["learner_vs_hf_bf16"]
    print(f"bf16 log-prob |learner - HF bf16|: mean {a['mean_abs']:.2e}, max {a['max_abs']:.2e}")
    if "learner_vs_tp1" in r:
        tp, a, b, c = (
            r["tensor_parallel"],
            r["learner_vs_tp1"],
            r["learner_vs_hf_fp32"],
            r["tp1_vs_hf_fp32"],
        )
        per = ", ".join(gb(x) for x in r["learner_peak_mem_gb_per_rank"])
        print(
            f"TP {tp} on {r['gpus']} ranks: {r['learner_tokens_per_s_per_gpu']:,.0f} tokens/s a GPU, "
            f"peak memory by rank {per}\n"
            f"log-probs |TP {tp} - TP 1|: mean {a['mean_abs']:.2e}, max {a['max_abs']:.2e}; "
            f"against HF fp32: TP {tp} mean {b['mean_abs']:.2e} (max {b['max_abs']:.2e}), "
            f"TP 1 mean {c['mean_abs']:.2e} (max {c['max_abs']:.2e})"
        )


if __name__ == "__main__":
    main()
