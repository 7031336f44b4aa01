"""The supervisor's side of liveness (`launch/liveness.py`): restart requests mapped to the engine
role that serves the URL, refused for a URL no role serves, dropped once the role restarted after
the request; a hung engine role due past restart_after_s. Real loopback servers; the whole
restart in a run is tests/integration/test_engine_liveness_runs.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from slime_async.config.engine import LivenessConfig
from slime_async.launch.liveness import RoleLiveness
from slime_async.utils.restart_requests import request_restart

FAST = LivenessConfig(
    probe_interval_s=0.1, ready_timeout_s=0.2, hung_after_s=0.5, restart_after_s=1.0
)


@dataclass
class _Child:
    started_at: float


@contextlib.contextmanager
def silent_server():
    """A port that accepts connections and never answers (a SIGSTOPped engine)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(2)
        for s in held:
            s.close()
        sock.close()


def test_restart_requests_are_mapped_to_roles(tmp_path):
    watch = RoleLiveness({"engine0": "http://127.0.0.1:9/"}, FAST, None, tmp_path)
    try:
        request_restart(tmp_path, "http://127.0.0.1:9", "stuck in its weight update", by="learner")
        request_restart(tmp_path, "http://10.0.0.7:30000", "stuck", by="learner")
        due = watch.due({"engine0": _Child(started_at=0.0)})
        assert due == [
            (
                "engine0",
                "engine0 (http://127.0.0.1:9): restart asked by learner: stuck in its weight update",
                "requested",
            )
        ]
        events = watch.events()
        assert any("http://10.0.0.7:30000" in e and "no role of this run" in e for e in events)
        # A request made before the role's last start is already served.
        request_restart(tmp_path, "http://127.0.0.1:9", "stuck", by="learner")
        assert watch.due({"engine0": _Child(started_at=time.time() + 60)}) == []
        assert any("already restarted since" in e for e in watch.events())
    finally:
        watch.close()


def test_a_hung_engine_role_is_due_past_restart_after_s(tmp_path):
    with silent_server() as url:
        watch = RoleLiveness({"engine0": url}, FAST, None, tmp_path)
        try:
            children = {"engine0": _Child(started_at=time.time())}
            assert watch.due(children) == []  # not watched before it is ready
            watch.watch_role("engine0")
            deadline = time.monotonic() + 20
            while not (due := watch.due(children)):
                assert time.monotonic() < deadline, "never due"
                time.sleep(0.05)
            ((role, why, cause),) = due
            assert (role, cause) == ("engine0", "hung")
            assert f"engine0 ({url}) answered no probe for" in why
            assert "restart_after_s = 1" in why and "GET /ready: no answer in 0.2s" in why
            assert any(e.startswith(f"engine0 ({url}) is hung") for e in watch.events())
            watch.unwatch_role("engine0")  # being restarted: not due meanwhile
            assert watch.due(children) == []
        finally:
            watch.close()
