"""Helpers of the engine tests: embedded engines started as child processes, HF greedy references,
the model runner and scheduler driven directly, and the weight pusher's settings."""

from __future__ import annotations

import math
import threading
import urllib.request
from pathlib import Path

import torch

from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.config import PushConfig
from slime_async.utils.procs import Child, free_port, python_module, wait_until
from tests.support.forked import fork_server, role_env

PROMPTS = [[2, 10, 11, 12, 13], [2, 20, 21], [2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 30]]


def push_config(**keys) -> PushConfig:
    """`[push]` for a `WeightPusher` of these tests: gloo, the group's store on loopback, and no
    wait for an engine that is down; `keys` override any of them or set the others."""
    return PushConfig(
        **{"backend": "gloo", "master_addr": "127.0.0.1", "resync_wait_s": 0.0, **keys}
    )


def engine_ready(url: str, api_key: str | None = None) -> bool:
    req = urllib.request.Request(f"{url}/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=2) as resp:
        return resp.status == 200


def launch_engine(
    model_dir: Path,
    log_dir: Path,
    *overrides: str,
    api_key: str | None = None,
    port: int | None = None,
) -> tuple[Child, str]:
    """Start an embedded engine on a loopback port (a free one by default) with torch threads = 1,
    without waiting for it; returns (child, url)."""
    port = port or free_port()
    args = [
        f"engine.model_path={model_dir}",
        f"engine.port={port}",
        "engine.host=127.0.0.1",
        "engine.embedded.device=cpu",
        "engine.embedded.torch_threads=1",
        "engine.embedded.max_running_requests=64",
        *overrides,
    ]
    if api_key:
        args.append(f"engine.api_key={api_key}")
    child = Child(
        f"engine-{port}",
        python_module("slime_async", "engine", *args),
        log_path=log_dir / f"engine-{port}.log",
        env=role_env(),
        fork_server=fork_server(),
    )
    return child, f"http://127.0.0.1:{port}"


def start_engines(
    n: int, model_dir: Path, log_dir: Path, *overrides: str, **kw
) -> list[tuple[Child, str]]:
    """`n` engines started together and waited for (readiness: GET /health); all stopped on error."""
    started = [launch_engine(model_dir, log_dir, *overrides, **kw) for _ in range(n)]
    try:
        for child, url in started:
            wait_until(
                lambda url=url: engine_ready(url, kw.get("api_key")),
                120,
                f"engine at {url}",
                interval=0.1,
                child=child,
            )
    except BaseException:
        for child, _ in started:
            child.stop()
        raise
    return started


def start_engine(model_dir: Path, log_dir: Path, *overrides: str, **kw) -> tuple[Child, str]:
    return start_engines(1, model_dir, log_dir, *overrides, **kw)[0]


def serve_engine(model_dir: Path, log_dir: Path, *overrides: str, **kw):
    """A fixture's body: yields the URL of an engine started with `overrides`, stops it after."""
    child, url = start_engine(model_dir, log_dir, *overrides, **kw)
    try:
        yield url
    finally:
        child.stop()


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding with HF transformers: (tokens, log_softmax of each chosen token)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logps = [
        torch.log_softmax(lg[0].float(), -1)[t].item()
        for lg, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logps


def greedy_with_runner(runner, prompts, steps: int):
    """Prefill `prompts` packed, then `steps` greedy decode steps, each prompt in its own blocks."""
    bs = runner.block_size
    tables = [runner.pool.allocate(math.ceil((len(p) + steps) / bs)) for p in prompts]
    logits = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    lens = [len(p) for p in prompts]
    bt = torch.zeros((len(prompts), runner.max_blocks_per_seq), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    toks, lps = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
        for i in range(len(prompts)):
            toks[i].append(tok[i].item())
            lps[i].append(lp[i].item())
        logits = runner.decode(tok, torch.tensor(lens), bt)
        lens = [n + 1 for n in lens]
    return toks, lps


def run_all(sched: Scheduler, prompts: list[list[int]], params: list) -> list[Request]:
    """Submit one request per prompt (with `params[i]`) and wait until every one has finished."""
    done = threading.Semaphore(0)
    reqs = [Request(f"r{i}", p, params[i], lambda r: done.release()) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=60)
    return reqs


def random_paged(
    device: str,
    dtype: torch.dtype,
    bs: int = 16,
    hkv: int = 2,
    h: int = 4,
    d: int = 32,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q, k cache, v cache, block tables, lengths) of four decode rows over a paged KV cache."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(12, bs, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(12, bs, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(4, h, d, generator=g).to(device, dtype)
    bt = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6], [11, 0, 0, 0], [7, 8, 10, 2]], dtype=torch.int32)
    lens = torch.tensor([bs * 3 + 1, bs * 4, 1, bs + 5], dtype=torch.int32)
    return q, kc, vc, bt.to(device), lens.to(device)
