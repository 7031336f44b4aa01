"""The real router (smg or sglang-router) as a child process for tests:
`with Router(urls, package="smg") as r: r.url`; `ROUTER_PACKAGES` parametrises a test over both,
skipping one that is not installed (with the pip command that installs it).

Started with the same command line and readiness check as `slime-async run`
(`slime_async/launch/router.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_async.config import ConfigError
from slime_async.launch.router import (
    resolve_router_package,
    router_argv,
    router_ready,
    router_workers,
)
from slime_async.utils.procs import Child, free_port, wait_until

ROUTER_PACKAGES = ["sglang-router", "smg"]
"""Every package that ships the router; `router_package_or_skip` skips one not installed."""


def router_package_or_skip(package: str) -> str:
    """`package` if installed here, else skip the test naming the pip command."""
    try:
        return resolve_router_package(package)  # type: ignore[arg-type]
    except ConfigError as e:
        pytest.skip(str(e))


class Router:
    """One router child process (`package`: smg, sglang-router or auto).
    `with Router(urls) as r: r.url`."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "round_robin",
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 60.0,
        api_key: str | None = None,
        package: str = "auto",
        health_check: tuple[int, int] | None = None,
    ):
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.host = host
        self.port = port or free_port(host)
        self.prometheus_port = free_port(host)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.api_key = api_key
        self.package = package
        self.health_check = health_check
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Router:
        argv = router_argv(
            self.worker_urls,
            host=self.host,
            port=self.port,
            prometheus_port=self.prometheus_port,
            policy=self.policy,
            api_key=self.api_key,
            health_check=self.health_check,
            package=self.package,  # type: ignore[arg-type]
        )
        self.child = Child(f"router ({self.package})", argv, log_path=self.log_path)
        try:
            wait_until(
                lambda: router_ready(self.url, self.worker_urls, self.api_key),
                self.startup_timeout_s,
                f"router ({self.package}) at {self.url} to accept {len(self.worker_urls)} workers",
                interval=0.2,
                child=self.child,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def workers(self) -> list[dict]:
        """The router's GET /workers list."""
        return router_workers(self.url, self.api_key)

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
