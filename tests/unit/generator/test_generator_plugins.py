"""The generator around its plug-ins: concurrent rewards, retries, redone groups, the error budget
as a rate, logged errors, lifecycle hooks, per-trajectory temperature, stale acks.

The engine is a scripted object with `EnginePool.generate`'s signature and the sink an in-memory
stand-in for the buffer's producer client (the real ones: tests/integration/test_generator_e2e.py
and the example run in tests/integration/test_example_guess_number.py); what is checked is the
generator's own logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re

import pytest

from slime_async.actors.generator.lifecycle import Lifecycle
from slime_async.actors.generator.loop import Generator, GeneratorError
from slime_async.config.generator import GeneratorConfig, SamplingConfig
from slime_async.metrics import GEN_RESPONSE_LEN_MAX, GEN_RESPONSE_LEN_MEAN
from slime_async.models.toy import char_tokenizer
from slime_async.queue.messages import AckStatus
from slime_async.utils.plugins import PluginError
from tests.support.scripted import Out

MOD = __name__  # plug-ins by import path resolve to this very module (tests/ is a package)


class Engine:
    """Answers every generate call with `#### 7<eos>`-like tokens; records the sampling params."""

    def __init__(self, tok):
        self.ids = [*tok.encode("#### 7", add_special_tokens=False), tok.eos_token_id]
        self.params = []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.params.append(dict(sampling_params))
        n = len(self.ids)
        return Out(list(self.ids), [-0.25] * n, [3] * n, {"type": "stop"})


class Sink:
    def __init__(self, status=AckStatus.OK):
        self.groups = []
        self.status = status

    async def admission(self, want):
        return want

    async def put_group(self, trajs):
        self.groups.append(trajs)
        return self.status


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def config(tmp_path, n_prompts=4, **kw):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+1", "answer": "7", "row": i}) + "\n"
            for i in range(n_prompts)
        )
    )
    base = dict(
        dataset=str(data),
        group_size=2,
        max_inflight=4,
        num_epochs=1,
        log_interval_s=60.0,
        reward_backoff_s=0.001,
        apply_chat_template=False,
        sampling=SamplingConfig(max_new_tokens=16),
    )
    base.update(kw)
    return GeneratorConfig(**base)


def run(cfg, tok, sink=None, engine=None):
    sink = sink or Sink()
    gen = Generator(cfg, engine or Engine(tok), tok)
    stats = asyncio.run(gen.run(sink))
    return gen, stats, sink


# ----- plug-ins used by the tests (named by import path, as a user names theirs) ---------------

CALLS = {"live": 0, "peak": 0, "n": 0}


async def slow_reward(sample, response_text, info):
    CALLS["live"] += 1
    CALLS["peak"] = max(CALLS["peak"], CALLS["live"])
    await asyncio.sleep(0.05)
    CALLS["live"] -= 1
    return 1.0


FLAKY = {"left": 0}


async def flaky_reward(sample, response_text, info):
    if FLAKY["left"] > 0:
        FLAKY["left"] -= 1
        raise ConnectionError("judge unreachable")
    return 1.0


def row_0_fails(sample, response_text, info):
    if sample.index == 0:
        return sample.metadata["secret"]  # KeyError: the README's user met exactly this
    return 1.0


BAD_ROWS: set[int] = set()


def some_rows_fail(sample, response_text, info):
    if sample.index in BAD_ROWS:
        raise ValueError(f"judge refused row {sample.index}")
    return 0.5


async def hangs(sample, response_text, info):
    await asyncio.sleep(30)


async def two_temperatures(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids, {"temperature": 1.0}))
    t.add_env(ctx.encode("<tool>1<eos><assistant>"))
    t.add_model(await ctx.generate(t.ids, {"temperature": 0.5}))
    return t


async def greedy(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids, {"temperature": 0.0}))
    return t


async def multi_turn(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    t.add_env(ctx.encode("<tool>too low<eos><assistant>"))  # 19 env tokens
    t.add_model(await ctx.generate(t.ids))
    return t


EVENTS: list = []


class Judge:
    """A lifecycle plug-in: a client opened once, closed once."""

    async def setup(self, ctx):
        EVENTS.append(("setup", ctx.config.producer_id))
        return {"client": "open"}

    async def teardown(self):
        EVENTS.append(("teardown",))


async def uses_state(ctx, sample):
    EVENTS.append(("rollout", ctx.state["client"]))
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    return t


def reward_with_state(sample, response_text, info):
    EVENTS.append(("reward", info["state"]["client"]))
    return 1.0


@contextlib.asynccontextmanager
async def judge_session(ctx):
    EVENTS.append(("enter",))
    try:
        yield "session"
    finally:
        EVENTS.append(("exit",))


def state_is_session(sample, response_text, info):
    assert info["state"] == "session"
    return 1.0


class BadSetup:
    def setup(self, ctx, extra):
        pass


# ----- Found 3: rewards of a group run concurrently ---------------------------------------------


def test_a_groups_rewards_are_scored_concurrently(tok, tmp_path):
    CALLS.update(live=0, peak=0)
    cfg = config(tmp_path, n_prompts=1, group_size=8, max_inflight=8, reward=f"{MOD}:slow_reward")
    _, stats, sink = run(cfg, tok)
    assert stats["groups_pushed"] == 1 and len(sink.groups[0]) == 8
    assert CALLS["peak"] == 8  # all eight judge calls were in flight together


# ----- Found 2: retries, redone groups, the budget as a rate, the off-by-one --------------------


def test_a_failing_reward_is_retried_with_back_off_and_counted(tok, tmp_path, caplog):
    FLAKY["left"] = 2
    cfg = config(tmp_path, n_prompts=1, reward=f"{MOD}:flaky_reward", reward_retries=2)
    with caplog.at_level(logging.WARNING, logger="slime_async.generator"):
        _, stats, sink = run(cfg, tok)
    assert stats["reward_retries"] == 2 and stats["groups_pushed"] == 1
    assert stats["plugin_errors"] == 0 and stats["groups_dropped"] == 0
    assert [t.reward for t in sink.groups[0]] == [1.0, 1.0]
    retry_logs = [r for r in caplog.records if "retry" in r.getMessage()]
    assert (
        len(retry_logs) == 2 and "ConnectionError: judge unreachable" in retry_logs[0].getMessage()
    )


def test_a_reward_that_times_out_is_retried(tok, tmp_path):
    cfg = config(
        tmp_path,
        n_prompts=1,
        group_size=1,
        reward=f"{MOD}:hangs",
        reward_timeout_s=0.05,
        reward_retries=1,
        group_redos=0,
        max_plugin_errors=5,
        plugin_error_window=5,
    )
    _, stats, sink = run(cfg, tok)
    assert stats["reward_retries"] == 1 and stats["groups_dropped"] == 1 and not sink.groups


def test_a_group_whose_reward_keeps_failing_is_redone_then_dropped(tok, tmp_path, caplog):
    cfg = config(tmp_path, reward=f"{MOD}:row_0_fails", reward_retries=1, group_redos=1)
    with caplog.at_level(logging.WARNING, logger="slime_async.generator"):
        _, stats, sink = run(cfg, tok)
    assert stats["groups_redone"] == 1 and stats["plugin_errors"] == 2
    assert stats["groups_dropped"] == 1 and stats["groups_pushed"] == 3
    assert sorted(g[0].metadata["row"] for g in sink.groups) == [1, 2, 3]
    assert stats["cursor_next"] == 4  # the dropped prompt is done, not retried for ever
    # Found 4: the error names the reward, the sample, the exception type, with a traceback.
    errors = [
        r for r in caplog.records if r.levelno == logging.ERROR and "attempt" in r.getMessage()
    ]
    assert len(errors) == 2
    msg = errors[0].getMessage()
    assert f"reward '{MOD}:row_0_fails'" in msg and "KeyError: 'secret'" in msg
    assert re.search(r"failed on sample gen0/e0/o\d+/[01]: KeyError", msg)
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is KeyError
    assert "Traceback" in caplog.text and "row_0_fails" in caplog.text


def test_the_error_budget_is_a_rate_over_a_recent_window(tok, tmp_path):
    # 12 prompts, rows 0, 5 and 10 always fail: 3 failures in all, never 2 within 4 attempts.
    BAD_ROWS.clear()
    BAD_ROWS.update({0, 5, 10})
    cfg = config(
        tmp_path,
        n_prompts=12,
        group_size=1,
        max_inflight=1,
        reward=f"{MOD}:some_rows_fail",
        reward_retries=0,
        group_redos=0,
        max_plugin_errors=2,
        plugin_error_window=4,
        seed=0,
    )
    gen = Generator(cfg, Engine(tok), tok)
    order = [gen.stream.at(k).row for k in range(12)]  # one group at a time: in this order
    BAD_ROWS.clear()
    BAD_ROWS.update(order[i] for i in (0, 5, 10))  # spaced: at most 1 failure per window of 4
    stats = asyncio.run(gen.run(Sink()))
    assert stats["plugin_errors"] == 3 and stats["groups_pushed"] == 9  # a total of 3 > 2: goes on
    # Two failures close together spend the budget: it stops at exactly max_plugin_errors.
    BAD_ROWS.clear()
    BAD_ROWS.update(order[i] for i in (3, 4))
    gen = Generator(cfg.model_copy(update={"state_path": None}), Engine(tok), tok)
    with pytest.raises(GeneratorError, match=r"2 of the last 4 group attempts failed") as e:
        asyncio.run(gen.run(Sink()))
    assert "max_plugin_errors = 2" in str(e.value)
    assert gen.stats()["plugin_errors"] == 2  # not max_plugin_errors + 1


def test_the_stop_message_counts_what_it_says(tok, tmp_path, caplog):
    BAD_ROWS.clear()
    BAD_ROWS.update(range(10))
    cfg = config(
        tmp_path,
        n_prompts=10,
        group_size=1,
        max_inflight=1,
        reward=f"{MOD}:some_rows_fail",
        reward_retries=0,
        group_redos=0,
        max_plugin_errors=3,
        plugin_error_window=10,
    )
    with (
        caplog.at_level(logging.ERROR, logger="slime_async.generator"),
        pytest.raises(GeneratorError),
    ):
        run(cfg, tok)
    counts = [r.getMessage() for r in caplog.records if "group attempts failed" in r.getMessage()]
    assert len(counts) == 3 and "3 of the last 3 group attempts failed" in counts[-1]
    assert not any("4 of the last" in m for m in counts)  # never "(11/10)"


def test_max_plugin_errors_beyond_the_window_is_refused():
    with pytest.raises(ValueError, match="plugin_error_window"):
        GeneratorConfig(max_plugin_errors=20, plugin_error_window=10)


# ----- Found 5: response_len counts model tokens ------------------------------------------------


def test_response_len_counts_model_tokens_only(tok, tmp_path):
    cfg = config(tmp_path, n_prompts=1, rollout=f"{MOD}:multi_turn", reward="exact_match")
    gen = Generator(cfg, Engine(tok), tok)
    sink = Sink()
    records = []
    gen._log_metrics = lambda: records.append(gen._take_window())
    asyncio.run(gen.run(sink))
    t = sink.groups[0][0]
    model = int(t.loss_mask.sum())
    assert model < len(t.response_ids)  # the env reply is in the response...
    assert records[-1][GEN_RESPONSE_LEN_MEAN] == records[-1][GEN_RESPONSE_LEN_MAX] == model


# ----- contracts: temperature per trajectory, stale acks -----------------------------------------


def test_trajectories_record_the_temperature_of_their_generate_calls(tok, tmp_path):
    cfg = config(tmp_path, n_prompts=1, sampling=SamplingConfig(temperature=0.7, max_new_tokens=8))
    _, _, sink = run(cfg, tok)
    assert {t.temperature for t in sink.groups[0]} == {0.7}
    _, _, sink = run(config(tmp_path, n_prompts=1, rollout=f"{MOD}:greedy"), tok)
    assert {t.temperature for t in sink.groups[0]} == {1.0}  # greedy is scored at 1.0


def test_mixed_temperatures_in_one_transcript_are_refused_naming_the_plugin(tok, tmp_path):
    cfg = config(
        tmp_path,
        n_prompts=1,
        rollout=f"{MOD}:two_temperatures",
        group_redos=0,
        max_plugin_errors=1,
        plugin_error_window=1,
    )
    with pytest.raises(GeneratorError, match="different temperatures") as e:
        run(cfg, tok)
    assert f"{MOD}:two_temperatures" in str(e.value)


def test_a_stale_ack_counts_as_dropped_not_pushed(tok, tmp_path):
    cfg = config(tmp_path, n_prompts=2)
    _, stats, sink = run(cfg, tok, sink=Sink(AckStatus.STALE))
    assert len(sink.groups) == 2
    assert stats["groups_pushed"] == 0 and stats["trajectories_pushed"] == 0
    assert stats["groups_dropped"] == 2 and stats["groups_stale"] == 2
    assert stats["plugin_errors"] == 0


# ----- Found 7: lifecycle -------------------------------------------------------------------------


def test_lifecycle_sets_up_once_hands_state_to_plugins_and_tears_down(tok, tmp_path):
    EVENTS.clear()
    cfg = config(
        tmp_path,
        rollout=f"{MOD}:uses_state",
        reward=f"{MOD}:reward_with_state",
        lifecycle=f"{MOD}:Judge",
    )
    _, stats, _ = run(cfg, tok)
    assert stats["groups_pushed"] == 4
    assert EVENTS[0] == ("setup", "gen0") and EVENTS[-1] == ("teardown",)
    assert EVENTS.count(("setup", "gen0")) == 1 and EVENTS.count(("teardown",)) == 1
    assert EVENTS.count(("rollout", "open")) == 8 and EVENTS.count(("reward", "open")) == 8


def test_lifecycle_teardown_runs_when_the_generator_fails(tok, tmp_path):
    EVENTS.clear()
    cfg = config(
        tmp_path,
        rollout=f"{MOD}:two_temperatures",
        lifecycle=f"{MOD}:Judge",
        group_redos=0,
        max_plugin_errors=1,
        plugin_error_window=1,
    )
    with pytest.raises(GeneratorError):
        run(cfg, tok)
    assert EVENTS == [("setup", "gen0"), ("teardown",)]


def test_lifecycle_as_an_async_context_manager(tok, tmp_path):
    EVENTS.clear()
    cfg = config(tmp_path, reward=f"{MOD}:state_is_session", lifecycle=f"{MOD}:judge_session")
    _, stats, _ = run(cfg, tok)
    assert stats["groups_pushed"] == 4 and EVENTS == [("enter",), ("exit",)]


def test_lifecycle_with_a_wrong_signature_is_refused_at_resolve():
    with pytest.raises(PluginError, match=r"BadSetup'\.setup: signature"):
        Lifecycle(f"{MOD}:BadSetup")
    with pytest.raises(PluginError, match="expected an object or class"):
        Lifecycle(f"{MOD}:EVENTS")
