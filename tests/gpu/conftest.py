"""The gpu tier: CUDA tests for a GPU machine (`make test-gpu`: pytest tests/gpu -m gpu)."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Say why, when a session that also loads a CPU tier has hidden the GPUs from these tests."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return
    hidden = pytest.mark.skipif(
        True,
        reason="CUDA_VISIBLE_DEVICES is empty (the CPU tiers empty it): run the gpu tier on its "
        "own, `make test-gpu`",
    )
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(hidden, append=False)  # ahead of the tests' own "needs a CUDA GPU"
