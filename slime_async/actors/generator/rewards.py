"""Reward functions: `reward(sample, response_text, info) -> float | dict[str, float]`.

Named in `generator.reward` by registered name (`exact_match`, `numeric_match`,
`format_check`, `math` = numeric match + 0.1 format bonus as two parts) or import path
(`my_pkg.rewards:judge`). Sync or `async def`: an async reward
may call a remote reward service over HTTP (it runs on the generator's event loop, so it must
not block; a sync one runs inline and should be cheap). A dict result names reward parts: the
trajectory's reward is their sum and the parts travel along in `reward_parts`.

`response_text` is the model's last turn decoded without special tokens (a rollout plugin may
set `transcript.reward_text` instead); `info` holds `full_text` (the whole response with
special tokens), `finish_reason`, `turns`, `response_length` (model tokens) and `state` (what
`generator.lifecycle` set up). The generator scores a group's transcripts concurrently and
retries a call that raises or times out (`generator.reward_retries`, `reward_timeout_s`).
A part named `correct` is what the learner's `accuracy` counts (else reward > 0).

The built-ins compare with `sample.metadata["answer"]`. The final answer in a response is the
text after its last `####` when there is one (the examples' convention), else the whole text.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slime_async.actors.generator.rollout import PluginContractError, Sample, Transcript
from slime_async.utils.plugins import Registry

REWARDS = Registry("reward", params=("sample", "response_text", "info"), is_async=None)

ANSWER_MARK = "####"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FORMAT = re.compile(r"####\s*[-+]?\d+(?:\.\d+)?\s*$")


def final_answer(text: str) -> str:
    """The text after the last `####`, or the whole text, stripped."""
    return text.rpartition(ANSWER_MARK)[2].strip()


def _answer(sample: Sample) -> str:
    if "answer" not in sample.metadata:
        raise PluginContractError(
            f"built-in rewards need an 'answer' field in the dataset record ({sample.group_id})"
        )
    return str(sample.metadata["answer"]).strip()


@REWARDS.register("exact_match")
def exact_match(sample: Sample, response_text: str, info: dict | None = None) -> float:
    """1.0 when the final answer equals the record's `answer` as text, else 0.0."""
    return float(final_answer(response_text) == _answer(sample))


@REWARDS.register("numeric_match")
def numeric_match(sample: Sample, response_text: str, info: dict | None = None) -> float:
    """1.0 when the last number of the final answer equals `answer` numerically (rel. 1e-6)."""
    numbers = _NUMBER.findall(final_answer(response_text).replace(",", ""))
    if not numbers:
        return 0.0
    try:
        want = float(_answer(sample).replace(",", ""))
    except ValueError:
        raise PluginContractError(
            f"numeric_match: answer {_answer(sample)!r} of {sample.group_id} is not a number"
        ) from None
    return float(math.isclose(float(numbers[-1]), want, rel_tol=1e-6, abs_tol=1e-9))


@REWARDS.register("format_check")
def format_check(sample: Sample, response_text: str, info: dict | None = None) -> float:
    """1.0 when the response ends with `#### <number>` and finished by a stop, not by length."""
    if info and info.get("finish_reason") == "length":
        return 0.0
    return float(bool(_FORMAT.search(response_text.strip())))


@REWARDS.register("math")
def math_reward(sample: Sample, response_text: str, info: dict | None = None) -> dict[str, float]:
    """Named parts: `correct` (numeric match) plus a small `format` bonus (0.1)."""
    return {
        "correct": numeric_match(sample, response_text, info),
        "format": 0.1 * format_check(sample, response_text, info),
    }


@dataclass
class RewardFn:
    """A resolved reward function that always returns a checked `(total, parts)`."""

    name: str
    fn: Callable[..., float | dict[str, float] | Awaitable[float | dict[str, float]]]

    async def __call__(
        self, sample: Sample, response_text: str, info: dict
    ) -> tuple[float, dict[str, float]]:
        result = self.fn(sample, response_text, info)
        if inspect.isawaitable(result):
            result = await result
        return check_reward(self.name, result)


def resolve_reward(name_or_path: str, key: str | None = None) -> RewardFn:
    """Look up a reward and check its signature (3 positional parameters) at start-up; `key`
    (the config key naming it) leads the error messages."""
    return RewardFn(name_or_path, REWARDS.resolve(name_or_path, key))


def check_reward(name: str, result: Any) -> tuple[float, dict[str, float]]:
    """(total, parts) of a reward result, or a PluginContractError naming the reward."""
    if isinstance(result, dict):
        if not result:
            raise PluginContractError(f"reward {name!r} returned an empty dict")
        parts: dict[str, float] = {}
        for k, v in result.items():
            if not isinstance(k, str) or not _is_number(v):
                raise PluginContractError(
                    f"reward {name!r}: part {k!r} = {v!r} is not a str -> number item"
                )
            parts[k] = float(v)
        bad = {k: v for k, v in parts.items() if not math.isfinite(v)}
        if bad:
            raise PluginContractError(f"reward {name!r} returned non-finite parts {bad}")
        return math.fsum(parts.values()), parts
    if not _is_number(result):
        raise PluginContractError(
            f"reward {name!r} returned {type(result).__name__} {result!r}; "
            "expected a float or a dict of named floats"
        )
    value = float(result)
    if not math.isfinite(value):
        raise PluginContractError(f"reward {name!r} returned non-finite {value}")
    return value, {}


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


def check_own_reward(name: str, tr: Transcript) -> tuple[float, dict[str, float]]:
    """Check a reward the rollout plugin set itself (`transcript.reward`, `reward_parts`)."""
    value, parts = check_reward(f"set by rollout {name}", tr.reward_parts or tr.reward)
    if tr.reward_parts and not math.isclose(value, float(tr.reward), rel_tol=1e-6, abs_tol=1e-9):
        raise PluginContractError(
            f"rollout {name!r}: reward {tr.reward} is not the sum of reward_parts {tr.reward_parts}"
        )
    return value, parts
