"""Synthetic trajectories of a chosen size, for the buffer's tests and benchmark."""

from __future__ import annotations

import numpy as np

from slime_async.queue.schema import Trajectory


def synthetic_group(
    group_id: str,
    group_size: int = 4,
    prompt_len: int = 16,
    response_len: int = 32,
    version: int = 0,
    seed: int = 0,
) -> list[Trajectory]:
    """`group_size` trajectories of one prompt; every model token tagged with `version`.

    A trajectory encodes to about 13 * response_len + 4 * prompt_len + 250 bytes.
    """
    rng = np.random.default_rng(seed)
    prompt: np.ndarray = rng.integers(3, 128, prompt_len, dtype=np.int32)  # [P]
    group = []
    for i in range(group_size):
        mask = np.ones(response_len, dtype=np.uint8)  # [R]
        mask[response_len // 2 : response_len // 2 + response_len // 8] = 0  # a tool reply
        group.append(
            Trajectory(
                id=f"{group_id}/{i}",
                group_id=group_id,
                group_size=group_size,
                prompt_ids=prompt,
                response_ids=rng.integers(3, 128, response_len, dtype=np.int32),
                logprobs=np.where(mask, -rng.random(response_len), 0.0).astype(np.float32),
                loss_mask=mask,
                versions=np.full(response_len, version, dtype=np.int32),
                reward=float(i % 2),
                reward_parts={"correct": float(i % 2)},
                finish_reason="stop",
                engine_id="engine-0",
                metadata={"source": "synthetic", "turns": 2},
            )
        )
    return group
