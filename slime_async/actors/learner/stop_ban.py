"""`min_new_tokens` on the learner's side: the tokens whose distribution left out the stop ids.

With `generator.sampling.min_new_tokens = m` the engine draws the first m tokens of every model
turn with the stop tokens (EOS and `stop_token_ids`) banned, i.e. from the distribution
renormalised over the other tokens, and reports those renormalised log-probs as mu. The learner
must score the same tokens under the same rule, or pi_prox / mu is off by 1 / (1 - p(stop)) on
every early token (a weight that is not staleness at all):

    log pi'(y_t) = s_y - log sum_{v not in stop} exp(s_v)     for t < m in its turn, s = z / T

`StopBan.banned(loss_mask)` marks those positions ([R], the first m model tokens after each
environment span); `logprobs.chunked_logprobs` masks the stop logits there, forward and backward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class StopBan:
    min_new_tokens: int
    """The engine's min_new_tokens (0: nothing is banned)."""
    stop_ids: tuple[int, ...]
    """The ids the engine bans: the model's EOS ids and generator.sampling.stop_token_ids."""

    @property
    def active(self) -> bool:
        return self.min_new_tokens > 0 and bool(self.stop_ids)

    def banned(self, loss_mask: np.ndarray) -> np.ndarray:
        """`[R]` uint8: 1 on the first `min_new_tokens` model tokens of every model turn."""
        model = np.asarray(loss_mask) > 0
        out = np.zeros(model.shape, dtype=np.uint8)
        if not self.active:
            return out
        run = 0
        for i, is_model in enumerate(model):
            run = run + 1 if is_model else 0
            if is_model and run <= self.min_new_tokens:
                out[i] = 1
        return out


def model_eos_ids(model_path: str | Path | None) -> tuple[int, ...]:
    """`eos_token_id` of the HF config at `model_path` (what the engine stops on), as a tuple."""
    if model_path is None:
        return ()
    path = Path(model_path) / "config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def stop_ban(min_new_tokens: int, stop_token_ids: list[int], model_path: str | None) -> StopBan:
    """The engine's ban for a run: its min_new_tokens over EOS + `stop_token_ids`."""
    ids = sorted(set(model_eos_ids(model_path)) | {int(t) for t in stop_token_ids})
    return StopBan(int(min_new_tokens), tuple(ids))
