"""Whether the engines honour `sampling_seed`, checked once when a generator starts.

SGLang 0.5.23 reads a request's `sampling_seed` only when the server runs with
`--enable-deterministic-inference` (srt/sampling/sampling_batch_info.py: otherwise no seed reaches
the sampler), and then draws every request without one with seed 42, so the n rollouts of a
prompt would be one answer. Both ways a run goes wrong without an error: seeded evaluation
(`eval.seed`) pins nothing, or every group has zero advantage. So the generator reads each
engine's `/server_info` (`enable_deterministic_inference`, one of ServerArgs' fields) against
`engine.deterministic_inference`:

    engine says true,  config false  ->  refused: the rollouts of a prompt would all be the same
    engine says false, config true   ->  refused: the setting would do nothing
    engine says false, eval seeded   ->  a warning: the sampled evaluation is not pinned
    engine does not say (a router)   ->  logged, not checked

The embedded engine says what it does: in non-strict mode it honours `sampling_seed` whatever the
setting (`seeds_honoured`); strict, it behaves and answers as SGLang.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.actors.generator.loop import GeneratorError

log = logging.getLogger("slime_async.generator")

FLAG = "--enable-deterministic-inference"


class SeedingMismatch(GeneratorError):
    """An engine's deterministic inference and `engine.deterministic_inference` disagree."""


def seeds_honoured(info: dict[str, Any]) -> bool | None:
    """Does the engine of this /server_info draw a request's `sampling_seed`? None: it does not
    say (a router, an older server)."""
    if info.get("engine") == "slime_async.embedded" and not info.get("strict_sglang"):
        return True  # the embedded engine's own rule: a seed is always honoured
    flag = info.get("enable_deterministic_inference")
    return flag if isinstance(flag, bool) else None


def check(url: str, info: dict[str, Any], deterministic: bool) -> bool | None:
    """One engine's /server_info against `engine.deterministic_inference`: raises
    `SeedingMismatch`, else returns `seeds_honoured(info)`."""
    flag = info.get("enable_deterministic_inference")
    if flag is True and not deterministic:
        raise SeedingMismatch(
            f"engine {url} runs with {FLAG}: SGLang then draws every request without a "
            "sampling_seed with seed 42, so the rollouts of a prompt would all be one answer; "
            "set engine.deterministic_inference = true (each rollout request then gets a seed "
            f"of its own) or start the engine without {FLAG}"
        )
    if flag is False and deterministic:
        raise SeedingMismatch(
            f"engine.deterministic_inference = true, but engine {url} runs without {FLAG}: "
            "it ignores sampling_seed, so the setting would do nothing; start the engines with "
            f"{FLAG} or set engine.deterministic_inference = false"
        )
    return seeds_honoured(info)


async def check_engines(
    clients: list[EngineClient], deterministic: bool, eval_seeded: bool, timeout_s: float = 30.0
) -> dict[str, bool | None]:
    """`check` every engine (an engine that does not answer /server_info in `timeout_s` is
    logged and left unchecked); warn when the sampled evaluation is seeded and an engine ignores
    the seeds. Returns each engine's `seeds_honoured` (None: unknown)."""

    async def info(c: EngineClient) -> dict[str, Any] | None:
        try:
            got = await asyncio.wait_for(c.get_server_info(), timeout_s)
        except (EngineError, TimeoutError) as e:
            log.warning("sampling_seed: %s /server_info did not answer (%s): not checked", c.url, e)
            return None
        return got if isinstance(got, dict) else None

    infos = await asyncio.gather(*(info(c) for c in clients))
    honoured: dict[str, bool | None] = {}
    for c, got in zip(clients, infos, strict=True):
        honoured[c.url] = None if got is None else check(c.url, got, deterministic)
        if got is not None and honoured[c.url] is None:
            log.info("sampling_seed: %s does not say whether it honours seeds", c.url)
    ignoring = sorted(u for u, h in honoured.items() if h is False)
    if eval_seeded and ignoring:
        log.warning(
            "eval.seed: %s ignore sampling_seed (SGLang honours it only with %s; "
            "engine.deterministic_inference): the sampled evaluation answers are not pinned, "
            "and runs compared by a sweep pair on data order and initial weights only",
            ", ".join(ignoring),
            FLAG,
        )
    return honoured
