"""The one retry helper: how many attempts, how long between them, and what is retried.

    policy = RetryPolicy(first_s=0.2, jitter=0.5, max_attempts=6)
    out = await retry_async(lambda attempt: client.call(...), policy,
                            retry_on=lambda e: isinstance(e, EngineError), on_retry=log_it)

Delay before retry n (n = 1 for the first retry) is `min(first_s * factor**(n-1), max_s)`,
stretched by a random factor in [1, 1 + jitter) so that many clients that failed together do not
all come back in the same instant. Callers whose loop is not a plain "call again" (failing over to
another engine, resending a put from a timer) use `policy.delay(n)` directly, so every back-off
in the project has the same shape and is configured the same way.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off with a cap and optional jitter."""

    first_s: float
    """Delay before the first retry."""
    max_s: float = 30.0
    """Longest delay between two attempts."""
    factor: float = 2.0
    """Growth of the delay per retry."""
    jitter: float = 0.0
    """Each delay is multiplied by a random factor in [1, 1 + jitter)."""
    max_attempts: int | None = None
    """Attempts in all, the first included (None: retry for ever)."""

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.max_s < 0:
            raise ValueError(f"RetryPolicy: delays must be >= 0 (got {self.first_s}, {self.max_s})")
        if self.factor < 1:
            raise ValueError(f"RetryPolicy: factor must be >= 1 (got {self.factor})")
        if self.jitter < 0:
            raise ValueError(f"RetryPolicy: jitter must be >= 0 (got {self.jitter})")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"RetryPolicy: max_attempts must be >= 1 (got {self.max_attempts})")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (1 for the first retry)."""
        if retry < 1:
            raise ValueError(f"retry numbers start at 1 (got {retry})")
        base = min(self.first_s * self.factor ** (retry - 1), self.max_s)
        if self.jitter:
            base *= 1.0 + self.jitter * (rng or random).random()
        return base

    def exhausted(self, attempts: int) -> bool:
        """True once `attempts` attempts have been made and no more are allowed."""
        return self.max_attempts is not None and attempts >= self.max_attempts


def _matches(error: BaseException, retry_on: RetryOn) -> bool:
    if isinstance(retry_on, type | tuple):
        return isinstance(error, retry_on)
    return bool(retry_on(error))


async def retry_async(
    fn: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    *,
    retry_on: RetryOn,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """`await fn(attempt)` (attempt = 0, 1, ...) until it returns, retrying errors that match
    `retry_on` after `policy.delay`. The last error is raised once the policy is exhausted; any
    other error (and cancellation) is raised at once. `on_retry(retry, error, delay)` is called
    before each wait: count and log there, so that no retry goes unseen."""
    attempt = 0
    while True:
        try:
            return await fn(attempt)
        except Exception as e:
            if not _matches(e, retry_on):
                raise
            attempt += 1
            if policy.exhausted(attempt):
                raise
            delay = policy.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, e, delay)
        await asyncio.sleep(delay)
