"""The keyword task: say the record's `keyword`; one retry with a hint when the first answer
misses it. Named in a config as `keyword_retry` (rollout), `keyword` (reward) and
`keyword_counter` (lifecycle) once the package is installed."""

from __future__ import annotations


async def rollout(ctx, sample):
    """First answer; if it lacks the keyword, a hint as environment tokens and a second answer
    (both answers are trained on, the hint is not)."""
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    first = await ctx.generate(t.ids)
    t.add_model(first)
    if sample.metadata["keyword"] not in ctx.decode(first.token_ids):
        t.add_env(ctx.encode(f"\nHint: the word starts with {sample.metadata['keyword'][0]!r}.\n"))
        t.add_model(await ctx.generate(t.ids))
    if ctx.state is not None:
        ctx.state.rollouts += 1
    return t


def reward(sample, response_text, info):
    """1.0 when the response contains the record's `keyword`, else 0.0."""
    return float(sample.metadata["keyword"] in response_text)


class Counter:
    """Lifecycle: counts the rollouts of one generator and reports them when it ends."""

    def __init__(self) -> None:
        self.rollouts = 0

    def setup(self, ctx) -> None:
        self.rollouts = 0

    def teardown(self) -> None:
        print(f"keyword_env: {self.rollouts} rollouts", flush=True)
