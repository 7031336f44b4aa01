"""`slime-async run`'s launch table started for real: the real sglang-router in front of stand-in
engines, the `run` command's run directory, progress line and resume with a stand-in learner, and
the real buffer, engines and router with a learner that checks its wiring. The table itself:
tests/unit/launch/test_supervisor_launch.py."""

import argparse
import io
import json
import re
import sys
import textwrap

import pytest

from slime_async.launch import preload
from slime_async.launch import table as launch
from slime_async.launch.supervisor import RoleSpec, Supervisor, ready_file_exists
from slime_async.metrics import metrics_path, read_metrics
from tests.support.launch_plan import child_config, planned

ENGINE = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port = int(next(a for a in sys.argv if a.startswith("engine.port=")).split("=")[1])
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # /health 200, /server_info {} (smg detects a backend by it; sglang-router
            # also accepts 404 there), the router's other info requests 404
            body = b"{}" if self.path == "/server_info" else b""
            self.send_response(200 if self.path in ("/health", "/server_info") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)

GENERATOR = textwrap.dedent(
    """
    import json, sys, time, urllib.request
    from slime_async.launch.run_dir import announce_ready
    from slime_async.config import load_config, split_cli_args
    cfg = load_config(*split_cli_args(sys.argv[1:]))
    urls = [cfg.engine.router_url]
    req = urllib.request.Request(urls[0] + "/workers")
    if cfg.engine.api_key:
        req.add_header("Authorization", f"Bearer {cfg.engine.api_key}")
    workers = json.loads(urllib.request.urlopen(req, timeout=5).read())["workers"]
    print(f"{sum(w['is_healthy'] for w in workers)} healthy workers behind {urls[0]}", flush=True)
    announce_ready()
    while True:
        time.sleep(0.05)
    """
)


@pytest.mark.parametrize("api_key", [None, "sekrit"])
def test_real_router_in_front_of_standin_engines(tmp_path, api_key):
    keys = [f"engine.api_key={api_key}"] if api_key else []
    _cfg, run_dir, stages = planned(tmp_path, "engine.num_engines=2", *keys)
    (tmp_path / "engine.py").write_text(ENGINE)
    (tmp_path / "generator.py").write_text(GENERATOR)
    py = sys.executable

    def standin(spec, script):  # the same overrides, a stand-in program
        return RoleSpec(
            spec.name,
            lambda resume: [py, str(script), *spec.argv(resume)[4:]],
            spec.ready,
            spec.ready_what,
            spec.on_exit_0,
        )

    stages[0] = [standin(s, tmp_path / "engine.py") for s in stages[0][1:]]  # no buffer here
    gen, learner = stages[2][0], stages[2][1]
    learner_done = RoleSpec(
        "learner",
        lambda resume: [
            py,
            "-c",
            "from slime_async.launch.run_dir import announce_ready as a; a()",
        ],
        ready_file_exists,
        on_exit_0="ends_run",
    )
    stages[2] = [standin(gen, tmp_path / "generator.py")]
    stages.append([learner_done])  # the run ends once the generator saw both workers
    assert learner.name == "learner"
    err = io.StringIO()
    sup = Supervisor(
        run_dir, stages, ready_timeout_s=60, stop_grace_s=5, poll_interval_s=0.05, err=err
    )
    assert sup.run() == 0, err.getvalue()
    assert "2 healthy workers behind http://127.0.0.1:" in run_dir.log("generator0").read_text()
    log = run_dir.log("supervisor").read_text()
    assert "router is ready (GET http://127.0.0.1:" in log and "lists 2 healthy" in log


LEARNER = textwrap.dedent(
    """
    import sys
    from slime_async.launch.run_dir import announce_ready
    from slime_async.config import load_config
    from slime_async.metrics import MetricsLogger
    cfg = load_config([sys.argv[1]])
    resumed = "--resumed" in sys.argv
    announce_ready()
    with MetricsLogger(cfg.run.run_dir, "learner") as log:
        first = 4 if resumed else 1
        for step in range(first, cfg.learner.num_steps + 1):
            log.log(step, {"reward": step / 10, "staleness/mean": 1.0})
    print("resumed" if resumed else "fresh", cfg.learner.num_steps, flush=True)
    """
)


def test_run_command_run_dir_config_progress_and_resume(tmp_path, monkeypatch, capsys):
    from slime_async.commands import run as run_cmd

    (tmp_path / "learner.py").write_text(LEARNER)

    def fake_plan(cfg, run_dir, gpu_reserve=None):  # the real table starts the real roles
        argv = [sys.executable, str(tmp_path / "learner.py"), str(run_dir.config_json)]
        return [
            [
                RoleSpec(
                    "learner",
                    lambda resume: argv + ["--resumed"] * resume,
                    ready_file_exists,
                    on_exit_0="ends_run",
                )
            ]
        ]

    monkeypatch.setattr(launch, "plan_roles", fake_plan)
    toml = tmp_path / "c.toml"
    toml.write_text(
        "[run]\nname = 'demo'\nprogress = 'plain'\nwandb = 'disabled'\n[learner]\nnum_steps = 3\n"
    )
    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)

    args = parser.parse_args([str(toml), f"run.runs_dir={tmp_path / 'runs'}"])
    assert run_cmd.main(args) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("demo-")
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["run"]["run_dir"] == str(run_dir) and saved["learner"]["num_steps"] == 3
    assert "fresh 3" in (run_dir / "logs" / "learner.log").read_text()
    out = capsys.readouterr().out
    assert "step 3/3 (100%)" in out and "reward 0.300" in out and "staleness 1.00" in out
    assert "run completed (exit 0)" in out

    # --resume: same directory, its config.json, overrides still apply; the learner resumes.
    args = parser.parse_args(["--resume", str(run_dir), "learner.num_steps=5"])
    assert run_cmd.main(args) == 0
    assert "resumed 5" in (run_dir / "logs" / "learner.log").read_text()
    assert json.loads((run_dir / "config.json").read_text())["learner"]["num_steps"] == 5
    steps = [r["step"] for r in read_metrics(metrics_path(run_dir, "learner"))]
    assert steps == [1, 2, 3, 4, 5]
    assert "step 5/5 (100%)" in capsys.readouterr().out


LEARNER_PROBE = textwrap.dedent(
    """
    import sys, urllib.request
    from slime_async.launch.run_dir import announce_ready
    from slime_async.config import ConfigError, load_config, split_cli_args
    from slime_async.queue.client import ConsumerClient
    files, overrides = split_cli_args(sys.argv[1:])
    cfg = load_config(files, overrides)
    with ConsumerClient(cfg.buffer, "learner") as c:
        print("buffer stats keys:", sorted(c.stats())[:3], flush=True)
    for url in cfg.engine.urls:
        print(url, urllib.request.urlopen(url + "/health", timeout=5).status, flush=True)
    announce_ready()
    """
)


def test_real_buffer_engines_and_router_start_and_stop(tmp_path):
    from slime_async.models.toy import make_tiny_model

    make_tiny_model(tmp_path / "model")
    _cfg, run_dir, stages = planned(
        tmp_path,
        "engine.num_engines=2",
        "buffer.wal_dir=wal",
        f"learner.model_path={tmp_path / 'model'}",
    )
    (tmp_path / "learner.py").write_text(LEARNER_PROBE)
    learner = stages[-1][-1]
    config_at = learner.argv(False).index(str(run_dir.config_json))
    probe = RoleSpec(
        "learner",
        lambda resume: [
            sys.executable,
            str(tmp_path / "learner.py"),
            *learner.argv(resume)[config_at:],
        ],
        ready_file_exists,
        on_exit_0="ends_run",
    )
    stages[-1] = [probe]  # the real buffer, engines and router; a learner that checks its wiring
    err = io.StringIO()
    sup = Supervisor(
        run_dir,
        stages,
        ready_timeout_s=120,
        stop_grace_s=10,
        poll_interval_s=0.05,
        err=err,
        preload=preload.modules(),  # what `run` gives it on a machine without a visible GPU
    )
    assert sup.run() == 0, err.getvalue()
    out = run_dir.log("learner").read_text()
    assert "buffer stats keys:" in out
    engine_ports = [
        child_config(run_dir, s.argv(False)).engine.port for s in stages[0] if s.name != "buffer"
    ]
    for port in engine_ports:  # the learner talks to each engine directly (weight pushes)
        assert f"http://127.0.0.1:{port} 200" in out
    assert (run_dir.path / "wal").is_dir()  # the buffer got the run's write-ahead log directory
    log = run_dir.log("supervisor").read_text()
    for role_name in ("buffer", "engine0", "engine1", "router"):
        assert f"{role_name} is ready" in log and f"stopped {role_name}" in log
    # The python -m roles were forked from the fork server; the router and the probe (not
    # `python -m`) started as programs of their own, and the log says why.
    for role_name in ("buffer", "engine0", "engine1"):
        assert re.search(rf"started {role_name} \(pid \d+, fork, log ", log), log
    router = "sglang_router.launch_router is not a module of slime_async"
    assert f"router was not forked: started exec ({router})" in log, log
    assert "learner was not forked" in log
    assert "fork server ready: " in log
    server = sup.fork_server
    assert server is not None and server.proc.returncode == 0  # closed at the end, not killed
    assert run_dir.read_children() == {}
