"""The one way this project starts the real router in front of several engines, and the HTTP
readiness probes of `slime-async run` (an engine's /health, the router's /workers).

Two packages ship that router: `sglang-router` (PyPI, 0.3.2 its last release; a PyO3 extension
run as `python -m sglang_router.launch_router`) and its successor `smg` (PyPI, 1.13; the same
argument parser: `python -m smg.launch_router`, or the `smg launch` console script of an smg
installed in a venv of its own). Every flag used here has the same name and meaning in both
(their `router_args.py`, `RouterArgs.add_cli_args`; checked against `--help` of each).

Binds host:port for requests and host:prometheus_port for metrics; both default to 0.0.0.0 in the
router, so both are always given. Ready when GET /workers lists every worker (`url`) with
`is_healthy` true (its own /health answers before workers are accepted). smg registers a worker
only once one of /v1/models, /version, /server_info answers (it retries while all are 404);
sglang-router 0.3.2 accepts 404 on its info requests.

Keys (measured with both packages in front of keyed embedded engines): `--api-key` is the key the
router sends to the workers (its health probes, worker-info calls and forwarded requests) *and*,
without `--control-plane-api-keys`, the Bearer key every client must send on /generate and
/workers (401 without it). So `engine.api_key` is given to the router as `--api-key` and the
generators and probes send it to the router as they send it to an engine. /health, /liveness and
/readiness need no key. The router re-serialises /generate bodies and drops unknown fields, but
passes response bodies through unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import urllib.request
from typing import Any, Literal

from slime_async.config import ConfigError

RouterPackage = Literal["smg", "sglang-router"]

_MODULE = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}
_PIP = {"smg": "pip install smg>=1.13", "sglang-router": "pip install sglang-router>=0.3"}


def router_entry(package: RouterPackage) -> list[str] | None:
    """The argv prefix that starts `package`'s router, or None where it is not installed: its
    module in this interpreter, else (smg only) an `smg` console script on PATH."""
    module = _MODULE[package]
    if importlib.util.find_spec(module.split(".")[0]) is not None:
        return [sys.executable, "-m", module]
    if package == "smg" and (exe := shutil.which("smg")) is not None:
        return [exe, "launch"]
    return None


def resolve_router_package(choice: Literal["auto", "smg", "sglang-router"]) -> RouterPackage:
    """`engine.router_package` made concrete: auto takes smg where installed, else sglang-router.
    A package that is not installed is refused with the pip command that installs it."""
    if choice == "auto":
        for package in ("smg", "sglang-router"):
            if router_entry(package) is not None:
                return package
        raise ConfigError(
            "engine.router_package = 'auto': neither smg nor sglang-router is installed, and "
            f"engine.num_engines > 1 needs a router: `{_PIP['smg']}` (or "
            f"`{_PIP['sglang-router']}`)"
        )
    if router_entry(choice) is None:
        raise ConfigError(
            f"engine.router_package = {choice!r}: it is not installed (no module "
            f"{_MODULE[choice].split('.')[0]!r} in {sys.executable}"
            + (" and no `smg` on PATH" if choice == "smg" else "")
            + f"): `{_PIP[choice]}`"
        )
    return choice


def router_argv(
    worker_urls: list[str],
    *,
    host: str,
    port: int,
    prometheus_port: int,
    policy: str = "round_robin",
    api_key: str | None = None,
    health_check: tuple[int, int] | None = None,
    package: Literal["auto", "smg", "sglang-router"] = "auto",
) -> list[str]:
    """The command line of one router (`package`, see `resolve_router_package`) in front of
    `worker_urls`. `api_key`: sent to the workers, and required from clients (module docstring).
    `health_check`: (seconds between its GET /health probes of each worker, failures in a row
    before it stops sending a worker requests); None: the router's own defaults (60 s, 3)."""
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    entry = router_entry(resolve_router_package(package))
    assert entry is not None  # resolve_router_package refused a missing package
    argv = [
        *entry,
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
    ]
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
