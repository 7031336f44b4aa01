"""Guess the number: a multi-turn environment scored by a remote judge over HTTP.

The model has up to `MAX_TURNS` guesses at a secret number between 1 and 100. After each wrong
guess the environment answers `<user>higher<eos><assistant>` or `lower` (loss mask 0); the game
ends at the right guess or after the last turn. The reward comes from the judge (judge.py), a
separate HTTP service that the generator's lifecycle plug-in `Judge` starts once in `setup` and
stops in `teardown`, together with the one HTTP session every reward call shares.

    generator.rollout   = "examples.guess_number.game:rollout"
    generator.reward    = "examples.guess_number.game:reward"      # async, calls the judge
    generator.lifecycle = "examples.guess_number.game:Judge"
    run.prepare         = "examples.guess_number.game:prepare"     # data + tiny model, cached

    python -m examples.guess_number.game --out examples/guess_number   # regenerate train.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from slime_async.api import RolloutContext, Sample, Transcript
from slime_async.utils.procs import Child, free_port

MAX_TURNS = 6
"""Guesses per game."""
GUESS_TOKENS = 8
"""Most tokens of one guess."""
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
"""The repository's cache directory (git-ignored): `prepare` writes only in it."""
MODEL = CACHE / "guess_number-model"
"""The example's tiny random-init model (char tokenizer), built by `prepare` when missing."""
JUDGE_ARGS_ENV = "GUESS_NUMBER_JUDGE_ARGS"
"""Extra arguments for the judge service, e.g. "--delay-s 0.2 --fail-every 7" (a slow, flaky judge)."""
_NUMBER = re.compile(r"-?\d+")


def make_dataset(path: str | Path, n: int, seed: int) -> Path:
    """`n` games: {"prompt", "secret"}."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            rec = {"prompt": "Guess my number, 1 to 100.", "secret": rng.randint(1, 100)}
            f.write(json.dumps(rec) + "\n")
    return path


def last_number(text: str) -> int | None:
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


async def rollout(ctx: RolloutContext, sample: Sample) -> Transcript:
    """Up to MAX_TURNS guesses; the environment's hints are loss-mask-0 tokens."""
    secret = int(sample.metadata["secret"])  # a field of the JSONL row
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    guesses: list[int | None] = []
    for turn in range(MAX_TURNS):
        out = await ctx.generate(t.ids, {"max_new_tokens": GUESS_TOKENS})
        t.add_model(out)  # loss mask 1: the tokens as sampled, with their versions
        guess = last_number(ctx.decode(out.token_ids))
        guesses.append(guess)
        if guess == secret or turn == MAX_TURNS - 1:
            break
        hint = "a number please" if guess is None else ("higher" if guess < secret else "lower")
        t.add_env(ctx.encode(f"<user>{hint}<eos><assistant>"))  # loss mask 0
    t.metadata["guesses"] = len(guesses)  # travels with the trajectory (scalars only)
    t.metadata["solved"] = guesses[-1] == secret
    return t


async def reward(sample: Sample, response_text: str, info: dict[str, Any]) -> dict[str, float]:
    """Ask the judge about the final guess (`response_text`: the last model turn)."""
    judge: Judge = info["state"]  # what Judge.setup returned: the open session and the URL
    body = {
        "secret": int(sample.metadata["secret"]),
        "guess": response_text,
        "turns": info["turns"],
    }
    async with judge.session.post(f"{judge.url}/score", json=body) as r:
        r.raise_for_status()  # a 503 raises: the generator retries (generator.reward_retries)
        return await r.json()  # {"correct": ..., "closeness": ...}: reward parts


class Judge:
    """The lifecycle plug-in: starts the judge service and one HTTP session, stops both."""

    def __init__(self) -> None:
        self.child: Child | None = None
        self.session: aiohttp.ClientSession | None = None
        self.url = ""

    async def setup(self, ctx: Any) -> Judge:
        port = free_port()
        log_dir = Path(ctx.run_dir) / "logs" if ctx.run_dir else Path.cwd()
        argv = [sys.executable, "-m", "examples.guess_number.judge", "--port", str(port)]
        argv += shlex.split(os.environ.get(JUDGE_ARGS_ENV, ""))
        self.child = Child("judge", argv, log_path=log_dir / "judge.log", cwd=REPO)
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        await _wait_healthy(self, timeout_s=60)
        return self

    async def teardown(self) -> None:
        if self.session is not None:
            await self.session.close()  # no "Unclosed client session" at exit
        if self.child is not None:
            self.child.stop()


async def _wait_healthy(judge: Judge, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with judge.session.get(f"{judge.url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if not judge.child.alive():
            raise RuntimeError(f"the judge exited with {judge.child.poll()}:\n{judge.child.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the judge at {judge.url} did not answer GET /health in {timeout_s}s"
            )
        await asyncio.sleep(0.1)


def prepare(cfg: Any) -> None:
    """`run.prepare` hook: the example's tiny model in its own cache (`MODEL`) when missing."""
    from slime_async.models.toy import make_tiny_model

    if not (MODEL / "config.json").exists():
        print(f"writing the guess-the-number example's tiny model to {MODEL}")
        tmp = MODEL.with_name(MODEL.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(tmp, "qwen3", seed=0)
        shutil.rmtree(MODEL, ignore_errors=True)
        tmp.rename(MODEL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write the example's train.jsonl")
    ap.add_argument("--out", default="examples/guess_number")
    ap.add_argument("-n", type=int, default=200)
    args = ap.parse_args(argv)
    print(make_dataset(Path(args.out) / "train.jsonl", args.n, seed=0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
