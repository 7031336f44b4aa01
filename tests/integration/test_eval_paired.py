"""Seeded evaluation (`eval.seed`): two runs that evaluate the same policy give the same answers.

Two real embedded engines (child processes) serve the same tiny model with different engine
seeds, as two runs of a sweep would; each is evaluated by its own `Evaluator`, one request at a
time on one and 64 at once on the other (so the engines batch the answers differently). With
`eval.seed` every answer is identical; without it the engines' own streams make them differ.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.generator.evaluate import Evaluator, answers_path
from slime_async.actors.generator.rewards import resolve_reward
from slime_async.config import EvalConfig, SamplingConfig
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import start_engines


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    model = make_tiny_model(root / "model", "qwen3", seed=0)
    data = root / "eval.jsonl"
    rows = [{"prompt": f"{i}+{i + 2}=", "answer": str(2 * i + 2)} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    started = [start_engines(1, model, root, f"engine.seed={s}")[0] for s in (11, 12)]
    try:
        yield root, model, data, [url for _, url in started]
    finally:
        for child, _ in started:
            child.stop()


def _answers(root, model, data, url, run, seed, concurrency):
    run_dir = root / run
    cfg = EvalConfig(data=str(data), samples=3, greedy=True, seed=seed, concurrency=concurrency)

    async def go():
        async with EngineClient(url) as engine:
            ev = Evaluator(
                cfg,
                SamplingConfig(temperature=1.0, max_new_tokens=12),
                engine,
                load_tokenizer(model),
                resolve_reward("examples.arithmetic.task:reward"),
                run_dir,
                apply_chat_template=False,
            )
            return await ev.evaluate(0)

    result = asyncio.run(go())
    assert result["status"] == "done", result
    lines = answers_path(run_dir, 0).read_text().splitlines()
    return {(a["record"], a["kind"]): a for a in map(json.loads, lines)}


def test_two_runs_evaluating_one_policy_give_identical_answers(setup):
    root, model, data, (url_a, url_b) = setup
    a = _answers(root, model, data, url_a, "run-a", seed=7, concurrency=1)
    b = _answers(root, model, data, url_b, "run-b", seed=7, concurrency=64)
    assert len(a) == 12 * 4 and a.keys() == b.keys()
    assert all(a[k]["ids"] == b[k]["ids"] for k in a)  # token for token, every answer
    sampled = [k for k in a if k[1] != "greedy"]
    # the three samples of one record are three different draws, not one repeated
    assert len({tuple(a[k]["ids"]) for k in sampled}) > len(sampled) // 2


def test_unseeded_evaluations_of_one_policy_differ(setup):
    root, model, data, (url_a, url_b) = setup
    a = _answers(root, model, data, url_a, "free-a", seed=None, concurrency=1)
    b = _answers(root, model, data, url_b, "free-b", seed=None, concurrency=64)
    sampled = [k for k in a if k[1] != "greedy"]
    assert any(a[k]["ids"] != b[k]["ids"] for k in sampled)
    assert all(a[k]["ids"] == b[k]["ids"] for k in a if k[1] == "greedy")
