"""`slime-async generator`: stream rollouts of the configured plugin from the engines to the buffer."""

from __future__ import annotations

import argparse
from pathlib import Path

from slime_async.commands import add_config_arguments, config_from_args

HELP = "run a generator: JSONL prompts -> rollout plugin on the engines -> rewards -> buffer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def engine_urls(cfg) -> list[str]:
    """engine.router_url, else engine.urls, else the embedded engine (or router) at host:port."""
    e = cfg.engine
    if e.router_url:
        return [e.router_url]
    if e.urls:
        return list(e.urls)
    port = e.router_port if e.num_engines > 1 else e.port
    if e.kind == "external" or port == 0:
        from slime_async.config import ConfigError

        raise ConfigError("engine.urls: the generator needs the engines' URLs (none configured)")
    return [f"http://{e.host}:{port}"]


def tokenizer_path(cfg) -> str:
    path = cfg.generator.tokenizer_path or cfg.engine.model_path or cfg.learner.model_path
    if not path:
        from slime_async.config import ConfigError

        raise ConfigError(
            "generator.tokenizer_path: no tokenizer (set it, engine.model_path or learner.model_path)"
        )
    return path


def under_run_dir(cfg, path: str | None, default: str) -> str | None:
    """Relative paths live under run.run_dir; with no path, `default` there (None without a run dir)."""
    run_dir = cfg.run.run_dir
    if path is None:
        return str(Path(run_dir) / default) if run_dir else None
    return str(Path(run_dir) / path) if run_dir and not Path(path).is_absolute() else path


def main(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os
    import sys

    cfg = config_from_args(args)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {cfg.generator.producer_id} %(levelname)s %(message)s",
    )
    # Rollout and reward plugins are named by import path relative to where the run is started
    # (`examples.calculator_agent.agent:rollout`), as with `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    gen_cfg = cfg.generator.model_copy(
        update={
            "state_path": under_run_dir(
                cfg, cfg.generator.state_path, f"state/{cfg.generator.producer_id}.json"
            )
        }
    )
    urls = engine_urls(cfg)
    tok_path = tokenizer_path(cfg)
    return asyncio.run(_run(cfg, gen_cfg, urls, tok_path))


async def _run(cfg, gen_cfg, urls: list[str], tok_path: str) -> int:
    import asyncio
    import json
    import logging
    import signal

    from slime_async.actors.engines.pool import EnginePool
    from slime_async.actors.generator import Generator, GeneratorError
    from slime_async.actors.run_dir import announce_ready
    from slime_async.metrics import MetricsLogger
    from slime_async.models.tokenizer import load_tokenizer
    from slime_async.queue.client import BufferUnavailable, ProducerClient

    log = logging.getLogger("slime_async.generator")
    tokenizer = load_tokenizer(tok_path)
    pool = EnginePool.from_config(cfg.engine, urls)
    metrics = None
    try:
        # Plugins, dataset and cursor are checked here, before anything connects.
        gen = Generator(gen_cfg, pool, tokenizer)
        if cfg.run.run_dir:
            metrics = gen.metrics = MetricsLogger(
                cfg.run.run_dir,
                f"generator{gen_cfg.shard_index}",
                wandb_mode=cfg.run.wandb,
                config=cfg.model_dump(mode="json"),
            )
        async with ProducerClient(cfg.buffer, gen_cfg.producer_id) as producer:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, gen.stop)
            log.info("engines %s, buffer %s, state %s", urls, cfg.buffer.producer_endpoint,
                     gen_cfg.state_path)  # fmt: skip
            # The buffer answered our hello: tell `slime-async run` (if it started us) we are up.
            announce_ready(f"generator {gen_cfg.producer_id}")
            try:
                stats = await gen.run(producer)
            except (GeneratorError, BufferUnavailable) as e:
                log.error("%s", e)
                return 1
            print(json.dumps({"generator": gen_cfg.producer_id, **stats}), flush=True)
            return 0
    finally:
        await pool.close()
        if metrics is not None:
            metrics.close()
