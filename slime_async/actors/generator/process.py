"""The generator process (`slime-async generator`): one `Generator` between engines and buffer.

Connects to: the engines at `cfg.generate_urls()` (one sglang-router, or each engine through an
`EnginePool`) and the buffer's producer endpoint. Writes: its cursor (`cfg.paths().generator_state`)
and `metrics/generator<i>.jsonl` in the run directory. Announces readiness once the buffer answered
its hello. SIGTERM/SIGINT stop it after the groups in flight are cancelled (they are redone on a
restart: the cursor only moves past acknowledged groups). What it sends, what it waits on and
what bounds its memory: see `Generator` (loop.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.generator.loop import Generator, GeneratorError
from slime_async.actors.generator.seeding import check_engines
from slime_async.config import ConfigError, SlimeConfig
from slime_async.metrics import MetricsLogger
from slime_async.models.tokenizer import load_tokenizer
from slime_async.queue.client import BufferUnavailable, ProducerClient
from slime_async.utils.readiness import announce_ready

log = logging.getLogger("slime_async.generator")


def tokenizer_path(cfg: SlimeConfig) -> str:
    """generator.tokenizer_path, else engine.model_path, else learner.model_path."""
    path = cfg.generator.tokenizer_path or cfg.engine.model_path or cfg.learner.model_path
    if not path:
        raise ConfigError(
            "generator.tokenizer_path: no tokenizer (set it, engine.model_path or learner.model_path)"
        )
    return path


def run_generator(cfg: SlimeConfig) -> int:
    """Run one generator until its dataset is done (0) or it cannot go on (1)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {cfg.generator.producer_id} %(levelname)s %(message)s",
    )
    # Rollout and reward plugins are named by import path relative to where the run is started
    # (`examples.calculator_agent.agent:rollout`), as with `python -m`, or to the config files'
    # directories (`generator.import_dirs`, put on sys.path when the config was loaded).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    state = cfg.paths().generator_state
    gen_cfg = cfg.generator.model_copy(update={"state_path": str(state) if state else None})
    return asyncio.run(_run(cfg, gen_cfg, cfg.generate_urls(), tokenizer_path(cfg)))


async def _run(cfg: SlimeConfig, gen_cfg, urls: list[str], tok_path: str) -> int:
    tokenizer = load_tokenizer(tok_path)
    # The pool breaks ties between engines with the generator's seed (run.seed unless set).
    pool = EnginePool.from_config(cfg.engine, urls, seed=gen_cfg.seed, owner=gen_cfg.producer_id)
    for client in pool.clients.values():  # routing replay: the engines report each token's experts
        client.return_routed_experts = cfg.learner.routing_replay
        client.prefix_keys = gen_cfg.prefix_keys  # extra_key: cached prefixes of one version only
    metrics = None
    try:
        # Plugins, dataset and cursor are checked here, before anything connects.
        gen = Generator(gen_cfg, pool, tokenizer, run_dir=cfg.run.run_dir)
        if cfg.run.run_dir:
            metrics = gen.metrics = MetricsLogger(
                cfg.run.run_dir, f"generator{gen_cfg.shard_index}"
            )
            if cfg.eval.interval and gen_cfg.shard_index == 0:  # generator 0 evaluates
                from slime_async.actors.generator.evaluate import Evaluator

                eval_metrics = MetricsLogger(cfg.run.run_dir, "eval")
                gen.evaluator = Evaluator(
                    cfg.eval,
                    gen_cfg.sampling,
                    pool,
                    tokenizer,
                    gen.reward,
                    cfg.run.run_dir,
                    prompt_key=gen_cfg.prompt_key,
                    apply_chat_template=gen_cfg.apply_chat_template,
                    metrics=eval_metrics,
                )
        try:
            # The hello is sent on entry: a producer id held by a live session (IdInUse) or a
            # buffer that never answers ends the generator here with one line, not a traceback.
            async with ProducerClient(cfg.buffer, gen_cfg.producer_id) as producer:
                # Answers must come from the weights the learner announced at the grant, or
                # later ones: an engine behind them (restarted) is not used until it catches up.
                pool.min_version = lambda: producer.version
                # sampling_seed as the engines treat it (SGLang: only with deterministic inference)
                honoured = await check_engines(
                    pool.watch_clients(),
                    cfg.engine.deterministic_inference,
                    eval_seeded=gen.evaluator is not None and cfg.eval.seed is not None,
                )
                if gen.evaluator is not None:
                    gen.evaluator.seeds_ignored = sum(h is False for h in honoured.values())
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, gen.stop)
                log.info(
                    "engines %s, buffer %s, state %s",
                    urls,
                    cfg.buffer.producer_endpoint,
                    gen_cfg.state_path,
                )
                # The buffer answered our hello: tell `slime-async run` (if it started us).
                announce_ready(f"generator {gen_cfg.producer_id}")
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
