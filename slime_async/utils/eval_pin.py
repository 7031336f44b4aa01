"""The pinned-evaluation handshake between the learner and generator 0, through the run directory.

    learner: engines hold version v (pushed, announced) and v is due -> writes eval/request_v<v>.json
    generator 0 (evaluate.py): sees the request -> evaluates v on the engines -> eval/result_v<v>.json
    learner: before pushing v + 1, waits for result_v<v>.json (eval.interval's "hold")

The learner holds only its push, not its training: generation and training go on at version v
while the evaluation runs, and no weight update can reach an evaluation answer. On a cluster the
learner and generator 0 must share `run.run_dir`. Files appear atomically (written, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

EVAL_DIR = "eval"


def request_path(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / EVAL_DIR / f"request_v{version}.json"


def result_path(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / EVAL_DIR / f"result_v{version}.json"


def write_json_atomic(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, path)
    return path


def pending_requests(run_dir: str | Path) -> list[int]:
    """Versions requested and not yet answered, oldest first."""
    d = Path(run_dir) / EVAL_DIR
    if not d.is_dir():
        return []
    out = []
    for p in d.glob("request_v*.json"):
        v = p.stem.removeprefix("request_v")
        if v.isdigit() and not result_path(run_dir, int(v)).exists():
            out.append(int(v))
    return sorted(out)


def read_request(run_dir: str | Path, version: int) -> dict[str, Any]:
    """The learner's request for `version` ({"version", "step", "position"}), or {} if unreadable."""
    try:
        out = json.loads(request_path(run_dir, version).read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def read_result(run_dir: str | Path, version: int) -> dict[str, Any] | None:
    p = result_path(run_dir, version)
    return json.loads(p.read_text()) if p.exists() else None
