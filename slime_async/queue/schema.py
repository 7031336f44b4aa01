"""The trajectory wire format of the buffer: one versioned module, validated on decode.

A trajectory travels as one MessagePack map (never pickle). Token arrays are raw little-endian
bytes inside the map (int32 ids and versions, float32 log-probs, uint8 loss mask): packing them
as lists of ints costs 5-7x more (measured with pyzmq 27.3 / msgpack 1.2.4 on loopback; the
"raw + encode/decode" row of `bench/bench_buffer.py` shows the codec's cost today).
`decode_trajectory` checks every field and raises `SchemaError` naming the first field that is
wrong, so a bad message gets a precise reply.

Trajectories follow a message's header (frame 0, see `messages.py`). The buffer validates them
once with `validate_trajectory` (the checks of `decode_trajectory`, building no arrays: a
`Summary` is all it keeps besides the bytes), stores and forwards their bytes as they came (never
re-encoded), and the consumer decodes them without checking again (`validate=False`).
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
_PACKED = ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask")
"""The arrays in the order the consumer copies them into one buffer (4-byte ones first)."""
_PACKED_DTYPES = tuple(_ARRAYS[name] for name in _PACKED)
_FIELDS_T = _FIELDS | {"temperature"}
_FIELDS_ALL = _FIELDS | _OPTIONAL_FIELDS
_SMALL = 4096
"""Responses up to this many bytes per int32 array are checked by byte slicing, longer ones by
numpy reductions (measured: a 64 KB trajectory validates in ~28 us instead of ~50 us)."""
_U32 = np.dtype("<u4")
_SIGN = 1 << 31


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


@dataclass(slots=True)
class Summary:
    """What the buffer keeps of a validated trajectory: no arrays, no Trajectory built."""

    id: str
    group_id: str
    group_size: int
    num_tokens: int
    oldest: int | None
    """The oldest model-token version (None: no model token)."""
    newest: int
    """The newest version of any token (0: no response token)."""
    newest_model: int | None
    """The newest model-token version (None: no model token)."""


def summarize(t: Trajectory) -> Summary:
    """The `Summary` of a decoded trajectory (its model tokens found with one mask)."""
    model = t.versions[t.loss_mask.astype(bool)]
    return Summary(
        t.id,
        t.group_id,
        int(t.group_size),
        t.num_tokens,
        int(model.min()) if model.size else None,
        int(t.versions.max()) if t.versions.size else 0,
        int(model.max()) if model.size else None,
    )


def encode_trajectory(t: Trajectory) -> bytes:
    """One trajectory as a MessagePack map with token arrays as raw little-endian bytes."""
    return msgpack.packb(_as_map(t), use_bin_type=True)


def encode_trajectories(trajs: list[Trajectory]) -> tuple[memoryview, list[int]]:
    """Several trajectories back to back (each exactly `encode_trajectory`'s bytes) in one
    buffer, and the length of each: one payload frame packed in place, with no per-trajectory
    bytes object and no join (each a copy of the payload; measured at 64 KB trajectories)."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    lengths, end = [], 0
    for t in trajs:
        packer.pack(_as_map(t))
        with packer.getbuffer() as packed:  # released at once: the next pack may grow it
            lengths.append(len(packed) - end)
            end = len(packed)
    return packer.getbuffer(), lengths


def _as_map(t: Trajectory) -> dict[str, Any]:
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
    return m


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
    """The trajectory of a map the buffer already validated (no checks: the consumer's path).

    copy=True: the five arrays are copied once, together, into one writable buffer (int32 and
    float32 ones first, so each stays 4-byte aligned) and viewed from there.
    """
    if not _LITTLE_ENDIAN_HOST:
        arrays = {name: _array(m, name, copy) for name in _ARRAYS}
    else:
        raw = [m[name] for name in _PACKED]
        whole = bytearray().join(raw) if copy else None
        arrays, at = {}, 0
        for name, dtype, blob in zip(_PACKED, _PACKED_DTYPES, raw, strict=True):
            n = len(blob)
            arrays[name] = (
                np.frombuffer(whole, dtype, n // dtype.itemsize, at)
                if whole is not None
                else np.frombuffer(blob, dtype)
            )
            at += n
    return Trajectory(
        id=m["id"],
        group_id=m["group_id"],
        group_size=m["group_size"],
        reward=m["reward"],
        reward_parts=m["reward_parts"],
        finish_reason=m["finish_reason"],
        engine_id=m["engine_id"],
        created_at=m["created_at"],
        enqueued_at=m["enqueued_at"],
        metadata=m["metadata"],
        temperature=m.get("temperature"),
        routed_experts=_routed(m, copy, validate=False),
        **arrays,
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

    copy=False returns read-only arrays (over the decoded map's bytes).
    validate=False skips every check: only for bytes the buffer already validated (the
    consumer's path; the buffer forwards trajectories exactly as it checked them).
    """
    m = unpack_map(blob, "trajectory")
    return _checked(m, copy) if validate else _trusted(m, copy)


def validate_trajectory(blob: bytes | memoryview) -> Summary:
    """Check one trajectory as `decode_trajectory` does (every field; `SchemaError` naming the
    bad one) and return its `Summary`, building no arrays on the common path (the buffer's).

    `_quick` accepts only maps that `_checked` accepts too; anything it does not accept
    (a bad field, routed experts, an unusual value) goes through `_checked`, which names the
    field, so both give the same answer and the same error.
    """
    m = unpack_map(blob, "trajectory")
    quick = _quick(m)
    return quick if quick is not None else summarize(_checked(m, copy=False))


def _quick(m: dict[str, Any]) -> Summary | None:
    """The summary of a well-formed trajectory map, in a few C-level passes over its bytes;
    None where `_checked` must decide (never wrongly accepting what `_checked` refuses)."""
    keys = m.keys()
    if keys != _FIELDS and keys != _FIELDS_T and not _FIELDS < keys <= _FIELDS_ALL:
        return None
    if m["schema"] != SCHEMA_VERSION:
        return None
    tid, gid, size = m["id"], m["group_id"], m["group_size"]
    if type(tid) is not str or not tid or type(gid) is not str or not gid:
        return None
    if type(size) is not int or size < 1:
        return None
    if type(m["finish_reason"]) is not str or type(m["engine_id"]) is not str:
        return None
    r, c, e = m["reward"], m["created_at"], m["enqueued_at"]
    # A finite sum means finite terms (NaN and infinities propagate); an overflow goes slow.
    if type(r) is not float or type(c) is not float or type(e) is not float:
        return None
    if not math.isfinite(r + c + e):
        return None
    temperature = m.get("temperature", 1.0)
    if type(temperature) is not float or not math.isfinite(temperature) or temperature <= 0:
        return None
    parts, metadata = m["reward_parts"], m["metadata"]
    if type(parts) is not dict or type(metadata) is not dict:
        return None
    for v in parts.values():
        if type(v) is not float or not math.isfinite(v):
            return None
    for v in metadata.values():
        kind = type(v)
        if kind is float:
            if not math.isfinite(v):
                return None
        elif kind is not str and kind is not int and kind is not bool:
            return None
    p, ids, lp, mask, ver = (m["prompt_ids"], m["response_ids"], m["logprobs"], m["loss_mask"],
                             m["versions"])  # fmt: skip
    if type(p) is not bytes or type(ids) is not bytes or type(lp) is not bytes:
        return None
    if type(mask) is not bytes or type(ver) is not bytes:
        return None
    n = len(ids)
    if len(p) % 4 or n % 4 or len(lp) != n or len(ver) != n or len(mask) * 4 != n:
        return None
    if n <= _SMALL:
        # Sign bits of every int32 (token ids and versions) in one pass; values 0/1 of the
        # mask; a float32 is NaN or infinite only where its top byte is 0x7f or 0xff.
        if not (p[3::4] + ids[3::4] + ver[3::4]).isascii() or mask.translate(None, b"\0\1"):
            return None
        top = lp[3::4]
        if b"\x7f" in top or b"\xff" in top:
            return None
    elif (
        np.frombuffer(ids, _U32).max() >= _SIGN
        or np.frombuffer(ver, _U32).max() >= _SIGN
        or (p and np.frombuffer(p, _U32).max() >= _SIGN)
        or np.frombuffer(mask, np.uint8).max() > 1
        or not math.isfinite(np.frombuffer(lp, _ARRAYS["logprobs"]).sum(dtype=np.float64))
    ):  # the same checks, one vectorised pass each: cheaper than byte slicing past ~1k tokens
        return None
    routed = m.get("routed_experts")
    if routed is not None:  # routing replay: ids of every token but the last (big: numpy)
        tokens = (len(p) + n) // 4 - 1
        if type(routed) is not bytes or len(routed) % 4 or tokens <= 0:
            return None
        if (len(routed) // 4) % tokens or (routed and np.frombuffer(routed, _U32).max() >= _SIGN):
            return None
    if not n:
        return Summary(tid, gid, size, len(p) // 4, None, 0, None)
    first = ver[:4]
    if ver == first * (n // 4):  # one policy version for the whole response (the usual case)
        v = int.from_bytes(first, "little")
        model = v if b"\x01" in mask else None
        return Summary(tid, gid, size, (len(p) + n) // 4, model, v, model)
    versions = np.frombuffer(ver, _ARRAYS["versions"])
    inside = versions[np.frombuffer(mask, np.bool_)]
    lo, hi = (int(inside.min()), int(inside.max())) if inside.size else (None, None)
    return Summary(tid, gid, size, (len(p) + n) // 4, lo, int(versions.max()), hi)


def _checked(m: dict[str, Any], copy: bool) -> Trajectory:
    """Every check of the schema, in order; `SchemaError` names the first bad field."""
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
