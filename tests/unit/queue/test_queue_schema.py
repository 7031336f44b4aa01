"""The wire schema: round trip, and every bad-input case rejected with the field named."""

import math

import msgpack
import numpy as np
import pytest

from slime_async.queue import schema
from slime_async.queue.messages import pack_header, unpack_header
from slime_async.queue.schema import (
    SCHEMA_VERSION,
    SchemaError,
    Trajectory,
    decode_trajectory,
    encode_trajectories,
    encode_trajectory,
    summarize,
    validate_trajectory,
)
from slime_async.testing.trajectories import synthetic_group


def _traj(response_len: int = 9) -> Trajectory:
    t = synthetic_group("g", group_size=2, prompt_len=5, response_len=response_len, version=3)[1]
    t.versions[6:] = 4  # a weight update arrived mid-response
    return t


def _map(t: Trajectory) -> dict:
    return msgpack.unpackb(encode_trajectory(t), raw=False)


def test_round_trip_keeps_every_field():
    t = _traj()
    back = decode_trajectory(encode_trajectory(t))
    for name in (
        "id",
        "group_id",
        "group_size",
        "reward",
        "reward_parts",
        "finish_reason",
        "engine_id",
        "created_at",
        "enqueued_at",
        "metadata",
    ):
        assert getattr(back, name) == getattr(t, name), name
    for name, dtype in (
        ("prompt_ids", np.int32),
        ("response_ids", np.int32),
        ("logprobs", np.float32),
        ("loss_mask", np.uint8),
        ("versions", np.int32),
    ):
        arr = getattr(back, name)
        assert arr.dtype == dtype and arr.flags.writeable, name
        np.testing.assert_array_equal(arr, getattr(t, name))
    assert back.oldest_version() == 3


def test_temperature_travels_when_set_and_is_optional():
    t = _traj()
    assert (
        "temperature" not in _map(t) and decode_trajectory(encode_trajectory(t)).temperature is None
    )
    t.temperature = 0.7
    assert _map(t)["temperature"] == 0.7
    assert decode_trajectory(encode_trajectory(t)).temperature == 0.7


def test_token_arrays_travel_as_little_endian_bytes():
    m = _map(_traj())
    assert m["schema"] == SCHEMA_VERSION
    assert m["response_ids"] == np.asarray(_traj().response_ids, dtype="<i4").tobytes()
    assert isinstance(m["logprobs"], bytes) and len(m["logprobs"]) == 4 * 9


def test_oldest_version_ignores_environment_tokens():
    t = _traj()
    t.versions[:] = 7
    t.versions[t.loss_mask == 0] = 1  # env tokens may carry anything; they do not count
    assert t.oldest_version() == 7
    t.loss_mask[:] = 0
    assert t.oldest_version() is None


def _bad(mutate, response_len: int = 9) -> SchemaError:
    """The error of the mutated trajectory, the same from the consumer's full decode and from
    the buffer's `validate_trajectory` (its quick path must never accept a bad map)."""
    m = _map(_traj(response_len))
    mutate(m)
    blob = msgpack.packb(m, use_bin_type=True)
    with pytest.raises(SchemaError) as e:
        decode_trajectory(blob)
    with pytest.raises(SchemaError) as quick:
        validate_trajectory(blob)
    assert (quick.value.field, str(quick.value)) == (e.value.field, str(e.value))
    return e.value


_BAD = [
    (lambda m: m.update(schema=99), "schema", "unknown schema version 99"),
    (lambda m: m.pop("schema"), "schema", "unknown schema version None"),
    (lambda m: m.update(logprobs=m["logprobs"][:-4]), "logprobs", "disagrees"),
    (lambda m: m.update(versions=m["versions"] + b"\0\0\0\0"), "versions", "disagrees"),
    (lambda m: m.update(loss_mask=m["loss_mask"][:3]), "loss_mask", "disagrees"),
    (lambda m: m.update(response_ids=m["response_ids"][:-1]), "response_ids", "whole number"),
    (lambda m: m.update(reward=math.nan), "reward", "finite"),
    (lambda m: m.update(reward=math.inf), "reward", "finite"),
    (lambda m: m.update(reward="1.0"), "reward", "number"),
    (lambda m: m.update(reward_parts={"x": -math.inf}), "reward_parts.x", "finite"),
    (
        lambda m: m.update(logprobs=np.array([math.nan] * 9, "<f4").tobytes()),
        "logprobs",
        "NaN or infinite",
    ),
    (
        lambda m: m.update(logprobs=np.array([-math.inf] * 9, "<f4").tobytes()),
        "logprobs",
        "NaN or infinite",
    ),
    (
        lambda m: m.update(response_ids=np.array([1] * 8 + [-5], "<i4").tobytes()),
        "response_ids",
        "negative token id",
    ),
    (
        lambda m: m.update(prompt_ids=np.array([-1], "<i4").tobytes()),
        "prompt_ids",
        "negative token id",
    ),
    (
        lambda m: m.update(versions=np.array([-1] * 9, "<i4").tobytes()),
        "versions",
        "negative",
    ),
    (lambda m: m.update(loss_mask=bytes([2] * 9)), "loss_mask", "0 or 1"),
    (lambda m: m.update(prompt_ids=[1, 2, 3]), "prompt_ids", "raw little-endian bytes"),
    (lambda m: m.update(group_size=0), "group_size", "positive"),
    (lambda m: m.update(id=""), "id", "empty"),
    (lambda m: m.update(id=5), "id", "string"),
    (lambda m: m.update(color="red"), "color", "unknown field"),
    (lambda m: m.pop("reward"), "reward", "missing field"),
    (lambda m: m.update(metadata={"x": [1, 2]}), "metadata.x", "scalar"),
    (lambda m: m.update(metadata={"x": math.nan}), "metadata.x", "finite"),
    (lambda m: m.update(temperature=0.0), "temperature", "> 0"),
    (lambda m: m.update(temperature=math.inf), "temperature", "finite"),
    (lambda m: m.update(temperature="hot"), "temperature", "number"),
]


@pytest.mark.parametrize(("mutate", "field", "words"), _BAD)
def test_bad_trajectory_names_the_field(mutate, field, words):
    e = _bad(mutate)
    assert e.field == field
    assert words in str(e)


def _poke(name: str, at: int, value: bytes):
    def mutate(m: dict) -> None:
        raw = bytearray(m[name])
        raw[at : at + len(value)] = value
        m[name] = bytes(raw)

    return mutate


_NAN, _NEG_INF = (np.array([x], "<f4").tobytes() for x in (math.nan, -math.inf))
_BAD_LONG = [  # responses of 2,000 tokens: the buffer checks these by numpy reductions
    (lambda m: m.update(logprobs=m["logprobs"][:-4]), "logprobs", "disagrees"),
    (lambda m: m.update(versions=m["versions"] + b"\0\0\0\0"), "versions", "disagrees"),
    (lambda m: m.update(response_ids=m["response_ids"][:-1]), "response_ids", "whole number"),
    (_poke("logprobs", 4 * 1999, _NAN), "logprobs", "NaN or infinite"),
    (_poke("logprobs", 4 * 1000, _NEG_INF), "logprobs", "NaN or infinite"),
    (_poke("response_ids", 4 * 1999, np.array([-5], "<i4").tobytes()), "response_ids", "negative"),
    (_poke("prompt_ids", 0, np.array([-1], "<i4").tobytes()), "prompt_ids", "negative"),
    (_poke("versions", 4 * 700, np.array([-1], "<i4").tobytes()), "versions", "negative"),
    (_poke("loss_mask", 1500, b"\x02"), "loss_mask", "0 or 1"),
]


@pytest.mark.parametrize(("mutate", "field", "words"), _BAD_LONG)
def test_bad_long_trajectory_names_the_field(mutate, field, words):
    e = _bad(mutate, response_len=2000)
    assert e.field == field and words in str(e)


def _fast(t):
    """The summary of the compiled path alone (None: it would hand `t` to the reference path)."""
    return schema._quick(schema._decoded(encode_trajectory(t)))


def test_validate_summarises_without_building_arrays():
    for response_len in (9, 2000):
        t = _traj(response_len)
        blob = encode_trajectory(t)
        s = validate_trajectory(blob)
        assert s == summarize(decode_trajectory(blob))
        assert _fast(t) == s  # the compiled path took it (no fallback to the reference checks)
        assert (s.oldest, s.newest, s.newest_model, s.num_tokens) == (3, 4, 4, 5 + response_len)
        mixed_no_model = _traj(response_len)
        mixed_no_model.loss_mask[:] = 0  # versions change, but no model token to date them
        assert _fast(mixed_no_model) == summarize(mixed_no_model)
        assert summarize(mixed_no_model).oldest is None
        t.versions[:] = 7  # one version throughout (the common case, found without numpy)
        assert validate_trajectory(encode_trajectory(t)) == summarize(t)
        t.loss_mask[:] = 0  # no model token
        assert validate_trajectory(encode_trajectory(t)) == summarize(t)
        assert summarize(t).oldest is None and summarize(t).newest == 7
        t.temperature, t.metadata = 0.5, {"a": 1, "b": True, "c": "x", "d": 0.5}
        assert validate_trajectory(encode_trajectory(t)) == summarize(t)
        t.routed_experts = np.arange((t.num_tokens - 1) * 6, dtype=np.int32) % 64  # 3 layers x 2
        assert _fast(t) == summarize(t)
        t.routed_experts[-1] = -1
        with pytest.raises(SchemaError, match="negative expert id"):
            validate_trajectory(encode_trajectory(t))
        t.routed_experts = t.routed_experts[:-1]
        with pytest.raises(SchemaError, match="not a multiple"):
            validate_trajectory(encode_trajectory(t))
    empty = _traj(0)
    assert validate_trajectory(encode_trajectory(empty)) == summarize(empty)


def test_quick_and_full_checks_agree_on_random_corruption():
    """Random single-field corruptions: the buffer's validation and the full decode accept the
    same maps, and name the same field for the ones they refuse."""
    rng = np.random.default_rng(0)
    values = [
        None,
        0,
        -1,
        1.5,
        math.nan,
        math.inf,
        "",
        "x",
        True,
        b"",
        b"\x00" * 4,
        b"\xff" * 8,
        [1],
        {"k": 1.0},
        {"k": math.nan},
        {"k": [1]},
        2**40,
    ]
    for i in range(400):
        t = _traj(int(rng.choice([0, 9, 1500])))
        m = _map(t)
        key = str(rng.choice([*sorted(m), "temperature", "routed_experts"]))
        if rng.random() < 0.5 and isinstance(m.get(key), bytes) and m[key]:
            raw = bytearray(m[key])
            raw[int(rng.integers(len(raw)))] = int(rng.integers(256))  # one byte flipped
            m[key] = bytes(raw)
        else:
            m[key] = values[int(rng.integers(len(values)))]
        blob = msgpack.packb(m, use_bin_type=True)
        try:  # the reference path: msgpack and `_checked`
            full = summarize(schema._checked(schema.unpack_map(blob, "trajectory"), copy=True))
        except SchemaError as e:
            with pytest.raises(SchemaError) as quick:
                validate_trajectory(blob)
            assert quick.value.field == e.field, (i, key)
            with pytest.raises(SchemaError) as decoded:
                decode_trajectory(blob)
            assert decoded.value.field == e.field, (i, key)
        else:
            assert validate_trajectory(blob) == full, (i, key)
            assert summarize(decode_trajectory(blob)) == full, (i, key)


@pytest.mark.parametrize("blob", [b"\xc1garbage", b"\x92\x01", msgpack.packb([1, 2])])
def test_malformed_messagepack_or_not_a_map(blob):
    with pytest.raises(SchemaError) as e:
        decode_trajectory(blob)
    assert e.value.field == "trajectory"


def test_header_round_trip_and_rejections():
    h = unpack_header(pack_header("put", seq=3))
    assert h == {"v": SCHEMA_VERSION, "op": "put", "seq": 3}
    with pytest.raises(SchemaError, match="malformed MessagePack"):
        unpack_header(b"\xc1")
    with pytest.raises(SchemaError, match="unknown schema version 7"):
        unpack_header(msgpack.packb({"v": 7, "op": "put"}))
    with pytest.raises(SchemaError, match="missing message type"):
        unpack_header(msgpack.packb({"v": SCHEMA_VERSION}))


def test_decode_without_copy_views_the_blob():
    blob = encode_trajectory(_traj())
    t = decode_trajectory(blob, copy=False)
    assert not t.response_ids.flags.writeable


def test_trajectories_packed_in_one_buffer_are_each_encode_trajectory():
    group = synthetic_group("g", group_size=3, prompt_len=5, response_len=6000)
    group[1].temperature, group[2].routed_experts = 0.7, np.arange(6010, dtype=np.int32)
    payload, lengths = encode_trajectories(group)
    blobs = [encode_trajectory(t) for t in group]
    assert lengths == [len(b) for b in blobs] and bytes(payload) == b"".join(blobs)


def test_compiled_codec_packs_the_reference_bytes():
    """The compiled encoder writes exactly what msgpack writes for the same map (one wire
    format, SCHEMA_VERSION 1), with and without the optional fields."""
    t = _traj()
    for temperature, routed in ((None, None), (0.7, np.arange((t.num_tokens - 1) * 2) % 8)):
        t.temperature, t.routed_experts = temperature, routed
        assert msgpack.packb(_map(t), use_bin_type=True) == encode_trajectory(t)
        empty = _traj(0)
        payload, lengths = encode_trajectories([t, empty])
        assert bytes(payload) == encode_trajectory(t) + encode_trajectory(empty)
        assert lengths == [len(encode_trajectory(t)), len(encode_trajectory(empty))]


@pytest.mark.parametrize(
    "change",
    [
        {"schema": True},  # True == 1 to the reference checks; the compiled decode wants an int
        {"metadata": {b"raw key": 1}},  # bytes keys: MessagePack allows them, so does _checked
        {"group_size": 2.0},  # a float: the reference path refuses it by name
    ],
)
def test_maps_the_compiled_path_refuses_are_decided_by_the_reference_path(change):
    """Whatever the compiled decode does not take goes through msgpack and `_checked`: the same
    answer as before, for the buffer, the consumer (no checks) and a checked decode."""
    t = _traj()
    m = {**_map(t), **change}
    blob = msgpack.packb(m, use_bin_type=True)
    assert schema._decoded(blob) is None
    try:
        want = summarize(schema._checked(schema.unpack_map(blob, "trajectory"), copy=True))
    except SchemaError as e:
        with pytest.raises(SchemaError) as got:
            validate_trajectory(blob)
        assert got.value.field == e.field == "group_size"
        return
    assert validate_trajectory(blob) == want == summarize(decode_trajectory(blob))
    back = decode_trajectory(blob, validate=False)  # the consumer's path
    np.testing.assert_array_equal(back.response_ids, t.response_ids)
    assert back.metadata == m["metadata"]
