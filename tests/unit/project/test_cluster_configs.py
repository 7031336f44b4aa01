"""The cluster recipe (README "Cluster", configs/cluster/): each role on its own node."""

from pathlib import Path

import pytest

from slime_async.config import ConfigError, generate_urls, load_config, split_cli_args
from slime_async.launch.run_dir import RunDir
from slime_async.launch.table import plan_roles
from slime_async.queue.security import SecurityError, check_bind
from tests.support.keys import write_curve_toml
from tests.support.repo import REPO

CLUSTER = REPO / "configs" / "cluster" / "qwen3_4b.toml"


@pytest.fixture()
def curve_toml(tmp_path) -> Path:
    return write_curve_toml(tmp_path)


def test_cluster_buffer_refuses_its_network_address_without_keys():
    # Refused when the config is loaded (`config`, `run`, `slurm`, every role), naming the key,
    # by the rule the buffer itself applies at bind time.
    with pytest.raises(
        ConfigError, match=r"buffer.producer_endpoint='tcp://10.0.0.10:5555'.*CURVE"
    ):
        load_config([CLUSTER])
    cfg = load_config([CLUSTER], ["buffer.allow_non_loopback=true"])
    cfg.buffer.allow_non_loopback = False
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


# ---- GLM-4-9B and Qwen3-30B-A3B (expert parallelism, routing replay)

GLM4 = REPO / "configs" / "cluster" / "glm4_9b.toml"
QWEN3_MOE = REPO / "configs" / "cluster" / "qwen3_30b_a3b.toml"
# What the configs' comments say each learner node runs, and the models' shapes (HF configs).
FAMILY_LAYOUTS = {
    GLM4: dict(ranks=8, heads=32, kv_heads=2, experts=0, model_type="glm4"),
    QWEN3_MOE: dict(ranks=16, heads=32, kv_heads=4, experts=128, model_type="qwen3_moe"),
}


@pytest.mark.parametrize("path", list(FAMILY_LAYOUTS), ids=lambda p: p.stem)
def test_family_cluster_configs_hold_together(path, curve_toml):
    cfg = load_config([path, curve_toml])
    shape = FAMILY_LAYOUTS[path]
    check_bind(cfg.buffer)
    assert generate_urls(cfg.engine) == [cfg.engine.router_url]
    assert cfg.engine.router_url not in cfg.engine.urls
    ln = cfg.learner
    tp, ep = ln.tensor_parallel, ln.expert_parallel
    assert shape["ranks"] % tp == 0 and shape["ranks"] % ep == 0
    assert shape["heads"] % tp == 0 and shape["kv_heads"] % tp == 0
    if shape["experts"]:
        assert shape["experts"] % ep == 0 and ln.routing_replay
    else:
        assert ep == 1 and not ln.routing_replay  # dense: neither applies (refused at start-up)
    assert str(path.stem).split("_")[0] in ln.model_path.lower().replace("-", "")


def test_dense_model_refuses_expert_parallel_and_routing_replay(tmp_path):
    """learner.expert_parallel > 1 or learner.routing_replay on a dense model is refused at
    start-up, naming the key."""
    from slime_async.models.arch import ModelArch, UnsupportedModel
    from slime_async.models.toy import tiny_config

    arch = ModelArch.from_hf_config(tiny_config("glm4").to_dict())
    with pytest.raises(UnsupportedModel, match=r"learner\.expert_parallel=2"):
        arch.check_tensor_parallel(1, 2)
    moe = ModelArch.from_hf_config(tiny_config("qwen3_moe", num_experts=6).to_dict())
    with pytest.raises(
        UnsupportedModel, match="num_experts=6 is not divisible by expert_parallel=4"
    ):
        moe.check_tensor_parallel(1, 4)
