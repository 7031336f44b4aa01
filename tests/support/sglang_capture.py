"""A recording HTTP proxy in front of a real engine: what the project's code sends, as sent.

    with RecordingProxy(engine_url) as proxy:   # binds 127.0.0.1:<free port>, own loop thread
        ... point EngineClient / EnginePool / WeightPusher / EngineProbe at proxy.url ...
    proxy.captured                              # [Captured(method, path, body, headers, query)]

Every request is recorded, then forwarded byte for byte to the upstream engine (its
Authorization and Content-Type headers with it), and the upstream's status, content type and
body are streamed back (server-sent events of a streamed /generate too). Paths in `refuse`
are answered 404 without forwarding, as an older server or a router that lacks the route would,
so that the callers' fall-backs run. Forwarded calls wait up to `timeout_s` for the upstream (a
weight update holds its call open while the broadcast runs); a proxy that does not come up in
10 s raises, naming its port.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.sglang_wheel import Captured

FORWARDED_HEADERS = {"authorization", "content-type", "accept"}


class RecordingProxy:
    """Records and forwards every HTTP request to `upstream` (see the module docstring)."""

    def __init__(self, upstream: str, refuse: set[str] | None = None, timeout_s: float = 300.0):
        self.upstream = upstream.rstrip("/")
        self.refuse = set(refuse or ())
        self.timeout_s = timeout_s
        self.captured: list[Captured] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-capture")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> RecordingProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            port = fut.result(timeout=10)
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self) -> int:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        return self._runner.addresses[0][1]

    def stop(self) -> None:
        """Close the listener and the upstream session, then the loop thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self) -> set[tuple[str, str]]:
        return {(c.method, c.path) for c in self.captured}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        self.captured.append(
            Captured(request.method, request.path, body, headers, dict(request.query))
        )
        if request.path in self.refuse:
            return web.json_response({"detail": "Not Found"}, status=404)
        assert self._session is not None
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=raw or None, headers=headers
            ) as up:
                resp = web.StreamResponse(status=up.status)
                if "Content-Type" in up.headers:
                    resp.headers["Content-Type"] = up.headers["Content-Type"]
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, TimeoutError) as e:
            return web.json_response(
                {"error": {"message": f"capture proxy: upstream {self.upstream}: {e!r}"}},
                status=502,
            )
