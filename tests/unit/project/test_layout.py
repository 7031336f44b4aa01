"""The package's layout holds: who may import whom, folder sizes, and the README's map of it.

The rules are the README's "Package map" table; this test reads the imports from the source (as
text, with `ast`), so a new import that crosses a boundary fails here with the file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.repo import REPO as ROOT

PKG = ROOT / "slime_async"

# Room -> the rooms it may import (besides itself). A room is a folder of the package, or a
# top-level module. Rooms not listed (commands, cli, __main__) may import anything but testing.
BASE = {"utils", "config", "metrics"}
MAY_IMPORT: dict[str, set[str]] = {
    "utils": set(),
    "config": set(),
    "metrics": set(),
    "megatron_compat": set(),
    "queue": BASE,
    "algos": BASE,
    "models": BASE | {"megatron_compat"},
    "models/llama": {"models"},
    "models/glm4": {"models"},
    "models/qwen3_moe": {"models", "models/llama"},
    "actors/engine": BASE | {"models", "megatron_compat"},
    "actors/engine/embedded": BASE | {"actors/engine", "models", "megatron_compat"},
    "actors/generator": BASE | {"actors/engine", "queue", "models"},
    "actors/learner": BASE | {"actors/engine", "queue", "models", "algos", "megatron_compat"},
    "launch": BASE | {"queue", "actors/engine"},
    "launch/ray": BASE | {"queue", "launch"},
    "api": BASE | {"actors/generator", "algos"},
    "actors": {"actors/generator"},  # the old import paths of the plug-in API
    "testing": BASE | {"queue", "queue/wal"},  # wal_runs.py writes a log as the buffer does
}


def room_of(module: str) -> str:
    """`slime_async.actors.engine.embedded.server` -> `actors/engine/embedded`."""
    parts = module.split(".")[1:]
    path = PKG.joinpath(*parts)
    if path.is_dir():
        rel = path.relative_to(PKG)
    elif path.with_suffix(".py").is_file():
        rel = path.with_suffix("").relative_to(PKG)
        rel = rel.parent if rel.parent != Path(".") else rel
    else:  # an attribute of a module: its module's room
        return room_of(".".join(module.split(".")[:-1]))
    return rel.as_posix() if str(rel) != "." else ""


def file_room(path: Path) -> str:
    rel = path.relative_to(PKG)
    if rel.parent == Path("."):
        return rel.stem
    return rel.parent.as_posix()


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("slime_async."):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.append((node.lineno, full if room_of_safe(full) else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("slime_async.")]
    return out


def room_of_safe(module: str) -> bool:
    parts = module.split(".")[1:]
    path = PKG.joinpath(*parts)
    return path.is_dir() or path.with_suffix(".py").is_file()


def allowed(src: str, dst: str) -> bool:
    if dst in ("", src) or dst.startswith(src + "/"):
        return True  # the package root, itself, or one of its own subfolders
    if dst == "testing":
        return src == "testing"
    return src not in MAY_IMPORT or dst in MAY_IMPORT[src]


def test_imports_follow_the_package_map():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        src = file_room(path)
        for line, module in imports_of(path):
            dst = room_of(module)
            if not allowed(src, dst):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {module} ({dst})")
    assert not bad, "imports across the package map:\n" + "\n".join(bad)


def test_runtime_never_imports_testing_builders():
    for path in PKG.rglob("*.py"):
        if file_room(path) == "testing":
            continue
        for line, module in imports_of(path):
            assert room_of(module) != "testing", f"{path}:{line} imports the testing builders"


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def test_no_folder_holds_more_than_a_fifth_of_the_package():
    total = sum(_lines(p) for p in PKG.rglob("*.py"))
    for folder in [p for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        own = sum(_lines(p) for p in folder.glob("*.py"))  # its own files, not its subfolders
        assert own <= 0.22 * total, f"{folder.relative_to(ROOT)} holds {own} of {total} lines"


def test_readme_map_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Package map", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"^\| `slime_async/([\w/.]*)` \|", section, flags=re.M))
    folders = {
        p.relative_to(PKG).as_posix() + "/"
        for p in PKG.rglob("*")
        if p.is_dir() and (p / "__init__.py").exists()
    }
    modules = {p.name for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert mapped == folders | modules, (
        f"README map: missing {sorted((folders | modules) - mapped)}, "
        f"not in the tree {sorted(mapped - folders - modules)}"
    )
    for room in MAY_IMPORT:  # every rule above is written in the map too
        key = room + ("/" if (PKG / room).is_dir() else ".py")
        assert f"| `slime_async/{key}` |" in section, f"README map lacks {key}"
