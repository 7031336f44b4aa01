"""The rollout plugin printed in README.md runs as printed: resolved by import path, token-exact."""

import asyncio
import re
import sys

from slime_async.actors.generator.rewards import resolve_reward
from slime_async.actors.generator.rollout import ROLLOUTS, Generation, RolloutContext, Sample
from slime_async.models.toy import char_tokenizer
from tests.support.repo import REPO

README = REPO / "README.md"


class ScriptedEngine:
    """Two turns: a calculator call, then the answer (the real engine is in test_generator_e2e)."""

    def __init__(self, tok):
        self.turns = [
            tok.encode(s, add_special_tokens=False) for s in ("<call>6*7</call>", "#### 42<eos>")
        ]
        self.requests = []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.requests.append(list(input_ids))
        ids = self.turns.pop(0)
        return Generation(ids, [-0.1] * len(ids), [5] * len(ids), "stop")


def test_readme_plugin_runs_as_printed(tmp_path, monkeypatch):
    text = README.read_text()
    code = re.search(r"```python\n(# my_agent\.py.*?)```", text, re.S).group(1)
    (tmp_path / "my_agent.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_agent", None)
    rollout = ROLLOUTS.resolve("my_agent:rollout")
    reward = resolve_reward("my_agent:reward")

    tok = char_tokenizer()
    engine = ScriptedEngine(tok)
    ctx = RolloutContext(engine, tok)
    t = asyncio.run(rollout(ctx, Sample("6*7", {"answer": "42"}, "g", 0, 0)))
    call = tok.encode("<call>6*7</call>", add_special_tokens=False)
    env = tok.encode("<tool>42<eos><assistant>", add_special_tokens=False)
    answer = tok.encode("#### 42<eos>", add_special_tokens=False)
    assert t.response_ids == [*call, *env, *answer]
    assert t.loss_mask == [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert engine.requests[1] == [*t.prompt_ids, *call, *env]  # the next turn continues exactly
    sample = Sample("6*7", {"answer": "42"}, "g", 0, 0)
    total, _parts = asyncio.run(reward(sample, t.last_model_text(), {}))
    assert total == 1.0


DOCS = REPO / "docs" / "plugins.md"


def test_the_plugin_reference_documents_every_object_and_field():
    """Found 6: the README did not say what a plug-in receives; docs/plugins.md must, in full."""
    import dataclasses

    from slime_async.api import SetupContext, Transcript

    docs = DOCS.read_text()
    assert "(docs/plugins.md)" in README.read_text()  # linked from the README
    for cls in (Sample, Generation, SetupContext):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in docs, f"{cls.__name__}.{f.name} is not documented"
    assert "`id`" in docs  # Sample.id
    tok = char_tokenizer()
    public = lambda obj: {n for n in dir(obj) if not n.startswith("_")}  # noqa: E731
    for name in public(Transcript([1], tok)):
        assert f"`{name}" in docs, f"Transcript.{name} is not documented"
    ctx = RolloutContext(ScriptedEngine(tok), tok)
    internals = {
        "engine",
        "max_resumes",
        "resume_policy",
        "rid_prefix",
        "stats",
        "use_chat_template",
    }
    for name in public(ctx) - internals:
        assert f"`{name}" in docs, f"RolloutContext.{name} is not documented"
    for key in ("full_text", "finish_reason", "turns", "response_length", "state"):
        assert f"`{key}`" in docs  # the reward's info
    for rule in (
        "relative to the config file",
        "imported from the working directory",
        "`correct`",
        "last model turn only",
        "setup(ctx)",
        "teardown()",
    ):
        assert rule in docs, rule
