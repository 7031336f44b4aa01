"""The learner's data: typed groups, rows, micro-batches, and exact per-token log-probs from
vocab-parallel logits.

Padding, not packing: megatron-core's local attention (no Transformer Engine) has no
variable-length kernel, so a packed row would need a block-diagonal `[s, s]` mask and would
still spend the quadratic attention compute across the sequences packed into it. Rows are
sorted by length before they are cut into micro-batches, which keeps the padding small.
Right padding under a causal mask never reaches a real token, and every per-token tensor is
masked explicitly anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from slime_async.queue.schema import Trajectory

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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


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
    full = torch.from_numpy(ids).to(device)
    routed = None
    if all(r.routed is not None for r in picked):
        width = picked[0].routed.shape[1]
        arr = np.zeros((b, s, width), dtype=np.int64)
        for j, r in enumerate(picked):
            arr[j, : r.input_len] = r.routed
        routed = torch.from_numpy(arr).to(device)
    return MicroBatch(
        input_ids=full[:, :-1].contiguous(),
        labels=full[:, 1:].contiguous(),
        position_ids=torch.arange(s, device=device).expand(b, s).contiguous(),
        resp_index=torch.from_numpy(resp_index).to(device),
        resp_valid=torch.from_numpy(valid).to(device),
        per_token={k: torch.from_numpy(v).to(device) for k, v in per_token.items()},
        rows=list(indices),
        temperature=torch.tensor([r.temperature for r in picked], dtype=torch.float32).to(device),
        routed_experts=routed,
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[label] and optionally the entropy, over TP vocab shards.

    logits: [B, S, V/tp] this rank's vocab slice; labels: [B, S] global ids; temperature: one
    for all rows or [B], one per row. Over the full vocabulary, with no top-k/top-p filtering:
    what SGLang reports as a token's log-prob (`log_softmax(logits / T)` before filtering).
    Returns logp [B, S] (and entropy [B, S]) in fp32, with grad. The sums across TP ranks
    all-reduce forward and pass the gradient through unchanged backward: every TP rank
    computes the same loss, so each rank's slice gets exactly its share.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = parallel_state.get_tensor_model_parallel_world_size()
    z = logits.float()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.to(z).view(-1, 1, 1)
    elif temperature != 1.0:
        z = z / temperature
    v_local = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    m = z.detach().amax(dim=-1)  # [B, S]
    if tp > 1:
        dist.all_reduce(
            m,
            op=dist.ReduceOp.MAX,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    local = labels - start
    in_shard = (local >= 0) & (local < v_local)
    target = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(in_shard, target, torch.zeros_like(target))
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        target = reduce_from_tensor_model_parallel_region(target)
    log_z = sum_exp.log()
    logp = target - log_z
    if not with_entropy:
        return logp, None
    # H = log Z - sum_v p_v * (z_v - m), with p = exp(z - m) / Z.
    p_shift = (exp * shifted).sum(dim=-1)
    if tp > 1:
        p_shift = reduce_from_tensor_model_parallel_region(p_shift)
    entropy = log_z - p_shift / sum_exp
    return logp, entropy


def gather_response(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[B, S] per-position values -> [B, T] per response token, 0 on padding."""
    out = values.gather(1, mb.resp_index)
    return torch.where(mb.resp_valid, out, torch.zeros_like(out))


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
    groups: Sequence[TrainGroup], vocab_size: int, temperature: float = 1.0
) -> list[Row]:
    """One Row per trajectory (prompt + response tokens, response-aligned per-token arrays), at
    the trajectory's own temperature (`temperature`, the run's, where it recorded none)."""
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
