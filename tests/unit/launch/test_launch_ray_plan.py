"""`run.launcher = "ray"` without a cluster: the placement check, the launch table with each role's
node address, the launcher's config keys (and a Ray run refused cleanly without Ray installed),
and the gathering of a node's files into the head's run directory. The real pipeline on a
simulated three-node Ray cluster: tests/integration/test_launch_ray.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from slime_async.config import load_config
from slime_async.launch.ray.placement import (
    HEAD_RESOURCE,
    PlacementError,
    bundle_of,
    check_fits,
    slots_of,
)
from slime_async.launch.run_dir import RunDir
from slime_async.launch.table import RoleAddresses, plan_roles
from tests.support.repo import REPO


def _slots_cfg(*overrides: str):
    return load_config([], ['run.launcher="ray"', *overrides])


def test_placement_check_names_missing_resources():
    cfg = _slots_cfg(
        "engine.num_engines=3", 'run.ray.engine_nodes="engine"', 'run.ray.learner_nodes="gpu8"'
    )
    slots = slots_of(cfg)
    assert [s.name for s in slots] == [
        "buffer",
        "engine0",
        "engine1",
        "engine2",
        "router",
        "generator0",
        "learner.rank0",
    ]
    bundles = [bundle_of(s, cfg.run.ray) for s in slots]
    assert bundles[1] == {"CPU": 1.0, "GPU": 1.0, "engine": 0.001}
    assert bundles[0] == {"CPU": 1.0, HEAD_RESOURCE: 0.001}  # CPU roles on the head
    head = {"Alive": True, "Resources": {"CPU": 8.0, HEAD_RESOURCE: 1.0}}
    engine = {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0, "engine": 4.0}}
    with pytest.raises(PlacementError) as e:
        check_fits(slots, bundles, [head, engine])
    msg = str(e.value)
    assert "engine roles (engine0, engine1, engine2) need GPU 3" in msg
    assert "missing GPU 1" in msg
    assert "nodes with resource 'gpu8': there is none" in msg
    learner = {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0, "gpu8": 1.0}}
    big_engine = {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 4.0, "engine": 4.0}}
    check_fits(slots, bundles, [head, big_engine, learner])  # fits
    with pytest.raises(PlacementError, match="missing GPU 4"):  # other work holds the GPUs
        check_fits(slots, bundles, [head, big_engine, learner], {"CPU": 20.0, "GPU": 0.0})


def test_table_takes_each_roles_node_address(tmp_path):
    cfg = load_config(
        [],
        [
            'run.launcher="ray"',
            "engine.num_engines=2",
            "run.learner_procs=2",
            'run.ray.engine_command=["{python}", "-m", "sglang.launch_server", "--host", '
            '"{host}", "--port", "{port}", "--tp-size", "{gpus}", "--model-path", "{model_path}"]',
            'learner.model_path="/models/m"',
        ],
    )
    run_dir = RunDir.create(tmp_path, "t", tmp_path / "run")
    cfg.run.run_dir = str(run_dir.path)
    cfg.write_json(run_dir.config_json)
    where = RoleAddresses(
        buffer_host="10.0.0.1",
        buffer_ports=(5555, 5556),
        engines=[("10.0.0.2", 30000), ("10.0.0.3", 30001)],
        router=("10.0.0.1", 29000, 29001),
        learner_master=("10.0.0.4", 29500),
    )
    roles = {s.name: s for stage in plan_roles(cfg, run_dir, where) for s in stage}
    assert roles["engine1"].argv(False)[1:] == [
        "-m",
        "sglang.launch_server",
        "--host",
        "10.0.0.3",
        "--port",
        "30001",
        "--tp-size",
        "1",
        "--model-path",
        "/models/m",
    ]
    router = roles["router"].argv(False)
    assert router[router.index("--host") + 1] == "10.0.0.1"
    assert router[router.index("--worker-urls") + 1 : router.index("--policy")] == [
        "http://10.0.0.2:30000",
        "http://10.0.0.3:30001",
    ]
    learner = roles["learner"]
    argv = learner.argv(False)
    assert "torch.distributed.run" not in argv  # one process per rank, no torchrun
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    assert json.loads(args["push.master_addr"]) == "10.0.0.4"
    assert json.loads(args["buffer.consumer_endpoint"]) == "tcp://10.0.0.1:5556"
    assert json.loads(args["engine.urls"]) == ["http://10.0.0.2:30000", "http://10.0.0.3:30001"]
    assert [e["RANK"] for e in learner.rank_envs] == ["0", "1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in learner.rank_envs} == {
        ("10.0.0.4", "29500", "2")
    }
    gen = dict(a.split("=", 1) for a in roles["generator0"].argv(False) if "=" in a)
    assert json.loads(gen["engine.router_url"]) == "http://10.0.0.1:29000"


def test_launcher_keys_checked_and_ray_stays_optional(tmp_path):
    from slime_async.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"run\.ray\.engine_nodes set but run\.launcher = 'local'"
    ):
        load_config([], ['run.ray.engine_nodes="engine"'])
    with pytest.raises(
        ConfigError, match=r"run\.engine_cuda_devices set but run\.launcher = 'ray'"
    ):
        load_config([], ['run.launcher="ray"', 'run.engine_cuda_devices=["0"]'])
    cfg, runs = tmp_path / "empty.toml", tmp_path / "runs"
    cfg.write_text("")
    # Importing the package and the local launcher never imports ray; without ray installed a
    # Ray run stops at start-up naming the extra (ray hidden from this interpreter).
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import slime_async, slime_async.cli, slime_async.commands.run\n"
        "import slime_async.launch.table, slime_async.launch.supervisor\n"
        "import slime_async.launch.ray.launcher\n"
        "assert sys.modules['ray'] is None\n"
        "from slime_async.cli import main\n"
        f"sys.exit(main(['run', '{cfg}', 'run.launcher=\"ray\"', 'run.runs_dir=\"{runs}\"']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'slime_async[ray]'" in proc.stderr
    assert not runs.exists()  # refused before a run directory was made


def test_gather_copies_a_nodes_files_into_the_heads_run_dir(tmp_path):
    """A node without the head's file system: the actor's copy of the run directory is read
    back by offsets and written into the head's (here two directories stand for two nodes)."""
    from slime_async.launch.ray.actor import MARKER, RoleProcess, write_gathered

    head, node = tmp_path / "head", tmp_path / "node"
    (head / "logs").mkdir(parents=True)
    (head / MARKER).write_text("token\n")
    proc = RoleProcess("buffer", str(node), "token", '{"run": {}}', sys.executable)
    assert not proc.shared and (node / "config.json").read_text() == '{"run": {}}'
    script = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]);"
        "(p / 'metrics/buffer.jsonl').write_text('{\"step\": 1}\\n');"
        "(p / 'buffer_final.json').write_text('{}'); print('hello')"
    )
    proc.start(
        [sys.executable, "-c", script, str(node)],
        {},
        "buffer",
        ["metrics/buffer.jsonl", "ready/buffer", "buffer_final.json"],
    )
    deadline = time.monotonic() + 30
    while proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    write_gathered(head, proc.gather())
    assert (head / "logs" / "buffer.log").read_text() == "hello\n"
    assert (head / "metrics" / "buffer.jsonl").read_text() == '{"step": 1}\n'
    assert (head / "buffer_final.json").read_text() == "{}"
    assert proc.gather() == {}  # nothing new
    shared = RoleProcess("x", str(head), "token", "{}", sys.executable)
    assert shared.shared and shared.gather() == {}
