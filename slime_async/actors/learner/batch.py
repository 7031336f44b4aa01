"""The learner's data: typed groups, rows, and micro-batches (padded or packed).

Two layouts of a micro-batch:
- padded (`plan_micro_batches` + `collate`): rows sorted by length, each micro-batch `[B, S]`
  right-padded to its longest row. Right padding under a causal mask never reaches a real
  token, and every per-token tensor is masked explicitly anyway.
- packed (`plan_packs` + `collate_packed`): whole rows laid end to end in one `[1, S]` row,
  position ids restarting at each row, and the rows' boundaries (`cu_seqlens`, in megatron's
  `PackedSeqParams`) so that attention stays inside each row and RoPE restarts per row
  (`models/attention.py: packed_rows`). No padding
  is computed at all; on a GPU the variable-length flash kernel also skips the cross-row blocks.
In both, `resp_index` locates each response token's prediction, and `flat_index()` turns it
into an index over the flattened `[B * S]` positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slime_async.actors.learner.stop_ban import StopBan
from slime_async.queue.schema import Trajectory
from slime_async.utils.device import to_device

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


@dataclass(frozen=True, eq=False)
class TrainGroup:
    """One prompt's trajectories: the unit the advantage estimator normalises over and the unit
    that data parallelism splits a batch on."""

    trajectories: tuple[Trajectory, ...]
    staleness: int = 0
    """The buffer's version at delivery minus the group's oldest model-token version."""

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)


@dataclass
class Row:
    """One sequence: prompt + response tokens, and response-aligned per-token values."""

    tokens: np.ndarray
    """[P + R] int64 prompt then response ids."""
    prompt_len: int
    """P >= 1: the first response token is predicted at position P - 1."""
    per_token: dict[str, np.ndarray] = field(default_factory=dict)
    """name -> [R] response-aligned values (behaviour logp, loss mask, versions, advantages)."""
    temperature: float = 1.0
    """The temperature its log-probs are computed at (the one the engine sampled it with)."""
    routed: np.ndarray | None = None
    """[P + R - 1, moe_layers * k] int32 experts chosen at generation (routing replay), or None."""

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def input_len(self) -> int:
        return len(self.tokens) - 1


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[B, S] int64, right-padded with 0."""
    labels: torch.Tensor
    """[B, S] int64 next tokens (labels[b, s] = tokens[b, s + 1]), padded with 0."""
    position_ids: torch.Tensor
    """[B, S] int64."""
    resp_index: torch.Tensor
    """[B, T] int64 position in S of each response token's prediction (0 on padding)."""
    resp_valid: torch.Tensor
    """[B, T] bool, False on padding past a row's response."""
    per_token: dict[str, torch.Tensor]
    """name -> [B, T] response-aligned values, 0 on padding."""
    rows: list[int]
    """Indices into the step's row list, in batch order."""
    temperature: torch.Tensor | None = None
    """[B] float32 per-row temperature (each trajectory's own)."""
    routed_experts: torch.Tensor | None = None
    """[B, S, moe_layers * k] int64 experts chosen at generation (routing replay; 0 on padding),
    None unless every row of the micro-batch carries them."""
    packed: Any = None
    """megatron's PackedSeqParams when the rows are packed into one `[1, S]` row (then
    `resp_index` indexes that row), None when padded."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def flat_index(self) -> torch.Tensor:
        """[B, T] index of each response token's prediction in the flattened `[b * S]` positions."""
        if self.packed is not None:
            return self.resp_index
        s = self.input_ids.shape[1]
        rows = torch.arange(self.resp_index.shape[0], device=self.resp_index.device)
        return self.resp_index + rows[:, None] * s


def plan_micro_batches(input_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch: sorted by length, each with B * max_len <= max_tokens.

    A row longer than `max_tokens` on its own gets a micro-batch of its own.
    """
    order = sorted(range(len(input_lens)), key=lambda i: input_lens[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(input_lens[i], max((input_lens[j] for j in current), default=0))
        if current and longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def plan_packs(input_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per packed micro-batch, each with sum(input_lens) <= max_tokens.

    First-fit over the rows longest first (a row longer than `max_tokens` gets a pack of its
    own); the packs come out shortest-total first, which does not matter to the result.
    """
    order = sorted(range(len(input_lens)), key=lambda i: -input_lens[i])
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = input_lens[i]
        for k, free in enumerate(room):
            if n <= free:
                packs[k].append(i)
                room[k] -= n
                break
        else:
            packs.append([i])
            room.append(max_tokens - n)
    return packs


def collate_packed(rows: list[Row], indices: list[int], device: torch.device) -> MicroBatch:
    """`rows[indices]` end to end in one `[1, S]` row (S = the sum of their input lengths)."""
    from slime_async.models.attention import packed_seq_params

    picked = [rows[i] for i in indices]
    b = len(picked)
    t = max(r.response_len for r in picked)
    lens = [r.input_len for r in picked]
    ids = np.concatenate([r.tokens[:-1] for r in picked])
    labels = np.concatenate([r.tokens[1:] for r in picked])
    pos = np.concatenate([np.arange(n) for n in lens])
    resp_index = np.zeros((b, t), dtype=np.int64)
    valid = np.zeros((b, t), dtype=bool)
    per_token = {k: np.zeros((b, t), dtype=v.dtype) for k, v in picked[0].per_token.items()}
    offset = 0
    for j, r in enumerate(picked):
        n = r.response_len
        resp_index[j, :n] = offset + np.arange(r.prompt_len - 1, r.prompt_len - 1 + n)
        valid[j, :n] = True
        for k, v in r.per_token.items():
            per_token[k][j, :n] = v
        offset += r.input_len
    return MicroBatch(
        input_ids=_on(ids, device)[None],
        labels=_on(labels, device)[None],
        position_ids=_on(pos, device)[None],
        resp_index=_on(resp_index, device),
        resp_valid=_on(valid, device),
        per_token={k: _on(v, device) for k, v in per_token.items()},
        rows=list(indices),
        temperature=_temperatures(picked, device),
        packed=packed_seq_params(lens, device),
    )


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A collated array on the device; on a GPU without waiting for the previous micro-batch's
    kernels (`to_device`)."""
    return to_device(torch.from_numpy(a), device)


def _temperatures(picked: list[Row], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor([r.temperature for r in picked], dtype=torch.float32), device)


def collate(rows: list[Row], indices: list[int], device: torch.device) -> MicroBatch:
    picked = [rows[i] for i in indices]
    b = len(picked)
    s = max(r.input_len for r in picked)
    t = max(r.response_len for r in picked)
    ids = np.zeros((b, s + 1), dtype=np.int64)
    resp_index = np.zeros((b, t), dtype=np.int64)
    valid = np.zeros((b, t), dtype=bool)
    per_token = {k: np.zeros((b, t), dtype=v.dtype) for k, v in picked[0].per_token.items()}
    for j, r in enumerate(picked):
        ids[j, : len(r.tokens)] = r.tokens
        n = r.response_len
        resp_index[j, :n] = np.arange(r.prompt_len - 1, r.prompt_len - 1 + n)
        valid[j, :n] = True
        for k, v in r.per_token.items():
            per_token[k][j, :n] = v
    full = _on(ids, device)
    routed = None
    if all(r.routed is not None for r in picked):
        width = picked[0].routed.shape[1]
        arr = np.zeros((b, s, width), dtype=np.int64)
        for j, r in enumerate(picked):
            arr[j, : r.input_len] = r.routed
        routed = _on(arr, device)
    return MicroBatch(
        input_ids=full[:, :-1].contiguous(),
        labels=full[:, 1:].contiguous(),
        position_ids=torch.arange(s, device=device).expand(b, s).contiguous(),
        resp_index=_on(resp_index, device),
        resp_valid=_on(valid, device),
        per_token={k: _on(v, device) for k, v in per_token.items()},
        rows=list(indices),
        temperature=_temperatures(picked, device),
        routed_experts=routed,
    )


def check_ids(tokens: np.ndarray, vocab: int, what: str) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"{what}: token id out of range [0, {vocab}): {int(tokens.max())}")


def check_trajectory(t: Trajectory, vocab_size: int) -> None:
    """Errors name the trajectory and the field."""
    r = len(t.response_ids)
    if len(t.prompt_ids) < 1 or r < 1:
        raise ValueError(f"trajectory {t.id!r}: prompt_ids and response_ids must be non-empty")
    for name in ("logprobs", "loss_mask", "versions"):
        if len(getattr(t, name)) != r:
            raise ValueError(
                f"trajectory {t.id!r}: {name} has {len(getattr(t, name))} entries, "
                f"response_ids has {r}"
            )
    check_ids(np.concatenate([t.prompt_ids, t.response_ids]), vocab_size, f"trajectory {t.id!r}")


def rows_from_groups(
    groups: Sequence[TrainGroup],
    vocab_size: int,
    temperature: float = 1.0,
    ban: StopBan | None = None,
) -> list[Row]:
    """One Row per trajectory (prompt + response tokens, response-aligned per-token arrays), at
    the trajectory's own temperature (`temperature`, the run's, where it recorded none). With
    an active `ban` (min_new_tokens), `per_token["stop_banned"]` marks the tokens drawn with the
    stop ids banned; a stop id there is refused (the engine could not have drawn it)."""
    rows = []
    for g in groups:
        for t in g:
            check_trajectory(t, vocab_size)
            tokens = np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)
            per_token = {
                "behavior_logp": np.asarray(t.logprobs, dtype=np.float32),
                "loss_mask": np.asarray(t.loss_mask, dtype=np.float32),
                "versions": np.asarray(t.versions, dtype=np.int64),
            }
            if ban is not None and ban.active:
                banned = ban.banned(t.loss_mask)
                hit = banned.astype(bool) & np.isin(t.response_ids, ban.stop_ids)
                if hit.any():
                    i = int(np.flatnonzero(hit)[0])
                    raise ValueError(
                        f"trajectory {t.id!r}: response token {i} is stop id "
                        f"{int(t.response_ids[i])} within the first min_new_tokens = "
                        f"{ban.min_new_tokens} of its turn, which the engine bans: "
                        "generator.sampling.min_new_tokens does not match the engine's"
                    )
                per_token["stop_banned"] = banned.astype(np.float32)
            temp = temperature if t.temperature is None else float(t.temperature)
            routed = None
            if t.routed_experts is not None:
                n = len(tokens) - 1
                flat = np.asarray(t.routed_experts, dtype=np.int32).reshape(-1)
                if flat.size % n:
                    raise ValueError(
                        f"trajectory {t.id!r}: routed_experts has {flat.size} ids, not a multiple "
                        f"of its {n} routed tokens (prompt + response - 1)"
                    )
                routed = flat.reshape(n, -1)
            rows.append(Row(tokens, len(t.prompt_ids), per_token, temp, routed))
    return rows
