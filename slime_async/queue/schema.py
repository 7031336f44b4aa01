"""The trajectory wire format of the buffer: one versioned module, validated on decode.

A trajectory travels as one MessagePack map (never pickle). Token arrays are raw little-endian
bytes inside the map (int32 ids and versions, float32 log-probs, uint8 loss mask): packing them
as lists of ints costs 5-7x more (measured with pyzmq 27.3 / msgpack 1.2.4 on loopback; the
"raw + encode/decode" row of `bench/bench_buffer.py` shows the codec's cost today).
`decode_trajectory` checks every field and raises `SchemaError` naming the first field that is
wrong, so a bad message gets a precise reply.

Trajectories follow a message's header (frame 0, see `messages.py`). The buffer validates them
once, stores and forwards their bytes as they came (never re-encoded), and the consumer decodes
them without checking again (`validate=False`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
"""Version of the trajectory map and of the message headers (`messages.py`): both ends check it."""
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"

Scalar = str | int | float | bool

_ARRAYS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype("<i4"),
    "response_ids": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "loss_mask": np.dtype("u1"),
    "versions": np.dtype("<i4"),
}
_RESPONSE_ARRAYS = ("response_ids", "logprobs", "loss_mask", "versions")
_FIELDS = frozenset(
    {
        "schema",
        "id",
        "group_id",
        "group_size",
        *_ARRAYS,
        "reward",
        "reward_parts",
        "finish_reason",
        "engine_id",
        "created_at",
        "enqueued_at",
        "metadata",
    }
)
_OPTIONAL_FIELDS = frozenset({"temperature", "routed_experts"})
"""Fields a trajectory may leave out (older producers); absent means the run's default."""
_ROUTED = np.dtype("<i4")


class SchemaError(ValueError):
    """A message or trajectory does not follow the schema; `field` names what is wrong."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass
class Trajectory:
    """One sampled response to one prompt, every response token tagged with its policy version."""

    id: str
    group_id: str
    group_size: int
    prompt_ids: np.ndarray
    """int32 [P]."""
    response_ids: np.ndarray
    """int32 [R]: model tokens and, in multi-turn rollouts, tool/environment tokens."""
    logprobs: np.ndarray
    """float32 [R]: behaviour log-probs from the engine; 0.0 on environment tokens."""
    loss_mask: np.ndarray
    """uint8 [R]: 1 model token, 0 environment/tool token."""
    versions: np.ndarray
    """int32 [R]: policy version that produced each token (env tokens: the preceding model token's)."""
    reward: float
    reward_parts: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    engine_id: str = ""
    created_at: float = field(default_factory=time.time)
    enqueued_at: float = 0.0
    metadata: dict[str, Scalar] = field(default_factory=dict)
    temperature: float | None = None
    """Sampling temperature the engine used (and scaled its log-probs by); None: the run's
    `generator.sampling.temperature`. The learner computes its log-probs at this temperature."""
    routed_experts: np.ndarray | None = None
    """int32 [P + R - 1, moe_layers, k] (any shape with that many ids; travels flat): the experts
    each token but the last went through at generation, per MoE layer (SGLang's
    `return_routed_experts`). Only with routing replay on; None otherwise."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def oldest_version(self) -> int | None:
        """The oldest policy version among model tokens (None when there is no model token)."""
        model = self.versions[self.loss_mask.astype(bool)]
        return int(model.min()) if model.size else None


def encode_trajectory(t: Trajectory) -> bytes:
    """One trajectory as a MessagePack map with token arrays as raw little-endian bytes."""
    m: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "id": t.id,
        "group_id": t.group_id,
        "group_size": int(t.group_size),
        "reward": float(t.reward),
        "reward_parts": {k: float(v) for k, v in t.reward_parts.items()},
        "finish_reason": t.finish_reason,
        "engine_id": t.engine_id,
        "created_at": float(t.created_at),
        "enqueued_at": float(t.enqueued_at),
        "metadata": dict(t.metadata),
    }
    if t.temperature is not None:
        m["temperature"] = float(t.temperature)
    if t.routed_experts is not None:
        m["routed_experts"] = memoryview(
            np.ascontiguousarray(t.routed_experts, dtype=_ROUTED).reshape(-1)
        ).cast("B")
    for name, dtype in _ARRAYS.items():
        # A byte view, not tobytes(): msgpack copies it once into the message.
        m[name] = memoryview(np.ascontiguousarray(getattr(t, name), dtype=dtype)).cast("B")
    return msgpack.packb(m, use_bin_type=True)


def _str(m: dict, name: str, allow_empty: bool = True) -> str:
    v = m.get(name)
    if not isinstance(v, str):
        raise SchemaError(name, f"expected a string, got {type(v).__name__}")
    if not allow_empty and not v:
        raise SchemaError(name, "must not be empty")
    return v


def _finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SchemaError(name, f"expected a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise SchemaError(name, f"must be finite, got {v}")
    return float(v)


def _array(m: dict, name: str, copy: bool) -> np.ndarray:
    raw = m.get(name)
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise SchemaError(name, f"expected raw little-endian bytes, got {type(raw).__name__}")
    dtype = _ARRAYS[name]
    if len(raw) % dtype.itemsize:
        raise SchemaError(
            name, f"{len(raw)} bytes is not a whole number of {dtype.name} ({dtype.itemsize} B)"
        )
    arr = np.frombuffer(raw, dtype=dtype)
    if _LITTLE_ENDIAN_HOST:
        return arr.copy() if copy else arr
    # Native byte order so that torch.from_numpy accepts it.
    return arr.astype(dtype.newbyteorder("="))


def unpack_map(blob: bytes | memoryview, what: str) -> dict[str, Any]:
    """A MessagePack map, or `SchemaError(what, ...)` for malformed bytes or another type."""
    try:
        m = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise SchemaError(what, f"malformed MessagePack: {e}") from None
    if not isinstance(m, dict):
        raise SchemaError(what, f"expected a map, got {type(m).__name__}")
    return m


def _trusted(m: dict[str, Any], copy: bool) -> Trajectory:
    """The trajectory of a map the buffer already validated (no checks: the consumer's path)."""
    arrays = {name: _array(m, name, copy) for name in _ARRAYS}
    scalars = {k: m[k] for k in _FIELDS.difference(_ARRAYS, ("schema",))}
    return Trajectory(
        **scalars,
        **arrays,
        temperature=m.get("temperature"),
        routed_experts=_routed(m, copy, validate=False),
    )


def _routed(m: dict[str, Any], copy: bool, validate: bool) -> np.ndarray | None:
    """The flat int32 routed experts, or None when the trajectory carries none."""
    raw = m.get("routed_experts")
    if raw is None:
        return None
    if validate:
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise SchemaError(
                "routed_experts", f"expected raw little-endian bytes, got {type(raw).__name__}"
            )
        if len(raw) % 4:
            raise SchemaError("routed_experts", f"{len(raw)} bytes is not a whole number of int32")
        if _negative_int32(raw):
            raise SchemaError("routed_experts", "negative expert id")
        routed = len(m["prompt_ids"]) // 4 + len(m["response_ids"]) // 4 - 1
        if routed <= 0 or (len(raw) // 4) % routed:
            raise SchemaError(
                "routed_experts",
                f"{len(raw) // 4} ids is not a multiple of the {routed} routed tokens "
                "(prompt + response - 1)",
            )
    arr = np.frombuffer(raw, dtype=_ROUTED)
    if not _LITTLE_ENDIAN_HOST:
        return arr.astype(_ROUTED.newbyteorder("="))
    return arr.copy() if copy else arr


def _negative_int32(raw: bytes) -> bool:
    """Whether little-endian int32 `raw` holds a negative value: a set top bit in some high
    byte (one C pass over a quarter of the bytes, no array reduction)."""
    return not raw[3::4].isascii()


def decode_trajectory(
    blob: bytes | memoryview, copy: bool = True, validate: bool = True
) -> Trajectory:
    """Decode and validate one trajectory; raise `SchemaError` naming the bad field.

    copy=False returns read-only arrays viewing `blob` (the buffer's validation path).
    validate=False skips every check: only for bytes the buffer already validated (the
    consumer's path; the buffer forwards trajectories exactly as it checked them).
    """
    m = unpack_map(blob, "trajectory")
    if not validate:
        return _trusted(m, copy)
    version = m.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            "schema", f"unknown schema version {version!r} (this side speaks {SCHEMA_VERSION})"
        )
    if m.keys() != _FIELDS:
        unknown = set(m) - _FIELDS - _OPTIONAL_FIELDS
        if unknown:
            raise SchemaError(sorted(unknown)[0], "unknown field")
        missing = _FIELDS - set(m)
        if missing:
            raise SchemaError(sorted(missing)[0], "missing field")
    temperature = m.get("temperature")
    if temperature is not None:
        temperature = _finite("temperature", temperature)
        if temperature <= 0:
            raise SchemaError("temperature", f"must be > 0, got {temperature}")
    group_size = m["group_size"]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise SchemaError("group_size", f"expected a positive integer, got {group_size!r}")
    arrays = {name: _array(m, name, copy) for name in _ARRAYS}
    r = len(arrays["response_ids"])
    for name in _RESPONSE_ARRAYS[1:]:
        if len(arrays[name]) != r:
            raise SchemaError(
                name, f"length {len(arrays[name])} disagrees with response_ids length {r}"
            )
    for name in ("prompt_ids", "response_ids"):
        if _negative_int32(m[name]):
            raise SchemaError(name, "negative token id")
    if r:
        # One pass: a float64 sum of finite float32 values cannot overflow; NaN/inf propagate.
        if not math.isfinite(arrays["logprobs"].sum(dtype=np.float64)):
            raise SchemaError("logprobs", "NaN or infinite log-prob")
        if m["loss_mask"].translate(None, b"\x00\x01"):
            raise SchemaError("loss_mask", "values must be 0 or 1")
        if _negative_int32(m["versions"]):
            raise SchemaError("versions", "negative policy version")
    parts = m["reward_parts"]
    if not isinstance(parts, dict):
        raise SchemaError("reward_parts", "expected a map of name -> number")
    metadata = m["metadata"]
    if not isinstance(metadata, dict):
        raise SchemaError("metadata", "expected a map of name -> scalar")
    for k, v in metadata.items():
        if not isinstance(v, str | int | float | bool):
            raise SchemaError(f"metadata.{k}", f"expected a scalar, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise SchemaError(f"metadata.{k}", f"must be finite, got {v}")
    return Trajectory(
        id=_str(m, "id", allow_empty=False),
        group_id=_str(m, "group_id", allow_empty=False),
        group_size=group_size,
        reward=_finite("reward", m["reward"]),
        reward_parts={k: _finite(f"reward_parts.{k}", v) for k, v in parts.items()},
        finish_reason=_str(m, "finish_reason"),
        engine_id=_str(m, "engine_id"),
        created_at=_finite("created_at", m["created_at"]),
        enqueued_at=_finite("enqueued_at", m["enqueued_at"]),
        metadata=metadata,
        temperature=temperature,
        routed_experts=_routed(m, copy, validate=True),
        **arrays,
    )
