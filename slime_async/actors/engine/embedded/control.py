"""The embedded engine's control routes: weight version, pause/continue, abort, cache flush,
garbage-collector freeze.

Serves /get_weight_version, /update_weight_version, /pause_generation, /continue_generation,
/abort_request, /flush_cache and /freeze_gc with SGLang 0.5.23's request fields and defaults
(`srt/managers/io_struct.py`) and answers (`srt/entrypoints/http_server.py`). Waits on: the
scheduler thread, which runs every command between two steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from slime_async.actors.engine.embedded.http import BadRequest, error, read_body
from slime_async.utils.gc_watch import freeze

if TYPE_CHECKING:
    from slime_async.actors.engine.embedded.server import EmbeddedEngine

PAUSE_MODES = ("abort", "retract", "in_place")
"""io_struct.py: PauseGenerationReqInput.mode, a Literal, "abort" by default."""


class ControlRoutes:
    """Control routes of one EmbeddedEngine; `add_routes` wires them into its app."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/get_weight_version", self.get_weight_version)
        router.add_post("/update_weight_version", self.update_weight_version)
        # http_server.py: flush_cache is served on GET and POST.
        for method in ("GET", "POST"):
            router.add_route(method, "/flush_cache", self.flush_cache)
            # http_server.py: freeze_gc_async, GET and POST as well.
            router.add_route(method, "/freeze_gc", self.freeze_gc)
        for name in ("pause_generation", "continue_generation", "abort_request"):
            router.add_post(f"/{name}", getattr(self, name))

    @property
    def _sched(self):
        return self.engine.scheduler

    async def get_weight_version(self, request: web.Request) -> web.Response:
        if self.engine.cfg.embedded.strict_sglang:
            # http_server.py of 0.5.23 has no such route (the version is in /model_info).
            return error(404, "unknown endpoint GET /get_weight_version (not in SGLang 0.5.23)")
        return web.json_response({"weight_version": self.engine.reported_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        if b.get("new_version") is None:
            raise BadRequest("update_weight_version needs new_version")
        new = str(b["new_version"])
        # io_struct.py: UpdateWeightVersionReqInput.abort_all_requests defaults to True, and
        # http_server.py: update_weight_version aborts every request first when it is set.
        if b.get("abort_all_requests", True):
            await self.engine._on_scheduler(lambda: self._sched.abort(abort_all=True))

        def apply() -> None:
            self._sched.version = new

        await self.engine._on_scheduler(apply)
        self.engine.reported_version = new
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(
                f"pause_generation mode must be abort, retract or in_place, got {mode!r}"
            )
        await self.engine._on_scheduler(lambda: self._sched.pause(mode))
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_body(request)
        await self.engine._on_scheduler(self._sched.resume)
        return web.json_response({"success": True, "message": "continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        # io_struct.py: AbortReq.abort_all False, rid "" by default.
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not rid:  # SGLang: nothing to abort, still 200
            return web.json_response({"success": True, "message": "aborted 0 request(s)"})
        n = await self.engine._on_scheduler(lambda: self._sched.abort(rid, abort_all))
        return web.json_response({"success": True, "message": f"aborted {n} request(s)"})

    async def freeze_gc(self, request: web.Request) -> web.Response:
        # As SGLang's scheduler and tokenizer manager (utils/common.py: freeze_gc): every object
        # alive now goes out of the garbage collector's sight, without a collection first.
        freeze(f"{request.method} /freeze_gc", collect=False)
        return web.Response(text="Garbage collection frozen.\n", status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        # As SGLang: a text body, 200 when flushed, 400 when requests were running (strict).
        ok = await self.engine._on_scheduler(self._sched.flush)
        if ok:
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(
            text="Cache not flushed: requests are running (strict_sglang, as SGLang).\n",
            status=400,
        )
