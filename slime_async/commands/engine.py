"""`slime-async engine`: serve an HF model over SGLang's native HTTP API (the embedded engine)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from slime_async.commands import add_config_arguments, config_from_args

HELP = (
    "serve a Hugging Face causal LM at SGLang's HTTP endpoints (continuous batching, weight sync)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--model-path", help="HF model directory (overrides engine.model_path)")
    p.add_argument("--host", help="address to bind (overrides engine.host)")
    p.add_argument("--port", type=int, help="port to bind, 0 = a free one (overrides engine.port)")


def main(args: argparse.Namespace) -> int:
    full = config_from_args(args)
    cfg = full.engine
    model_path = args.model_path or cfg.model_path
    host = args.host or cfg.host
    port = cfg.port if args.port is None else args.port
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")

    # Imported here, not at the top: torch and transformers would make `--help` take seconds.
    from slime_async.actors.engine.embedded.server import EmbeddedEngine, serve
    from slime_async.utils.gc_watch import freeze

    engine = EmbeddedEngine(cfg, model_path, group_timeout_s=full.push.group_timeout_s)

    async def run() -> int:
        runner, url = await serve(engine, host, port)
        # This process serves one engine: what start-up made (the model, compiled kernels, CUDA
        # graphs, the tokenizer) goes out of the collector's sight before the first request, as
        # SGLang's server after its warm-up (a full collection of it stalls every request).
        freeze("engine start-up")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"engine ready at {url} (model {engine.model_path}, device {engine.device})", flush=True
        )
        try:
            while not stop.is_set():
                if engine.scheduler.fatal is not None:
                    # As SGLang's server when its scheduler exits: the process ends (strict mode).
                    await asyncio.sleep(0.5)  # the failed calls get their answers first
                    print(f"engine stopped: {engine.scheduler.fatal}", flush=True)
                    return 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
            return 0
        finally:
            await runner.cleanup()

    return asyncio.run(run())
