"""bench/bench_async.py starts on every shipped single-machine config at its defaults: pinned
evaluation on where the config has held-out data, off (with a note) where it has none."""

import importlib.util

import pytest

from slime_async.config import load_config
from tests.support.repo import REPO

spec = importlib.util.spec_from_file_location("bench_async", REPO / "bench" / "bench_async.py")
bench_async = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_async)

CONFIGS = sorted(
    str(p.relative_to(REPO))
    for p in [*REPO.glob("configs/*.toml"), *REPO.glob("configs/staleness/*.toml")]
)


@pytest.mark.parametrize("config", CONFIGS)
def test_default_eval_interval_is_one_the_config_accepts(config, capsys):
    n = bench_async.eval_interval([config], [], None)
    cfg = load_config([REPO / config], [f"eval.interval={n}"])
    assert (n > 0) == (cfg.eval.data is not None)
    if cfg.eval.data is None:
        assert "no eval.data" in capsys.readouterr().out


def test_an_asked_interval_is_kept():
    assert bench_async.eval_interval(["configs/quickstart.toml"], [], 3) == 3
