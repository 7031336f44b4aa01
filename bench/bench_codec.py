"""The trajectory codec alone: the compiled path (msgspec) against the reference path (msgpack
and the Python checks that name a bad field), per trajectory, in one run.

    .venv/bin/python bench/bench_codec.py [--sizes 4,64] [--repeat 2000]

Rows: encode (the producer), validate (the buffer: every check, a `Summary`, no arrays) and
decode without checks (the consumer: one copy of the arrays). The reference path is what every
trajectory the compiled path does not accept goes through (bad input, unusual maps); the ratio
is reference time / compiled time.
"""

from __future__ import annotations

import argparse
import timeit

import msgpack
import msgspec

from slime_async.queue import schema
from slime_async.testing.trajectories import synthetic_group


def _as_map(t) -> dict:
    """The trajectory map for msgpack: the wire struct's fields, optional ones left out."""
    return {k: v for k, v in msgspec.structs.asdict(schema._wire(t)).items() if v is not None}


def _per_call_us(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=repeat, repeat=3)) / repeat * 1e6


def _rows(t, blob: bytes) -> dict:
    """step -> (compiled, reference) callables on one trajectory and its bytes."""
    return {
        "encode": (
            lambda: schema.encode_trajectory(t),
            lambda: msgpack.packb(_as_map(t), use_bin_type=True),
        ),
        "validate": (
            lambda: schema.validate_trajectory(blob),
            lambda: schema.summarize(
                schema._checked(schema.unpack_map(blob, "trajectory"), copy=False)
            ),
        ),
        "decode": (
            lambda: schema.decode_trajectory(blob, validate=False),
            lambda: schema._trusted(schema.unpack_map(blob, "trajectory"), copy=True),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,64", help="trajectory sizes in KB, comma-separated")
    ap.add_argument("--repeat", type=int, default=2000, help="calls per timing")
    args = ap.parse_args()
    print(f"{'payload':>7} | {'step':<9} | {'compiled us':>11} | {'reference us':>12} | ratio")
    print("-" * 60)
    for kb in (int(k) for k in args.sizes.split(",")):
        t = synthetic_group("g", 1, prompt_len=64, response_len=max(1, (kb * 1024 - 500) // 13))[0]
        blob = schema.encode_trajectory(t)
        rows = _rows(t, blob)
        assert msgpack.packb(_as_map(t), use_bin_type=True) == blob  # the same bytes
        for step, (fast, ref) in rows.items():
            a, b = _per_call_us(fast, args.repeat), _per_call_us(ref, args.repeat)
            print(
                f"{len(blob) / 1024:>5.1f}KB | {step:<9} | {a:>11.2f} | {b:>12.2f} | {b / a:5.1f}x"
            )


if __name__ == "__main__":
    main()
