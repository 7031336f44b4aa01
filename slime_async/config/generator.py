"""`[generator]`: prompts -> rollouts (asyncio plugins) -> rewards -> buffer."""

from pydantic import Field

from slime_async.config.base import Section


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: all)."""
    max_new_tokens: int = Field(256, ge=1)
    """Most tokens generated per turn."""
    stop_token_ids: list[int] = []
    """Extra token ids that end generation (the tokenizer's EOS always does)."""


class GeneratorConfig(Section):
    dataset: str = "examples/arithmetic/train.jsonl"
    """JSONL file of prompts, one JSON object per line."""
    prompt_key: str = "prompt"
    """Field of each JSONL record that holds the prompt (the rest is task metadata)."""
    rollout: str = "slime_async.actors.rollout:single_turn"
    """Rollout plugin, an async function, by import path `package.module:function`."""
    reward: str = "slime_async.actors.rewards:exact_match"
    """Reward function (sync or async) by import path."""
    group_size: int = Field(8, ge=1)
    """Rollouts per prompt (n samples of one prompt form a group)."""
    max_inflight: int = Field(64, ge=1)
    """Upper limit of concurrent rollouts (the buffer's admission may allow fewer)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters sent to the engines."""
    producer_id: str = "gen0"
    """Identity of this generator towards the buffer (sequence numbers are per producer)."""
    seed: int = 0
    """Shuffling seed of the dataset."""
