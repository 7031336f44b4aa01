"""The one way this project starts the real sglang-router (PyPI `sglang-router`), and the HTTP
readiness probes of `slime-async run` (an engine's /health, the router's /workers).

Binds host:port for requests and host:prometheus_port for metrics; both default to 0.0.0.0 in the
router, so both are always given. Ready when GET /workers lists every worker as healthy (its own
/health answers before workers are accepted); with an API key the router answers 401 without it.
The router re-serialises /generate bodies and drops unknown fields, but passes response bodies
through unchanged.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from slime_async.utils.procs import python_module


def router_argv(
    worker_urls: list[str],
    *,
    host: str,
    port: int,
    prometheus_port: int,
    policy: str = "round_robin",
    api_key: str | None = None,
    health_check: tuple[int, int] | None = None,
) -> list[str]:
    """The command line of one sglang-router in front of `worker_urls`. `health_check`:
    (seconds between its GET /health probes of each worker, failures in a row before it stops
    sending a worker requests); None: the router's own defaults (60 s, 3)."""
    if not worker_urls:
        raise ValueError("sglang-router needs at least one worker URL")
    argv = python_module(
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
    )
    if api_key:
        argv += ["--api-key", api_key]
    if health_check is not None:
        interval, failures = health_check
        argv += [
            "--health-check-interval-secs",
            str(interval),
            "--health-failure-threshold",
            str(failures),
        ]
    return argv


def _get(url: str, api_key: str | None, timeout_s: float) -> Any:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    return urllib.request.urlopen(req, timeout=timeout_s)


def http_ok(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> bool:
    """GET `url` answers 200."""
    with _get(url, api_key, timeout_s) as resp:
        return resp.status == 200


def router_workers(router_url: str, api_key: str | None = None, timeout_s: float = 2.0) -> list:
    """The router's GET /workers list."""
    with _get(f"{router_url}/workers", api_key, timeout_s) as resp:
        return json.loads(resp.read()).get("workers", [])


def router_ready(
    router_url: str, worker_urls: list[str], api_key: str | None = None, timeout_s: float = 2.0
) -> bool:
    """The router lists every worker in `worker_urls` as healthy."""
    workers = router_workers(router_url, api_key, timeout_s)
    healthy = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
    return all(u.rstrip("/") in healthy for u in worker_urls)
