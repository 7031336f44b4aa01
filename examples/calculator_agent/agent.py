"""Multi-turn tool use: the model calls a calculator, the environment answers in tokens.

One episode, token by token (`|` separates segments; mask 1 = trained model tokens):

    prompt            <user>37*24+15<eos><assistant>
    model   (mask 1)  <call>37*24+15</call>          generation stops at </call>
    env     (mask 0)  <tool>903<eos><assistant>      the calculator's reply, then the model's turn
    model   (mask 1)  #### 903<eos>

The model's tokens are kept exactly as the engine returned them and the next turn continues
from `transcript.ids`, so what the learner trains on is exactly what was sampled. The reward
checks the final answer (`#### <number>`) of the last model turn.

    generator.rollout = "examples.calculator_agent.agent:rollout"
    generator.reward  = "examples.calculator_agent.agent:reward"
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from examples.calculator_agent.calculator import calculator
from slime_async.api import RolloutContext, Sample, Transcript, numeric_match

MAX_CALLS = 3
MAX_RESPONSE_TOKENS = 192
CALL, END_CALL, TOOL, ASSISTANT, EOS = "<call>", "</call>", "<tool>", "<assistant>", "<eos>"


async def rollout(ctx: RolloutContext, sample: Sample) -> Transcript:
    """Generate; while the model ends a turn with a calculator call, answer it and continue."""
    end_call = ctx.tokenizer.convert_tokens_to_ids(END_CALL)
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    calls = 0
    while True:
        budget = MAX_RESPONSE_TOKENS - len(t.response_ids)
        out = await ctx.generate(
            t.ids,
            {
                "stop_token_ids": [end_call],
                "max_new_tokens": min(budget, ctx.sampling.max_new_tokens),
            },
        )
        t.add_model(out)
        if not out.token_ids or out.token_ids[-1] != end_call or calls == MAX_CALLS:
            break  # answered, ran out of tokens, or called too often
        calls += 1
        reply = calculator(call_expression(ctx.decode(out.token_ids, skip_special_tokens=False)))
        t.add_env(ctx.encode(f"{TOOL}{reply}{EOS}{ASSISTANT}"))
        if len(t.response_ids) >= MAX_RESPONSE_TOKENS:
            t.finish_reason = "length"
            break
    t.metadata["tool_calls"] = calls
    return t


def call_expression(turn_text: str) -> str:
    """The expression between the turn's last `<call>` and its closing `</call>`."""
    body = turn_text.rpartition(CALL)[2]
    return body.partition(END_CALL)[0].strip()


def reward(sample: Sample, response_text: str, info: dict | None = None) -> float:
    """1.0 when the last model turn ends with `#### <the answer>`, else 0.0."""
    if "####" not in response_text:
        return 0.0
    return numeric_match(sample, response_text, info)


# ----- task data --------------------------------------------------------------------------------


def sample_problem(rng: random.Random) -> str:
    a, b, c = rng.randrange(10, 100), rng.randrange(10, 100), rng.randrange(1, 100)
    return rng.choice([f"{a}*{b}+{c}", f"{a}*{b}-{c}", f"({a}+{b})*{c}", f"{a}*{c}+{b}*{c}"])


def make_dataset(path: str | Path, n: int, seed: int) -> Path:
    """Write `n` problems as JSONL records {prompt, answer}."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            expr = sample_problem(rng)
            f.write(json.dumps({"prompt": expr, "answer": calculator(expr)}) + "\n")
    return path


def sft_examples(n: int, seed: int, tokenizer: Any) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, target_ids, target_mask): one tool call, its reply (mask 0), the answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        expr = sample_problem(rng)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": expr}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        segments = [
            (f"{CALL}{expr}{END_CALL}", 1),
            (f"{TOOL}{calculator(expr)}{EOS}{ASSISTANT}", 0),
            (f"#### {calculator(expr)}{EOS}", 1),
        ]
        target, mask = [], []
        for text, m in segments:
            ids = tokenizer.encode(text, add_special_tokens=False)
            target += ids
            mask += [m] * len(ids)
        out.append(([int(t) for t in prompt], target, mask))
    return out


def main(argv: list[str] | None = None) -> int:
    from examples.data_cli import write_splits

    return write_splits(make_dataset, "calculator", "examples/calculator_agent", 1000, 100, argv)


if __name__ == "__main__":
    raise SystemExit(main())
