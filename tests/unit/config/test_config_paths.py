"""The config layer decides paths, URLs and seeds once: one rule, used by every role."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_async.config import ConfigError, SlimeConfig, load_config, written_path
from slime_async.launch.run_dir import RunDir
from tests.support.repo import REPO


def test_written_paths_live_under_the_run_dir(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(
        [],
        [
            f"run.run_dir={str(run)!r}",
            "buffer.wal_dir=wal",
            "generator.producer_id=gen3",
            f"learner.save={str(tmp_path / 'abs')!r}",
        ],
    )
    paths = cfg.paths()
    assert paths.run_dir == run
    assert paths.wal_dir == run / "wal"
    assert paths.generator_state == run / "state" / "gen3.json"  # default, follows producer_id
    assert paths.checkpoints == tmp_path / "abs"  # absolute paths are kept


def test_without_a_run_dir_written_paths_are_under_the_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config([], ["buffer.wal_dir=wal", "generator.state_path=cursor.json"])
    paths = cfg.paths()
    assert paths.run_dir is None
    assert paths.wal_dir == tmp_path / "wal" and paths.generator_state == tmp_path / "cursor.json"
    assert load_config([], []).paths().checkpoints is None  # nowhere to put them by default


def test_defaults_that_follow_other_keys_are_not_frozen_into_config_json(tmp_path):
    """`slime-async run` writes config.json once; each generator overrides its producer_id."""
    cfg = load_config([], [f"run.run_dir={str(tmp_path)!r}"])
    cfg.write_json(tmp_path / "config.json")
    child = load_config([tmp_path / "config.json"], ["generator.producer_id=gen1"])
    assert child.paths().generator_state == tmp_path / "state" / "gen1.json"


def test_run_dir_under_uses_the_same_rule(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.under("wal") == written_path(tmp_path, "wal") == tmp_path / "wal"


def test_generate_urls_router_then_engines_then_embedded():
    assert load_config(
        [], ["engine.urls=['http://a:1']", "engine.router_url='http://r:2'"]
    ).generate_urls() == ["http://r:2"]
    assert load_config([], ["engine.urls=['http://a:1', 'http://b:1']"]).generate_urls() == [
        "http://a:1",
        "http://b:1",
    ]
    assert load_config([], ["engine.port=31000"]).generate_urls() == ["http://127.0.0.1:31000"]
    several = load_config([], ["engine.num_engines=2", "engine.router_port=31100"])
    assert several.generate_urls() == ["http://127.0.0.1:31100"]  # the router run starts
    with pytest.raises(ConfigError, match=r"engine\.urls"):
        load_config([], ["engine.kind=external"]).generate_urls()


def test_run_seed_seeds_every_role_unless_a_role_sets_its_own(tmp_path):
    shipped = load_config([], [])  # the defaults a user gets: one seed for every role
    assert shipped.engine.seed == shipped.generator.seed == shipped.learner.seed == shipped.run.seed
    cfg = load_config([], ["run.seed=7", "learner.seed=99"])
    assert (cfg.engine.seed, cfg.generator.seed, cfg.learner.seed) == (7, 7, 99)
    cfg.write_json(tmp_path / "config.json")  # recorded: the children read these values
    again = SlimeConfig.read_json(tmp_path / "config.json")
    assert (again.run.seed, again.engine.seed, again.generator.seed, again.learner.seed) == (
        7,
        7,
        7,
        99,
    )


def test_paths_are_absolute_even_for_a_relative_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config([], ["run.run_dir=runs/x", "buffer.wal_dir=wal"])
    assert cfg.paths().wal_dir == Path(tmp_path) / "runs" / "x" / "wal"


def test_run_refuses_inputs_that_do_not_exist_before_starting_anything(tmp_path):
    """A model directory that is not there used to fail inside the engine and the learner, after
    the buffer had started, with Hugging Face's "Repo id must be in the form ..." (no hub here):
    `slime-async run` now names each missing input and its key, and starts nothing."""
    import subprocess
    import sys

    from slime_async.config.paths import missing_inputs
    from tests.support.run_config import tiny_run_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg_path = tiny_run_config(
        tmp_path / "run.toml", model="no-such-model", data=data, run_dir=tmp_path / "run"
    )
    cfg = load_config([str(cfg_path)], [])
    missing = f"learner.model_path: {tmp_path / 'no-such-model'} does not exist"
    assert missing_inputs(cfg) == [missing]  # the engine serves learner.model_path (unset here)
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async", "run", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert missing in proc.stderr
    assert "relative to the config file" in proc.stderr
    assert not (tmp_path / "run" / "logs" / "buffer.log").exists()  # nothing was started
