"""A recording HTTP proxy in front of a real engine: `with RecordingProxy(url) as p: p.url`.

Binds a free loopback port and serves it from its own thread and event loop (so a synchronous
test, or a router child process, can reach it while the test waits on something else). Every
request is forwarded to `target` as it came (method, path, query, body, Authorization) and
answered with the engine's status, body and content type; the JSON body of each request and of
its answer are kept (`recorded(path)`: (request, answer) pairs in arrival order), so a test can
check field by field what reached the engine (for example through sglang-router, which
re-serialises /generate bodies) and what it answered. Buffers whole bodies: no streaming.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from typing import Any

import aiohttp
from aiohttp import web

from slime_async.utils.procs import free_port


class RecordingProxy:
    """Forwards to `target` and records each request's JSON body by path."""

    def __init__(self, target: str, host: str = "127.0.0.1", timeout_s: float = 120.0):
        self.target = target.rstrip("/")
        self.host = host
        self.port = free_port(host)
        self.timeout_s = timeout_s
        self.exchanges: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def recorded(self, path: str) -> list[tuple[Any, Any]]:
        """(request body, answer body) of each call of `path` answered so far, JSON-decoded where
        they are JSON."""
        with self._lock:
            return list(self.exchanges[path])

    async def _forward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization",)}
        if request.content_type:
            headers["Content-Type"] = request.content_type
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.request(
                request.method, self.target + request.path_qs, data=raw, headers=headers
            ) as r,
        ):
            data = await r.read()
            with self._lock:
                self.exchanges[request.path].append((_decoded(raw), _decoded(data)))
            return web.Response(
                body=data, status=r.status, content_type=r.content_type or "application/json"
            )

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    def start(self) -> RecordingProxy:
        self._thread = threading.Thread(target=self._run, name="recording-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError(f"recording proxy on {self.url} did not start within 30 s")
        if self._error is not None:
            raise RuntimeError(f"recording proxy on {self.url} failed: {self._error}")
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _decoded(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw
