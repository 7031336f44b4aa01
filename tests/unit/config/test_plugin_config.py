"""Plug-ins as a new user names them: relative paths from the config file, plug-in modules next
to it, `slime-async config` and `run` checking every plug-in before anything starts, prepare
hooks that write only to their own cache, and a readable start-up failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_async.config import load_config
from slime_async.utils.procs import Child, python_module, wait_until
from tests.support.repo import REPO

PLUGIN = """
async def rollout(ctx, sample):
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    return t


def reward(sample, response_text, info):
    return float(response_text.strip() == sample.metadata["secret"])


def bad_reward(sample, response_text):  # one parameter short
    return 0.0


async def sync_rollout_by_mistake(ctx):
    return None
"""


@pytest.fixture()
def project(tmp_path):
    """A user's project: a config, its plug-in module and data, in their own directory."""
    d = tmp_path / "my_project"
    (d / "data").mkdir(parents=True)
    (d / "data" / "train.jsonl").write_text('{"prompt": "guess", "secret": "7"}\n')
    (d / "guess_plugin.py").write_text(PLUGIN)
    (d / "run.toml").write_text(
        textwrap.dedent(
            """
            [generator]
            dataset = "data/train.jsonl"
            rollout = "guess_plugin:rollout"
            reward = "guess_plugin:reward"
            [learner]
            model_path = "../models/tiny"
            """
        )
    )
    sys.modules.pop("guess_plugin", None)
    yield d
    sys.modules.pop("guess_plugin", None)


def test_relative_paths_resolve_from_the_config_file(project, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config([project / "run.toml"])
    assert cfg.generator.dataset == str(project / "data" / "train.jsonl")
    assert cfg.learner.model_path == str(tmp_path / "models" / "tiny")
    # On the command line there is no file: the working directory, as for any tool.
    cli = load_config([project / "run.toml"], ["generator.dataset=mine.jsonl"])
    assert cli.generator.dataset == "mine.jsonl"
    # A run's config.json keeps the absolute paths: every role reads the same files.
    cfg.write_json(tmp_path / "config.json")
    again = load_config([tmp_path / "config.json"])
    assert again.generator.dataset == cfg.generator.dataset
    assert str(project) in again.generator.import_dirs


def test_plugin_modules_next_to_the_config_are_importable(project, tmp_path, monkeypatch):
    from slime_async.actors.generator.rewards import resolve_reward
    from slime_async.actors.generator.rollout import ROLLOUTS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_config([project / "run.toml"])
    assert ROLLOUTS.resolve(cfg.generator.rollout).__module__ == "guess_plugin"
    assert resolve_reward(cfg.generator.reward).name == "guess_plugin:reward"


def test_shipped_configs_mean_what_they_meant_from_the_repo_root():
    from examples.arithmetic import base_model

    cfg = load_config([REPO / "configs" / "quickstart.toml"])
    assert Path(cfg.generator.dataset) == base_model.DATASET  # what prepare builds
    assert Path(cfg.learner.model_path) == base_model.MODEL
    for name in ("arithmetic", "calculator_agent"):
        ex = load_config([REPO / "examples" / name / "config.toml"])
        assert Path(ex.generator.dataset) == REPO / "examples" / name / "train.jsonl"


def test_prepare_writes_only_to_its_own_cache(tmp_path, monkeypatch, capsys):
    """Found 1: the quickstart's hook wrote 4,000 arithmetic rows to the user's dataset path."""
    from examples.arithmetic import base_model

    monkeypatch.setattr(base_model, "DATASET", tmp_path / "cache" / "train.jsonl")
    monkeypatch.setattr(base_model, "MODEL", tmp_path / "cache" / "base")
    built = []
    monkeypatch.setattr(base_model, "build_base_model", lambda out, *a, **k: built.append(out))
    mine = tmp_path / "mine" / "guess.jsonl"
    cfg = load_config([], [f"generator.dataset={str(mine)!r}", "learner.model_path='m'"])
    base_model.prepare(cfg)
    assert not mine.exists() and not mine.parent.exists()  # the user's path is left alone
    assert base_model.DATASET.is_file() and built == [tmp_path / "cache" / "base"]
    assert "generator.dataset" in capsys.readouterr().out  # and the user is told


def test_the_gpu_config_builds_its_model_on_the_gpu_in_a_child(tmp_path, monkeypatch):
    """configs/gpu_one_h200.toml's hook warms its 0.6B model up in a child process, so the
    `slime-async run` that calls it holds no CUDA context on the GPU its roles share; a failed
    warm-up stops the run naming the command."""
    from examples.arithmetic import base_model

    cfg = load_config([REPO / "configs" / "gpu_one_h200.toml"])
    assert Path(cfg.learner.model_path) == base_model.MODEL_GPU
    assert Path(cfg.generator.dataset) == base_model.DATASET
    for name in ("DATASET", "EVAL", "EVAL_LARGE"):
        monkeypatch.setattr(base_model, name, tmp_path / f"{name}.jsonl")
    monkeypatch.setattr(base_model, "MODEL_GPU", tmp_path / "gpu-base")
    calls = []

    def child(cmd, cwd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(base_model.subprocess, "run", child)
    with pytest.raises(SystemExit, match="gpu-base failed \\(exit 3\\)"):
        base_model.prepare_gpu(cfg)
    (cmd,) = calls
    assert cmd[1:3] == ["-m", "examples.arithmetic.base_model"]
    assert {"--shape", "0.6b", "--dtype", "bfloat16", "--require-gpu"} <= set(cmd)
    assert base_model.DATASET.is_file()


def test_the_gpu_warm_up_refuses_a_machine_without_a_gpu():
    done = subprocess.run(
        [
            *(sys.executable, "-m", "examples.arithmetic.base_model", "--shape", "0.6b"),
            *("--require-gpu", "--out", "/nonexistent/never-written"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=120,
    )
    assert done.returncode == 2 and "none is visible" in done.stderr


def _cli(*args, cwd=REPO, timeout=120):
    return subprocess.run(
        python_module("slime_async", *args),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def test_config_command_imports_and_checks_every_plugin(project, tmp_path):
    r = _cli("config", str(project / "run.toml"), "--no-plugins", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli("config", str(project / "run.toml"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generator"]["rollout"] == "guess_plugin:rollout"
    for line in ("generator.rollout guess_plugin:rollout: ok", "generator.reward", "algo.loss"):
        assert line in r.stderr
    r = _cli("config", str(project / "run.toml"), "generator.reward=guess_plugin:bad_reward")
    assert r.returncode == 2
    assert "reward 'guess_plugin:bad_reward'" in r.stderr and "signature" in r.stderr


def test_run_checks_plugins_before_starting_any_process(project, tmp_path):
    """Found 8: a bad signature used to show only after the buffer and engines had started."""
    run_dir = tmp_path / "run"
    r = _cli(
        "run",
        str(project / "run.toml"),
        f"run.run_dir={str(run_dir)!r}",
        "generator.rollout=guess_plugin:sync_rollout_by_mistake",
        "run.progress=plain",
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert "rollout 'guess_plugin:sync_rollout_by_mistake'" in r.stderr
    assert "started" not in r.stdout  # no buffer, engine, generator or learner
    logs = run_dir / "logs"
    assert not logs.exists() or not any(logs.iterdir())


def test_a_child_that_dies_at_start_up_is_reported_readably(tmp_path):
    """Found 10: the start-up failure message read 'exited with 3 before x to be ready:'."""
    child = Child(
        "engine0",
        [sys.executable, "-c", "import sys; print('CUDA not available'); sys.exit(3)"],
        log_path=tmp_path / "engine0.log",
    )
    try:
        with pytest.raises(RuntimeError) as e:
            wait_until(lambda: False, 30, "engine0 to be ready (GET /health)", child=child)
    finally:
        child.stop()
    msg = str(e.value)
    assert msg.startswith(
        f"engine0 (pid {child.pid}) exited with 3 while waiting for engine0 to be ready "
        f"(GET /health); last lines of {tmp_path / 'engine0.log'}:\n"
    )
    assert msg.endswith("CUDA not available")


def test_inspect_says_when_a_run_kept_no_log(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    load_config([], [f"run.run_dir={str(run)!r}"]).write_json(run / "config.json")
    r = _cli("inspect", str(run))
    assert r.returncode == 2 and "buffer.wal_dir" in r.stderr
    r = _cli("inspect", str(tmp_path))
    assert r.returncode == 2 and "not a run directory" in r.stderr


def test_inspect_decodes_segments_from_the_loss_mask():
    import numpy as np

    from slime_async.commands.inspect import segments
    from slime_async.testing.trajectories import synthetic_group

    t = synthetic_group("g", 1, response_len=16)[0]
    t.loss_mask = np.array([1] * 5 + [0] * 3 + [1] * 8, dtype=np.uint8)
    assert segments(t) == [
        {"kind": "model", "start": 0, "end": 5},
        {"kind": "env", "start": 5, "end": 8},
        {"kind": "model", "start": 8, "end": 16},
    ]


@pytest.fixture()
def installed_only(monkeypatch):
    """This process as if slime_async were installed: the checkout (and its `examples/`) off
    sys.path, the examples' modules forgotten; both restored afterwards."""
    repo = str(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", repo)])
    for name in [n for n in sys.modules if n == "examples" or n.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)


def test_shipped_config_works_from_another_directory(tmp_path, monkeypatch, capsys, installed_only):
    """`slime-async config <checkout>/configs/quickstart.toml` from elsewhere: the shipped configs
    name the checkout in generator.import_dirs, relative to themselves."""
    from slime_async.cli import main

    monkeypatch.chdir(tmp_path)
    quickstart = REPO / "configs" / "quickstart.toml"
    assert main(["config", str(quickstart), "generator.import_dirs=[]"]) == 2
    # Without the entry, the error names the key, the path, where it looked, and what to do.
    err = capsys.readouterr().err
    assert (
        "run.prepare = 'examples.arithmetic.base_model:prepare': no module named 'examples'; "
        "searched "
    ) in err
    assert f"{tmp_path} (the working directory)" in err and str(REPO / "configs") in err
    assert "name the checkout in generator.import_dirs" in err
    for config in (quickstart, REPO / "examples" / "guess_number" / "config.toml"):
        assert main(["config", str(config)]) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert "run.prepare examples." in err
        assert str(REPO) in json.loads(out)["generator"]["import_dirs"]


def test_import_dirs_are_relative_to_the_file_that_sets_them(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "run.toml").write_text('[generator]\nimport_dirs = ["../lib", "/abs/dir"]\n')
    monkeypatch.chdir(tmp_path / "lib")
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_config([conf / "run.toml"])
    assert cfg.generator.import_dirs == [str(lib), "/abs/dir", str(conf)]
    # From the command line: relative to the working directory, as every path there.
    cli = load_config([conf / "run.toml"], ['generator.import_dirs=["x"]'])
    assert cli.generator.import_dirs == ["x", str(conf)]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "generator.reward",
            "guess_plugin:nothere",
            "generator.reward = 'guess_plugin:nothere': module 'guess_plugin' (/",
        ),
        (
            "generator.rollout",
            "no_such_module:rollout",
            "generator.rollout = 'no_such_module:rollout': no module named 'no_such_module'; "
            "searched ",
        ),
        (
            "algo.loss",
            "guess_plugin.sub:loss",
            "algo.loss = 'guess_plugin.sub:loss': no module named 'guess_plugin.sub'; searched",
        ),
        (
            "generator.lifecycle",
            "guess_plugin:missing",
            "generator.lifecycle = 'guess_plugin:missing': module 'guess_plugin'",
        ),
        ("generator.reward", "no_such_reward", "generator.reward: unknown reward 'no_such_reward'"),
    ],
)
def test_plugin_import_errors_name_the_key_the_path_and_the_places(
    project, tmp_path, monkeypatch, capsys, key, value, message
):
    from slime_async.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["config", str(project / "run.toml"), f"{key}={value!r}"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "has no attribute" in message or "(/" in message:  # the module's file, then the name
        assert "guess_plugin.py) has no attribute" in err
    if "searched" in message:  # the config file's directory among the places
        assert str(project) in err
    if value.startswith("no_such_module"):  # a missing top-level module: the working dir too
        assert f"{tmp_path} (the working directory)" in err


def test_a_refused_start_writes_nothing_to_runs(project, tmp_path):
    """A run refused by its checks (a plug-in, a missing input) leaves no empty run directory."""
    runs = tmp_path / "runs"
    for override in ("generator.reward=guess_plugin:nothere", "learner.model_path='nowhere'"):
        r = _cli(
            "run",
            str(project / "run.toml"),
            f"run.runs_dir={str(runs)!r}",
            override,
            "run.progress=plain",
            cwd=tmp_path,
        )
        assert r.returncode == 2, r.stderr
        assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
