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

Two codecs, one wire format. The common path is compiled: msgspec packs a `_Wire` struct and
decodes one, checking every key and type in C and leaving the token arrays as views of the
received bytes (no copy until the consumer's one). The reference path is msgpack into a dict and
`_checked`, which names the first bad field: anything the compiled path does not accept at once
(bad input, or an unusual but valid map, such as a schema of `true`) is decided there, so both
give the same answer and the same error. Both write the same bytes. `bench/bench_codec.py`
times one against the other (docs/performance.md has the figures).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
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
_I4, _F4, _U1 = _ARRAYS["prompt_ids"], _ARRAYS["logprobs"], _ARRAYS["loss_mask"]
_PACKED = ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask")
"""The arrays in the order the consumer copies them into one buffer (4-byte ones first)."""
_PACKED_DTYPES = tuple(_ARRAYS[name] for name in _PACKED)
_SMALL = 4096
"""Responses up to this many bytes per int32 array are checked by byte slicing, longer ones by
numpy reductions (measured: a 64 KB trajectory validates in ~28 us instead of ~50 us)."""


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


class _Wire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The trajectory map as it travels, for the compiled codec: its fields are the map's keys
    (in this order when packed; any order decodes), their types checked in C on decode. The
    arrays decode as views of the received bytes. Optional fields left at None are not sent."""

    schema: int
    id: str
    group_id: str
    group_size: int
    reward: float
    reward_parts: dict[str, float]
    finish_reason: str
    engine_id: str
    created_at: float
    enqueued_at: float
    metadata: dict[str, str | int | float | bool]
    prompt_ids: memoryview
    response_ids: memoryview
    logprobs: memoryview
    loss_mask: memoryview
    versions: memoryview
    temperature: float | None = None
    routed_experts: memoryview | None = None


_WIRE = msgspec.msgpack.Decoder(_Wire)


def _wire(t: Trajectory) -> _Wire:
    def raw(a: np.ndarray, dtype: np.dtype) -> memoryview:
        # A view, not tobytes(): the encoder copies its bytes once into the message.
        return np.ascontiguousarray(a, dtype=dtype).data

    routed = t.routed_experts
    return _Wire(
        SCHEMA_VERSION,
        t.id,
        t.group_id,
        int(t.group_size),
        float(t.reward),
        {k: float(v) for k, v in t.reward_parts.items()},
        t.finish_reason,
        t.engine_id,
        float(t.created_at),
        float(t.enqueued_at),
        dict(t.metadata),
        raw(t.prompt_ids, _I4),
        raw(t.response_ids, _I4),
        raw(t.logprobs, _F4),
        raw(t.loss_mask, _U1),
        raw(t.versions, _I4),
        None if t.temperature is None else float(t.temperature),
        None if routed is None else raw(routed.reshape(-1), _ROUTED),
    )


def encode_trajectory(t: Trajectory) -> bytes:
    """One trajectory as a MessagePack map with token arrays as raw little-endian bytes."""
    return msgspec.msgpack.encode(_wire(t))


def encode_trajectories(trajs: list[Trajectory]) -> tuple[bytearray, list[int]]:
    """Several trajectories back to back (each exactly `encode_trajectory`'s bytes) in one
    buffer, and the length of each: one payload frame packed in place, with no per-trajectory
    bytes object and no join (each a copy of the payload; measured at 64 KB trajectories)."""
    encoder = msgspec.msgpack.Encoder()  # one per call: an encoder is not shared across threads
    out = bytearray()
    lengths = []
    for t in trajs:
        end = len(out)
        encoder.encode_into(_wire(t), out, end)
        lengths.append(len(out) - end)
    return out, lengths


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


def _arrays(raw: list, copy: bool) -> dict[str, np.ndarray]:
    """The five token arrays from their bytes in `_PACKED` order, without checks.

    copy=True: copied once, together, into one writable buffer (int32 and float32 ones first,
    so each stays 4-byte aligned) and viewed from there; copy=False: read-only views.
    """
    if not _LITTLE_ENDIAN_HOST:  # native byte order, so that torch.from_numpy accepts them
        return {
            name: np.frombuffer(blob, dtype).astype(dtype.newbyteorder("="))
            for name, dtype, blob in zip(_PACKED, _PACKED_DTYPES, raw, strict=True)
        }
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
    return arrays


def _trusted(m: dict[str, Any], copy: bool) -> Trajectory:
    """The trajectory of a map the buffer already validated (no checks: the consumer's path,
    when the compiled codec did not take it)."""
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
        **_arrays([m[name] for name in _PACKED], copy),
    )


def _from_wire(w: _Wire, copy: bool) -> Trajectory:
    """The trajectory of a decoded `_Wire` (checked by `_quick`, or trusted)."""
    raw = [w.prompt_ids, w.response_ids, w.logprobs, w.versions, w.loss_mask]
    return Trajectory(
        id=w.id,
        group_id=w.group_id,
        group_size=w.group_size,
        reward=w.reward,
        reward_parts=w.reward_parts,
        finish_reason=w.finish_reason,
        engine_id=w.engine_id,
        created_at=w.created_at,
        enqueued_at=w.enqueued_at,
        metadata=w.metadata,
        temperature=w.temperature,
        routed_experts=None if w.routed_experts is None else _routed_array(w.routed_experts, copy),
        **_arrays(raw, copy),
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
    return _routed_array(raw, copy)


def _routed_array(raw: bytes | memoryview, copy: bool) -> np.ndarray:
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

    copy=False returns read-only arrays (over `blob`'s bytes).
    validate=False skips every check: only for bytes the buffer already validated (the
    consumer's path; the buffer forwards trajectories exactly as it checked them).
    """
    w = _decoded(blob)
    if w is not None and (not validate or _quick(w) is not None):
        return _from_wire(w, copy)
    m = unpack_map(blob, "trajectory")
    return _checked(m, copy) if validate else _trusted(m, copy)


def validate_trajectory(blob: bytes | memoryview) -> Summary:
    """Check one trajectory as `decode_trajectory` does (every field; `SchemaError` naming the
    bad one) and return its `Summary`, building no arrays on the common path (the buffer's).

    The compiled decode and `_quick` accept only maps that `_checked` accepts too; whatever they
    do not accept (a bad field, an unusual value) goes through `_checked`, which names the
    field, so both give the same answer and the same error.
    """
    w = _decoded(blob)
    quick = _quick(w) if w is not None else None
    if quick is not None:
        return quick
    return summarize(_checked(unpack_map(blob, "trajectory"), copy=False))


def _decoded(blob: bytes | memoryview) -> _Wire | None:
    """`blob` through the compiled codec (keys and types checked, arrays as views of `blob`);
    None for anything it refuses: the reference path decides those and names the field."""
    try:
        return _WIRE.decode(blob)
    except (msgspec.MsgspecError, RecursionError):
        return None


def _quick(w: _Wire) -> Summary | None:
    """The summary of a well-formed trajectory, in a few C-level passes over its bytes; None
    where `_checked` must decide (never wrongly accepting what `_checked` refuses). Keys and
    types were checked by the compiled decode; values are checked here."""
    tid, gid, size = w.id, w.group_id, w.group_size
    if w.schema != SCHEMA_VERSION or not tid or not gid or size < 1:
        return None
    # A finite sum means finite terms (NaN and infinities propagate); an overflow goes slow.
    if not math.isfinite(w.reward + w.created_at + w.enqueued_at):
        return None
    temperature = w.temperature
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        return None
    parts = w.reward_parts
    if parts and not math.isfinite(sum(parts.values())):
        return None
    for v in w.metadata.values():
        if type(v) is float and not math.isfinite(v):
            return None
    p, ids, lp, mask, ver = w.prompt_ids, w.response_ids, w.logprobs, w.loss_mask, w.versions
    n = len(ids)
    if len(p) % 4 or n % 4 or len(lp) != n or len(ver) != n or len(mask) * 4 != n:
        return None
    routed = w.routed_experts
    if routed is not None:  # routing replay: ids of every token but the last (big: numpy)
        routed_tokens = (len(p) + n) // 4 - 1
        if len(routed) % 4 or routed_tokens <= 0 or (len(routed) // 4) % routed_tokens:
            return None
        if routed and np.frombuffer(routed, _I4).min() < 0:
            return None
    tokens = (len(p) + n) // 4
    if not n:
        if p and np.frombuffer(p, _I4).min() < 0:
            return None
        return Summary(tid, gid, size, tokens, None, 0, None)
    if n <= _SMALL:
        # Small arrays as bytes (cheap copies of views): sign bits of every int32 (token ids
        # and versions) in one pass; values 0/1 of the mask; a float32 is NaN or infinite only
        # where its top byte is 0x7f or 0xff.
        p, ids, lp, mask, ver = bytes(p), bytes(ids), bytes(lp), bytes(mask), bytes(ver)
        if not (p[3::4] + ids[3::4] + ver[3::4]).isascii() or mask.translate(None, b"\0\1"):
            return None
        top = lp[3::4]
        if b"\x7f" in top or b"\xff" in top:
            return None
        first = ver[:4]
        if ver == first * (n // 4):  # one policy version for the whole response (the usual case)
            v = int.from_bytes(first, "little")
            model = v if b"\x01" in mask else None
            return Summary(tid, gid, size, tokens, model, v, model)
        versions, masked = np.frombuffer(ver, _I4), np.frombuffer(mask, np.uint8)
        hi = int(versions.max())
    else:
        # The same checks as numpy reductions: cheaper than bytes past ~1k tokens. Token ids in
        # one pass (one copy); a float32 sum is finite only when every term is (an overflow goes
        # slow); one version throughout is found from the range, without the mask.
        versions, masked = np.frombuffer(ver, _I4), np.frombuffer(mask, np.uint8)
        lo, hi, has_model = int(versions.min()), int(versions.max()), int(masked.max())
        if (
            lo < 0
            or has_model > 1
            or np.frombuffer(b"".join((p, ids)), _I4).min() < 0
            or not math.isfinite(np.frombuffer(lp, _F4).sum())
        ):
            return None
        if lo == hi or not has_model:
            model = lo if has_model else None
            return Summary(tid, gid, size, tokens, model, hi, None if model is None else hi)
    # Versions change inside the response (a weight push mid-generation): the model tokens'.
    inside = versions[masked.view(np.bool_)]
    if not inside.size:
        return Summary(tid, gid, size, tokens, None, hi, None)
    return Summary(tid, gid, size, tokens, int(inside.min()), hi, int(inside.max()))


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
