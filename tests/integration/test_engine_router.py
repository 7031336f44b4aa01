"""Two embedded engines behind the real router (round_robin), once per installed package (smg,
sglang-router; one not installed is skipped), and the client-side pool."""

import asyncio
import urllib.error

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.engine.pool import EnginePool
from slime_async.actors.engine.weight_push import PushError, WeightPusher
from slime_async.launch.router import router_workers
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import push_config, start_engine, start_engines
from tests.support.router import ROUTER_PACKAGES, Router, router_package_or_skip

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def prompt(i: int) -> list[int]:
    return [2] + [10 + (i * 5 + j) % 50 for j in range(2 + i % 6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shape = dict(family="llama", max_position_embeddings=2048)
    return make_tiny_model(root / "v0", seed=3, **shape), make_tiny_model(
        root / "v1", seed=4, **shape
    )


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def engines(models, logs):
    started = start_engines(2, models[0], logs, "engine.embedded.max_context_len=1200")
    try:
        yield started
    finally:
        for child, _ in started:
            child.stop()


@pytest.fixture(scope="module", params=ROUTER_PACKAGES)
def router(request, engines, logs):
    package = router_package_or_skip(request.param)
    with Router(
        [url for _, url in engines],
        policy="round_robin",
        log_path=logs / f"router-{package}.log",
        package=package,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def keyed_engines(models, logs):
    started = start_engines(2, models[0], logs, "engine.embedded.max_context_len=256", api_key="k1")
    try:
        yield [url for _, url in started]
    finally:
        for child, _ in started:
            child.stop()


@pytest.mark.parametrize("package", ROUTER_PACKAGES)
async def test_with_a_key_the_router_sends_it_to_the_engines_and_requires_it(
    package, keyed_engines, logs
):
    """`engine.api_key` is the router's --api-key: it reaches keyed engines with it (they are
    registered and healthy) and, in both packages, clients must send the same key on /generate
    and /workers, as the generator does (EngineClient with the key)."""
    package = router_package_or_skip(package)
    log = logs / f"keyed-{package}.log"
    with Router(keyed_engines, log_path=log, api_key="k1", package=package) as r:
        assert r.healthy_workers() == 2
        async with EngineClient(r.url, api_key="k1") as via:
            out = await via.generate(prompt(0), GREEDY)
            assert len(out.token_ids) == 12
        for key in (None, "wrong"):
            async with EngineClient(r.url, api_key=key, max_retries=0) as bad:
                with pytest.raises(Exception) as e:
                    await bad.generate(prompt(0), GREEDY)
                assert "401" in str(e.value), (package, key, e.value)
        with pytest.raises(urllib.error.HTTPError) as e:
            router_workers(r.url)  # the readiness probe needs the key too
        assert e.value.code == 401


async def _steps(url: str) -> int:
    async with EngineClient(url) as c:
        return (await c.get_server_info())["decode_steps"]


async def test_generate_through_router_round_robin(engines, router):
    urls = [u for _, u in engines]
    assert {w["url"] for w in router.workers()} == set(urls)
    before = [await _steps(u) for u in urls]
    async with EngineClient(urls[0]) as direct, EngineClient(router.url) as via:
        for i in range(6):
            a = await direct.generate(prompt(i), GREEDY)
            b = await via.generate(prompt(i), GREEDY)
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
            )
            # The router passes meta_info through unchanged, the version spans included.
            # (The engines serve "default" until a test of this module pushes weights.)
            assert b.meta_info["weight_versions"] == a.meta_info["weight_versions"]
            assert len(b.meta_info["weight_versions"]) == 1 and b.versions == a.versions
        outs = await asyncio.gather(*(via.generate(prompt(i), GREEDY) for i in range(16)))
        assert all(len(o.token_ids) == 12 for o in outs)
    after = [await _steps(u) for u in urls]
    assert all(a > b for a, b in zip(after, before, strict=True)), "round_robin used both engines"


async def test_in_flight_versions_survive_the_router(engines, router, models):
    urls = [u for _, u in engines]
    pusher = WeightPusher(urls, push_config(pause_mode="in_place", timeout_s=60))
    await asyncio.to_thread(pusher.connect)
    try:
        sd = AutoModelForCausalLM.from_pretrained(models[1], local_files_only=True).state_dict()
        long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
        async with (
            EngineClient(router.url) as via,
            EngineClient(urls[0]) as e0,
            EngineClient(urls[1]) as e1,
        ):
            old = await e0.get_weight_version()  # 0, or what the other package's run pushed
            new = old + 5
            tasks = [asyncio.create_task(via.generate(prompt(i), long)) for i in range(2)]
            for _ in range(2000):
                infos = [await e0.get_server_info(), await e1.get_server_info()]
                if all(i["running"] >= 1 for i in infos):
                    break
                await asyncio.sleep(0.002)
            await asyncio.gather(e0.pause_generation("in_place"), e1.pause_generation("in_place"))
            await asyncio.to_thread(pusher.push, [list(sd.items())], new)
            outs = await asyncio.gather(*tasks)
    finally:
        await asyncio.to_thread(pusher.close)
    for out in outs:
        switch = out.versions.index(new)
        assert switch > 0 and out.versions == [old] * switch + [new] * (1000 - switch)
        assert out.weight_version == new


async def test_pool_fails_over_and_takes_a_returning_engine_back(models, logs):
    first, second = start_engines(2, models[0], logs, "engine.embedded.max_context_len=256")
    children = [first[0], second[0]]
    urls = [first[1], second[1]]
    try:
        async with EnginePool(urls, max_retries=4, backoff_s=0.05, probe_interval_s=0.1) as pool:
            ref = await pool.generate(prompt(1), GREEDY)
            children[0].kill()
            outs = await asyncio.gather(*(pool.generate(prompt(1), GREEDY) for _ in range(8)))
            assert all(o.token_ids == ref.token_ids and o.engine_url == urls[1] for o in outs)
            assert urls[0] in pool.down and pool.failures[urls[0]] >= 1
            # The engine comes back on the same port: the pool's probe finds it and uses it again.
            port = int(urls[0].rsplit(":", 1)[1])
            children[0] = start_engine(
                models[0], logs, "engine.embedded.max_context_len=256", port=port
            )[0]
            for _ in range(300):
                if urls[0] not in pool.down:
                    break
                await asyncio.sleep(0.05)
            assert urls[0] not in pool.down
            outs = await asyncio.gather(*(pool.generate(prompt(i), GREEDY) for i in range(8)))
            assert {o.engine_url for o in outs} == set(urls)
    finally:
        for child in children:
            child.stop()


def test_a_push_broken_by_a_dead_engine_leaves_the_other_engine_free(models, logs, engines, caplog):
    """The handshake must not wait for one engine: an engine killed in the middle of a
    push left the other one inside the broadcast, on the thread that also serves destroy and
    init; the learner asked it to destroy the group before closing its own end, so that call
    could only time out (30 s) and the rebuilt group waited for it. The learner now closes its
    end first: the survivor leaves the broadcast at once and answers destroy and init."""
    caplog.set_level("WARNING", logger="slime_async.actors.engine.weight_push")
    ((doomed, doomed_url),) = start_engines(
        1, models[0], logs, "engine.embedded.max_context_len=256"
    )
    survivor = engines[0][1]
    sd = list(
        AutoModelForCausalLM.from_pretrained(models[0], local_files_only=True).state_dict().items()
    )
    pusher = WeightPusher([survivor, doomed_url], push_config(timeout_s=60))
    try:
        pusher.connect()

        def buckets():
            yield sd[:5]
            doomed.kill()  # SIGKILL between two buckets: the survivor waits in the broadcast
            yield sd[5:]

        assert pusher.push(buckets(), "broken")["failed"] == 1.0
        assert pusher.resync_needed()
        again = pusher.push([sd], "after")
        assert again["failed"] == 0.0 and again["engines"] == 1.0
        stuck = [
            r.getMessage()
            for r in caplog.records
            if survivor in r.getMessage() and "destroy_weights_update_group" in r.getMessage()
        ]
        assert stuck == [], stuck  # its destroy call was answered, not timed out
        info = asyncio.run(_server_info(survivor))
        assert info["weight_groups"] == [pusher.group_name] and info["weight_version"] == "after"
    finally:
        pusher.close()
        doomed.stop()


async def _server_info(url: str) -> dict:
    async with EngineClient(url) as c:
        return await c.get_server_info()


def test_a_handshake_that_cannot_complete_names_the_engine_and_why(models, logs):
    """The wait for the weight group once failed after 300 s naming every engine. Now the
    failure names the engine whose init call had not returned and what it says of itself. Here
    the learner counts one rank too many for it (2 ranks for a 1-rank engine), so the
    rendezvous can never complete (the engine waits in it longer than the learner: 30 s, 4 s)."""
    ((child, url),) = start_engines(
        1, models[0], logs, "engine.embedded.max_context_len=256", "push.group_timeout_s=30"
    )
    pusher = None
    try:
        pusher = WeightPusher([url], push_config(timeout_s=4))
        pusher.ranks[url] = 2  # what the pusher would read from a tp_size=2 engine's /server_info
        with pytest.raises(PushError) as e:
            pusher.connect()
        msg = str(e.value)
        assert e.value.url == url and e.value.step == "init_weights_update_group"
        assert f"did not join: {url}: its init call is queued or blocked" in msg, msg
    finally:
        child.kill()  # its scheduler still waits in the rendezvous: no clean stop to wait for
        if pusher is not None:
            pusher.close()
        child.stop()
