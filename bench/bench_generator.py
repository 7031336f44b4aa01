"""The generator's overhead: tokens/s through Generator + buffer next to bare engine calls.

    .venv/bin/python bench/bench_generator.py [--rollouts 256] [--concurrency 32] [--tokens 64]

One embedded engine (a tiny random model) and one buffer run as child processes on loopback.
Baseline: `rollouts` calls of `EnginePool.generate` with `concurrency` in flight, nothing else.
Generator: the same number of rollouts of the same length (ignore_eos) as groups of 8 through
the rollout plugin, reward, wire encoding and `put_group` acknowledged by the buffer, with
`max_inflight = concurrency`. Printed: tokens/s of each and the ratio, measured in the same run
(alternating, `--repeat` times each); the engine is the bottleneck in both, so the ratio is
what the generator's own work costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.generator.loop import Generator
from slime_async.actors.generator.rollout import ROLLOUTS, RolloutContext, Sample, Transcript
from slime_async.config import BufferConfig, GeneratorConfig, SamplingConfig
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import make_tiny_model
from slime_async.queue.client import ProducerClient
from slime_async.utils.procs import Child, free_port, python_module, tcp_ready, wait_until

GROUP = 8


@ROLLOUTS.register("bench_fixed_length")
async def fixed_length(ctx: RolloutContext, sample: Sample) -> Transcript:
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids, {"ignore_eos": True}))
    return t


async def baseline(url: str, prompts: list[list[int]], params: dict, concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    async with EnginePool([url]) as pool:

        async def one(ids: list[int]) -> int:
            async with sem:
                return len((await pool.generate(ids, dict(params))).token_ids)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def through_generator(url: str, cfg: GeneratorConfig, buf: BufferConfig, tok) -> int:
    async with EnginePool([url]) as pool:
        gen = Generator(cfg, pool, tok)
        async with ProducerClient(buf, cfg.producer_id) as producer:
            stats = await gen.run(producer)
    assert stats["groups_dropped"] == 0
    return int(stats["tokens_generated"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=256, help="rollouts per measurement")
    p.add_argument("--concurrency", type=int, default=32, help="rollouts in flight")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rollout")
    p.add_argument("--repeat", type=int, default=2, help="measurements of each, alternating")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_generator_"))
    model = make_tiny_model(work / "model", family="qwen3")
    tok = load_tokenizer(model)
    port = free_port()
    buf = BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        max_staleness=10_000,  # nobody consumes: admission must not be the limit here
    )
    engine = Child(
        "engine",
        python_module(
            "slime_async",
            "engine",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "engine.embedded.device=cpu",
            f"engine.embedded.max_running_requests={args.concurrency}",
        ),
        log_path=work / "engine.log",
    )
    buffer = Child(
        "buffer",
        python_module(
            "slime_async",
            "buffer",
            f"buffer.producer_endpoint='{buf.producer_endpoint}'",
            f"buffer.consumer_endpoint='{buf.consumer_endpoint}'",
            "buffer.max_staleness=10000",
        ),
        log_path=work / "buffer.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: urllib.request.urlopen(url + "/health").status == 200,
            120,
            "engine",
            child=engine,
        )
        consumer_port = int(buf.consumer_endpoint.rsplit(":", 1)[1])
        wait_until(lambda: tcp_ready("127.0.0.1", consumer_port), 60, "buffer", child=buffer)
        n_prompts = args.rollouts // GROUP
        rows = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(n_prompts)]
        prompts = [
            tok.encode(f"<user>{r['prompt']}<eos><assistant>", add_special_tokens=False)
            for r in rows
            for _ in range(GROUP)
        ]
        params = {**SamplingConfig(max_new_tokens=args.tokens).model_dump(), "ignore_eos": True}
        asyncio.run(baseline(url, prompts[: args.concurrency], params, args.concurrency))  # warm-up
        results: dict[str, list[float]] = {"engine only": [], "generator": []}
        for rep in range(args.repeat):
            t0 = time.perf_counter()
            n = asyncio.run(baseline(url, prompts, params, args.concurrency))
            results["engine only"].append(n / (time.perf_counter() - t0))
            data = work / f"d{rep}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            cfg = GeneratorConfig(
                dataset=str(data),
                rollout="bench_fixed_length",
                group_size=GROUP,
                max_inflight=args.concurrency,
                num_epochs=1,
                producer_id=f"bench{rep}",
                sampling=SamplingConfig(max_new_tokens=args.tokens),
                log_interval_s=3600,
            )
            t0 = time.perf_counter()
            n = asyncio.run(through_generator(url, cfg, buf, tok))
            results["generator"].append(n / (time.perf_counter() - t0))
        base = max(results["engine only"])
        print(f"{args.rollouts} rollouts x {args.tokens} tokens, {args.concurrency} in flight")
        for name, xs in results.items():
            best = max(xs)
            print(f"  {name:12s} {best:9.0f} tokens/s (best of {len(xs)})  ratio {best / base:.2f}")
    finally:
        buffer.stop()
        engine.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
