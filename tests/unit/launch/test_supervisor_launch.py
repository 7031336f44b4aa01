"""The launch table of `slime-async run` (argv per role, overrides that validate, torchrun, resume)
and the `run` command's refusals. The table started for real:
tests/integration/test_launch_roles.py."""

import argparse

import pytest

from slime_async.config import ConfigError
from slime_async.launch.router import resolve_router_package, router_entry
from tests.support.launch_plan import child_config, names, planned


def test_one_engine_no_router(tmp_path):
    cfg, run_dir, stages = planned(
        tmp_path, "buffer.wal_dir=wal", "learner.model_path=/models/tiny", "generator.producer_id=g"
    )
    assert names(stages) == [["buffer", "engine0"], ["generator0", "learner"]]
    by_name = {s.name: s for stage in stages for s in stage}
    buffer = child_config(run_dir, by_name["buffer"].argv(False))
    engine_argv = by_name["engine0"].argv(False)
    assert engine_argv[1:4] == ["-m", "slime_async", "engine"]
    engine = child_config(run_dir, engine_argv)
    gen = child_config(run_dir, by_name["generator0"].argv(False))
    learner = child_config(run_dir, by_name["learner"].argv(False))

    assert buffer.buffer.wal_dir == str(run_dir.path / "wal")
    assert buffer.buffer.producer_endpoint != cfg.buffer.producer_endpoint  # port 0 was chosen
    assert gen.buffer.producer_endpoint == buffer.buffer.producer_endpoint
    assert learner.buffer.consumer_endpoint == buffer.buffer.consumer_endpoint
    assert engine.engine.port > 0 and engine.engine.model_path == "/models/tiny"
    url = f"http://127.0.0.1:{engine.engine.port}"
    assert gen.engine.urls == [url] and learner.engine.urls == [url]
    assert gen.generator.producer_id == "g"
    assert learner.learner.save == str(run_dir.checkpoints_dir)
    assert learner.run.run_dir == str(run_dir.path)
    assert by_name["learner"].on_exit_0 == "ends_run"
    assert by_name["generator0"].on_exit_0 == "expected"
    assert by_name["buffer"].on_exit_0 == by_name["engine0"].on_exit_0 == "failure"

    # Resume: the learner loads the checkpoint directory once it holds something.
    assert child_config(run_dir, by_name["learner"].argv(True)).learner.load is None
    (run_dir.checkpoints_dir / "iter_0000002").mkdir(parents=True)
    resumed = child_config(run_dir, by_name["learner"].argv(True))
    assert resumed.learner.load == str(run_dir.checkpoints_dir)


def test_router_generators_and_torchrun(tmp_path):
    cfg, run_dir, stages = planned(
        tmp_path, "engine.num_engines=2", "run.num_generators=2", "run.learner_procs=2"
    )
    assert names(stages) == [
        ["buffer", "engine0", "engine1"],
        ["router"],
        ["generator0", "generator1", "learner"],
    ]
    by_name = {s.name: s for stage in stages for s in stage}
    ports = [child_config(run_dir, by_name[f"engine{i}"].argv(False)).engine.port for i in (0, 1)]
    engine_urls = [f"http://127.0.0.1:{p}" for p in ports]
    seeds = [child_config(run_dir, by_name[f"engine{i}"].argv(False)).engine.seed for i in (0, 1)]
    assert seeds == [cfg.run.seed, cfg.run.seed + 1]  # one sampler stream per engine
    router = by_name["router"].argv(False)
    # The package engine.router_package = "auto" finds here (smg where installed).
    entry = router_entry(resolve_router_package("auto"))
    assert entry is not None and router[: len(entry)] == entry
    rport = router[router.index("--port") + 1]
    assert router[router.index("--host") + 1] == "127.0.0.1"
    assert router[router.index("--prometheus-host") + 1] == "127.0.0.1"
    assert router[router.index("--worker-urls") + 1 : router.index("--policy")] == engine_urls
    for i in (0, 1):
        gen = child_config(run_dir, by_name[f"generator{i}"].argv(False))
        # Generation goes through the router; the engines' own URLs stay known.
        assert gen.engine.router_url == f"http://127.0.0.1:{rport}"
        assert gen.engine.urls == engine_urls
        assert gen.generator.producer_id == f"gen{i}"
        assert (gen.generator.shard_index, gen.generator.num_shards) == (i, 2)
    learner_argv = by_name["learner"].argv(False)
    assert learner_argv[1:6] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    assert learner_argv[6:9] == ["-m", "slime_async", "learner"]
    assert child_config(run_dir, learner_argv).engine.urls == engine_urls  # weights: every engine


def test_external_engines_start_no_engine(tmp_path):
    _cfg, run_dir, stages = planned(
        tmp_path, "engine.kind=external", 'engine.urls=["http://10.0.0.5:30000"]'
    )
    assert names(stages) == [["buffer"], ["generator0", "learner"]]
    gen = child_config(run_dir, stages[1][0].argv(False))
    assert gen.engine.urls == ["http://10.0.0.5:30000"]
    with pytest.raises(ConfigError, match=r"engine\.urls: engine\.kind = 'external' needs"):
        planned(tmp_path / "again", "engine.kind=external")


def test_weight_group_address_and_restarts_by_default(tmp_path):
    """Engines on loopback: the learner's weight group listens there too; engines elsewhere:
    the learner's own default (its node's routable address). Restarts are on by default."""
    cfg, run_dir, stages = planned(tmp_path)
    assert cfg.run.restart_failed >= 1
    learner = {s.name: s for st in stages for s in st}["learner"]
    assert child_config(run_dir, learner.argv(False)).push.master_addr == "127.0.0.1"
    _cfg, run_dir, stages = planned(
        tmp_path / "ext", "engine.kind=external", 'engine.urls=["http://10.0.0.5:30000"]'
    )
    learner = {s.name: s for st in stages for s in st}["learner"]
    assert child_config(run_dir, learner.argv(False)).push.master_addr is None
    _cfg, run_dir, stages = planned(tmp_path / "set", "push.master_addr=10.1.2.3")
    learner = {s.name: s for st in stages for s in st}["learner"]
    assert child_config(run_dir, learner.argv(False)).push.master_addr == "10.1.2.3"


def test_run_command_refuses_bad_invocations(tmp_path):
    from slime_async.commands import run as run_cmd
    from slime_async.config import ConfigError

    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    with pytest.raises(ConfigError, match=r"name at least one CONFIG\.toml"):
        run_cmd.main(parser.parse_args([]))
    with pytest.raises(ConfigError, match=r"no config\.json here"):
        run_cmd.main(parser.parse_args(["--resume", str(tmp_path)]))
    (tmp_path / "config.json").write_text("{}")
    toml = tmp_path / "c.toml"
    toml.write_text("")
    with pytest.raises(ConfigError, match="drop"):
        run_cmd.main(parser.parse_args(["--resume", str(tmp_path), str(toml)]))
    with pytest.raises(ConfigError, match="already holds a run"):
        run_cmd.main(parser.parse_args([str(toml), f"run.run_dir={tmp_path}"]))
