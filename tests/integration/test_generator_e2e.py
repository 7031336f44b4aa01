"""The generator against real embedded engines and a real buffer, as child processes on loopback.

The engines serve a tiny model trained for a few seconds to replay one calculator episode, so
that greedy decoding makes a real tool call: the multi-turn test then checks the exact token
sequence. Other tests only need some output, whatever the model writes.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.generator.loop import Generator, GeneratorError
from slime_async.actors.generator.rewards import exact_match
from slime_async.actors.generator.rollout import RolloutContext, Sample
from slime_async.config import BufferConfig, GeneratorConfig, SamplingConfig
from slime_async.launch.router import http_ok, router_ready
from slime_async.models.tokenizer import load_tokenizer
from slime_async.models.toy import char_tokenizer, make_tiny_model, save_tokenizer
from slime_async.queue.client import ConsumerClient, ProducerClient
from slime_async.utils.procs import Child, free_port, python_module, tcp_ready, wait_until
from tests.support.repo import REPO

EPISODE = ("12*3+4", "<call>12*3+4</call>", "<tool>40<eos><assistant>", "#### 40<eos>")


def train_replay_model(out_dir: Path) -> Path:
    """A tiny qwen3 model that, greedily, replays the calculator episode EPISODE."""
    torch.set_num_threads(1)
    make_tiny_model(out_dir, family="qwen3", seed=0)
    tok = char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    text = f"<user>{EPISODE[0]}<eos><assistant>{''.join(EPISODE[1:])}"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break
    model.save_pretrained(out_dir)
    save_tokenizer(tok, out_dir)
    return out_dir


def start_engine(model_dir: Path, log_dir: Path, name: str) -> tuple[Child, str]:
    port = free_port()
    child = Child(
        name,
        python_module(
            "slime_async",
            "engine",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "engine.embedded.device=cpu",
            "engine.embedded.torch_threads=1",
            "engine.embedded.strict_sglang=true",
        ),
        log_path=log_dir / f"{name}.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(url + "/health"), 120, f"{name} /health", child=child)
    return child, url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_replay_model(tmp_path_factory.mktemp("replay_model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    child, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "engine0")
    try:
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def second_engine(model_dir, tmp_path_factory):
    """(child, url) of another engine; the engine-kill test kills it, so it comes last."""
    child, url = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "engine1")
    try:
        yield child, url
    finally:
        child.stop()


def buffer_config(**kw) -> BufferConfig:
    return BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        request_timeout_s=2.0,
        give_up_s=60.0,
        **kw,
    )


@pytest.fixture()
def buffer(tmp_path):
    """A fresh buffer process; yields (config, child); its consumer side is for the test."""
    holder = {}

    def start(**kw) -> BufferConfig:
        cfg = buffer_config(**kw)
        fields = ["producer_endpoint", "consumer_endpoint", "request_timeout_s", "give_up_s", *kw]
        overrides = [f"buffer.{k}={json.dumps(getattr(cfg, k))}" for k in fields]
        child = Child(
            "buffer", python_module("slime_async", "buffer", *overrides), tmp_path / "buffer.log"
        )
        holder["child"] = child
        port = int(cfg.consumer_endpoint.rsplit(":", 1)[1])
        wait_until(lambda: tcp_ready("127.0.0.1", port), 60, "buffer", child=child)
        return cfg

    try:
        yield start
    finally:
        if "child" in holder:
            holder["child"].stop()


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def drain(cfg: BufferConfig, want_groups: int) -> list[list]:
    """Every group the buffer delivers until `want_groups` arrived (and nothing after)."""
    groups = []
    with ConsumerClient(cfg, "test-learner") as c:
        while len(groups) < want_groups:
            b = c.get_batch(num_groups=1, timeout_s=30)
            assert b is not None, f"only {len(groups)} of {want_groups} groups arrived"
            groups += b.groups
            c.commit(b.batch_id)
        assert c.get_batch(num_groups=1, timeout_s=0.2) is None
    return groups


async def run_generator(gen_cfg: GeneratorConfig, buf: BufferConfig, urls: list[str], tok):
    async with EnginePool(urls, max_retries=2, backoff_s=0.05, probe_interval_s=0.2) as pool:
        gen = Generator(gen_cfg, pool, tok)
        async with ProducerClient(buf, gen_cfg.producer_id) as producer:
            return gen, await gen.run(producer)


def gen_config(dataset: Path, **kw) -> GeneratorConfig:
    base = dict(
        dataset=str(dataset),
        group_size=3,
        max_inflight=6,
        num_epochs=1,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=24),
        log_interval_s=60.0,
        retry_backoff_s=0.05,
    )
    base.update(kw)
    return GeneratorConfig(**base)


# ----- groups, masks, versions ------------------------------------------------------------------


def test_groups_arrive_whole_with_masks_and_versions(engine, buffer, tokenizer, tmp_path):
    buf = buffer()
    records = [{"prompt": f"{i}+{i}", "answer": str(2 * i), "level": i} for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = gen_config(data, reward="exact_match")
    _, stats = asyncio.run(run_generator(cfg, buf, [engine], tokenizer))
    assert stats["groups_pushed"] == 5 and stats["trajectories_pushed"] == 15
    assert stats["groups_dropped"] == 0
    version = asyncio.run(_weight_version(engine))
    groups = drain(buf, 5)
    seen_rows = set()
    for g in groups:
        assert len(g) == 3 and len({t.group_id for t in g}) == 1
        gid = g[0].group_id
        assert [t.id for t in g] == [f"{gid}/{n}" for n in range(3)]
        assert all(t.group_size == 3 for t in g)
        rec = records[g[0].metadata["row"]]
        seen_rows.add(g[0].metadata["row"])
        want_prompt = tokenizer.encode(
            f"<user>{rec['prompt']}<eos><assistant>", add_special_tokens=False
        )
        for t in g:
            assert t.prompt_ids.tolist() == want_prompt
            assert 1 <= len(t.response_ids) <= 24
            assert t.loss_mask.tolist() == [1] * len(t.response_ids)
            assert set(t.versions.tolist()) == {version}
            assert all(math.isfinite(x) and x <= 0 for x in t.logprobs.tolist())
            assert t.finish_reason in ("stop", "length")
            assert t.engine_id == engine
            assert t.metadata["answer"] == rec["answer"] and t.metadata["level"] == rec["level"]
            assert t.metadata["epoch"] == 0 and t.created_at <= t.enqueued_at
            text = tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=True)
            sample = Sample(rec["prompt"], rec, gid, 0, 0)
            assert t.reward == exact_match(sample, text, {})
    assert seen_rows == set(range(5))


async def _decode_steps(url: str) -> int:
    async with EngineClient(url) as c:
        return (await c.get_server_info())["decode_steps"]


async def _weight_version(url: str) -> int:
    async with EngineClient(url) as c:
        return await c.get_weight_version()


# ----- multi-turn ---------------------------------------------------------------------------------


def test_calculator_agent_sequence_is_model_and_env_tokens_exactly(
    engine, buffer, tokenizer, tmp_path
):
    buf = buffer()
    data = write_jsonl(tmp_path / "calc.jsonl", [{"prompt": EPISODE[0], "answer": "40"}] * 2)
    cfg = gen_config(
        data,
        rollout="examples.calculator_agent.agent:rollout",
        reward="examples.calculator_agent.agent:reward",
        group_size=2,
        sampling=SamplingConfig(temperature=0.0, max_new_tokens=32),
    )
    _, stats = asyncio.run(run_generator(cfg, buf, [engine], tokenizer))
    assert stats["groups_pushed"] == 2
    call, tool, answer = (tokenizer.encode(s, add_special_tokens=False) for s in EPISODE[1:])
    for g in drain(buf, 2):
        for t in g:
            assert t.response_ids.tolist() == call + tool + answer
            assert t.loss_mask.tolist() == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
            env = t.loss_mask == 0
            assert (t.logprobs[env] == 0).all() and (t.logprobs[~env] < 0).all()
            assert t.reward == 1.0
            assert t.metadata["tool_calls"] == 1 and t.metadata["turns"] == 2


# ----- admission ----------------------------------------------------------------------------------


def test_admission_keeps_inflight_work_inside_the_staleness_budget(
    engine, buffer, tokenizer, tmp_path
):
    # budget = (max_staleness + 1) * groups_per_step = 2 groups buffered or granted at once
    buf = buffer(max_staleness=1, groups_per_step=1)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}", "answer": "0"} for i in range(6)])
    cfg = gen_config(data, group_size=2, max_inflight=16, admission_poll_s=0.01)

    async def scenario():
        async with EnginePool([engine]) as pool:
            gen = Generator(cfg, pool, tokenizer)
            async with ProducerClient(buf, cfg.producer_id) as producer:
                task = asyncio.create_task(gen.run(producer))
                consumer = ConsumerClient(buf, "test-learner")
                got = []
                try:
                    while len(got) < 6:
                        # let the generator fill the budget and then ask again and again
                        await _until(
                            lambda n=len(got): gen.stats()["groups_pushed"] >= min(6, n + 2)
                        )
                        asked = gen.stats()["admission_requests"]
                        await _until(
                            lambda a=asked: (
                                gen.stats()["admission_requests"] >= a + 5 or task.done()
                            )
                        )
                        s = gen.stats()
                        assert s["groups_started"] - len(got) <= 2, s
                        assert consumer.stats()["groups_ready"] <= 2
                        b = await asyncio.to_thread(consumer.get_batch, 1, None, 10)
                        got += b.groups
                        consumer.commit(b.batch_id)
                finally:
                    consumer.close()
                stats = await task
        return got, stats

    got, stats = asyncio.run(scenario())
    assert len(got) == 6 and stats["groups_pushed"] == 6
    assert stats["admission_wait_s"] > 0


async def _until(pred, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def long_rollout(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids, {"ignore_eos": True}))
    return t


# ----- engine failure -----------------------------------------------------------------------------


def test_through_sglang_router_to_two_engines(engine, second_engine, buffer, tokenizer, tmp_path):
    _, url2 = second_engine
    buf = buffer()
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    router = Child(
        "router",
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            engine,
            url2,
            "--policy",
            "round_robin",
        ],
        log_path=tmp_path / "router.log",
    )
    try:
        wait_until(lambda: router_ready(router_url, [engine, url2]), 60, "router", child=router)
        steps0 = [asyncio.run(_decode_steps(u)) for u in (engine, url2)]
        data = write_jsonl(
            tmp_path / "d.jsonl", [{"prompt": f"{i}", "answer": "0"} for i in range(4)]
        )
        _, stats = asyncio.run(run_generator(gen_config(data), buf, [router_url], tokenizer))
        steps1 = [asyncio.run(_decode_steps(u)) for u in (engine, url2)]
    finally:
        router.stop()
    assert stats["groups_pushed"] == 4
    assert steps1[0] > steps0[0] and steps1[1] > steps0[1]  # round robin used both engines
    for g in drain(buf, 4):
        for t in g:
            assert t.engine_id == router_url  # the client sees the router only
            assert t.loss_mask.tolist() == [1] * len(t.response_ids)
            assert len(t.versions) == len(t.response_ids) == len(t.logprobs)


def test_engine_killed_mid_run_does_not_stop_generation(
    engine, second_engine, buffer, tokenizer, tmp_path
):
    buf = buffer()
    second, url2 = second_engine
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"{i}+1", "answer": "0"} for i in range(10)]
    )
    # long responses, so that the kill lands in the middle of requests on the second engine
    cfg = gen_config(
        data,
        rollout="tests.integration.test_generator_e2e:long_rollout",
        group_size=2,
        max_inflight=4,
        sampling=SamplingConfig(max_new_tokens=64),
    )

    async def scenario():
        async with EnginePool(
            [engine, url2], max_retries=3, backoff_s=0.05, probe_interval_s=0.2
        ) as pool:
            gen = Generator(cfg, pool, tokenizer)
            async with ProducerClient(buf, cfg.producer_id) as producer:
                task = asyncio.create_task(gen.run(producer))
                await _until(lambda: pool.in_flight[url2] > 0 and gen.stats()["groups_pushed"] >= 1)
                pushed_at_kill = gen.stats()["groups_pushed"]
                second.kill()
                stats = await task
                return pushed_at_kill, stats, pool.stats()

    pushed_at_kill, stats, pool_stats = asyncio.run(scenario())
    assert pushed_at_kill < 10
    assert stats["groups_pushed"] == 10 and stats["groups_dropped"] == 0
    assert pool_stats["failures"][url2] >= 1 and url2 in pool_stats["down"]
    groups = drain(buf, 10)
    assert len({g[0].group_id for g in groups}) == 10
    # rollouts cut off by the kill were redone in full, on the surviving engine
    assert all(len(t.response_ids) == 64 for g in groups for t in g)
    assert {t.engine_id for g in groups for t in g} <= {engine, url2}


# ----- restart ------------------------------------------------------------------------------------


def test_generator_restart_duplicates_nothing(engine, model_dir, buffer, tmp_path):
    n = 48  # long enough (about 2 s here) to be killed in the middle
    buf = buffer(max_staleness=10)  # admission budget 11 x 8 groups: all of them fit undrained
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"{i}*{i}", "answer": "0"} for i in range(n)]
    )
    state = tmp_path / "gen_state.json"
    args = [
        f"generator.dataset={data}",
        f"generator.state_path={state}",
        f"generator.tokenizer_path={model_dir}",
        f"engine.urls=['{engine}']",
        "generator.group_size=2",
        "generator.max_inflight=2",
        "generator.num_epochs=1",
        "generator.sampling.max_new_tokens=24",
        "run.wandb=disabled",
        f"run.run_dir={tmp_path / 'run'}",
        "generator.log_interval_s=600",
        f"buffer.producer_endpoint={buf.producer_endpoint}",
        f"buffer.consumer_endpoint={buf.consumer_endpoint}",
    ]

    def acked() -> int:
        return json.loads(state.read_text())["next"] if state.exists() else 0

    def start(name: str) -> Child:
        return Child(
            name, python_module("slime_async", "generator", *args), tmp_path / f"{name}.log"
        )

    # 1) killed without warning (SIGKILL), 2) stopped as the supervisor stops it (SIGTERM),
    # 3) run to the end; each resumes from the state file the previous one left.
    first = start("gen-a")
    try:
        wait_until(lambda: acked() >= 3, 120, "3 acknowledged groups", child=first)
        first.kill()
    finally:
        first.stop()
    after_kill = acked()
    assert 3 <= after_kill < n, "the first generator finished before it was killed"
    second = start("gen-b")
    try:
        wait_until(lambda: acked() >= after_kill + 3, 120, "3 more groups", child=second)
        second.signal(signal.SIGTERM)
        wait_until(lambda: not second.alive(), 60, "gen-b to stop on SIGTERM")
        assert second.poll() == 0, second.tail()
    finally:
        second.stop()
    after_term = acked()
    assert after_term < n, "the second generator finished before it was stopped"
    third = start("gen-c")
    try:
        wait_until(lambda: not third.alive(), 120, "the last generator to finish")
        assert third.poll() == 0, third.tail()
    finally:
        third.stop()
    assert acked() == n
    groups = drain(buf, n)
    ids = [g[0].group_id for g in groups]
    assert len(ids) == len(set(ids)) == n
    assert {g[0].metadata["offset"] for g in groups} == set(range(n))
    assert f"resuming at item {after_kill}" in (tmp_path / "gen-b.log").read_text()
    assert f"resuming at item {after_term}" in (tmp_path / "gen-c.log").read_text()
    metrics = (tmp_path / "run/metrics/generator0.jsonl").read_text().splitlines()
    last = json.loads(metrics[-1])
    assert last["gen/groups_pushed"] == n - after_term  # the last process's share
    assert last["gen/tokens_per_s"] > 0 and "generator/idle_pct" in last


# ----- contract failures --------------------------------------------------------------------------


async def ragged_rollout(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    t.logprobs.pop()  # a plugin that edits the transcript by hand and gets it wrong
    return t


async def dict_rollout(ctx, sample):
    out = await ctx.generate(ctx.prompt_ids(sample))
    return {"tokens": out.token_ids}


async def fails_on_row_0(ctx, sample):
    if sample.index == 0 and sample.sample_index == 1:
        raise KeyError("tool 'search' is not configured")
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    return t


def nan_reward(sample, response_text, info):
    return float("nan")


@pytest.mark.parametrize(
    ("rollout", "reward", "problem"),
    [
        (
            "tests.integration.test_generator_e2e:ragged_rollout",
            "exact_match",
            "mismatched lengths",
        ),
        ("tests.integration.test_generator_e2e:dict_rollout", "exact_match", "returned dict"),
        ("single_turn", "tests.integration.test_generator_e2e:nan_reward", "non-finite"),
    ],
)
def test_contract_failure_stops_the_run_and_pushes_nothing(
    engine, buffer, tokenizer, tmp_path, rollout, reward, problem
):
    buf = buffer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}", "answer": "0"} for i in range(4)])
    cfg = gen_config(data, rollout=rollout, reward=reward, max_plugin_errors=1, group_size=2)
    with pytest.raises(GeneratorError, match=problem) as e:
        asyncio.run(run_generator(cfg, buf, [engine], tokenizer))
    assert "1 of the last 1 group attempts failed" in str(e.value)  # stops at the first
    assert rollout.split(":")[-1] in str(e.value) or reward.split(":")[-1] in str(e.value)
    with ConsumerClient(buf, "probe") as c:
        s = c.stats()
        assert s["groups_ready"] == 0 and s["groups_pending"] == 0


def test_a_failing_group_is_dropped_counted_and_the_rest_pushed(
    engine, buffer, tokenizer, tmp_path
):
    buf = buffer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}", "answer": "0"} for i in range(4)])
    cfg = gen_config(
        data, rollout="tests.integration.test_generator_e2e:fails_on_row_0", group_size=2
    )
    _, stats = asyncio.run(run_generator(cfg, buf, [engine], tokenizer))
    # Redone once from its prompt (generator.group_redos = 1), failed again, then dropped.
    assert stats["groups_dropped"] == 1 and stats["plugin_errors"] == 2
    assert stats["groups_redone"] == 1
    assert stats["groups_pushed"] == 3 and stats["cursor_next"] == 4
    assert {g[0].metadata["row"] for g in drain(buf, 3)} == {1, 2, 3}


def test_startup_contract_errors_name_the_plugin(engine, model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1", "answer": "1"}])
    common = [
        f"generator.dataset={data}",
        f"generator.tokenizer_path={model_dir}",
        f"engine.urls=['{engine}']",
    ]
    cases = [
        (
            "generator.rollout=tests.integration.test_generator_e2e:nan_reward",
            "must be an `async def` function",
        ),
        (
            "generator.reward=tests.integration.test_generator_e2e:no_such_fn",
            "has no attribute 'no_such_fn'",
        ),
    ]
    for override, problem in cases:
        r = subprocess.run(
            python_module("slime_async", "generator", *common, override),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert r.returncode == 2, r.stderr
        assert problem in r.stderr and override.split("=")[1] in r.stderr


def test_a_second_generator_under_a_live_producer_id_exits_with_one_line(
    engine, model_dir, buffer, tmp_path
):
    """Two generators under one producer id would lose groups (the second's puts answered
    'duplicate'): the buffer refuses the second session, and the generator process ends with
    exit 1 and one line naming the id, not a traceback."""
    buf = buffer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1", "answer": "1"}])
    overrides = [
        f"generator.dataset={data}",
        f"generator.tokenizer_path={model_dir}",
        f"engine.urls=['{engine}']",
        f"buffer.producer_endpoint='{buf.producer_endpoint}'",
        f"buffer.consumer_endpoint='{buf.consumer_endpoint}'",
        "buffer.give_up_s=20",
    ]

    async def second_generator_while_gen0_is_held():
        async with ProducerClient(buf, "gen0"):
            child = await asyncio.create_subprocess_exec(
                *python_module("slime_async", "generator", *overrides),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=REPO,
            )
            _, err = await asyncio.wait_for(child.communicate(), 120)
            return child.returncode, err.decode()

    code, err = asyncio.run(second_generator_while_gen0_is_held())
    assert code == 1, err
    assert "gen0" in err and "held by another live session" in err, err
    assert "Traceback" not in err, err


# ----- partial rollouts across a weight update ----------------------------------------------------


def test_generation_aborted_by_a_weight_update_resumes_with_per_token_versions(
    engine, model_dir, tokenizer
):
    async def scenario():
        async with EnginePool([engine]) as pool, EngineClient(engine) as admin:
            v0 = await admin.get_weight_version()
            ctx = RolloutContext(
                pool, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=400)
            )
            steps0 = (await admin.get_server_info())["decode_steps"]
            task = asyncio.create_task(
                ctx.generate(ctx.encode("<user>1<eos><assistant>"), {"ignore_eos": True})
            )
            while (await admin.get_server_info())["decode_steps"] < steps0 + 20:
                assert not task.done()
                await asyncio.sleep(0.01)
            await admin.pause_generation("abort")
            await admin.update_weights_from_disk(str(model_dir), weight_version=v0 + 1)
            await admin.continue_generation()
            return v0, await task

    v0, out = asyncio.run(scenario())
    assert len(out.token_ids) == 400 and out.finish_reason == "length"
    assert out.resumes >= 1
    assert out.versions[0] == v0 and out.versions[-1] == v0 + 1
    assert out.versions == sorted(out.versions)  # old tokens keep their version
    assert len(out.logprobs) == 400 and all(x <= 0 for x in out.logprobs)
