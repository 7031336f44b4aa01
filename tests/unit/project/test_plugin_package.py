"""Plug-in packages: `examples/plugin_package` pip-installed into a temporary directory, its entry
points (group `slime_async.plugins`) seen by the rollout, reward, loss and lifecycle registries
and by `slime-async config`; a name that is also built in, or given by two packages, refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.actors.generator.lifecycle import LIFECYCLES, Lifecycle
from slime_async.actors.generator.rewards import REWARDS, resolve_reward
from slime_async.actors.generator.rollout import ROLLOUTS
from slime_async.algos import ADVANTAGES, LOSSES
from slime_async.utils.plugins import PluginError
from tests.support.repo import REPO

PACKAGE = REPO / "examples" / "plugin_package"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package installed with pip into a directory of its own (built from a copy:
    the build leaves nothing in the checkout)."""
    tmp = tmp_path_factory.mktemp("plugin_package")
    source, target = tmp / "src", tmp / "site"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    return target


@pytest.fixture()
def installed(site, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    yield site
    for name in [n for n in sys.modules if n == "keyword_env" or n.startswith("keyword_env.")]:
        del sys.modules[name]


def _dist(site: Path, name: str, entry_points: str) -> None:
    """A minimal installed distribution: its metadata and entry points, as pip writes them."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[slime_async.plugins]\n{entry_points}\n")


def test_registries_see_the_installed_package(installed):
    assert "keyword_retry" in ROLLOUTS.names() and "single_turn" in ROLLOUTS.names()
    assert "keyword" in REWARDS.names() and "keyword_pg" in LOSSES.names()
    assert LIFECYCLES.names() == ["keyword_counter"]
    assert ROLLOUTS.resolve("keyword_retry").__module__ == "keyword_env.env"
    reward = resolve_reward("keyword", "generator.reward")
    assert reward.fn.__module__ == "keyword_env.env"
    lc = Lifecycle("keyword_counter")
    assert lc.kind == "hooks" and type(lc.obj).__name__ == "Counter"
    assert LOSSES.resolve("keyword_pg", "algo.loss").__name__ == "policy_gradient"
    assert "keyword" not in ADVANTAGES.names()  # each kind sees only its own entry points


def test_the_installed_loss_trains_like_a_builtin_one(installed):
    import torch

    from slime_async.algos import LossInput, build_algorithm
    from slime_async.config import AlgoConfig

    algo = build_algorithm(AlgoConfig(loss="keyword_pg"))  # the learner's own start-up check
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = algo.loss_fn(
        LossInput(
            logp=logp,
            behavior_logp=logp.detach(),
            advantages=torch.tensor([[1.0, 1.0]]),
            loss_mask=torch.tensor([[1.0, 0.0]]),
            versions=torch.zeros(1, 2, dtype=torch.int32),
            current_version=0,
            token_denominator=1.0,
            seq_denominator=1.0,
        ),
        AlgoConfig(),
    )
    assert out.loss.item() == pytest.approx(1.0)  # -(1 x -1), the masked token left out


def test_unknown_names_list_the_installed_ones(installed):
    with pytest.raises(PluginError) as e:
        REWARDS.resolve("keywrd", "generator.reward")
    msg = str(e.value)
    assert msg.startswith("generator.reward: unknown reward 'keywrd'")
    assert "'keyword'" in msg and "'slime_async.plugins' entry points 'reward.<name>'" in msg


def test_a_name_that_is_built_in_or_doubled_is_refused(installed, tmp_path, monkeypatch):
    _dist(tmp_path, "clash_a", "reward.math = clash_a:math\nreward.keyword = clash_a:kw")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(
        PluginError,
        match=r"reward 'math' is built in and also an entry point of clash_a \(reward.math = clash_a:math\)",
    ):
        REWARDS.resolve("math", "generator.reward")
    with pytest.raises(PluginError) as e:
        REWARDS.resolve("keyword", "generator.reward")
    msg = str(e.value)
    assert "reward 'keyword' is an entry point of several installed packages (" in msg
    assert "clash_a (reward.keyword = clash_a:kw)" in msg
    assert "slime-async-keyword-env (reward.keyword = keyword_env.env:reward)" in msg


def test_an_entry_point_that_does_not_load_names_its_package(tmp_path, monkeypatch):
    _dist(tmp_path, "broken_env", "rollout.broken = broken_env_missing.mod:rollout")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(PluginError) as e:
        ROLLOUTS.resolve("broken", "generator.rollout")
    assert str(e.value).startswith(
        "generator.rollout: rollout 'broken': the entry point of broken_env "
        "(rollout.broken = broken_env_missing.mod:rollout) does not load: ModuleNotFoundError"
    )


def test_config_command_checks_installed_plugins(site, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime_async",
            "config",
            str(REPO / "configs" / "quickstart.toml"),
            "generator.rollout=keyword_retry",
            "generator.reward=keyword",
            "generator.lifecycle=keyword_counter",
            "algo.loss=keyword_pg",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for line in (
        "generator.rollout keyword_retry: ok",
        "generator.reward keyword: ok",
        "generator.lifecycle keyword_counter: ok",
        "algo.loss keyword_pg: ok",
    ):
        assert line in r.stderr
