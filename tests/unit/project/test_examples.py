"""The examples' task code: arithmetic data and parser, the safe calculator, SFT data, configs."""

import json
import random

import pytest

from examples.arithmetic import task
from examples.calculator_agent import agent
from examples.calculator_agent.calculator import CalcError, calculator, evaluate
from slime_async.actors.generator.rollout import Sample
from slime_async.config import load_config
from slime_async.models.toy import char_tokenizer
from slime_async.utils.plugins import import_object


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_arithmetic_solution_is_worked_running_sums():
    p = task.Problem((23, 7, 58))
    assert p.prompt == "23+7+58" and p.answer == 88
    assert p.solution() == "23+7=30\n30+58=88\n#### 88"
    assert task.parse_answer(p.solution()) == 88


@pytest.mark.parametrize(
    ("text", "want"), [("#### 12", 12), ("a\n#### 3\n#### -4 ", -4), ("12", None), ("#### x", None)]
)
def test_arithmetic_parse_answer(text, want):
    assert task.parse_answer(text) == want


def test_arithmetic_lengths_have_a_long_tail(tok):
    lens = sorted(len(tok.encode(p.solution())) for p in task.problems(2000, seed=0))
    p50, p99 = lens[len(lens) // 2], lens[int(0.99 * len(lens))]
    assert p99 >= 3 * p50  # the tail the async-vs-sync benchmark needs
    assert lens[-1] < 128  # fits generator.sampling.max_new_tokens of the example config


def test_arithmetic_dataset_and_reward(tmp_path):
    path = task.make_dataset(tmp_path / "train.jsonl", 50, seed=3)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 50 and recs == [json.loads(x) for x in path.read_text().splitlines()]
    assert task.make_dataset(tmp_path / "again.jsonl", 50, seed=3).read_text() == path.read_text()
    r = recs[0]
    assert sum(int(x) for x in r["prompt"].split("+")) == int(r["answer"])
    s = Sample(r["prompt"], r, "g", 0, 0)
    right = task.Problem(tuple(int(x) for x in r["prompt"].split("+"))).solution()
    assert task.reward(s, right, {}) == 1.0
    assert task.reward(s, right.replace(f"#### {r['answer']}", "#### 0"), {}) == 0.0


def test_arithmetic_sft_examples_match_the_generator_prompt(tok):
    ex = task.sft_examples(3, seed=1, tokenizer=tok)
    p = task.problems(3, seed=1)[0]
    prompt, target = ex[0]
    assert prompt == tok.encode(f"<user>{p.prompt}<eos><assistant>", add_special_tokens=False)
    assert target[-1] == tok.eos_token_id
    assert tok.decode(target[:-1]) == p.solution()


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("-4+10/4", -1.5),
        ("2*-3", -6),
        (" 12 * ( 3 + 4 ) ", 84),
        ("1.5*2", 3),
    ],
)
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("__import__('os')", "unexpected character"),
        ("1/0", "division by zero"),
        ("1+", "unexpected end"),
        ("(1+2", "missing"),
        ("1 2", "unexpected '2'"),
        ("", "empty"),
        ("(" * 20 + "1" + ")" * 20, "nested too deeply"),
        ("9" * 70, "longer than"),
        ("99999999*99999999*999", "out of range"),
    ],
)
def test_calculator_refuses_anything_else(expr, problem):
    with pytest.raises(CalcError, match=problem):
        evaluate(expr)
    assert calculator(expr).startswith("error: ")


def test_calculator_formats_results():
    assert (
        calculator("10/4") == "2.5" and calculator("6/3") == "2" and calculator("1/3") == "0.3333"
    )


def test_agent_call_parsing_and_reward():
    assert agent.call_expression("<call>3*4</call>") == "3*4"
    assert agent.call_expression("x<call>1</call><call> 2+2 </call>") == "2+2"
    s = Sample("3*4", {"answer": "12"}, "g", 0, 0)
    assert agent.reward(s, "#### 12", {}) == 1.0
    assert agent.reward(s, "12", {}) == 0.0  # no final-answer mark: a bare call text scores nothing


def test_agent_data_answers_are_the_calculator_values(tmp_path, tok):
    recs = [
        json.loads(x)
        for x in agent.make_dataset(tmp_path / "c.jsonl", 20, 0).read_text().splitlines()
    ]
    assert all(calculator(r["prompt"]) == r["answer"] for r in recs)
    prompt, target, mask = agent.sft_examples(1, seed=0, tokenizer=tok)[0]
    expr = agent.sample_problem(random.Random(0))
    assert tok.decode(prompt) == f"<user>{expr}<eos><assistant>"
    text = tok.decode(target)
    assert (
        text
        == f"<call>{expr}</call><tool>{calculator(expr)}<eos><assistant>#### {calculator(expr)}<eos>"
    )
    env = [t for t, m in zip(target, mask, strict=True) if m == 0]
    assert tok.decode(env) == f"<tool>{calculator(expr)}<eos><assistant>"


@pytest.mark.parametrize("name", ["arithmetic", "calculator_agent", "guess_number"])
def test_example_configs_resolve(name, repo_root):
    cfg = load_config([repo_root / "examples" / name / "config.toml"]).generator
    assert (repo_root / cfg.dataset).is_file()
    from slime_async.actors.generator.rewards import resolve_reward
    from slime_async.actors.generator.rollout import ROLLOUTS

    ROLLOUTS.resolve(cfg.rollout)
    resolve_reward(cfg.reward)
    assert import_object("examples.calculator_agent.agent:rollout") is agent.rollout


def test_arithmetic_difficulty_is_a_parameter():
    easy = task.Difficulty(operands={2: 1.0}, digits={1: 1.0})
    ps = task.problems(50, seed=0, difficulty=easy)
    assert all(len(p.operands) == 2 and max(p.operands) < 10 for p in ps)
    assert task.problems(5, seed=0) == task.problems(5, seed=0, difficulty=task.Difficulty())
