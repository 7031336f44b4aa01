"""An HTTP proxy in front of a real engine, for tests of what a real SGLang server (or an older
one) would answer where the embedded engine cannot be made to: it binds a free loopback port
on a thread of its own (its own event loop) and forwards every request to `target` unchanged
(method, path, query, body, Authorization), except where the test says otherwise:

    with EngineProxy(engine_url) as proxy:              # proxy.url: point the client here
        proxy.answer["/begin_weight_update"] = (404, {"detail": "Not Found"})  # not forwarded
        proxy.rewrite["/server_info"] = lambda body: {**body, "pp_size": 2}   # engine's answer, changed
        proxy.requests                                  # [(method, path, Authorization or None)]
        proxy.recorded("/generate")                     # [(request JSON, answer JSON)] answered

`answer` and `rewrite` may be changed while it runs (read per request). Every request is
recorded before it is answered or forwarded. A forwarded request waits as long as the engine
takes (a weight update lasts the whole broadcast). `stop()` (or leaving the `with`) closes the
port and joins the thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from slime_async.utils.procs import free_port

_HOP = {"host", "content-length", "transfer-encoding", "connection"}


class EngineProxy:
    """Forwards to `target`; `answer[path] = (status, json)` answers a path itself,
    `rewrite[path] = fn` changes the engine's JSON answer of a path."""

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.answer: dict[str, tuple[int, Any]] = {}
        self.rewrite: dict[str, Callable[[Any], Any]] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.exchanges: dict[str, list[tuple[Any, Any]]] = {}
        """path -> (request body, answer body) of each call answered, JSON-decoded where JSON."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-proxy")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def calls(self, path: str) -> list[tuple[str, str, str | None]]:
        """The recorded requests to `path`."""
        return [r for r in self.requests if r[1] == path]

    def recorded(self, path: str) -> list[tuple[Any, Any]]:
        """(request body, answer body) of each call of `path` answered so far."""
        return list(self.exchanges.get(path, ()))

    def start(self) -> EngineProxy:
        """Bind the port and serve; returns once the port accepts connections."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests.append((request.method, path, request.headers.get("Authorization")))
        sent = await request.read()
        if path in self.answer:
            status, body = self.answer[path]
            self.exchanges.setdefault(path, []).append((_decoded(sent), body))
            return web.json_response(body, status=status)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method, self.target + request.path_qs, data=sent, headers=headers
        ) as resp:
            raw = await resp.read()
            status, ctype = resp.status, resp.headers.get("Content-Type", "application/json")
        fn = self.rewrite.get(path)
        if fn is not None and status == 200:
            raw = json.dumps(fn(json.loads(raw))).encode()
            ctype = "application/json"
        self.exchanges.setdefault(path, []).append((_decoded(sent), _decoded(raw)))
        return web.Response(body=raw, status=status, content_type=ctype.split(";")[0])

    def stop(self) -> None:
        """Close the port and the connections to the engine; join the thread."""
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> EngineProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _decoded(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw
