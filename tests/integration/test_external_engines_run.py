"""A real `slime-async run` with `engine.kind = "external"`: two STRICT embedded engines started
here as processes of their own (the project's engine command), behind the real router
(`engine.router_url`, started here; once per installed package, one not installed skipped), all
with an API key. The run trains and pushes weights to both; then one engine is SIGSTOPped past
the liveness deadline: the router, the generator and the learner's push mark it down, the pushes
go on without it; after SIGCONT it is back, rejoins the weight group, and serves the learner's
weights again. Each step counted in the roles' metrics.

The run's own engines and router under the same disturbance: test_engine_liveness_runs.py.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from slime_async.actors.engine.client import EngineClient
from slime_async.metrics import read_metrics
from tests.support.engine_util import start_engines
from tests.support.router import ROUTER_PACKAGES, Router, router_package_or_skip
from tests.support.run_config import tiny_run_config
from tests.support.runs import (
    assert_nothing_lost_nothing_twice,
    finish,
    start_run,
    steps_done,
    stop_group,
    tiny_inputs,
    wait_for,
)

KEY = "ext-key"
STEPS = 10
GROUPS, GROUP_SIZE = 2, 4
LIVENESS = {"probe_interval_s": 1.0, "ready_timeout_s": 2.0, "hung_after_s": 4.0}
"""Faster than the defaults (2 s, 5 s, 10 s), as in test_engine_liveness_runs.py."""
ROUTER_HEALTH = (1, 2)
"""The router probes /health every 1 s (5 s timeout) and marks a worker down after 2 misses."""

pytestmark = pytest.mark.slow


def _log(run_dir, role: str) -> str:
    path = run_dir / "logs" / f"{role}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def _weight_version(url: str) -> str:
    async def get() -> str:
        async with EngineClient(url, api_key=KEY, max_retries=0) as c:
            return str((await c.get_model_info())["weight_version"])

    return asyncio.run(get())


def _router_health(router: Router) -> dict[str, bool]:
    return {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in router.workers()}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("package", ROUTER_PACKAGES)
def test_external_engines_behind_the_router_train_lose_one_and_take_it_back(package, tmp_path):
    package = router_package_or_skip(package)
    root, model, data = tiny_inputs(tmp_path)
    engines = start_engines(
        2,
        model,
        root,
        "engine.embedded.strict_sglang=true",
        "engine.embedded.max_running_requests=16",
        api_key=KEY,
    )
    urls = [u for _, u in engines]
    try:  # the engines are stopped whatever happens below
        _run_and_check(engines, urls, package, root, model, data)
    finally:
        for child, _ in engines:
            child.stop()


def _run_and_check(engines, urls, package, root, model, data) -> None:
    proc = None
    try:
        with Router(
            urls,
            log_path=root / "router.log",
            api_key=KEY,
            package=package,
            health_check=ROUTER_HEALTH,
        ) as router:
            run_dir = root / "run"
            cfg = tiny_run_config(
                root / "external.toml",
                model=model,
                data=data,
                run_dir=run_dir,
                buffer={"max_staleness": 2},
                learner={"num_steps": STEPS, "groups_per_step": GROUPS},
                generator={"group_size": GROUP_SIZE, "log_interval_s": 1.0},
                engine={
                    "kind": "external",
                    "urls": urls,
                    "router_url": router.url,
                    "api_key": KEY,
                    "port": None,
                },
                # The engines are this test's: their embedded settings are on their command line.
                engine__embedded={
                    k: None
                    for k in ("device", "torch_threads", "max_running_requests", "strict_sglang")
                },
                engine__liveness={**LIVENESS, "restart_after_s": 0},
            )
            proc = start_run(cfg)
            wait_for(lambda: steps_done(run_dir) >= 5, 300, "5 learner steps", proc)
            (child, url) = engines[1]
            child.signal(signal.SIGSTOP)
            try:
                hung = f"engine {url} is hung: no answer to any probe"
                wait_for(lambda: hung in _log(run_dir, "generator0"), 60, "generator: hung", proc)
                wait_for(lambda: hung in _log(run_dir, "learner"), 60, "push: hung", proc)
                wait_for(lambda: not _router_health(router)[url], 60, "router: down", proc)
                left_out = f"without {{'{url}': 'no answer to any probe"
                wait_for(lambda: left_out in _log(run_dir, "learner"), 120, "a push without", proc)
            finally:
                child.signal(signal.SIGCONT)
            rejoins = f"engine {url} is back: it rejoins the weight group"
            wait_for(lambda: rejoins in _log(run_dir, "learner"), 120, "it rejoins", proc)
            wait_for(lambda: _router_health(router)[url], 60, "router: healthy again", proc)
            finish(proc, timeout=300)
    finally:
        if proc is not None:
            stop_group(proc)
        for child, _ in engines:
            child.signal(signal.SIGCONT)
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    last = learner[-1]
    pushes = [r for r in learner if r.get("push/seconds", 0) > 0]
    assert len(learner) == STEPS and len(pushes) >= 5, (len(learner), len(pushes))
    assert last["push/engines_hung"] >= 1 and last["push/engines_back"] >= 1
    assert last["push/engines_left_out"] >= 1 and last["push/resyncs"] >= 1
    assert last["push/engines"] == 2.0
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")
    assert gen[-1]["gen/engines_hung"] >= 1 and gen[-1]["gen/engines_back"] >= 1
    # The engine that was stopped serves the learner's last weights, as the other one does.
    assert [_weight_version(u) for u in urls] == [str(last["version"])] * 2
    assert_nothing_lost_nothing_twice(run_dir, STEPS, GROUPS, GROUP_SIZE)
