"""Embedded-engine benchmarks, each side by side with its baseline in the same run.

Generation (default): tokens/s of the embedded engine (a child process, over HTTP, B concurrent
/generate requests, greedy, ignore_eos) against HF transformers `generate()` on the same batch
of B prompts in this process, printed as a ratio.

    python bench/bench_engine.py                                  # tiny model on CPU, B = 1, 16, 64
    python bench/bench_engine.py --model qwen3-0.5b --device cuda --batches 1,16,64,128

Weight push (`--push`): the learner side (this process, cuda:0) pushes the model to an embedded
engine on cuda:1 through WeightPusher (NCCL, HTTP calls, bucketed), against a raw NCCL broadcast
of the same buckets between two bare processes measured in the same run. `--device cpu` runs the
same path over gloo (a dry run).

    python bench/bench_engine.py --push --model qwen3-0.5b --device cuda --bucket-mb 512
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.actors.engine.weight_sync import init_weight_group
from slime_async.testing.models import (
    QWEN3_05B_SHAPE,
    char_tokenizer,
    make_tiny_model,
    save_tokenizer,
    tiny_config,
)
from slime_async.utils.procs import Child, free_port, python_module, wait_until


def make_model(out: Path, name: str, dtype: torch.dtype) -> Path:
    """A random-init model directory: `tiny` (make_tiny_model) or `qwen3-0.5b` (Qwen3-0.6B shape)."""
    if name == "tiny":
        return make_tiny_model(out, family="qwen3", seed=0)
    cfg = tiny_config("qwen3", **QWEN3_05B_SHAPE)
    cfg.head_dim = 128  # as Qwen3-0.6B: 16 heads x 128 = 2048 wide attention on a 1024 model
    torch.manual_seed(0)
    # Random init of ~0.6B parameters is much faster on a GPU than on the host.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(char_tokenizer(), out)
    return out


def start_engine(
    model_dir: Path, device: str, dtype: str, max_running: int, log: Path, threads: int
) -> tuple[Child, str]:
    port = free_port()
    args = [
        f"engine.model_path={model_dir}",
        f"engine.port={port}",
        f"engine.device={device}",
        f"engine.dtype={dtype}",
        f"engine.max_running_requests={max_running}",
        "engine.max_context_len=1024",
        f"engine.torch_threads={threads}",
    ]
    child = Child("engine", python_module("slime_async", "engine", *args), log_path=log)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200

    wait_until(ready, 600, f"engine at {url}", interval=0.2, child=child)
    return child, url


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [
        [2, *torch.randint(8, min(vocab, 100), (length - 1,), generator=g).tolist()]
        for _ in range(batch)
    ]


async def engine_tokens_per_s(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    async with EngineClient(url, timeout_s=3600) as c:
        await asyncio.gather(
            *(c.generate(p, {**params, "max_new_tokens": 4}) for p in prompts)
        )  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(p, params) for p in prompts))
        dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def hf_tokens_per_s(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_generation(args: argparse.Namespace, work: Path) -> None:
    device = args.device
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / args.model, args.model, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    threads = 0 if device.startswith("cuda") else args.cpu_threads
    if threads:
        torch.set_num_threads(threads)
    hf = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        .to(device)
        .eval()
    )
    vocab = hf.config.vocab_size
    child, url = start_engine(
        model_dir, device, args.dtype, max(batches), work / "engine.log", threads
    )
    rows = []
    try:
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, vocab)
            eng = asyncio.run(engine_tokens_per_s(url, prompts, args.new_tokens))
            with torch.inference_mode():
                ref = hf_tokens_per_s(hf, prompts, args.new_tokens, device)
            rows.append((b, eng, ref))
            print(
                f"batch {b:4d}: engine {eng:9.1f} tok/s   HF generate {ref:9.1f} tok/s   ratio {eng / ref:5.2f}x",
                flush=True,
            )
    finally:
        child.stop()
    name = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"CPU x{threads or torch.get_num_threads()} threads"
    )
    print(
        f"\n{args.model}, {args.dtype}, {device} ({name}), prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy"
    )
    print("| concurrent requests | embedded engine tok/s | HF generate() tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for b, eng, ref in rows:
        print(f"| {b} | {eng:.0f} | {ref:.0f} | {eng / ref:.2f}x |")


# ---- weight push --------------------------------------------------------------------------------


def buckets_of(
    state: dict[str, torch.Tensor], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    buckets, cur, size = [], [], 0
    for name, t in state.items():
        if cur and size + t.numel() * t.element_size() > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t.numel() * t.element_size()
    if cur:
        buckets.append(cur)
    return buckets


def _raw_rank(rank: int, port: int, sizes: list[int], reps: int, backend: str, queue) -> None:
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = init_weight_group("127.0.0.1", port, rank, 2, "raw_bench", backend, dev)
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    times = []
    for _ in range(reps + 1):  # the first round sets the communicator up
        sync(dev)
        t0 = time.perf_counter()
        for b in bufs:
            group.broadcast(b)
        sync(dev)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(times[1:])
    group.destroy()


def raw_broadcast_seconds(sizes: list[int], reps: int, backend: str) -> list[float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_raw_rank, args=(r, port, sizes, reps, backend, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    times = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return times


def bench_push(args: argparse.Namespace, work: Path) -> None:
    """cuda: learner on cuda:0, engine on cuda:1, NCCL. cpu (a dry run of the same path): gloo."""
    gpu = args.device.startswith("cuda")
    # NVLink multicast stays off (it can take a shared host's GPUs down); the engine inherits it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if gpu and torch.cuda.device_count() < 2:
        sys.exit("--push on cuda needs two GPUs (learner on cuda:0, engine on cuda:1)")
    backend, learner_dev, engine_dev = (
        ("nccl", "cuda:0", "cuda:1") if gpu else ("gloo", "cpu", "cpu")
    )
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / args.model, args.model, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    # named_parameters, not state_dict: a tied lm_head is the embedding and travels once.
    state = {k: v.detach().to(learner_dev) for k, v in model.named_parameters()}
    buckets = buckets_of(state, args.bucket_mb << 20)
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    total = sum(sizes)
    raw = raw_broadcast_seconds(sizes, args.reps, backend)
    child, url = start_engine(
        model_dir, engine_dev, args.dtype, 8, work / "engine.log", 0 if gpu else 1
    )
    try:
        if gpu:
            torch.cuda.set_device(0)
        pusher = WeightPusher(
            [url], backend=backend, device=learner_dev, master_addr="127.0.0.1", timeout_s=600
        )
        pusher.connect()
        push = []
        for v in range(args.reps + 1):  # the first push sets the communicator up
            sync(learner_dev)
            push.append(pusher.push(buckets, version=v + 1)["seconds"])
        pusher.close()
    finally:
        child.stop()
    p, r = statistics.median(push[1:]), statistics.median(raw)
    where = torch.cuda.get_device_name() if gpu else "CPU, gloo"
    print(
        f"\nweight push of {args.model} ({total / 1e9:.3f} GB, {args.dtype}) in {len(buckets)} buckets of <= {args.bucket_mb} MB, {learner_dev} -> engine on {engine_dev} ({where})"
    )
    print("| path | median s | GB/s |")
    print("| --- | --- | --- |")
    print(f"| WeightPusher (HTTP + {backend}, pause/continue) | {p:.3f} | {total / p / 1e9:.2f} |")
    print(f"| raw {backend} broadcast, same buckets | {r:.3f} | {total / r / 1e9:.2f} |")
    print(
        f"push / raw time: {p / r:.2f}x   (push s: {[round(x, 3) for x in push]}; raw s: {[round(x, 3) for x in raw]})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=["tiny", "qwen3-0.5b"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--cpu-threads", type=int, default=1, help="torch threads of the engine and of HF on CPU"
    )
    ap.add_argument("--push", action="store_true", help="weight-push benchmark (two GPUs)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        if args.push:
            bench_push(args, Path(tmp))
        else:
            bench_generation(args, Path(tmp))


if __name__ == "__main__":
    main()
