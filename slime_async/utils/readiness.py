"""The readiness convention between `slime-async run` and the roles it starts.

The supervisor sets `SLIME_ASYNC_READY_FILE` for each child and deletes that file before every
(re)start. A role without a port to probe (the learner, the generators) calls `announce_ready()`
once it can do its work; outside a supervised run the variable is unset and the call does
nothing. Under torchrun every rank inherits the variable: call it on rank 0 after a barrier so the
file means all ranks are ready.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

READY_ENV = "SLIME_ASYNC_READY_FILE"


def announce_ready(detail: str = "") -> Path | None:
    """Tell the supervisor this process is ready (writes the file named by $SLIME_ASYNC_READY_FILE)."""
    target = os.environ.get(READY_ENV)
    if not target:
        return None
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"pid {os.getpid()} time {time.time():.3f} {detail}".rstrip() + "\n")
    os.replace(tmp, path)  # the supervisor never sees a half-written file
    return path
