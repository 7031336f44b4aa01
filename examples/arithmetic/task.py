"""Multi-operand addition with worked running sums: the quickstart's task.

    prompt:    23+7+58
    solution:  23+7=30
               30+58=88
               #### 88<eos>

The number of operands follows a skewed distribution (mostly 2, a long tail up to 8) and the
operands have 1-3 digits, so response lengths range from about 10 to about 100 characters with a
long tail: the asynchronous pipeline's advantage over a synchronous one shows on such tails.
A char-level model must carry digits through each running sum; a tiny model after a short SFT
warm-up gets the short problems right and most long ones wrong, which leaves RL room to improve.

    python -m examples.arithmetic.task --out examples/arithmetic   # writes train/eval JSONL

Also used by the quickstart: `make_dataset`, `sft_examples`, `parse_answer` and `reward`
(`generator.reward = "examples.arithmetic.task:reward"`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# P(number of operands): mostly 2, a long tail to 8.
OPERAND_WEIGHTS = {2: 0.45, 3: 0.22, 4: 0.13, 5: 0.08, 6: 0.06, 7: 0.04, 8: 0.02}
# P(digits of an operand).
DIGIT_WEIGHTS = {1: 0.35, 2: 0.5, 3: 0.15}
ANSWER_MARK = "####"


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(str(x) for x in self.operands)

    @property
    def answer(self) -> int:
        return sum(self.operands)

    def solution(self, slip_prob: float = 0.0, rng: random.Random | None = None) -> str:
        """The worked solution the SFT warm-up teaches: one running sum per line, then the answer.

        With `slip_prob` > 0 each running sum is off by a small amount with that probability and
        the work carries on from the wrong total (a noisy demonstration, like human data).
        """
        lines, total = [], self.operands[0]
        for x in self.operands[1:]:
            s = total + x
            if slip_prob and rng is not None and rng.random() < slip_prob:
                s = max(0, s + rng.choice((-10, -2, -1, 1, 2, 10)))
            lines.append(f"{total}+{x}={s}")
            total = s
        lines.append(f"{ANSWER_MARK} {total}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Difficulty:
    """The task's knobs: P(number of operands) and P(digits of an operand)."""

    operands: dict[int, float] = field(default_factory=lambda: dict(OPERAND_WEIGHTS))
    digits: dict[int, float] = field(default_factory=lambda: dict(DIGIT_WEIGHTS))


def sample_problem(rng: random.Random, difficulty: Difficulty | None = None) -> Problem:
    d = difficulty or Difficulty()
    k = rng.choices(list(d.operands), weights=list(d.operands.values()))[0]
    operands = []
    for _ in range(k):
        n = rng.choices(list(d.digits), weights=list(d.digits.values()))[0]
        operands.append(rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n))
    return Problem(tuple(operands))


def problems(n: int, seed: int, difficulty: Difficulty | None = None) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng, difficulty) for _ in range(n)]


def make_dataset(path: str | Path, n: int, seed: int, difficulty: Difficulty | None = None) -> Path:
    """Write `n` problems as JSONL records {prompt, answer, operands}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in problems(n, seed, difficulty):
            rec = {"prompt": p.prompt, "answer": str(p.answer), "operands": len(p.operands)}
            f.write(json.dumps(rec) + "\n")
    return path


def sft_examples(
    n: int,
    seed: int,
    tokenizer: Any,
    difficulty: Difficulty | None = None,
    slip_prob: float = 0.0,
) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, target_ids) pairs for the SFT warm-up; the target ends with EOS.

    Prompt ids come from the tokenizer's chat template, exactly as the generator builds them.
    Use a seed different from the RL dataset's so the warm-up does not see the RL prompts.
    `slip_prob`: fraction of running sums written wrong (see `Problem.solution`).
    """
    out = []
    slips = random.Random(seed + 1)
    for p in problems(n, seed, difficulty):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(prompt, "keys"):  # transformers 5 returns a BatchEncoding
            prompt = prompt["input_ids"]
        target = tokenizer.encode(p.solution(slip_prob, slips), add_special_tokens=False)
        out.append(([int(t) for t in prompt], [*target, tokenizer.eos_token_id]))
    return out


def parse_answer(text: str) -> int | None:
    """The integer after the last `####`, or None when there is none or it is not an integer."""
    _, mark, tail = text.rpartition(ANSWER_MARK)
    if not mark:
        return None
    tail = tail.strip()
    try:
        return int(tail)
    except ValueError:
        return None


def reward(sample: Any, response_text: str, info: dict | None = None) -> float:
    """1.0 when the parsed answer equals the record's answer, else 0.0."""
    got = parse_answer(response_text)
    return float(got is not None and got == int(sample.metadata["answer"]))


def main(argv: list[str] | None = None) -> int:
    from examples.data_cli import write_splits

    return write_splits(make_dataset, "arithmetic", "examples/arithmetic", 2000, 200, argv)


if __name__ == "__main__":
    raise SystemExit(main())
