"""The rollout API: token-exact transcripts, abort/resume keeping versions, contract errors.

`ctx.generate` is exercised against a scripted object with `EnginePool.generate`'s signature
(the real embedded engine is used in tests/integration/test_generator_e2e.py); the test checks
every request the context sends.
"""

import asyncio
import math

import numpy as np
import pytest

from slime_async.actors.engine.client import EngineRequestError, GenerateOutput
from slime_async.actors.generator.loop import Generator
from slime_async.actors.generator.rollout import (
    ROLLOUTS,
    EngineFailure,
    Generation,
    PluginContractError,
    RolloutContext,
    Sample,
    Transcript,
    check_rollout_result,
    single_turn,
)
from slime_async.config.generator import GeneratorConfig, SamplingConfig
from slime_async.models.toy import char_tokenizer
from slime_async.queue.schema import decode_trajectory, encode_trajectory
from slime_async.utils.plugins import PluginError
from tests.support.scripted import Out


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


class ScriptedEngine:
    """Answers each generate call with the next scripted output and records the request."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.requests = []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.requests.append((list(input_ids), dict(sampling_params), rid))
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def gen(ids, version, reason="stop"):
    return Generation(list(ids), [-0.5] * len(ids), [version] * len(ids), reason)


def test_transcript_is_the_exact_concatenation(tok):
    prompt = [3, 10, 11, 1, 4]
    t = Transcript(prompt, tok)
    t.add_model(gen([6, 10, 7], version=3))
    t.add_env([5, 12, 1, 4])
    t.add_model(gen([87, 12, 1], version=4))
    assert t.ids == [*prompt, 6, 10, 7, 5, 12, 1, 4, 87, 12, 1]
    assert t.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    # env tokens carry the version of the preceding model token and log-prob 0
    assert t.versions == [3, 3, 3, 3, 3, 3, 3, 4, 4, 4]
    assert t.logprobs[3:7] == [0.0] * 4
    assert t.turns == 2 and t.num_model_tokens == 6
    t.finalize("p")
    t.reward = 1.0
    traj = t.to_trajectory("g/0", "g", 1, created_at=5.0)
    back = decode_trajectory(encode_trajectory(traj))
    assert back.response_ids.tolist() == t.response_ids
    assert back.loss_mask.tolist() == t.loss_mask
    assert back.versions.tolist() == t.versions
    assert back.prompt_ids.tolist() == prompt
    np.testing.assert_allclose(back.logprobs, t.logprobs)


def test_env_tokens_before_any_model_token_get_the_first_model_version(tok):
    t = Transcript([3], tok)
    t.add_env([5, 6])
    t.add_model(gen([7], version=9))
    t.finalize("p")
    assert t.versions == [9, 9, 9]


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda t: t.logprobs.pop(), "mismatched lengths"),
        (lambda t: t.loss_mask.__setitem__(slice(None), [0, 0]), "no model tokens"),
        (lambda t: t.loss_mask.__setitem__(0, 2), "0 or 1"),
        (lambda t: t.logprobs.__setitem__(0, math.nan), "log-prob nan"),
        (lambda t: t.logprobs.__setitem__(0, 0.7), "log-prob 0.7"),
    ],
)
def test_finalize_names_the_plugin_and_problem(tok, mutate, problem):
    t = Transcript([3], tok)
    t.add_model(gen([7, 8], version=0))
    mutate(t)
    with pytest.raises(PluginContractError, match=problem) as e:
        t.finalize("my.plugin:rollout")
    assert "my.plugin:rollout" in str(e.value)


def test_add_model_rejects_ragged_generation(tok):
    t = Transcript([3], tok)
    with pytest.raises(PluginContractError, match="3 tokens but 2 log-probs"):
        t.add_model(Generation([1, 2, 3], [-1.0, -1.0], [0, 0, 0], "stop"))


def test_chat_template_and_prompt_ids(tok):
    ctx = RolloutContext(ScriptedEngine([]), tok)
    s = Sample("23+7", {}, "g", 0, 0)
    assert ctx.prompt_ids(s) == ctx.encode("<user>23+7<eos><assistant>")
    msgs = Sample(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], {}, "g", 0, 0
    )
    assert ctx.prompt_ids(msgs) == ctx.encode("<user>hi<eos><assistant>yo<eos><assistant>")
    raw = RolloutContext(ScriptedEngine([]), tok, apply_chat_template=False)
    assert raw.prompt_ids(s) == ctx.encode("23+7")
    with pytest.raises(PluginContractError, match="text or a list of messages"):
        ctx.prompt_ids(Sample(17, {}, "g", 0, 0))


def test_generate_sends_sglang_sampling_params(tok):
    eng = ScriptedEngine([Out([10, 1], [-0.1, -0.2], [2, 2], {"type": "stop"})])
    ctx = RolloutContext(
        eng, tok, SamplingConfig(temperature=0.7, max_new_tokens=9), rid_prefix="g/0/"
    )
    out = asyncio.run(ctx.generate([3, 4], {"top_k": 5}))
    ids, params, rid = eng.requests[0]
    assert ids == [3, 4]
    assert params == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 5,
        "max_new_tokens": 9,
        "stop_token_ids": [],
    }
    assert rid.startswith("g/0/")
    assert (out.token_ids, out.versions, out.finish_reason) == ([10, 1], [2, 2], "stop")
    assert out.engine_id == "e0"


def test_generate_resumes_an_aborted_request_keeping_versions(tok):
    eng = ScriptedEngine(
        [
            Out([10, 11, 12], [-0.1] * 3, [4, 4, 4], {"type": "abort", "message": "weight update"}),
            Out([], [], [], "abort"),  # aborted again before any token
            Out([13, 1], [-0.3, -0.4], [5, 5], "stop"),
        ]
    )
    ctx = RolloutContext(eng, tok, SamplingConfig(max_new_tokens=10))
    out = asyncio.run(ctx.generate([3, 4]))
    assert out.token_ids == [10, 11, 12, 13, 1]
    assert out.versions == [4, 4, 4, 5, 5]
    assert out.logprobs == pytest.approx([-0.1, -0.1, -0.1, -0.3, -0.4])
    assert out.finish_reason == "stop" and out.resumes == 2
    # each resumption continues from prompt + tokens so far, with the remaining budget
    assert [r[0] for r in eng.requests] == [[3, 4], [3, 4, 10, 11, 12], [3, 4, 10, 11, 12]]
    assert [r[1]["max_new_tokens"] for r in eng.requests] == [10, 7, 7]
    assert len({r[2] for r in eng.requests}) == 3  # fresh rid per request
    assert ctx.stats.resumes == 2 and ctx.stats.tokens == 5


def test_abort_with_budget_spent_ends_as_length(tok):
    eng = ScriptedEngine([Out([10, 11], [-0.1] * 2, [0, 0], "abort")])
    ctx = RolloutContext(eng, tok, SamplingConfig(max_new_tokens=2))
    assert asyncio.run(ctx.generate([3])).finish_reason == "length"


def test_endless_aborts_and_engine_errors_become_engine_failures(tok):
    eng = ScriptedEngine([Out([10], [-0.1], [0], "abort")] * 3)
    ctx = RolloutContext(eng, tok, max_resumes=2)
    with pytest.raises(EngineFailure, match="aborted 3 times"):
        asyncio.run(ctx.generate([3]))
    ctx = RolloutContext(ScriptedEngine([ConnectionError("refused")]), tok)
    with pytest.raises(EngineFailure, match="ConnectionError: refused"):
        asyncio.run(ctx.generate([3]))
    ragged = ScriptedEngine([Out([10, 11], [-0.1], [0, 0], "stop")])
    with pytest.raises(EngineFailure, match="2 tokens, 1 log-probs"):
        asyncio.run(RolloutContext(ragged, tok).generate([3]))


def test_single_turn_builds_prompt_and_one_model_turn(tok):
    answer = tok.encode("#2<eos>", add_special_tokens=False)
    eng = ScriptedEngine([Out(answer, [-0.2] * 3, [1, 1, 1], "stop")])
    ctx = RolloutContext(eng, tok)
    t = asyncio.run(single_turn(ctx, Sample("1+1", {}, "g", 0, 0)))
    assert t.prompt_ids == ctx.encode("<user>1+1<eos><assistant>")
    assert t.response_ids == answer and t.loss_mask == [1, 1, 1]
    assert t.last_model_text() == "#2"
    assert ROLLOUTS.resolve("single_turn") is single_turn


def test_rollout_result_checks_name_the_plugin(tok):
    t = Transcript([1], tok)
    assert check_rollout_result("p", t) == [t]
    assert check_rollout_result("p", [t, t]) == [t, t]
    with pytest.raises(PluginContractError, match="rollout 'my:fn' returned an empty list"):
        check_rollout_result("my:fn", [])
    with pytest.raises(PluginContractError, match="rollout 'my:fn' returned dict"):
        check_rollout_result("my:fn", {"ids": [1]})


def not_async(ctx, sample):
    return None


async def one_arg(ctx):
    return None


def test_rollout_signature_checked_at_resolve():
    with pytest.raises(
        PluginError, match=r"rollout 'tests.unit.generator.test_rollout:not_async'.*async def"
    ):
        ROLLOUTS.resolve("tests.unit.generator.test_rollout:not_async")
    with pytest.raises(
        PluginError, match=r"rollout 'tests.unit.generator.test_rollout:one_arg'.*signature"
    ):
        ROLLOUTS.resolve("tests.unit.generator.test_rollout:one_arg")


def test_a_rejected_request_is_not_retried_as_an_engine_failure(tok):
    err = EngineRequestError("http://e", "POST /generate", "HTTP 400: prompt too long", 400)
    ctx = RolloutContext(ScriptedEngine([err]), tok)
    with pytest.raises(EngineRequestError, match="prompt too long"):
        asyncio.run(ctx.generate([3]))


def test_generator_retries_a_rollout_after_engine_failures(tok, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg = GeneratorConfig(dataset=str(data), group_size=1, retry_backoff_s=0.001)
    sample = Sample("1+1", {}, "g", 0, 0)
    down = ConnectionError("refused")
    eng = ScriptedEngine([down, down, Out([10, 1], [-0.1, -0.2], [0, 0], "stop")])
    gen = Generator(cfg, eng, tok)
    with caplog.at_level("WARNING", logger="slime_async.generator"):
        _, [t] = asyncio.run(gen._rollout(sample))
    assert t.response_ids == [10, 1]
    assert [r[2].split("/")[2] for r in eng.requests] == ["a0", "a1", "a2"]  # a fresh rid each
    assert gen.stats()["rollout_retries"] == 2 and gen.stats()["engine_errors"] == 2
    assert [m for m in caplog.messages if "retry" in m] == [
        "rollout g/0: engine request failed: ConnectionError: refused; retry 1 in 0.0s",
        "rollout g/0: engine request failed: ConnectionError: refused; retry 2 in 0.0s",
    ]
    # With rollout_max_attempts, the generator gives up and stops with a fatal error.
    eng = ScriptedEngine([down] * 2)
    gen = Generator(cfg.model_copy(update={"rollout_max_attempts": 2}), eng, tok)
    with pytest.raises(EngineFailure, match="ConnectionError: refused"):
        asyncio.run(gen._rollout(sample))
    assert len(eng.requests) == 2 and gen.stats()["rollout_retries"] == 2
    assert "rollout of g failed 2 times" in str(gen._fatal) and gen._stop.is_set()


class RoutingEngine(ScriptedEngine):
    """A scripted engine that also records the routed_start each request asks for."""

    async def generate(self, input_ids, sampling_params, rid=None, routed_start=0):
        self.starts = [*getattr(self, "starts", []), routed_start]
        return await super().generate(input_ids, sampling_params, rid)


def _rows(n, width, base):
    return (np.arange(n * width, dtype=np.int32).reshape(n, width) % 7 + base).astype(np.int32)


def test_generate_keeps_every_segments_routing_in_order(tok):
    """Routing replay across an aborted-and-resumed request: the first segment's routing stays
    (not replaced by the resumed request's prefill under newer weights); the resumed request
    asks only for the rows it lacks, and an answer covering the whole stream (a router that
    dropped routed_experts_start_len) is cut to them; a third segment that honours the start."""
    width = 4  # 2 MoE layers x top-2
    first = _rows(4, width, 0)  # prompt [3, 4] + 3 tokens: positions [0, 4) fed
    whole = _rows(6, width, 10)  # the resumed request's answer from position 0: [0, 6)
    tail = _rows(2, width, 20)  # the third request honours start 6: [6, 8)
    eng = RoutingEngine(
        [
            Out([10, 11, 12], [-0.1] * 3, [4] * 3, "abort", routed_experts=first.reshape(-1)),
            Out([13, 14], [-0.2] * 2, [5] * 2, "abort", routed_experts=whole.reshape(-1)),
            Out([15, 1], [-0.3] * 2, [6] * 2, "stop", routed_experts=tail.reshape(-1)),
        ]
    )
    ctx = RolloutContext(eng, tok, SamplingConfig(max_new_tokens=10))
    out = asyncio.run(ctx.generate([3, 4]))
    assert out.token_ids == [10, 11, 12, 13, 14, 15, 1] and out.resumes == 2
    assert eng.starts == [0, 4, 6]
    want = np.concatenate([first, whole[4:], tail]).reshape(-1)
    assert out.routed_experts is not None and np.array_equal(out.routed_experts, want)
    assert ctx.stats.routing_missing == 0


@pytest.mark.parametrize("second", [None, np.zeros(7, dtype=np.int32)], ids=["missing", "ragged"])
def test_generate_counts_a_segment_without_fitting_routing(tok, second):
    """A resumed segment whose answer has no routing, or routing of no fitting size: the
    generation carries none (never a partial one) and the loss is counted."""
    eng = RoutingEngine(
        [
            Out([10, 11], [-0.1] * 2, [4] * 2, "abort", routed_experts=_rows(3, 4, 0).reshape(-1)),
            Out([12, 1], [-0.2] * 2, [5] * 2, "stop", routed_experts=second),
        ]
    )
    ctx = RolloutContext(eng, tok, SamplingConfig(max_new_tokens=10))
    out = asyncio.run(ctx.generate([3, 4]))
    assert out.token_ids == [10, 11, 12, 1]
    assert out.routed_experts is None
    assert ctx.stats.routing_missing == 1


def test_a_resumed_turn_keeps_min_new_tokens_counted_from_its_start(tok):
    """After an abort at 3 tokens the engine must ban stop tokens for only 5 - 3 more draws,
    not 5 again (it counts from the resumed request's start)."""
    eng = ScriptedEngine(
        [
            Out([10, 11, 12], [-0.1] * 3, [4, 4, 4], {"type": "abort", "message": "weight update"}),
            Out([13, 14, 15, 1], [-0.3] * 4, [5] * 4, "stop"),
        ]
    )
    ctx = RolloutContext(eng, tok, SamplingConfig(max_new_tokens=10, min_new_tokens=5))
    asyncio.run(ctx.generate([3, 4]))
    assert [r[1]["min_new_tokens"] for r in eng.requests] == [5, 2]


def test_a_per_call_min_new_tokens_other_than_the_config_is_refused(tok):
    ctx = RolloutContext(ScriptedEngine([]), tok, SamplingConfig(max_new_tokens=10))
    with pytest.raises(PluginContractError, match=r"generator\.sampling\.min_new_tokens"):
        asyncio.run(ctx.generate([3, 4], {"min_new_tokens": 4}))


def _answer(ids, version, cached, keyed, reason="stop"):
    return GenerateOutput(
        token_ids=list(ids),
        logprobs=[-0.5] * len(ids),
        versions=[version] * len(ids),
        finish_reason=reason,
        weight_version=version,
        prompt_tokens=0,
        completion_tokens=len(ids),
        engine_url="http://e",
        cached_tokens=cached,
        prefix_version=keyed,
    )


def test_generate_counts_cached_prompt_tokens_and_keys_behind_the_weights(tok, caplog):
    """cached_tokens of every answer are counted, with the tokens generated over them; an answer
    that reused a prefix under the key of an older version than its weights is counted and logged
    (a resumed request is counted per request it sent)."""
    engine = ScriptedEngine(
        [
            _answer([6], 0, cached=0, keyed=0),
            _answer([6, 7], 0, cached=16, keyed=0),
            _answer([6], 0, cached=16, keyed=0, reason="abort"),  # aborted for an update
            _answer([7, 1], 1, cached=16, keyed=0),  # resumed before an answer of v1 came back
            _answer([6], 1, cached=0, keyed=None),  # sent without a key: never "behind"
        ]
    )
    ctx = RolloutContext(engine, tok, SamplingConfig(max_new_tokens=8))
    for _ in range(4):
        asyncio.run(ctx.generate([3, 10]))
    s = ctx.stats
    assert s.cached_prompt_tokens == 48
    assert s.tokens_over_cached_prefix == 2 + 1 + 2
    assert s.prefix_key_behind == 1
    assert (
        "16 cached prompt tokens under the key of version 0, answered by version 1" in caplog.text
    )


def test_keys_behind_are_all_counted_and_logged_at_powers_of_two(tok, caplog):
    engine = ScriptedEngine([_answer([6], 1, cached=16, keyed=0) for _ in range(9)])
    ctx = RolloutContext(engine, tok, SamplingConfig(max_new_tokens=8))
    for _ in range(9):
        asyncio.run(ctx.generate([3, 10]))
    assert ctx.stats.prefix_key_behind == 9
    logged = [r.getMessage() for r in caplog.records if "under the key of version" in r.message]
    assert [m.split("; ")[-1].split(" so far")[0] for m in logged] == ["1", "2", "4", "8"]
