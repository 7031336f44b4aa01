"""What a scripted engine answers: the fields of `EnginePool.generate`'s output that the rollout
context and the generator read, for tests that drive them without an engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Out:
    token_ids: list
    logprobs: list
    versions: list
    finish_reason: object
    engine_url: str = "e0"
    routed_experts: object = None
    """Flat int32 routed experts (routing replay), as the engine client decodes them."""
