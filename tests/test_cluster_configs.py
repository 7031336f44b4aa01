"""The cluster recipe (README "Cluster", configs/cluster/): each role on its own node."""

import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import generate_urls, load_config, split_cli_args
from slime_async.launch.run_dir import RunDir
from slime_async.launch.table import plan_roles
from slime_async.queue.security import SecurityError, check_bind

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "configs" / "cluster" / "qwen3_4b.toml"


@pytest.fixture()
def curve_toml(tmp_path) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "slime_async", "keygen", str(tmp_path / "keys"),
         "--clients", "generator", "learner"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = tmp_path / "curve.toml"
    path.write_text(out)
    return path


def test_cluster_buffer_refuses_its_network_address_without_keys():
    cfg = load_config([CLUSTER])
    with pytest.raises(SecurityError, match="CURVE"):
        check_bind(cfg.buffer)


def test_cluster_buffer_binds_with_keygen_output(curve_toml):
    cfg = load_config([CLUSTER, curve_toml])
    check_bind(cfg.buffer)  # no error: CURVE on
    for key in ("server_secret_key", "server_public_key", "client_secret_key"):
        assert Path(getattr(cfg.buffer.curve, key)).is_file(), key
    assert Path(cfg.buffer.curve.authorized_clients_dir).is_dir()


def test_cluster_roles_read_their_part(curve_toml, tmp_path):
    cfg = load_config([CLUSTER, curve_toml])
    # Generators go through the router; the learner pushes weights to every server.
    assert generate_urls(cfg.engine) == [cfg.engine.router_url]
    assert len(cfg.engine.urls) == 16 and cfg.engine.router_url not in cfg.engine.urls
    # The learner: 8 ranks as TP 2 x DP 4; Qwen3-4B's 32 heads / 8 kv heads divide by TP 2.
    tp = cfg.learner.tensor_parallel
    assert 8 % tp == 0 and 32 % tp == 0 and 8 % tp == 0  # ranks, heads, kv heads
    # Each role can be started alone with the same files plus per-node overrides.
    files, overrides = split_cli_args(
        [str(CLUSTER), str(curve_toml), "generator.producer_id=gen-node-g"]
    )
    assert load_config(files, overrides).generator.producer_id == "gen-node-g"


def test_single_machine_plan_of_external_engines_uses_router(curve_toml, tmp_path):
    cfg = load_config([CLUSTER, curve_toml], [f"run.run_dir={tmp_path / 'run'}"])
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    stages = plan_roles(cfg, run_dir)
    names = [[s.name for s in stage] for stage in stages]
    assert names == [["buffer"], ["generator0", "learner"]]  # external engines: none started
    gen_argv = stages[1][0].argv(False)
    assert any(a.startswith("engine.router_url=") for a in gen_argv)
