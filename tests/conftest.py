"""Shared fixtures. Tests use loopback addresses only and stop what they start by PID."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def repo_root() -> Path:
    return REPO
