"""The checkout the tests run from: its root, found from this file, not from a fixed depth."""

from __future__ import annotations

import os
from pathlib import Path


def find_root(start: Path) -> Path:
    """The nearest folder at or above `start` that holds pyproject.toml."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml at or above {start}")


REPO = find_root(Path(__file__).resolve().parent)


def pythonpath_with_repo() -> str:
    """PYTHONPATH for a child that imports `tests.*`: one started as a script (a torchrun worker)
    has the script's folder on sys.path, not the checkout's root."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
