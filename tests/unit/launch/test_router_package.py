"""`engine.router_package`: which router `slime-async run` starts, and a missing one refused at
start-up with the pip command (slime_async/launch/router.py)."""

import sys

import pytest

from slime_async.config import ConfigError
from slime_async.launch import router as rt


def _installed(monkeypatch, *modules: str, smg_on_path: bool = False) -> None:
    monkeypatch.setattr(
        rt.importlib.util, "find_spec", lambda name: object() if name in modules else None
    )
    monkeypatch.setattr(rt.shutil, "which", lambda n: "/opt/smg/bin/smg" if smg_on_path else None)


def _argv(package: str) -> list[str]:
    return rt.router_argv(
        ["http://127.0.0.1:1"], host="127.0.0.1", port=2, prometheus_port=3, package=package
    )


def test_auto_prefers_smg_and_falls_back_to_sglang_router(monkeypatch):
    _installed(monkeypatch, "smg", "sglang_router")
    assert _argv("auto")[:3] == [sys.executable, "-m", "smg.launch_router"]
    assert _argv("sglang-router")[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    _installed(monkeypatch, "sglang_router")
    assert _argv("auto")[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    _installed(monkeypatch, "sglang_router", smg_on_path=True)  # smg in a venv of its own
    assert _argv("auto")[:2] == ["/opt/smg/bin/smg", "launch"]


def test_the_same_flags_for_both_packages(monkeypatch):
    _installed(monkeypatch, "smg", "sglang_router")
    argvs = [
        rt.router_argv(
            ["http://127.0.0.1:1", "http://127.0.0.1:4"],
            host="127.0.0.1",
            port=2,
            prometheus_port=3,
            policy="cache_aware",
            api_key="k",
            health_check=(1, 4),
            package=p,
        )[3:]
        for p in ("smg", "sglang-router")
    ]
    assert argvs[0] == argvs[1]
    a = argvs[0]
    assert a[a.index("--api-key") + 1] == "k" and a[a.index("--policy") + 1] == "cache_aware"
    assert a[a.index("--health-check-interval-secs") + 1] == "1"
    assert a[a.index("--health-failure-threshold") + 1] == "4"


@pytest.mark.parametrize(
    ("choice", "pip"),
    [("smg", "pip install smg>=1.13"), ("sglang-router", "pip install sglang-router>=0.3")],
)
def test_a_package_that_is_not_installed_is_refused_with_its_pip_command(monkeypatch, choice, pip):
    _installed(monkeypatch)
    with pytest.raises(ConfigError, match=f"engine.router_package = '{choice}'.*{pip}"):
        _argv(choice)
    with pytest.raises(ConfigError, match="neither smg nor sglang-router is installed"):
        _argv("auto")


def test_the_launch_table_refuses_a_missing_router_before_starting_anything(monkeypatch, tmp_path):
    from tests.support.launch_plan import planned

    _installed(monkeypatch, "sglang_router")
    with pytest.raises(ConfigError, match=r"engine\.router_package = 'smg'"):
        planned(tmp_path, "engine.num_engines=2", "engine.router_package=smg")
