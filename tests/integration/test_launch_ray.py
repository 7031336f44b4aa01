"""`run.launcher = "ray"`: the real pipeline on a simulated three-node Ray cluster.

One `ray.cluster_utils.Cluster` for the module: a head (CPU roles), an "engine" node and a
"learner" node, each its own raylet with fake GPUs and a custom resource that the placement rules
name. Ray stays on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); the two worker nodes have the
addresses 127.0.0.2 and 127.0.0.3, so an address a role got from its own node is told apart from
the head's 127.0.0.1. Without Ray installed these tests skip; the placement rules and the launch
table without a cluster: tests/unit/launch/test_launch_ray_plan.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from slime_async.metrics import read_metrics
from tests.support.cpu_only import fake_gpu_ids
from tests.support.repo import REPO
from tests.support.run_config import tiny_run_config
from tests.support.runs import finish

NAMESPACE = "slime_async_test"
ENGINE_IP, LEARNER_IP = "127.0.0.2", "127.0.0.3"
GROUPS_PER_STEP, GROUP_SIZE, MAX_STALENESS = 2, 4, 1


# ----- on a simulated cluster ----------------------------------------------------------------


def _start_cluster(cluster_cls):
    """Head (CPU roles) + an engine node + a learner node. Ray waits 30 s at most for a raylet to
    register (fixed in Ray); on a machine loaded far past its cores that can pass: one retry."""
    for attempt in (1, 2):
        c = cluster_cls()
        try:
            c.add_node(num_cpus=8, node_ip_address="127.0.0.1", include_dashboard=False)
            nodes = {
                "head": c.head_node.node_id,
                "engine": c.add_node(
                    num_cpus=4, num_gpus=2, node_ip_address=ENGINE_IP, resources={"engine": 4}
                ).node_id,
                "learner": c.add_node(
                    num_cpus=4, num_gpus=2, node_ip_address=LEARNER_IP, resources={"learner": 4}
                ).node_id,
            }
            c.wait_for_nodes()
            return c, nodes
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    old = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.x (read at import)
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from examples.arithmetic.task import make_dataset
    from slime_async.models.toy import make_tiny_model

    root = tmp_path_factory.mktemp("ray")
    with fake_gpu_ids(2):  # the raylets (and so the roles) keep these ids
        c, nodes = _start_cluster(Cluster)
    try:
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        model = make_tiny_model(root / "model", "qwen3", seed=0)
        data = make_dataset(root / "train.jsonl", 300, seed=0)
        yield {
            "ray": ray,
            "address": c.address,
            "nodes": nodes,
            "root": root,
            "model": model,
            "data": data,
        }
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old


def _config(cl: dict, name: str, steps: int) -> Path:
    root = cl["root"]
    return tiny_run_config(
        root / f"{name}.toml",
        model=cl["model"],
        data=cl["data"],
        run_dir=root / name,
        run={"stop_grace_s": 10, "launcher": "ray"},
        run__ray={
            "address": cl["address"],
            "namespace": NAMESPACE,
            "engine_nodes": "engine",
            "learner_nodes": "learner",
            "cpu_nodes": "head",
            "cpus_per_role": 0.5,
            "sync_interval_s": 0.5,
        },
        buffer={"max_staleness": MAX_STALENESS},
        generator={"group_size": GROUP_SIZE},
        learner={"num_steps": steps, "groups_per_step": GROUPS_PER_STEP},
        algo={"advantage": None, "loss": None},  # the defaults
    )


def _start(cfg: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "slime_async", "run", str(cfg), *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)  # polling the run's files: the readiness signal here


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics" / "learner.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _nothing_left(cl: dict, run_dir: Path) -> None:
    """No actor or placement group of the run alive in the cluster, no process of it anywhere."""
    from ray._private import state

    prefix = run_dir.name + "/"
    deadline = time.monotonic() + 30
    while True:
        actors = [
            a["Name"]
            for a in state.actors().values()
            if a["Name"].startswith(prefix) and a["State"] != "DEAD"
        ]
        groups = [
            g
            for g in cl["ray"].util.placement_group_table().values()
            if g["name"] == run_dir.name and g["state"] != "REMOVED"
        ]
        procs = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if str(run_dir / "config.json") in cmd:
                procs.append(f"{p.pid}: {cmd[:120]}")
        if not (actors or groups or procs):
            return
        assert time.monotonic() < deadline, f"left behind: {actors} {groups} {procs}"
        time.sleep(0.2)


def _accounting(run_dir: Path, steps: int) -> list[dict]:
    learner = read_metrics(run_dir / "metrics" / "learner.jsonl")
    assert learner[-1]["step"] == steps
    final = json.loads((run_dir / "buffer_final.json").read_text())
    assert final["counts"]["committed_trajectories"] == steps * GROUPS_PER_STEP * GROUP_SIZE
    dropped = sum(final["dropped_trajectories"].values())
    acknowledged = final["counts"]["trajectories_in"]
    assert (
        acknowledged
        == final["counts"]["committed_trajectories"] + dropped + final["trajectories_held"]
    ), final
    return learner


@pytest.mark.timeout(900)  # the first test to run also starts the cluster (fixture)
def test_job_on_three_nodes_places_trains_replaces_a_killed_engine_and_loses_nothing(cluster):
    """Two learner ranks on the learner node, the engine on the engine node, the CPU roles on the
    head; the engine's actor is killed after step 1: the supervisor replaces it (counted, as
    under the local launcher: the same supervisor drives the actors) and the run completes with
    nothing lost and nothing left on any node."""
    ray = cluster["ray"]
    steps = 4
    run_dir = cluster["root"] / "three-nodes"
    proc = _start(_config(cluster, "three-nodes", steps), "run.learner_procs=2")
    try:
        _wait_for(lambda: _steps_done(run_dir) >= 1, 240, "step 1", proc)
        actor = ray.get_actor("three-nodes/engine0", namespace=NAMESPACE)
        ray.kill(actor, no_restart=True)
        out = finish(proc, 300, expect=None)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "run completed (exit 0)" in out, out[-4000:]

    # Each process on the node its rule names; the addresses are those nodes' own.
    placed = json.loads((run_dir / "placement.json").read_text())
    nodes = cluster["nodes"]
    for name in ("buffer", "generator0"):
        assert placed[name]["node_id"] == nodes["head"] and placed[name]["ip"] == "127.0.0.1"
    assert placed["engine0"]["node_id"] == nodes["engine"]  # the replacement too
    assert placed["engine0"]["ip"] == ENGINE_IP
    for rank in (0, 1):
        assert placed[f"learner.rank{rank}"]["node_id"] == nodes["learner"]
    # One fake GPU per bundle, a different one for each learner rank.
    cuda = {placed[f"learner.rank{r}"]["cuda_visible_devices"] for r in (0, 1)}
    assert len(cuda) == 2 and None not in cuda
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    argv_line = next(line for line in sup.splitlines() if "argv learner:" in line)
    assert f'push.master_addr="{LEARNER_IP}"' in argv_line
    assert f"http://{ENGINE_IP}:" in argv_line
    assert "engine0 is ready (GET http://127.0.0.2:" in sup
    # Both ranks ran the learner (rank 1 logs to learner.rank1.log), under gloo over 127.0.0.3.
    assert (run_dir / "logs" / "learner.rank1.log").is_file()
    # The role command lines ran as under the local launcher: each learner rank and the engine
    # froze their start-up heap out of the garbage collector's sight before training / serving.
    for name, rank in (("learner.log", 0), ("learner.rank1.log", 1)):
        text = (run_dir / "logs" / name).read_text()
        assert f"learner rank {rank} start-up: " in text and "objects frozen" in text, name
    assert "engine start-up: " in (run_dir / "logs" / "engine0.log").read_text()

    # The killed engine: reported with its signal, replaced, ready again, counted.
    assert "engine0 (pid" in sup and "was killed by SIGKILL" in sup, sup[-3000:]
    assert "restarting engine0" in sup
    assert sup.count("engine0 is ready") == 2
    (rec,) = read_metrics(run_dir / "metrics" / "supervisor.jsonl")
    assert rec["supervisor/restarts/engine0"] == 1 and rec["supervisor/restarts"] == 1
    assert "role failures: 1; restarted: engine0 1x" in out

    learner = _accounting(run_dir, steps)
    # Weights went out before the kill and, to the replacement, at the end.
    pushed = [r for r in learner if not r["learner/batch_skipped"]]
    assert pushed[0]["push/seconds"] > 0 and pushed[-1]["push/seconds"] > 0
    assert learner[-1]["version"] >= steps - 1
    assert all(r["staleness/max"] <= MAX_STALENESS for r in learner)
    gen = read_metrics(run_dir / "metrics" / "generator0.jsonl")
    assert max(r["step"] for r in gen) >= steps - 1
    _nothing_left(cluster, run_dir)


@pytest.mark.timeout(900)
def test_sigint_to_the_driver_leaves_nothing_on_any_node(cluster):
    run_dir = cluster["root"] / "sigint"
    proc = _start(_config(cluster, "sigint", 50))
    sup = run_dir / "logs" / "supervisor.log"

    def all_started() -> bool:  # every role's process runs on its node (the learner last)
        return sup.is_file() and "started learner" in sup.read_text()

    try:
        _wait_for(all_started, 240, "the learner to be started", proc)
        os.kill(proc.pid, signal.SIGINT)
        out = finish(proc, 120, expect=None)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-4000:]
    assert "received SIGINT; stopping every role" in out
    _nothing_left(cluster, run_dir)


@pytest.mark.timeout(900)
def test_unsatisfiable_placement_fails_at_once(cluster):
    cfg = _config(cluster, "too-big", 2)
    t0 = time.monotonic()
    proc = _start(cfg, "engine.num_engines=3", 'run.ray.learner_nodes="gpu80"')
    out = finish(proc, 120, expect=None)
    assert proc.returncode == 2, out[-3000:]
    assert "engine roles (engine0, engine1, engine2) need GPU 3 on nodes with resource " in out
    assert "'engine', which have GPU 2 in all: missing GPU 1" in out
    assert "need nodes with resource 'gpu80': there is none" in out
    assert time.monotonic() - t0 < 90  # no wait for resources that will never come
    _nothing_left(cluster, cluster["root"] / "too-big")
