"""Restart requests: a role asks `slime-async run`'s supervisor to restart an engine.

    request_restart(run_dir, url, reason, by="learner")    # writes <run_dir>/restart_requests/*.json
    for req in take_restart_requests(run_dir): ...          # the supervisor: read and removed

One JSON file per request ({url, reason, by, time}), written whole (a rename), so a reader never
sees half of one. The supervisor acts on them in `slime_async/launch/liveness.py`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

REQUESTS_DIR = "restart_requests"
"""The folder of the run directory that holds the pending requests."""


def request_restart(run_dir: str | Path, url: str, reason: str, by: str) -> bool:
    """Ask the run's supervisor to restart the engine at `url` (a file it reads); True once
    written."""
    folder = Path(run_dir) / REQUESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    body = {"url": url.rstrip("/"), "reason": reason, "by": by, "time": time.time()}
    tmp = folder / f".{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(body))
    tmp.replace(folder / f"{uuid.uuid4().hex}.json")  # whole or not at all
    log.info("asked slime-async run to restart engine %s: %s", url, reason)
    return True


def take_restart_requests(run_dir: str | Path) -> list[dict]:
    """The pending requests, oldest first, each removed once read (an unreadable one is
    removed and reported as such)."""
    folder = Path(run_dir) / REQUESTS_DIR
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            body = json.loads(path.read_text())
            if not isinstance(body, dict) or not isinstance(body.get("url"), str):
                raise ValueError("no url")
        except (OSError, ValueError) as e:
            body = {"url": "", "reason": f"unreadable request {path.name}: {e}", "time": 0.0}
        path.unlink(missing_ok=True)
        out.append(body)
    return out
