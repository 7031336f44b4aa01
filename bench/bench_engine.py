"""Embedded-engine benchmarks, each side by side with its baseline in the same run.

Generation (default): tokens/s of the embedded engine (a child process, over HTTP, B concurrent
/generate requests, greedy, ignore_eos) against HF transformers `generate()` on the same batch
of B prompts in this process, printed as a ratio.

    python bench/bench_engine.py                                  # tiny model on CPU, B = 1, 16, 64
    python bench/bench_engine.py --model qwen3-0.5b --device cuda --batches 1,16,64,128
    python bench/bench_engine.py --quickstart                     # the quickstart's shapes on CPU

`--quickstart`: the quickstart's own model (`.cache/arithmetic-base`, built by `make quickstart`),
prompts of 20 tokens, 96 new tokens, one torch thread each: the CPU figure a regression of the
engine's CPU path shows in (the ratio to HF generate at the same shapes).

Weight push (`--push`): the learner side (this process, cuda:0) pushes the model to an embedded
engine on cuda:1 through WeightPusher (NCCL, HTTP calls, bucketed), against a raw NCCL broadcast
of the same buckets between two bare processes measured in the same run. `--device cpu` runs the
same path over gloo (a dry run).

    python bench/bench_engine.py --push --model qwen3-0.5b --device cuda --bucket-mb 512

Colocated push (`--push-backend ipc,gloo`): learner and engine on ONE device (cuda:0, or the CPU
at tiny size), the push by each backend named (ipc: tensors by CUDA IPC handle through
/update_weights_from_tensor, shared memory on the CPU; gloo: the broadcast through host memory),
each `--reps` times, median and range, against a raw `copy_` of the same bytes on that device.

    python bench/bench_engine.py --push-backend ipc,gloo --model qwen3-0.5b --device cuda --reps 5

GRPO-shaped load (`--grpo`): 64 prompts x n = 8 samples (one request each, `sampling_params.n`),
512 new tokens, temperature 1, against one engine with `engine.embedded.prefix_sharing` on and one with it
off (each prompt prefilled 8 times), in the same run; then each engine's peak GPU memory against
`engine.embedded.mem_fraction` of the GPU.

    python bench/bench_engine.py --grpo --model qwen3-0.5b --device cuda

Kernels (`--kernels`, GPU): the paged Triton decode kernel against SDPA over gathered blocks at
1 / 64 / 256 requests and 160 / 1,024 tokens each (the attention alone, one layer), and the
runner's whole decode step replayed from its CUDA graph (no HTTP, no scheduler).

    python bench/bench_engine.py --kernels --model qwen3-0.5b --device cuda
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
from slime_async.config import PushConfig
from slime_async.models.toy import (
    QWEN3_05B_SHAPE,
    char_tokenizer,
    make_tiny_model,
    save_tokenizer,
    tiny_config,
)
from slime_async.utils.procs import Child, free_port, python_module, wait_until


def make_model(out: Path, name: str, dtype: torch.dtype) -> Path:
    """A random-init model directory: `tiny` (make_tiny_model) or `qwen3-0.5b` (Qwen3-0.6B shape);
    any other name is an existing HF model directory, used as it is."""
    if name not in ("tiny", "qwen3-0.5b"):
        path = Path(name)
        if not (path / "config.json").is_file():
            sys.exit(f"--model {name}: not tiny, qwen3-0.5b or an HF model directory")
        return path
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
    model_dir: Path,
    device: str,
    dtype: str,
    max_running: int,
    log: Path,
    threads: int,
    extra: tuple[str, ...] = (),
) -> tuple[Child, str]:
    port = free_port()
    args = [
        f"engine.model_path={model_dir}",
        f"engine.port={port}",
        f"engine.embedded.device={device}",
        f"engine.embedded.dtype={dtype}",
        f"engine.embedded.max_running_requests={max_running}",
        "engine.embedded.max_context_len=1024",
        f"engine.embedded.torch_threads={threads}",
        *extra,
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
        f"\n{Path(args.model).name}, {args.dtype}, {device} ({name}), prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy"
    )
    print("| concurrent requests | embedded engine tok/s | HF generate() tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for b, eng, ref in rows:
        print(f"| {b} | {eng:.0f} | {ref:.0f} | {eng / ref:.2f}x |")


# ---- GRPO-shaped load ----------------------------------------------------------------------------


async def grpo_tokens_per_s(url: str, prompts: list[list[int]], n: int, new_tokens: int):
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "n": n, "ignore_eos": True}
    async with EngineClient(url, timeout_s=3600) as c:
        body = {"input_ids": prompts[-1], "sampling_params": {**params, "max_new_tokens": 4}}
        await c.call("POST", "/generate", body)  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(
                c.call(
                    "POST",
                    "/generate",
                    {"input_ids": p, "sampling_params": params, "return_logprob": True},
                )
                for p in prompts
            )
        )
        dt = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for group in outs for o in group)
    return tokens / dt, tokens, dt


def server_info(url: str) -> dict:
    import json

    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
        return json.loads(r.read())


def bench_grpo(args: argparse.Namespace, work: Path) -> None:
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / args.model, args.model, dtype)
    vocab = 1000 if args.model != "tiny" else 64
    prompts = prompts_for(args.grpo_prompts, args.grpo_prompt_len, vocab)
    slots = args.grpo_prompts * args.grpo_n
    rows = []
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.grpo_sharing]
    for sharing in modes:
        extra = (
            f"engine.embedded.prefix_sharing={str(sharing).lower()}",
            f"engine.embedded.mem_fraction={args.mem_fraction}",
            "engine.embedded.max_prefill_tokens=16384",
        )
        child, url = start_engine(
            model_dir, args.device, args.dtype, slots, work / f"engine_{sharing}.log", 0, extra
        )
        try:
            before = server_info(url)
            tps, tokens, dt = asyncio.run(
                grpo_tokens_per_s(url, prompts, args.grpo_n, args.grpo_new_tokens)
            )
            info = server_info(url)
        finally:
            child.stop()
        prefilled = info["prefill_tokens"] - before["prefill_tokens"]
        rows.append((sharing, tps, tokens, dt, prefilled, info))
        print(
            f"prefix_sharing={sharing}: {tps:,.0f} tok/s ({tokens} tokens in {dt:.1f} s), "
            f"prompt tokens prefilled {prefilled}",
            flush=True,
        )
    print(
        f"\nGRPO load: {args.grpo_prompts} prompts x {args.grpo_n} samples, prompt "
        f"{args.grpo_prompt_len}, {args.grpo_new_tokens} new tokens, temperature 1, {args.dtype}"
    )
    print(
        "| prompt sharing | tokens/s | prompt tokens prefilled | peak GPU memory | mem_fraction x total |"
    )
    print("| --- | --- | --- | --- | --- |")
    for sharing, tps, _, _, prefilled, info in rows:
        mem = info.get("memory", {})
        peak = mem.get("peak_reserved_bytes", 0) / 2**30
        cap = mem.get("mem_fraction", 0) * mem.get("total_bytes", 0) / 2**30
        print(
            f"| {'on' if sharing else 'off'} | {tps:,.0f} | {prefilled:,} | {peak:.1f} GiB | {cap:.1f} GiB |"
        )
    if len(rows) == 2:
        print(f"sharing on / off: {rows[0][1] / rows[1][1]:.2f}x")


def _median_ms(fn, *args) -> float:
    import triton

    return triton.testing.do_bench(lambda: fn(*args), return_mode="median")


# ---- kernels --------------------------------------------------------------------------------------


def bench_kernels(args: argparse.Namespace, work: Path) -> None:
    from slime_async.actors.engine.embedded import attention
    from slime_async.actors.engine.embedded.model_runner import ModelRunner

    dev, dt = "cuda", torch.bfloat16
    H, Hkv, D, bs = 16, 8, 128, 16
    print("| requests | tokens each | Triton paged kernel (us) | SDPA over gathered blocks (us) |")
    print("| --- | --- | --- | --- |")
    for n in (1, 64, 256):
        for L in (160, 1024):
            nb = n * (L // bs) + 1
            kc = torch.randn(nb, bs, Hkv, D, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            q = torch.randn(n, H, D, device=dev, dtype=dt)
            bt = (torch.randperm(nb - 1, device=dev)[: n * (L // bs)] + 1).view(n, -1).int()
            lens = torch.full((n,), L, dtype=torch.int32, device=dev)
            tk = _median_ms(attention.paged_decode, q, kc, vc, bt, lens, D**-0.5)
            tg = _median_ms(attention.decode_reference, q, kc, vc, bt, lens, D**-0.5, L)
            print(f"| {n} | {L} | {tk * 1e3:.1f} | {tg * 1e3:.1f} |", flush=True)
    model_dir = make_model(work / args.model, args.model, dt)
    for attn in ("triton", "gathered"):
        runner = ModelRunner(
            model_dir,
            dev,
            dt,
            max_slots=256,
            max_context_len=1024,
            num_blocks=256 * 64 + 1,
            decode_attention=attn,
        )
        runner.capture_cuda_graphs()
        print(
            f"\nwhole decode step from its CUDA graph ({attn} attention, fused layers: "
            f"{type(runner.math).__name__})"
        )
        print("| requests | context | ms per step | tokens/s |")
        print("| --- | --- | --- | --- |")
        for n in (1, 64, 256):
            for L in (160, 1024):
                per = L // bs
                bt = torch.arange(1, n * per + 1, dtype=torch.int32).view(n, per)
                table = torch.zeros((n, runner.max_blocks_per_seq), dtype=torch.int32)
                table[:, :per] = bt
                ids = torch.randint(5, 1000, (n,), device=dev)
                pos = torch.full((n,), L - 1, dtype=torch.long)
                ms = _median_ms(runner.decode, ids, pos, table)
                print(f"| {n} | {L} | {ms:.2f} | {n / ms * 1e3:,.0f} |", flush=True)
        runner.drop_cuda_graphs()
        runner = None
        torch.cuda.empty_cache()


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
        push_cfg = PushConfig(
            backend=backend, master_addr="127.0.0.1", timeout_s=600, resync_wait_s=0.0
        )
        pusher = WeightPusher([url], push_cfg, device=learner_dev)
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


def _spread(xs: list[float]) -> str:
    """median [min, max], in seconds."""
    return f"{statistics.median(xs):.4f} [{min(xs):.4f}, {max(xs):.4f}]"


def raw_copy_seconds(buckets: list[list[tuple[str, torch.Tensor]]], reps: int) -> list[float]:
    """The hardware baseline of a colocated push: `copy_` of the same bytes into other tensors on
    the same device (device to device on a GPU, memcpy on the CPU)."""
    dst = [[torch.empty_like(t) for _, t in b] for b in buckets]
    dev = str(buckets[0][0][1].device)
    times = []
    for _ in range(reps + 1):  # the first round allocates nothing new but warms the copy kernels
        sync(dev)
        t0 = time.perf_counter()
        for b, d in zip(buckets, dst, strict=True):
            for (_, t), o in zip(b, d, strict=True):
                o.copy_(t)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_push_backends(args: argparse.Namespace, work: Path) -> None:
    """`--push-backend ipc,gloo`: the learner (this process) and one embedded engine on the SAME
    device (cuda:0, or the CPU), the push by each backend named, each `--reps` times after one
    warm-up push, and a raw `copy_` of the same bytes as the baseline. ipc: tensors by CUDA IPC
    handle (shared memory on the CPU) through /update_weights_from_tensor; gloo: the broadcast
    through host memory (what an engine on the learner's GPU got before)."""
    backends = [b.strip() for b in args.push_backend.split(",") if b.strip()]
    unknown = sorted(set(backends) - {"ipc", "gloo", "nccl"})
    if unknown:
        sys.exit(f"--push-backend: unknown backend(s) {unknown} (ipc, gloo, nccl)")
    if "nccl" in backends:
        sys.exit("--push-backend nccl needs an engine on a GPU of its own: use --push")
    if args.reps < 5:
        sys.exit(f"--push-backend wants --reps >= 5 for a median and a spread, got {args.reps}")
    gpu = args.device.startswith("cuda")
    dev = "cuda:0" if gpu else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / args.model, args.model, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    state = {k: v.detach().to(dev) for k, v in model.named_parameters()}
    del model
    buckets = buckets_of(state, args.bucket_mb << 20)
    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    rows = {"raw copy_ (same device, same bytes)": raw_copy_seconds(buckets, args.reps)}
    child, url = start_engine(
        model_dir, dev, args.dtype, 8, work / "engine.log", 0 if gpu else args.cpu_threads
    )
    try:
        if gpu:
            torch.cuda.set_device(0)
        for backend in backends:
            cfg = PushConfig(
                backend=backend, master_addr="127.0.0.1", timeout_s=300, resync_wait_s=0.0
            )
            pusher = WeightPusher([url], cfg)  # gloo: buckets moved to host memory, as "auto" did
            try:
                pusher.connect()
                times, failed = [], 0.0
                for v in range(args.reps + 1):  # the first push sets the path up
                    sync(dev)
                    stats = pusher.push(buckets, version=f"{backend}-{v}")
                    failed += stats["failed"]
                    times.append(stats["seconds"])
                if failed:
                    sys.exit(
                        f"--push-backend {backend}: {failed:.0f} pushes failed (engine log: {work / 'engine.log'})"
                    )
                rows[f"WeightPusher, push.backend = {backend}"] = times[1:]
            finally:
                pusher.close()
    finally:
        child.stop()
    where = torch.cuda.get_device_name() if gpu else "CPU"
    print(
        f"\ncolocated weight push of {args.model} ({total / 1e6:.1f} MB, {args.dtype}) in "
        f"{len(buckets)} buckets of <= {args.bucket_mb} MB, learner and engine on {dev} ({where}), "
        f"{args.reps} pushes each after a warm-up"
    )
    print("| path | median s [min, max] | GB/s (median) |")
    print("| --- | --- | --- |")
    for name, xs in rows.items():
        print(f"| {name} | {_spread(xs)} | {total / statistics.median(xs) / 1e9:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="tiny", help="tiny, qwen3-0.5b (random init) or an HF model directory"
    )
    ap.add_argument(
        "--quickstart",
        action="store_true",
        help="the quickstart's model and shapes on CPU (prompt 20, 96 new tokens, 1 thread)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--cpu-threads", type=int, default=1, help="torch threads of the engine and of HF on CPU"
    )
    ap.add_argument("--push", action="store_true", help="weight-push benchmark (two GPUs)")
    ap.add_argument(
        "--push-backend",
        default=None,
        help="colocated push benchmark, e.g. ipc,gloo: learner and engine on one device",
    )
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--grpo", action="store_true", help="GRPO-shaped load, prompt sharing on/off")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--grpo-prompt-len", type=int, default=256)
    ap.add_argument("--grpo-new-tokens", type=int, default=512)
    ap.add_argument("--grpo-sharing", choices=["both", "on", "off"], default="both")
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument(
        "--kernels", action="store_true", help="decode attention and step timings (GPU)"
    )
    args = ap.parse_args()
    if args.quickstart:
        root = Path(__file__).resolve().parent.parent
        args.model, args.device = str(root / ".cache" / "arithmetic-base"), "cpu"
        args.prompt_len, args.new_tokens, args.cpu_threads = 20, 96, 1
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        if args.push_backend:
            bench_push_backends(args, Path(tmp))
        elif args.push:
            bench_push(args, Path(tmp))
        elif args.grpo:
            bench_grpo(args, Path(tmp))
        elif args.kernels:
            bench_kernels(args, Path(tmp))
        else:
            bench_generation(args, Path(tmp))


if __name__ == "__main__":
    main()
