"""The engine pool against two real embedded engines, one of them behind the learner's version
(it restarted from the base model): no answer of the engine behind is used, each one thrown
away is counted, and the engine is used again once it serves the version.
"""

import asyncio

import pytest

from slime_async.actors.engine.client import EngineClient, EngineError
from slime_async.actors.engine.pool import EnginePool
from tests.support.engine_util import start_engines


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("pool-behind")
    model = make_tiny_model(root / "model", "qwen3", seed=0)
    started = start_engines(2, model, root)
    try:
        yield [url for _, url in started]
    finally:
        for child, _ in started:
            child.stop()


async def _set_version(url: str, version: int) -> None:
    client = EngineClient(url)
    try:
        await client.update_weight_version(str(version))
    finally:
        await client.close()


def test_answers_of_an_engine_behind_the_learner_are_thrown_away_and_counted(engines):
    current, behind = engines

    async def run() -> tuple[list[int], dict]:
        await _set_version(current, 3)  # the learner's push reached this engine only
        await _set_version(behind, 0)
        learner = {"version": 3}
        async with EnginePool(engines, probe_interval_s=0.1, seed=0) as pool:
            pool.min_version = lambda: learner["version"]
            params = {"max_new_tokens": 4, "temperature": 1.0}
            outs = [await pool.generate([2, 10, 11], params) for _ in range(8)]
            assert pool.stats()["behind"][behind] >= 1  # it was tried, and thrown away
            # It catches up (the learner's resync push): used again.
            await _set_version(behind, 3)
            for _ in range(100):
                if behind not in pool.down:
                    break
                await asyncio.sleep(0.05)
            more = [await pool.generate([2, 10, 11], params) for _ in range(8)]
            return [v for o in outs + more for v in o.versions], {
                "stats": pool.stats(),
                "urls": [o.engine_url for o in more],
            }

    versions, seen = asyncio.run(run())
    assert set(versions) == {3}  # no token of the engine behind was used
    assert behind in seen["urls"]  # back in use once it serves the version
    assert seen["stats"]["down"] == []


def test_with_every_engine_behind_the_call_fails_naming_the_versions(engines):
    async def run() -> None:
        for url in engines:
            await _set_version(url, 1)
        async with EnginePool(
            engines, max_retries=2, backoff_s=0.01, probe_interval_s=0.05
        ) as pool:
            pool.min_version = lambda: 5
            await pool.generate([2, 10, 11], {"max_new_tokens": 2, "temperature": 1.0})

    with pytest.raises(EngineError, match="version 1, behind the learner's 5"):
        asyncio.run(run())
