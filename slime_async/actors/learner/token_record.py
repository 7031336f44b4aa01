"""What the learner saw of every token of a step, for `slime-async inspect`: one small file per
recorded step, `<run_dir>/token_records/step_<N>.npz`.

Per response token of every trajectory trained on (aligned with the trajectory's response ids,
as in the write-ahead log):

| array | dtype | what |
| --- | --- | --- |
| `behavior_logp` | f32 | mu: the engine's log-prob of the token (as the trajectory carried it) |
| `prox_logp` | f32 | the learner's log-prob at the start of the batch (pi_prox; where the step computed no forward pass for it, that of the row's first update) |
| `logp` | f32 | the learner's log-prob under the weights of the row's last update (pi_theta as the loss last saw it) |
| `advantage` | f32 | the advantage the loss was given |
| `grad` | f32 | d loss / d logp of the token, summed over the batch's updates: the weight of its score-function gradient |
| `loss_mask` | u8 | 1 for model tokens, 0 for environment tokens |

plus `ids` (trajectory ids), `offsets` [R + 1] into the token arrays, and per step `step`,
`version` (after the step) and `grad_norms` (one per applied or skipped update).

Cost: 21 bytes per response token per recorded step on disk (the write-ahead log spends about
13 per response token), one gather of these arrays to rank 0 over the data-parallel group, and
a `[B, T]` device-to-host copy per micro-batch, read once its update's gradient norm is known
(no wait of its own for the GPU). `learner.token_record_interval` records every
N-th step (0: never) and `learner.token_record_keep` keeps only the newest files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # `slime-async inspect` reads records without importing torch
    import torch

    from slime_async.actors.learner.batch import MicroBatch, Row

RECORD_DIR = "token_records"
FIELDS = ("behavior_logp", "prox_logp", "logp", "advantage", "grad")
_NAME = re.compile(r"^step_(\d+)\.npz$")


class TokenRecorder:
    """Collects one step's per-token values on this rank; `Updates` feeds it each micro-batch."""

    def __init__(self, rows: Sequence[Row], ids: Sequence[str]):
        self.rows = list(rows)
        self._index = {id(r): i for i, r in enumerate(self.rows)}
        self.ids = list(ids)
        self.values: list[dict[str, np.ndarray]] = []
        for r in self.rows:
            n = r.response_len
            prox = r.per_token.get("prox_logp")
            self.values.append(
                {
                    "behavior_logp": np.asarray(r.per_token["behavior_logp"], np.float32),
                    "prox_logp": (
                        np.asarray(prox, np.float32)
                        if prox is not None
                        else np.full(n, np.nan, np.float32)
                    ),
                    "logp": np.full(n, np.nan, np.float32),
                    "advantage": np.asarray(r.per_token["advantages"], np.float32),
                    "grad": np.zeros(n, np.float32),
                    "loss_mask": np.asarray(r.per_token["loss_mask"]).astype(np.uint8),
                }
            )
        self.grad_norms: list[float] = []
        # (rows, micro-batch, log-probs, their gradient) on the device until the update is done
        self._pending: list[tuple[Sequence[Row], MicroBatch, Any, Any]] = []

    def observe(self, rows: Sequence[Row], mb: MicroBatch, logp: torch.Tensor) -> None:
        """After the micro-batch's backward: its log-probs `logp` [B, T] and their gradient.

        Kept on the device until `update_done`: reading them here would make the host wait for
        the backward pass before it issues the next micro-batch or the optimizer's work (the
        update's gradient norm waits for the GPU anyway, so by then the copy costs no wait)."""
        self._pending.append((rows, mb, logp.detach(), logp.grad))

    def update_done(self, grad_norm: float) -> None:
        self._drain()
        self.grad_norms.append(float(grad_norm))

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for rows, mb, logp, grad_t in pending:
            lp = logp.float().cpu().numpy()
            grad = grad_t.float().cpu().numpy() if grad_t is not None else np.zeros_like(lp)
            for j, i in enumerate(mb.rows):
                k = self._index.get(id(rows[i]))
                if k is None:
                    continue
                v, n = self.values[k], self.rows[k].response_len
                if np.isnan(v["prox_logp"]).all():
                    v["prox_logp"] = lp[j, :n].copy()
                v["logp"] = lp[j, :n].copy()
                v["grad"] += grad[j, :n]

    def gather(self, dp_group: Any, is_rank0: bool, tp_rank: int) -> dict[str, Any] | None:
        """Every rank calls it; rank 0 gets the whole step's arrays (DP ranks' rows joined)."""
        import torch.distributed as dist

        self._drain()

        mine = (self.ids, self.values) if tp_rank == 0 else ([], [])
        parts: list[Any] = [mine]
        if dist.get_world_size(dp_group) > 1:
            parts = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(parts, mine, group=dp_group)
        if not is_rank0:
            return None
        ids = [i for p in parts for i in p[0]]
        values = [v for p in parts for v in p[1]]
        lengths = [len(v["logp"]) for v in values]
        out: dict[str, Any] = {
            "ids": np.asarray(ids, dtype=str),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "grad_norms": np.asarray(self.grad_norms, np.float32),
        }
        for name in (*FIELDS, "loss_mask"):
            dtype = np.uint8 if name == "loss_mask" else np.float32
            out[name] = (
                np.concatenate([v[name] for v in values]) if values else np.zeros(0, dtype)
            ).astype(dtype)
        return out


def grad_size(grad: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """|d loss / d logp| x (1 - p) per token (`grad`, `logp`: [N] of a record): within sqrt(2) of
    the norm of the loss's gradient at the token's logits, which is g (onehot - softmax), of norm
    between (1 - p) |g| and sqrt(2) (1 - p) |g|."""
    return np.abs(grad) * -np.expm1(logp)


def record_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / RECORD_DIR / f"step_{step}.npz"


def write(run_dir: str | Path, step: int, version: int, record: dict[str, Any], keep: int) -> Path:
    """Write step `step`'s record (atomically) and keep only the newest `keep` (0: all)."""
    path = record_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, step=np.int64(step), version=np.int64(version), **record)
    tmp.replace(path)
    if keep:
        for old in recorded_steps(run_dir)[:-keep]:
            record_path(run_dir, old).unlink(missing_ok=True)
    return path


def recorded_steps(run_dir: str | Path) -> list[int]:
    d = Path(run_dir) / RECORD_DIR
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def read(run_dir: str | Path, step: int) -> dict[str, Any] | None:
    """Step `step`'s record as numpy arrays, or None when that step was not recorded."""
    path = record_path(run_dir, step)
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def per_trajectory(record: dict[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    """trajectory id -> its per-token arrays."""
    off = record["offsets"]
    return {
        str(tid): {name: record[name][off[i] : off[i + 1]] for name in (*FIELDS, "loss_mask")}
        for i, tid in enumerate(record["ids"])
    }
