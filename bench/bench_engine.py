"""Embedded-engine benchmarks, each side by side with its baseline in the same run and its roofline.

Generation (default): tokens/s of the embedded engine (a child process, over HTTP, B concurrent
/generate requests, greedy, ignore_eos: every request runs to `--new-tokens`) against HF
transformers `generate()` on the same batch of B prompts in this process (run first, alone on
the device, and released before the engine starts with `--mem-fraction` of it), printed as a
ratio. `--context L` makes the prompts L tokens long (decode at long context; the engine's
max_context_len follows). The warm-up's prefill leaves the prompts' full KV blocks cached
(prefix sharing), so the timed run's prefill is mostly cache hits: `prompt_tokens_prefilled` in
the JSON counts what was prefilled.

    python bench/bench_engine.py                                  # tiny model on CPU, B = 1, 16, 64
    python bench/bench_engine.py --model qwen3-0.5b --device cuda --batches 1,16,64,128
    python bench/bench_engine.py --model qwen3-0.5b --device cuda --batches 64 --context 4096 \
        --new-tokens 64                                           # decode at a 4k context
    python bench/bench_engine.py --quickstart                     # the quickstart's shapes on CPU

Roofline (generation and GRPO rows): the memory-bandwidth limit of the decode at HBM bandwidth
`--hbm-tbps` (default 4.8, an H200), from the model actually loaded: each step reads the weights
(parameters x dtype bytes) and every request's KV cache (2 x layers x kv_heads x head_dim x dtype
bytes a token of context), contexts growing from prompt + 1 to prompt + new; limit = all tokens
over the sum of the steps' times (bench/roofline.py). Printed beside each measured tokens/s as a
fraction (measured / roofline), and written with `--json`. Prefill, sampling and HTTP are not in
the limit. On a CPU the fraction against an H200's bandwidth means nothing; `--hbm-tbps` sets it.

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

GRPO-shaped load (`--grpo`): 64 prompts x n = 8 samples, 512 new tokens (`--new-tokens`),
temperature 1, each `--grpo-top-p` (comma-separated, e.g. 1.0,0.95), ignore_eos (every sample
runs to length; the run fails if fewer tokens come back), all samples running at once, against
one engine with `engine.embedded.prefix_sharing` on and one with it off (each prompt prefilled 8
times), in the same run; then each engine's peak GPU memory against `engine.embedded.mem_fraction`
of the GPU. `--grpo-fanout`: `n` sends one request per prompt with `sampling_params.n` (the
server expands it, one prefill); `requests` sends n requests of the same prompt, as the
generator sends a group (one rollout per sample); `both` runs each on the same engine. The
prompt cache is flushed before each run.

    python bench/bench_engine.py --grpo --model qwen3-0.5b --device cuda
    python bench/bench_engine.py --grpo --model qwen3-0.5b --device cuda --grpo-sharing on \
        --grpo-fanout both --grpo-top-p 1.0,0.95

`--engine-options "key=value;..."` sets [engine.embedded] keys of every engine the generation
table and the GRPO load start (an A/B of one setting in processes of their own, e.g.
`decode_shared_prefix=off`: each sample's decode reads its prompt's blocks on its own).

Kernels (`--kernels`, GPU): the paged Triton decode kernel against SDPA over gathered blocks at
1 / 64 / 256 requests and 160 / 1,024 tokens each (the attention alone, one layer), the
runner's whole decode step replayed from its CUDA graph (no HTTP, no scheduler) up to 4,096
tokens with each step's roofline, and a profile of the step's kernels and of the sampler.

    python bench/bench_engine.py --kernels --model qwen3-0.5b --device cuda

Under each generation and GRPO row: the engine loop's timing from /get_server_info (device time
of the decode steps from CUDA events, the host's waits, the device's share of the loop) and the
decode steps against the roofline of a step of their mean batch. `--scheduler` runs the
scheduler and runner in this process without HTTP (`--trace DIR`: a profiler trace and the
host's top functions); `--spy SECONDS` samples the engine process with py-spy during each run.

    python bench/bench_engine.py --scheduler --model qwen3-0.5b --device cuda --batches 1,256
    python bench/bench_engine.py --grpo --model qwen3-0.5b --device cuda --spy 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import roofline
import torch
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.weight_push import PHASES as PUSH_PHASES
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
    max_context_len: int = 1024,
) -> tuple[Child, str]:
    port = free_port()
    args = [
        f"engine.model_path={model_dir}",
        f"engine.port={port}",
        f"engine.embedded.device={device}",
        f"engine.embedded.dtype={dtype}",
        f"engine.embedded.max_running_requests={max_running}",
        f"engine.embedded.max_context_len={max_context_len}",
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


def engine_log_dir(args: argparse.Namespace, work: Path) -> Path:
    """Where the engine's log goes: `--engine-logs` (kept after the run), else the run's
    temporary directory."""
    if not args.engine_logs:
        return work
    out = Path(args.engine_logs)
    out.mkdir(parents=True, exist_ok=True)
    return out


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [
        [2, *torch.randint(8, min(vocab, 100), (length - 1,), generator=g).tolist()]
        for _ in range(batch)
    ]


async def engine_tokens_per_s(
    url: str, prompts: list[list[int]], new_tokens: int
) -> tuple[float, dict]:
    """Tokens/s of the timed run (after a warm-up) and /get_server_info just before it."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    async with EngineClient(url, timeout_s=3600) as c:
        await asyncio.gather(
            *(c.generate(p, {**params, "max_new_tokens": 4}) for p in prompts)
        )  # warm-up
        before = await asyncio.to_thread(server_info, url)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(p, params) for p in prompts))
        dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt, before


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


def decode_shape(model_dir: Path, dtype: torch.dtype) -> roofline.DecodeShape:
    """The loaded model's decode roofline inputs: its parameter count (built on the meta device,
    a tied output layer counted once), `dtype`'s bytes, and the KV layout from its config."""
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    heads = cfg.num_attention_heads
    return roofline.DecodeShape(
        params=params,
        dtype_bytes=torch.finfo(dtype).bits // 8,
        layers=cfg.num_hidden_layers,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    )


def describe_roofline(shape: roofline.DecodeShape, hbm_tbps: float) -> str:
    return (
        f"roofline: HBM {hbm_tbps} TB/s; weights {shape.weight_bytes / 1e6:,.1f} MB "
        f"({shape.params / 1e6:,.1f}M params x {shape.dtype_bytes} B) + KV "
        f"{shape.kv_bytes_per_token / 1e3:.1f} KB a token of context (2 x {shape.layers} layers "
        f"x {shape.kv_heads} kv heads x {shape.head_dim} x {shape.dtype_bytes} B) per decode step, "
        "averaged over the decode; prefill, sampling and HTTP not counted"
    )


def with_roofline(
    row: dict, shape, batch: int, prompt_len: int, new: int, hbm: float, group: int = 1
) -> dict:
    """`row` with the decode roofline of its shape (`group` requests reading a prompt once)
    and each measured tokens/s as a fraction."""
    row.update(roofline.decode_roofline(shape, batch, prompt_len, new, hbm, group))
    measured = [k for k, v in row.items() if k.endswith("_tokens_per_s") and v is not None]
    for key in [k for k in measured if k != "roofline_tokens_per_s"]:
        row[key[: -len("_tokens_per_s")] + "_of_roofline"] = row[key] / row["roofline_tokens_per_s"]
    return row


def table_head(*columns: str) -> None:
    """A markdown table's header and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def fmt(x: float | None, spec: str) -> str:
    """`x` formatted, or "OOM" where the measurement ran out of memory."""
    return "OOM" if x is None else format(x, spec)


def write_json(path: str | None, record: dict, partial: bool = False) -> None:
    """`record` to `path` (if given); `partial`: the rows so far, rewritten after each row so
    that a run stopped by a timeout leaves what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**record, "partial": partial}, indent=2) + "\n")
        if not partial:
            print(f"wrote {path}")


def bench_generation(args: argparse.Namespace, work: Path) -> dict:
    device = args.device
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / Path(args.model).name, args.model, dtype)
    shape = decode_shape(model_dir, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    threads = 0 if device.startswith("cuda") else args.cpu_threads
    if threads:
        torch.set_num_threads(threads)
    # HF first, alone on the device, then released: the engine then gets its --mem-fraction of
    # a GPU with nothing else resident (at long contexts both caches would not fit at once).
    hf = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        .to(device)
        .eval()
    )
    vocab = hf.config.vocab_size
    hf_rates: dict[int, float | None] = {}
    for b in batches:
        try:
            with torch.inference_mode():
                hf_rates[b] = hf_tokens_per_s(
                    hf, prompts_for(b, args.prompt_len, vocab), args.new_tokens, device
                )
        except torch.cuda.OutOfMemoryError as e:
            hf_rates[b] = None
            print(f"batch {b}: HF generate ran out of memory: {str(e).splitlines()[0][:200]}")
        print(f"batch {b:4d}: HF generate {fmt(hf_rates[b], '9.1f')} tok/s", flush=True)
    del hf
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    context = args.prompt_len + args.new_tokens
    child, url = start_engine(
        model_dir,
        device,
        args.dtype,
        max(batches),
        engine_log_dir(args, work) / "engine.log",
        threads,
        (f"engine.embedded.mem_fraction={args.mem_fraction}", *engine_options(args)),
        max_context_len=max(1024, context),
    )
    rows = []
    try:
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, vocab)
            before = server_info(url)
            spy_out = work / f"spy_{b}.txt"
            spy = spy_start(child.proc.pid, args.spy, spy_out) if args.spy else None
            eng, timed_before = asyncio.run(engine_tokens_per_s(url, prompts, args.new_tokens))
            after = server_info(url)
            prefilled = after["prefill_tokens"] - before["prefill_tokens"]
            timing = loop_timing(timed_before, after)
            ref = hf_rates[b]
            row = {"batch": b, "engine_tokens_per_s": eng, "hf_tokens_per_s": ref}
            row = with_roofline(row, shape, b, args.prompt_len, args.new_tokens, args.hbm_tbps)
            row["ratio_engine_over_hf"] = eng / ref if ref else None
            row["prompt_tokens_prefilled"] = prefilled  # the warm-up and the timed run
            row["prefill_attention"] = after.get("prefill_attention")
            row["engine_loop"] = timing  # the timed run only
            row["cuda_allocator"] = allocator_delta(
                before["memory"], after["memory"]
            )  # warm-up too
            row["engine_gc"] = gc_delta(timed_before, after)  # the timed run
            row["decode_steps_of_roofline"] = decode_steps_of_roofline(
                timing, shape, args.prompt_len, args.new_tokens, args.hbm_tbps
            )
            rows.append(row)
            write_json(args.json, {"rows": rows, "hbm_tbps": args.hbm_tbps}, partial=True)
            print(
                f"batch {b:4d}: engine {eng:9.1f} tok/s   HF generate {fmt(ref, '9.1f')} tok/s   "
                f"ratio {fmt(row['ratio_engine_over_hf'], '5.2f')}x   roofline "
                f"{row['roofline_tokens_per_s']:9.1f} tok/s "
                f"(engine {row['engine_of_roofline']:.3g} of it)\n    {describe_loop(timing)}"
                + (
                    f"\n    decode steps alone at {row['decode_steps_of_roofline']:.2f} of the "
                    "roofline of a step of their mean batch"
                    if row["decode_steps_of_roofline"]
                    else ""
                )
                + (
                    f"\n    CUDA allocator (warm-up and timed run): {row['cuda_allocator']}"
                    if any(row["cuda_allocator"].values())
                    else ""
                )
                + f"\n    {describe_gc(row['engine_gc'])}",
                flush=True,
            )
            spy_report(spy, spy_out)
    finally:
        child.stop()
    name = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"CPU x{threads or torch.get_num_threads()} threads"
    )
    print(
        f"\n{Path(args.model).name}, {args.dtype}, {device} ({name}), prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy, ignore_eos (every request runs to length)"
    )
    print(describe_roofline(shape, args.hbm_tbps))
    table_head(
        "concurrent requests",
        "embedded engine tok/s",
        "HF generate() tok/s",
        "ratio",
        "roofline tok/s",
        "engine / roofline",
        "HF / roofline",
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['engine_tokens_per_s']:.0f} | {fmt(r['hf_tokens_per_s'], '.0f')} "
            f"| {fmt(r['ratio_engine_over_hf'], '.2f')}x | {r['roofline_tokens_per_s']:.0f} "
            f"| {r['engine_of_roofline']:.3g} | {fmt(r.get('hf_of_roofline'), '.3g')} |"
        )
    return {
        "bench": "generation",
        "model": Path(args.model).name,
        "device": name,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "sampling": "greedy, ignore_eos",
        "params": shape.params,
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "rows": rows,
    }


# ---- GRPO-shaped load ----------------------------------------------------------------------------


async def grpo_tokens_per_s(
    url: str, prompts: list[list[int]], n: int, new_tokens: int, top_p: float, fanout: str
) -> tuple[float, int, float]:
    """Every prompt's n samples at temperature 1 and `top_p`, ignore_eos (each runs to
    `new_tokens`), all at once: fanout "n" sends one request per prompt with
    `sampling_params.n` (the server expands it: one prefill); "requests" sends n requests of the
    same prompt (how the generator sends a group: one rollout per sample)."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": top_p, "ignore_eos": True}
    if fanout == "n":
        bodies = [{"input_ids": p, "sampling_params": {**params, "n": n}} for p in prompts]
    else:
        bodies = [{"input_ids": p, "sampling_params": params} for p in prompts for _ in range(n)]
    async with EngineClient(url, timeout_s=3600) as c:
        # each run starts from an empty prompt cache: runs on one engine compare like with like
        if not await c.flush_cache():
            raise RuntimeError(f"engine at {url} refused /flush_cache before a GRPO run")
        warm = {"input_ids": prompts[-1], "sampling_params": {**params, "max_new_tokens": 4}}
        await c.call("POST", "/generate", warm)
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.call("POST", "/generate", {**b, "return_logprob": True}) for b in bodies)
        )
        dt = time.perf_counter() - t0
    # with n > 1 a response is a list of n outputs, else one output
    flat = [o for out in outs for o in (out if isinstance(out, list) else [out])]
    tokens = sum(len(o["output_ids"]) for o in flat)
    if tokens != len(prompts) * n * new_tokens:
        raise RuntimeError(
            f"GRPO load: {tokens} tokens came back, expected {len(prompts)} prompts x {n} x "
            f"{new_tokens} (ignore_eos: every sample runs to length)"
        )
    return tokens / dt, tokens, dt


def server_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
        return json.loads(r.read())


LOOP_KEYS = (
    "loop_s",
    "host_wait_s",
    "decode_steps_timed",
    "decode_rows_timed",
    "decode_device_s",
    "prefill_batches",
    "prefill_s",
    "prefill_device_s",
)


def loop_timing(before: dict, after: dict) -> dict:
    """The engine loop's time between two /get_server_info answers: working wall time, device
    time of the decode steps (GPU), host waits on the device, mean decode batch."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in LOOP_KEYS}
    steps = d["decode_steps_timed"]
    return {
        "loop_s": d["loop_s"],
        "host_wait_s": d["host_wait_s"],
        "prefills": d["prefill_batches"],
        "prefill_s": d["prefill_s"],
        "prefill_device_s": d["prefill_device_s"],
        "decode_steps": steps,
        "mean_decode_batch": d["decode_rows_timed"] / steps if steps else None,
        "decode_device_ms_per_step": 1e3 * d["decode_device_s"] / steps if steps else None,
        "loop_ms_per_decode_step": 1e3 * d["loop_s"] / steps if steps else None,
        "device_share_of_loop": d["decode_device_s"] / d["loop_s"] if d["loop_s"] else None,
    }


def py_spy() -> str | None:
    """py-spy's executable: on PATH, or where bench/gpu_suite.sh installs the wheels of .whl/."""
    import shutil

    found = shutil.which("py-spy")
    if found:
        return found
    for site in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        exe = Path(site) / "bin" / "py-spy"
        if site and exe.is_file():
            return str(exe)
    return None


def spy_start(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """Sample the engine process `pid` with py-spy for `seconds` (raw collapsed stacks to
    `out`); None, with a message, when py-spy is not installed."""
    exe = py_spy()
    if exe is None:
        print("--spy: py-spy is not installed (pip install py-spy, or its wheel in .whl/)")
        return None
    secs = str(max(1, round(seconds)))  # py-spy takes whole seconds
    cmd = [exe, "record", "-d", secs, "-r", "200", "-p", str(pid), "--format", "raw"]
    return subprocess.Popen(
        [*cmd, "-o", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def spy_summary(raw: str, thread: str = "Scheduler._loop", top: int = 12) -> str:
    """py-spy's raw stacks ("frame;frame;... count" lines) of the samples whose stack holds
    `thread` (the engine's scheduler loop): the frames most often on top (self) and on the stack
    (inclusive), as shares of those samples. A host blocked in a copy or a sync shows as the
    frame that called it."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.strip().rpartition(" ")
        if not stack or not count.isdigit() or thread not in stack:
            continue
        n, frames = int(count), stack.split(";")
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return f"py-spy: no samples of {thread}"
    lines = [f"py-spy: {total} samples of {thread}; on top of the stack:"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {n / total:6.1%}  {f}")
    lines.append("  on the stack:")
    skip = ("Thread.", "Scheduler._loop", "Scheduler._guarded")
    ranked = [(f, n) for f, n in incl.items() if not f.startswith(skip)]
    for f, n in sorted(ranked, key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {n / total:6.1%}  {f}")
    return "\n".join(lines)


def spy_report(spy: subprocess.Popen | None, out: Path) -> None:
    if spy is None:
        return
    try:
        _, err = spy.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        spy.kill()
        print("--spy: py-spy did not finish in 120 s")
        return
    if not out.is_file():
        print(f"--spy: py-spy wrote no profile ({err.decode(errors='replace').strip()[-300:]})")
        return
    print(spy_summary(out.read_text()))


def decode_steps_of_roofline(
    t: dict, shape: roofline.DecodeShape, prompt_len: int, new: int, hbm: float
) -> float | None:
    """The decode steps' device time against the roofline of a step of their mean batch (the
    run's prefill and HTTP left out): what a long-context run that prefills its prompts inside
    the timed run still says about the decode. None without device timing (CPU)."""
    if not t["decode_steps"] or not t["decode_device_ms_per_step"]:
        return None
    batch = max(1, round(t["mean_decode_batch"]))
    limit = roofline.decode_roofline(shape, batch, prompt_len, new, hbm)["roofline_step_ms"]
    return limit / t["decode_device_ms_per_step"]


def allocator_delta(before: dict, after: dict) -> dict[str, int]:
    """The CUDA caching allocator's counts between two readings of the engine's `memory` (a
    retry freed the allocator's whole cache and synchronized: a stall); zeros off a GPU."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("alloc_retries", "device_mallocs")}


def gc_delta(before: dict, after: dict) -> dict:
    """The engine process's garbage collections between two /get_server_info answers: how many
    (by generation), their seconds, the longest so far, how many were long (over
    engine.embedded.gc_warning_s)."""
    if "gc_collections" not in after:
        return {}
    return {
        "collections": [
            a - b for a, b in zip(after["gc_collections"], before["gc_collections"], strict=True)
        ],
        "seconds": round(sum(after["gc_seconds"]) - sum(before["gc_seconds"]), 4),
        "long": after["gc_long_collections"] - before["gc_long_collections"],
        "longest_s_so_far": after["gc_longest_s"],
        "frozen_objects": after["gc_frozen_objects"],
    }


def describe_gc(g: dict) -> str:
    if not g:
        return "engine garbage collections: not reported"
    return (
        f"engine garbage collections: {g['collections']} (by generation), "
        f"{g['seconds']:.3f} s, {g['long']} long; {g['frozen_objects']} objects frozen"
    )


def describe_loop(t: dict) -> str:
    if not t["decode_steps"]:
        return (
            f"engine loop {t['loop_s']:.3f} s (no decode step timed on a device); "
            f"{t['prefills']} prefills: {t['prefill_s']:.3f} s of host time"
        )
    return (
        f"engine loop {t['loop_s']:.3f} s: {t['decode_steps']} decode steps (mean batch "
        f"{t['mean_decode_batch']:.1f}), {t['loop_ms_per_decode_step']:.2f} ms of loop and "
        f"{t['decode_device_ms_per_step']:.2f} ms of device time a step (device "
        f"{t['device_share_of_loop']:.0%} of the loop), host waited {t['host_wait_s']:.3f} s; "
        f"{t['prefills']} prefills: {t['prefill_s']:.3f} s of host time (admission, launch), "
        f"{t['prefill_device_s']:.3f} s on the device"
    )


def engine_options(args: argparse.Namespace) -> tuple[str, ...]:
    """`--engine-options` as overrides of [engine.embedded] (the A/B of a setting)."""
    items = [kv.strip() for kv in (args.engine_options or "").split(";") if kv.strip()]
    return tuple(f"engine.embedded.{kv}" for kv in items)


def bench_grpo(args: argparse.Namespace, work: Path) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / Path(args.model).name, args.model, dtype)
    shape = decode_shape(model_dir, dtype)
    vocab = 1000 if args.model != "tiny" else 64
    new = args.grpo_new_tokens
    prompts = prompts_for(args.grpo_prompts, args.grpo_prompt_len, vocab)
    slots = args.grpo_prompts * args.grpo_n
    top_ps = [float(x) for x in args.grpo_top_p.split(",")]
    fanouts = {"both": ("n", "requests"), "n": ("n",), "requests": ("requests",)}[args.grpo_fanout]
    gpu = args.device.startswith("cuda")
    threads = 0 if gpu else args.cpu_threads
    rows = []
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.grpo_sharing]
    for sharing in modes:
        extra = (
            f"engine.embedded.prefix_sharing={str(sharing).lower()}",
            f"engine.embedded.mem_fraction={args.mem_fraction}",
            "engine.embedded.max_prefill_tokens=16384",
            *engine_options(args),
        )
        child, url = start_engine(
            model_dir,
            args.device,
            args.dtype,
            slots,
            engine_log_dir(args, work) / f"engine_{sharing}.log",
            threads,
            extra,
            max_context_len=max(1024, args.grpo_prompt_len + new),
        )
        try:
            for fanout in fanouts:
                for top_p in top_ps:
                    before = server_info(url)
                    spy_out = work / f"spy_{sharing}_{fanout}_{top_p}.txt"
                    spy = spy_start(child.proc.pid, args.spy, spy_out) if args.spy else None
                    tps, tokens, dt = asyncio.run(
                        grpo_tokens_per_s(url, prompts, args.grpo_n, new, top_p, fanout)
                    )
                    info = server_info(url)
                    row = {
                        "prefix_sharing": sharing,
                        "fanout": fanout,
                        "top_p": top_p,
                        "engine_tokens_per_s": tps,
                        "tokens": tokens,
                        "seconds": dt,
                        # the warm-up request's prompt and the timed run's
                        "prompt_tokens_prefilled": info["prefill_tokens"]
                        - before["prefill_tokens"],
                        "memory": info.get("memory", {}),
                        "engine_loop": loop_timing(before, info),  # warm-up included
                        "engine_gc": gc_delta(before, info),  # warm-up included
                        "decode_shared_prefix": info.get("decode_shared_prefix"),
                        "decode_shared_steps": info.get("decode_shared_steps", 0)
                        - before.get("decode_shared_steps", 0),
                    }
                    # the engine reads a shared prompt once a group where it says it does
                    once = sharing and row["decode_shared_prefix"] == "on"
                    group = args.grpo_n if once else 1
                    with_roofline(
                        row, shape, slots, args.grpo_prompt_len, new, args.hbm_tbps, group
                    )
                    rows.append(row)
                    write_json(args.json, {"rows": rows, "hbm_tbps": args.hbm_tbps}, partial=True)
                    print(
                        f"prefix_sharing={sharing} fanout={fanout} top_p={top_p}: {tps:,.0f} "
                        f"tok/s ({tokens} tokens in {dt:.1f} s), prompt tokens prefilled "
                        f"{row['prompt_tokens_prefilled']}, roofline "
                        f"{row['roofline_tokens_per_s']:,.0f} tok/s "
                        f"({row['engine_of_roofline']:.3g} of it)\n    "
                        f"{describe_loop(row['engine_loop'])}; CUDA graphs up to batch "
                        f"{max(info.get('cuda_graph_batch_sizes') or [0])}; shared prompt "
                        f"blocks read once: {row['decode_shared_prefix']} "
                        f"({row['decode_shared_steps']} steps)\n    "
                        f"{describe_gc(row['engine_gc'])}",
                        flush=True,
                    )
                    spy_report(spy, spy_out)
        finally:
            child.stop()
    print(
        f"\nGRPO load: {args.grpo_prompts} prompts x {args.grpo_n} samples ({slots} running at "
        f"once), prompt {args.grpo_prompt_len}, {new} new tokens, temperature 1, ignore_eos "
        f"(every sample runs to length), {args.dtype}; fanout n: one request per prompt with "
        "sampling_params.n; requests: n requests of the same prompt (as the generator sends)"
    )
    print(describe_roofline(shape, args.hbm_tbps))
    table_head(
        "prompt sharing",
        "fanout",
        "top_p",
        "tokens/s",
        "prompt's keys read",
        "roofline tok/s",
        "fraction",
        "prompt tokens prefilled",
        "peak GPU memory",
        "mem_fraction x total",
    )
    for r in rows:
        mem = r["memory"]
        peak = mem.get("peak_reserved_bytes", 0) / 2**30
        cap = mem.get("mem_fraction", 0) * mem.get("total_bytes", 0) / 2**30
        print(
            f"| {'on' if r['prefix_sharing'] else 'off'} | {r['fanout']} | {r['top_p']} "
            f"| {r['engine_tokens_per_s']:,.0f} "
            f"| {'once a group' if r['prompt_read_by'] > 1 else 'by each request'} "
            f"| {r['roofline_tokens_per_s']:,.0f} "
            f"| {r['engine_of_roofline']:.3g} | {r['prompt_tokens_prefilled']:,} "
            f"| {peak:.1f} GiB | {cap:.1f} GiB |"
        )
    on = [r for r in rows if r["prefix_sharing"]]
    off = [r for r in rows if not r["prefix_sharing"]]
    if on and off:
        print(
            f"sharing on / off (first of each): {on[0]['engine_tokens_per_s'] / off[0]['engine_tokens_per_s']:.2f}x"
        )
    return {
        "bench": "grpo",
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "prompts": args.grpo_prompts,
        "n": args.grpo_n,
        "prompt_len": args.grpo_prompt_len,
        "new_tokens": new,
        "sampling": "temperature 1, ignore_eos",
        "params": shape.params,
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "rows": rows,
    }


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
    shape = decode_shape(model_dir, dt)
    for attn in ("triton", "gathered"):
        runner = ModelRunner(
            model_dir,
            dev,
            dt,
            max_slots=256,
            max_context_len=4096,
            num_blocks=256 * 64 + 1,  # 64 requests of 4,096 tokens, or 256 of 1,024
            decode_attention=attn,
        )
        runner.capture_cuda_graphs()
        print(
            f"\nwhole decode step from its CUDA graph ({attn} attention, fused layers: "
            f"{type(runner.math).__name__})"
        )
        print(
            f"| requests | context | ms per step | tokens/s | roofline ms ({args.hbm_tbps} TB/s) "
            "| roofline / step |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for n, L in [(n, L) for n in (1, 64, 256) for L in (160, 1024, 4096) if n * L <= 2**18]:
            if attn == "gathered" and L > 1024:
                continue  # SDPA over gathered blocks pads every row to the longest: minutes
            per = L // bs
            bt = torch.arange(1, n * per + 1, dtype=torch.int32).view(n, per)
            table = torch.zeros((n, runner.max_blocks_per_seq), dtype=torch.int32)
            table[:, :per] = bt
            ids = torch.randint(5, 1000, (n,), device=dev)
            pos = torch.full((n,), L - 1, dtype=torch.long)
            ms = _median_ms(runner.decode, ids, pos, table)
            floor = (shape.weight_bytes + n * L * shape.kv_bytes_per_token) / (args.hbm_tbps * 1e9)
            print(
                f"| {n} | {L} | {ms:.2f} | {n / ms * 1e3:,.0f} | {floor:.2f} | {floor / ms:.2f} |",
                flush=True,
            )
        if attn == "triton":
            profile_step(runner)
        runner.drop_cuda_graphs()
        runner = None
        torch.cuda.empty_cache()


def profile_step(runner, n: int = 256, context: int = 160) -> None:
    """Where a decode step's device time goes: the kernels of one eager step, of the graph's
    replay, and of the sampler (greedy; temperature 1 at top_p 1.0 and 0.95), by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    from slime_async.actors.engine.embedded.sampling import sample

    dev, bs = runner.device, runner.block_size
    per = context // bs
    table = torch.zeros((n, runner.max_blocks_per_seq), dtype=torch.int32)
    table[:, :per] = torch.arange(1, n * per + 1, dtype=torch.int32).view(n, per)
    ids = torch.randint(5, 1000, (n,), device=dev)
    pos = torch.full((n,), context - 1, dtype=torch.long)
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.full((n,), -1, dtype=torch.long)

    def sampler(t: float, top_p: float):
        logits = runner.decode(ids, pos, table)
        temp = torch.full((n,), t)
        return lambda: sample(logits, temp, k, torch.full((n,), top_p), gen, picks=runner.picks)

    cases = {
        "eager decode step": lambda: runner.decode_step(ids, pos.to(dev), table.to(dev), context),
        "graph replay": lambda: runner.decode(ids, pos, table),
        "sample greedy": sampler(0.0, 1.0),
        "sample T=1 top_p 1.0": sampler(1.0, 1.0),
        "sample T=1 top_p 0.95": sampler(1.0, 0.95),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 5
        print(f"\n{name}, {n} rows, context {context}: {total / 1e3:.3f} ms of kernels a call")
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:14]
        for e in top:
            if e.self_device_time_total <= 0:
                continue
            print(
                f"  {e.self_device_time_total / 5 / 1e3:8.3f} ms  x{e.count // 5:<4d} {e.key[:110]}"
            )


# ---- the scheduler in process ------------------------------------------------------------------


def bench_scheduler(args: argparse.Namespace, work: Path) -> None:
    """The engine's scheduler and runner in this process, no HTTP: B requests of prompt
    `--prompt-len`, `--new-tokens` each (greedy, or `--temperature`), after a warm-up; tokens/s
    and the loop's timing (`StepTiming`) per batch size. `--trace DIR` writes a torch profiler
    trace of the timed run (chrome format, gzipped) and prints the device's busy share and the
    scheduler thread's top host functions (cProfile)."""
    import cProfile
    import gzip
    import pstats
    import threading

    from slime_async.actors.engine.embedded.model_runner import ModelRunner
    from slime_async.actors.engine.embedded.sampling import SamplingParams
    from slime_async.actors.engine.embedded.scheduler import Request, Scheduler

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_dir = make_model(work / Path(args.model).name, args.model, dtype)
    shape = decode_shape(model_dir, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(
        model_dir,
        args.device,
        dtype,
        max_slots=max(batches),
        max_context_len=max(1024, args.prompt_len + args.new_tokens),
        mem_fraction=args.mem_fraction,
    )
    runner.warm_sampling()
    if args.device.startswith("cuda"):
        runner.capture_cuda_graphs()
    sched = Scheduler(runner)
    sched.start()
    vocab = runner.vocab_size

    def run(b: int, new: int) -> float:
        left, done = [b], threading.Event()

        def on_done(r: Request) -> None:
            left[0] -= 1
            if left[0] == 0:
                done.set()

        params = SamplingParams(max_new_tokens=new, temperature=args.temperature, ignore_eos=True)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts_for(b, args.prompt_len, vocab)):
            sched.submit(Request(rid=f"{b}-{new}-{i}", input_ids=p, params=params, on_done=on_done))
        if not done.wait(600):
            raise TimeoutError(f"{left[0]} of {b} requests unfinished after 600 s")
        return time.perf_counter() - t0

    try:
        for b in batches:
            run(b, 4)  # warm-up
            before = sched.timing.stats()
            mem_before = runner.memory_info()
            prof = None
            if args.trace and b == max(batches):
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
                host = cProfile.Profile()
                sched.call(host.enable).result()
            dt = run(b, args.new_tokens)
            after = sched.timing.stats()
            t = loop_timing(before, after)
            row = with_roofline(
                {"batch": b, "engine_tokens_per_s": b * args.new_tokens / dt},
                shape,
                b,
                args.prompt_len,
                args.new_tokens,
                args.hbm_tbps,
            )
            print(
                f"batch {b:4d}: scheduler in process {row['engine_tokens_per_s']:9.1f} tok/s "
                f"(T={args.temperature}), roofline {row['roofline_tokens_per_s']:9.1f} "
                f"({row['engine_of_roofline']:.3g} of it)\n    {describe_loop(t)}",
                flush=True,
            )
            alloc = allocator_delta(mem_before, runner.memory_info())
            if any(alloc.values()):
                print(f"    CUDA allocator in the timed run: {alloc}", flush=True)
            if prof is not None:
                sched.call(host.disable).result()
                prof.__exit__(None, None, None)
                out = Path(args.trace)
                out.mkdir(parents=True, exist_ok=True)
                raw = work / "trace.json"
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as f, gzip.open(out / f"trace_b{b}.json.gz", "wb") as g:
                    g.write(f.read())
                print(f"    {device_busy(raw)}; trace: {out / f'trace_b{b}.json.gz'}")
                pstats.Stats(host).sort_stats("tottime").print_stats(20)
    finally:
        sched.stop()


def device_busy(trace: Path) -> str:
    """The share of the traced time during which some kernel or copy ran on the device."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return "no device events in the trace"
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    wall = spans[-1][1] - spans[0][0]
    return f"device busy {busy / wall:.0%} of {wall / 1e3:.1f} ms ({len(spans)} device events)"


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
    phases: dict[str, dict[str, float]] = {}
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
                times, failed, laps = [], 0.0, []
                for v in range(args.reps + 1):  # the first push sets the path up
                    sync(dev)
                    stats = pusher.push(buckets, version=f"{backend}-{v}")
                    failed += stats["failed"]
                    times.append(stats["seconds"])
                    laps.append({p: stats.get(f"{p}_s", 0.0) for p in PUSH_PHASES})
                if failed:
                    sys.exit(
                        f"--push-backend {backend}: {failed:.0f} pushes failed (engine log: {work / 'engine.log'})"
                    )
                rows[f"WeightPusher, push.backend = {backend}"] = times[1:]
                phases[backend] = {
                    p: statistics.median(x[p] for x in laps[1:]) for p in PUSH_PHASES
                }
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
    opened = [
        ln.split(" INFO ")[-1].strip()
        for ln in (work / "engine.log").read_text().splitlines()
        if "opened in" in ln
    ]
    if opened:
        print("the engine's last calls by handle:\n  " + "\n  ".join(opened[-3:]))
    raw = statistics.median(rows["raw copy_ (same device, same bytes)"])
    print("\nparts of a push, median ms (transfer: the buckets' calls; the rest: control calls)")
    print("| backend | " + " | ".join(PUSH_PHASES) + " | transfer / raw copy |")
    print("| --- |" + " --- |" * (len(PUSH_PHASES) + 1))
    for backend, ph in phases.items():
        cells = " | ".join(f"{ph[p] * 1e3:.2f}" for p in PUSH_PHASES)
        print(f"| {backend} | {cells} | {ph['transfer'] / raw:.1f}x |")


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="prompts of this many tokens (the prompt length of the generation and GRPO loads): "
        "decode at long context",
    )
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens generated per request (default 128; with --grpo 512)",
    )
    ap.add_argument(
        "--hbm-tbps",
        type=float,
        default=roofline.H200_HBM_TBPS,
        help="memory bandwidth of the decode roofline, TB/s (default: an H200's 4.8)",
    )
    ap.add_argument("--json", help="also write the results (each row with its roofline) here")
    ap.add_argument(
        "--engine-logs",
        metavar="DIR",
        help="keep the engine's log here (generation and --grpo; e.g. with TORCH_LOGS=recompiles)",
    )
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
    ap.add_argument(
        "--grpo-new-tokens", type=int, default=None, help="as --new-tokens (default 512)"
    )
    ap.add_argument("--grpo-sharing", choices=["both", "on", "off"], default="both")
    ap.add_argument(
        "--grpo-fanout",
        choices=["n", "requests", "both"],
        default="n",
        help="n: one request per prompt with sampling_params.n; requests: n requests of the same "
        "prompt (as the generator sends a group); both: each, on the same engine",
    )
    ap.add_argument(
        "--grpo-top-p", default="1.0", help="comma-separated top_p values, one run each"
    )
    ap.add_argument(
        "--engine-options",
        help="[engine.embedded] keys for the engines of --grpo and the generation table, "
        "key=value separated by ';' (e.g. decode_shared_prefix=off)",
    )
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.8,
        help="engine.embedded.mem_fraction of the engine (the generation table's HF baseline "
        "runs before the engine starts; the GRPO load's engines run one at a time)",
    )
    ap.add_argument(
        "--kernels", action="store_true", help="decode attention and step timings (GPU)"
    )
    ap.add_argument(
        "--scheduler",
        action="store_true",
        help="the scheduler and runner in this process, no HTTP (tokens/s and loop timing)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="--scheduler's sampling")
    ap.add_argument(
        "--spy",
        type=float,
        default=0.0,
        help="generation and GRPO runs: sample the engine with py-spy for this many seconds from "
        "the start of each run and print where its scheduler thread spends them",
    )
    ap.add_argument("--trace", help="--scheduler: write a profiler trace of the largest batch here")
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the mode; refusals of what cannot run, each naming its option."""
    if args.quickstart:
        root = Path(__file__).resolve().parent.parent
        args.model, args.device = str(root / ".cache" / "arithmetic-base"), "cpu"
        args.prompt_len, args.new_tokens, args.cpu_threads = 20, 96, 1
    if args.context is not None:
        if args.context < 2:
            sys.exit(f"--context {args.context}: a prompt needs at least 2 tokens")
        args.prompt_len = args.grpo_prompt_len = args.context
    if args.grpo_new_tokens is None:
        args.grpo_new_tokens = args.new_tokens or 512
    if args.new_tokens is None:
        args.new_tokens = 128
    try:
        top_ps = [float(x) for x in args.grpo_top_p.split(",")]
    except ValueError:
        sys.exit(f"--grpo-top-p {args.grpo_top_p!r}: comma-separated numbers in (0, 1]")
    if not all(0 < p <= 1 for p in top_ps):
        sys.exit(f"--grpo-top-p {args.grpo_top_p!r}: each value must be in (0, 1]")
    if args.hbm_tbps <= 0:
        sys.exit(f"--hbm-tbps {args.hbm_tbps}: must be positive")
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.kernels and not gpu:
        sys.exit("--kernels times Triton kernels and CUDA graphs: it needs --device cuda")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    return args


def main() -> None:
    args = resolve(build_parser().parse_args())
    # A timeout's SIGTERM unwinds (finally blocks, subprocess.run's kill): no child process of
    # this bench outlives it holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        record = None
        if args.push_backend:
            bench_push_backends(args, Path(tmp))
        elif args.push:
            bench_push(args, Path(tmp))
        elif args.grpo:
            record = bench_grpo(args, Path(tmp))
        elif args.kernels:
            bench_kernels(args, Path(tmp))
        elif args.scheduler:
            bench_scheduler(args, Path(tmp))
        else:
            record = bench_generation(args, Path(tmp))
        if record is not None:
            write_json(args.json, {**record, "hbm_tbps": args.hbm_tbps})


if __name__ == "__main__":
    main()
