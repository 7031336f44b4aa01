"""Shared fixtures, and the rule the markers follow. Tests use loopback addresses only and stop
what they start by PID."""

from pathlib import Path

import pytest

from tests.support.repo import REPO

TESTS = Path(__file__).resolve().parent


@pytest.fixture()
def repo_root() -> Path:
    return REPO


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` marks exactly the tests of tests/gpu; `slow` ones live in tests/integration (so the
    unit tier stays fast without deselecting anything)."""
    misplaced = []
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        tier = item.path.relative_to(TESTS).parts[0]
        if (item.get_closest_marker("gpu") is not None) != (tier == "gpu"):
            misplaced.append(f"{item.nodeid}: `gpu` marks the tests of tests/gpu, and only those")
        if item.get_closest_marker("slow") is not None and tier != "integration":
            misplaced.append(f"{item.nodeid}: a `slow` test belongs in tests/integration")
    if misplaced:
        raise pytest.UsageError("tests in the wrong tier:\n" + "\n".join(misplaced))
