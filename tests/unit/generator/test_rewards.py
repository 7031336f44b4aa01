"""Reward plumbing: built-ins, sync and async rewards by name or import path, contract errors."""

import asyncio
import math

import numpy as np
import pytest

from slime_async.actors.generator.rewards import (
    REWARDS,
    check_own_reward,
    check_reward,
    exact_match,
    final_answer,
    format_check,
    numeric_match,
    resolve_reward,
)
from slime_async.actors.generator.rollout import PluginContractError, Sample, Transcript
from slime_async.utils.plugins import PluginError


def sample(answer="42", **meta):
    return Sample(prompt="q", metadata={"answer": answer, **meta}, group_id="g", index=0, epoch=0)


def test_final_answer_takes_text_after_last_mark():
    assert final_answer("1+2=3\n#### 3") == "3"
    assert final_answer("#### 1\n#### 2 ") == "2"
    assert final_answer("  7 ") == "7"


@pytest.mark.parametrize(
    ("text", "want"),
    [("#### 42", 1.0), ("work\n#### 42", 1.0), ("42", 1.0), ("#### 43", 0.0), ("#### 42.0", 0.0)],
)
def test_exact_match(text, want):
    assert exact_match(sample(), text, {}) == want


@pytest.mark.parametrize(
    ("text", "answer", "want"),
    [
        ("#### 42.0", "42", 1.0),
        ("the result is 1,234", "1234", 1.0),
        ("#### -3.5", "-3.50", 1.0),
        ("#### 41.99", "42", 0.0),
        ("no number", "42", 0.0),
        ("#### 1e3", "1000", 1.0),
    ],
)
def test_numeric_match(text, answer, want):
    assert numeric_match(sample(answer), text, {}) == want


def test_numeric_match_names_a_non_numeric_answer():
    with pytest.raises(PluginContractError, match=r"'abc'.*not a number"):
        numeric_match(sample("abc"), "#### 1", {})


def test_builtins_need_an_answer_field():
    s = Sample(prompt="q", metadata={}, group_id="g7", index=0, epoch=0)
    with pytest.raises(PluginContractError, match=r"'answer' field.*g7"):
        exact_match(s, "#### 1", {})


def test_format_check():
    assert format_check(sample(), "1+1=2\n#### 2", {"finish_reason": "stop"}) == 1.0
    assert format_check(sample(), "#### 2 and more", {"finish_reason": "stop"}) == 0.0
    assert format_check(sample(), "#### 2", {"finish_reason": "length"}) == 0.0


def test_registry_names_and_dict_reward_sums_parts():
    assert {"exact_match", "numeric_match", "format_check", "math"} <= set(REWARDS.names())
    fn = resolve_reward("math")
    total, parts = asyncio.run(fn(sample(), "#### 42", {"finish_reason": "stop"}))
    assert parts == {"correct": 1.0, "format": 0.1}
    assert total == pytest.approx(1.1)


async def remote_style_reward(sample, response_text, info):
    await asyncio.sleep(0)  # an async reward may await a remote service
    return {"judge": 0.5, "length": -0.25}


def test_async_reward_by_import_path():
    fn = resolve_reward("tests.unit.generator.test_rewards:remote_style_reward")
    assert asyncio.run(fn(sample(), "x", {})) == (0.25, {"judge": 0.5, "length": -0.25})


def two_args(sample, text):
    return 1.0


def test_wrong_signature_fails_at_resolve_naming_the_reward():
    with pytest.raises(
        PluginError, match=r"reward 'tests.unit.generator.test_rewards:two_args'.*signature"
    ):
        resolve_reward("tests.unit.generator.test_rewards:two_args")
    with pytest.raises(PluginError, match="unknown reward 'exactmatch'"):
        resolve_reward("exactmatch")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (math.nan, "non-finite"),
        (math.inf, "non-finite"),
        ("1.0", "returned str"),
        (None, "returned NoneType"),
        ({}, "empty dict"),
        ({"a": "x"}, "part 'a'"),
        ({"a": math.nan}, "non-finite parts"),
    ],
)
def test_check_reward_rejects_bad_results(value, problem):
    with pytest.raises(PluginContractError, match=problem) as e:
        check_reward("my.mod:fn", value)
    assert "my.mod:fn" in str(e.value)


def test_check_reward_accepts_numbers():
    assert check_reward("r", 1) == (1.0, {})
    assert check_reward("r", True) == (1.0, {})
    assert check_reward("r", np.float32(0.5)) == (0.5, {})


def test_a_reward_set_by_the_rollout_is_checked_too():
    t = Transcript([1])
    t.reward = 0.5
    assert check_own_reward("r", t) == (0.5, {})
    t.reward, t.reward_parts = 1.5, {"a": 1.0, "b": 0.5}
    assert check_own_reward("r", t) == (1.5, {"a": 1.0, "b": 0.5})
    t.reward = 2.0
    with pytest.raises(PluginContractError, match="not the sum of reward_parts"):
        check_own_reward("my:rollout", t)
    t.reward, t.reward_parts = math.nan, {}
    with pytest.raises(PluginContractError, match=r"set by rollout my:rollout.*non-finite"):
        check_own_reward("my:rollout", t)
