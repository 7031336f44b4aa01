"""The one retry helper: delays, caps, jitter, attempts, and what is (not) retried."""

from __future__ import annotations

import asyncio
import random

import pytest

from slime_async.utils.retry import RetryPolicy, retry_async


def test_delays_double_up_to_the_cap():
    p = RetryPolicy(first_s=0.5, max_s=3.0)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="start at 1"):
        p.delay(0)


def test_jitter_stretches_within_its_bound():
    p = RetryPolicy(first_s=1.0, jitter=0.5)
    rng = random.Random(0)
    delays = [p.delay(1, rng) for _ in range(200)]
    assert all(1.0 <= d < 1.5 for d in delays) and max(delays) - min(delays) > 0.3


@pytest.mark.parametrize(
    "kwargs", [{"first_s": -1}, {"first_s": 1, "factor": 0.5}, {"first_s": 1, "max_attempts": 0}]
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


def test_retries_matching_errors_until_success_and_reports_each():
    seen, calls = [], []

    async def flaky(attempt: int) -> str:
        calls.append(attempt)
        if attempt < 2:
            raise ConnectionError(f"down {attempt}")
        return "ok"

    out = asyncio.run(
        retry_async(
            flaky,
            RetryPolicy(first_s=0.001),
            retry_on=ConnectionError,
            on_retry=lambda n, e, d: seen.append((n, str(e), d)),
        )
    )
    assert out == "ok" and calls == [0, 1, 2]
    assert seen == [(1, "down 0", 0.001), (2, "down 1", 0.002)]


def test_gives_up_after_max_attempts_with_the_last_error():
    calls = []

    async def down(attempt: int) -> None:
        calls.append(attempt)
        raise TimeoutError(f"attempt {attempt}")

    policy = RetryPolicy(first_s=0.001, max_attempts=3)
    with pytest.raises(TimeoutError, match="attempt 2"):
        asyncio.run(retry_async(down, policy, retry_on=(TimeoutError, ConnectionError)))
    assert calls == [0, 1, 2]


def test_other_errors_are_raised_at_once():
    calls = []

    async def bad_request(attempt: int) -> None:
        calls.append(attempt)
        raise ValueError("400: bad field")

    with pytest.raises(ValueError, match="bad field"):
        asyncio.run(retry_async(bad_request, RetryPolicy(first_s=0.001), retry_on=lambda e: False))
    assert calls == [0]
