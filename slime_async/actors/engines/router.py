"""Start and stop the real sglang-router (PyPI `sglang-router`) in front of several engines.

Binds host:port for requests and host:prometheus_port for metrics (both default to 0.0.0.0 in the
router, so both are always set). Ready when GET /workers lists every worker with is_healthy true
(its own /health answers before workers are accepted). The router re-serialises /generate bodies
and drops unknown fields, but passes response bodies through unchanged.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from slime_async.utils.procs import Child, free_port, python_module, wait_until


class Router:
    """One sglang-router child process. `with Router(urls) as r: r.url`."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "round_robin",
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 60.0,
    ):
        if not worker_urls:
            raise ValueError("sglang-router needs at least one worker URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.host = host
        self.port = port or free_port(host)
        self.prometheus_port = free_port(host)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Router:
        argv = python_module(
            "sglang_router.launch_router",
            "--host", self.host,
            "--port", str(self.port),
            "--prometheus-host", self.host,
            "--prometheus-port", str(self.prometheus_port),
            "--policy", self.policy,
            "--worker-urls", *self.worker_urls,
        )  # fmt: skip
        self.child = Child("sglang-router", argv, log_path=self.log_path)
        try:
            wait_until(
                lambda: self.healthy_workers() >= len(self.worker_urls),
                self.startup_timeout_s,
                f"sglang-router at {self.url} to accept {len(self.worker_urls)} workers",
                interval=0.2,
                child=self.child,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def workers(self) -> list[dict]:
        """The router's GET /workers list."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=2) as resp:
            return json.loads(resp.read()).get("workers", [])

    def healthy_workers(self) -> int:
        return sum(1 for w in self.workers() if w.get("is_healthy"))

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
