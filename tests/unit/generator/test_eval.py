"""Pinned evaluation: every answer of an evaluation comes from one policy version.

The tests here drive `Evaluator` with a scripted engine (the SGLang fields it returns: per-token
versions from `weight_versions` spans). The end-to-end check of a real run (the evaluated
versions, their results, and that the learner pushed version v + 1 only after the evaluation of v
had finished) is in tests/integration/test_staleness_sweep.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from slime_async.actors.engine.client import GenerateOutput
from slime_async.actors.generator.evaluate import Evaluator
from slime_async.actors.generator.rewards import resolve_reward
from slime_async.config import ConfigError, EvalConfig, SamplingConfig, load_config
from slime_async.metrics import names as M
from slime_async.models.toy import char_tokenizer
from slime_async.utils.eval_pin import read_result, request_path, write_json_atomic


class ScriptedEngine:
    """Answers `#### <answer>` (right for even records, wrong for odd ones when sampled); the
    version of each token comes from `versions(rid)`."""

    def __init__(self, tokenizer, versions):
        self.tok = tokenizer
        self.versions = versions
        self.rids: list[str] = []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.rids.append(rid)
        index = int(rid.split("/")[2])  # rid: eval/v<version>/<record>/<kind>/a<attempt>/...
        right = sampling_params["temperature"] == 0 or index % 2 == 0
        answer = 2 * index + 1 + (0 if right else 1)  # records are "i+(i+1)"
        ids = self.tok.encode(f"#### {answer}", add_special_tokens=False)
        vs = self.versions(rid, len(ids))
        return GenerateOutput(
            ids, [-0.1] * len(ids), vs, "stop", vs[-1], len(input_ids), len(ids), "http://engine"
        )


def _evaluator(tmp_path, versions, **cfg):
    data = tmp_path / "eval.jsonl"
    rows = [{"prompt": f"{i}+{i + 1}", "answer": str(2 * i + 1)} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = char_tokenizer()
    engine = ScriptedEngine(tok, versions)
    ev = Evaluator(
        EvalConfig(data=str(data), samples=2, **cfg),
        SamplingConfig(temperature=1.0, max_new_tokens=16),
        engine,
        tok,
        resolve_reward("examples.arithmetic.task:reward"),
        tmp_path,
    )
    return ev, engine


def test_greedy_and_sampled_accuracy_of_one_version(tmp_path):
    ev, engine = _evaluator(tmp_path, lambda rid, n: [3] * n)
    result = asyncio.run(ev.evaluate(3))
    assert result["status"] == "done"
    rec = result["metrics"]
    assert rec[M.EVAL_VERSION] == 3 and rec[M.EVAL_EXAMPLES] == 6
    assert rec[M.EVAL_ACC_GREEDY] == 1.0  # greedy answers are right
    assert rec[M.EVAL_ACC_SAMPLED] == 0.5  # sampled: right on even records only
    assert rec[M.EVAL_PASS_AT_K] == 0.5
    assert rec[M.EVAL_RERUNS] == 0 and rec[M.EVAL_DISCARDED] == 0
    assert len(engine.rids) == 6 * 3 and all(r.startswith("eval/v3/") for r in engine.rids)
    assert read_result(tmp_path, 3) == json.loads(json.dumps(result))


def test_an_answer_from_an_older_version_is_generated_again_and_counted(tmp_path):
    first = set()

    def versions(rid, n):  # the first attempt at record 2's greedy answer: half still at v2
        key = rid.split("/a")[0]
        if "/2/greedy" in key and key not in first:
            first.add(key)
            return [2] * (n // 2) + [3] * (n - n // 2)
        return [3] * n

    ev, _ = _evaluator(tmp_path, versions)
    result = asyncio.run(ev.evaluate(3))
    assert result["status"] == "done"
    assert result["metrics"][M.EVAL_RERUNS] == 1
    assert result["metrics"][M.EVAL_ACC_GREEDY] == 1.0


def test_an_answer_of_a_newer_version_discards_the_evaluation(tmp_path):
    ev, _ = _evaluator(tmp_path, lambda rid, n: [3] * (n - 1) + [4])  # the weights moved on
    result = asyncio.run(ev.evaluate(3))
    assert result["status"] == "discarded" and "version 4" in result["reason"]
    assert M.EVAL_ACC_GREEDY not in result["metrics"]  # never reported as an accuracy
    assert result["metrics"][M.EVAL_DISCARDED] == 1


def test_the_watch_answers_requests_written_by_the_learner(tmp_path):
    ev, _ = _evaluator(tmp_path, lambda rid, n: [5] * n)

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(ev.watch(stop))
        # Version 5 after a restart that left two versions behind: the weights of 3 updates.
        write_json_atomic(request_path(tmp_path, 5), {"version": 5, "step": 4, "position": 3})
        for _ in range(200):
            if read_result(tmp_path, 5):
                break
            await asyncio.sleep(0.02)
        stop.set()
        await task

    asyncio.run(go())
    result = read_result(tmp_path, 5)
    assert result["status"] == "done"
    rec = result["metrics"]  # where the evaluated weights sit in training
    assert (rec[M.EVAL_VERSION], rec[M.EVAL_LEARNER_STEP], rec[M.EVAL_POSITION]) == (5, 4, 3)


def test_eval_interval_without_data_is_refused():
    with pytest.raises(ConfigError, match=r"eval\.data"):
        load_config([], ["eval.interval=5"])


def test_the_run_summary_reports_evaluation_accuracy_first_to_last_version():
    from slime_async.commands.run import summarize_eval
    from slime_async.metrics import names as m

    rows = [
        {m.EVAL_VERSION: 0, m.EVAL_ACC_GREEDY: 0.85, m.EVAL_ACC_SAMPLED: 0.41},
        {m.EVAL_VERSION: 50, m.EVAL_ACC_GREEDY: 0.9, m.EVAL_ACC_SAMPLED: 0.6},
        {m.EVAL_VERSION: 250, m.EVAL_ACC_GREEDY: 0.95, m.EVAL_ACC_SAMPLED: 0.8},
    ]
    got = summarize_eval(rows)
    assert got == (
        "eval accuracy, version 0 -> 250: greedy 85.0 -> 95.0 (+10.0 points), "
        "sampled 41.0 -> 80.0 (+39.0 points)"
    )
    assert summarize_eval(rows[:1]) == ""  # one evaluation: nothing to compare


def test_after_a_learner_restart_the_summary_says_how_many_updates_apart():
    """A restarted learner left versions 11..17 behind (its checkpoint's weights are version 18):
    the last evaluated version, 38, is 30 updates after version 0, and the summary says so."""
    from slime_async.commands.run import summarize_eval
    from slime_async.metrics import names as m

    rows = [
        {m.EVAL_VERSION: 0, m.EVAL_POSITION: 0, m.EVAL_ACC_GREEDY: 0.5},
        {m.EVAL_VERSION: 38, m.EVAL_POSITION: 30, m.EVAL_ACC_GREEDY: 0.7},
    ]
    assert summarize_eval(rows) == (
        "eval accuracy, version 0 -> 38 (30 updates apart): greedy 50.0 -> 70.0 (+20.0 points)"
    )
    same = [{**r, m.EVAL_POSITION: r[m.EVAL_VERSION]} for r in rows]  # no restart: no remark
    assert summarize_eval(same).startswith("eval accuracy, version 0 -> 38: ")
