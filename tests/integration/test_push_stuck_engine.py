"""An engine stuck in its weight-update call (an NCCL member that never comes free when the
learner closes its end; here a stand-in on the real gloo group, `tests/support/stuck_engine.py`,
beside a real embedded engine): the push times out that call after push.timeout_s, leaves the
engine out, asks the supervisor to restart it, and the restarted engine rejoins the weights. The
supervisor is the real one, running the two engines as its roles; this test is the learner.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.config.engine import LivenessConfig
from slime_async.launch import preload
from slime_async.launch.router import http_ok
from slime_async.launch.run_dir import RunDir
from slime_async.launch.supervisor import RoleSpec, Supervisor, ready_file_exists
from slime_async.metrics import names as M
from slime_async.metrics import read_metrics
from slime_async.utils.procs import free_port, python_module
from slime_async.utils.restart_requests import request_restart
from tests.support.engine_util import push_config

LIVENESS = LivenessConfig(probe_interval_s=0.5, ready_timeout_s=2.0, hung_after_s=6.0)


def _version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/model_info", timeout=5) as resp:
        return str(json.loads(resp.read())["weight_version"])


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def _buckets(model_dir: Path, scale: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return [[(n, (p.detach() * scale).contiguous()) for n, p in model.named_parameters()]]


@pytest.fixture()
def model_dir(tmp_path):
    from slime_async.models.toy import make_tiny_model

    return make_tiny_model(tmp_path / "model", "qwen3", seed=0)


def test_an_engine_stuck_in_its_update_is_timed_out_restarted_and_rejoins(
    tmp_path, model_dir, caplog
):
    caplog.set_level("INFO")
    run_dir = RunDir.create(tmp_path, "t", tmp_path / "run")
    stuck_port, real_port = free_port(), free_port()
    stuck_url, real_url = f"http://127.0.0.1:{stuck_port}", f"http://127.0.0.1:{real_port}"
    marker, done = tmp_path / "stuck-once", tmp_path / "done"
    engine0 = RoleSpec(
        "engine0",
        lambda resume: [
            sys.executable,
            "-m",
            "tests.support.stuck_engine",
            "--port",
            str(stuck_port),
            "--marker",
            str(marker),
        ],
        ready=lambda _p: http_ok(f"{stuck_url}/ready"),
        liveness_url=stuck_url,
    )
    engine1 = RoleSpec(
        "engine1",
        lambda resume: python_module(
            "slime_async",
            "engine",
            f"engine.model_path={model_dir}",
            f"engine.port={real_port}",
            "engine.embedded.device=cpu",
            "engine.embedded.torch_threads=1",
            "engine.embedded.strict_sglang=true",
        ),
        ready=lambda _p: http_ok(f"{real_url}/health"),
        env={"OMP_NUM_THREADS": "1"},
        liveness_url=real_url,
    )
    # The run's end: a role that exits 0 once the test is done.
    learner = RoleSpec(
        "learner",
        lambda resume: [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from slime_async.utils.readiness import announce_ready\n"
            "announce_ready('stand-in')\n"
            f"while not os.path.exists({str(done)!r}): time.sleep(0.05)\n",
        ],
        ready=ready_file_exists,
        on_exit_0="ends_run",
    )
    sup = Supervisor(
        run_dir,
        [[engine0, engine1], [learner]],
        restart_failed=1,
        stop_grace_s=2.0,
        poll_interval_s=0.1,
        liveness=LIVENESS,
        progress=None,
        preload=preload.modules(),  # what `run` gives it on a machine without a visible GPU
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(sup.run()), daemon=True)
    thread.start()
    sup_log = run_dir.log("supervisor")
    pusher = None
    try:
        _wait(lambda: sup_log.is_file() and "learner is ready" in sup_log.read_text(), 180, "roles")
        push = push_config(timeout_s=4.0, flush_timeout_s=5.0, report_after_s=2.0)
        pusher = WeightPusher(
            [stuck_url, real_url],
            push.model_copy(update={"stall_deadline_s": 30.0}),
            liveness=LIVENESS,
            request_restart=partial(request_restart, run_dir.path, by="the test's learner"),
        )
        pusher.connect()
        assert pusher.members == [stuck_url, real_url]

        stats = pusher.push(_buckets(model_dir, 1.0), 1)
        assert stats["failed"] == 1.0 and pusher.resync_needed()
        assert stuck_url in pusher.liveness.stuck
        assert f"step update_weights_from_distributed, engine {stuck_url}" in caplog.text
        assert (
            f"engine {stuck_url} is stuck (its update call did not complete in 4s)" in caplog.text
        )
        metrics = pusher.metrics()
        assert metrics[M.PUSH_STUCK_ENGINES] == 1 and metrics[M.PUSH_RESTART_REQUESTS] == 1
        assert metrics[M.PUSH_STALLS] >= 1  # the update call outlived push.report_after_s

        # The supervisor takes the request: engine0 stopped, restarted, ready again.
        _wait(lambda: "restart asked by the test's learner" in sup_log.read_text(), 30, "restart")
        _wait(lambda: sup_log.read_text().count("engine0 is ready") == 2, 60, "engine0 back")
        _wait(lambda: stuck_url not in pusher.liveness.stuck, 30, "the stuck mark lifted")

        stats = pusher.push(_buckets(model_dir, 1.0), 1)
        assert stats["failed"] == 0.0 and stats["engines"] == 2.0
        assert pusher.members == [stuck_url, real_url]
        assert _version(stuck_url) == "1" and _version(real_url) == "1"
        assert not pusher.resync_needed()
        assert pusher.metrics()[M.PUSH_RESYNCS] >= 1
        done.touch()
        thread.join(60)
    finally:
        done.touch()
        if pusher is not None:
            pusher.close()
        thread.join(60)
    assert codes == [0]
    text = sup_log.read_text()
    assert "stopping engine0 (pid" in text and f"engine0 ({stuck_url}): restart asked" in text
    (rec,) = read_metrics(run_dir.path / "metrics" / "supervisor.jsonl")
    assert rec["supervisor/requested_restarts"] == 1 and rec["supervisor/restarts/engine0"] == 1
    assert rec["supervisor/hung_restarts"] == 0
