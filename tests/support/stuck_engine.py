"""A stand-in engine whose weight-update call never completes: what a member of an NCCL group
that never comes free looks like to the learner (the broadcast returns on the learner's side,
the engine's `/update_weights_from_distributed` never answers). That cannot be made here (no
GPUs, and gloo's members come free), so this server speaks the weight-sync part of SGLang's API
over the project's real gloo group (`actors/engine/weight_sync.py`) and then blocks.

    python -m tests.support.stuck_engine --port P --marker PATH

The first update call it gets (while `--marker` does not exist) receives the tensors, creates
the marker and never answers; from then on every route that SGLang serves on its scheduler thread
(weight calls, pause, continue, flush, /server_info, /health's generation) blocks too, while
/ready and /model_info still answer at once (SGLang serves those without the scheduler). Started
again with the marker present, it behaves: it receives each update and reports the version.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from aiohttp import web

from slime_async.actors.engine.weight_sync import init_weight_group, receive_tensors


class StuckEngine:
    def __init__(self, marker: Path):
        self.marker = marker
        self.version = "default"
        self.groups: dict = {}
        self.stuck = asyncio.Event()

    async def _scheduler(self) -> None:
        """What a call that needs SGLang's scheduler waits on: nothing, unless it is stuck."""
        if self.stuck.is_set():
            await asyncio.Event().wait()  # for ever: the scheduler sits in the collective

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        await self._scheduler()
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stuck", "weight_version": self.version})

    async def server_info(self, request: web.Request) -> web.Response:
        await self._scheduler()
        return web.json_response(
            {"tp_size": 1, "pp_size": 1, "dp_size": 1, "device": "cpu", "weight_groups": []}
        )

    async def ok(self, request: web.Request) -> web.Response:
        await self._scheduler()
        return web.json_response({"success": True, "message": "ok"})

    async def flush(self, request: web.Request) -> web.Response:
        await self._scheduler()
        return web.Response(text="Cache flushed.\n")

    async def init_group(self, request: web.Request) -> web.Response:
        await self._scheduler()
        b = await request.json()
        group = await asyncio.to_thread(
            init_weight_group,
            b["master_address"],
            int(b["master_port"]),
            int(b["rank_offset"]),
            int(b["world_size"]),
            b["group_name"],
            b["backend"],
            "cpu",
            60.0,
        )
        self.groups[b["group_name"]] = group
        return web.json_response({"success": True, "message": "joined"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        await self._scheduler()
        group = self.groups.pop((await request.json())["group_name"], None)
        if group is not None:
            group.destroy()
        return web.json_response({"success": True, "message": "destroyed"})

    async def update(self, request: web.Request) -> web.Response:
        await self._scheduler()
        b = await request.json()
        group = self.groups[b["group_name"]]
        await asyncio.to_thread(receive_tensors, group, b["names"], b["dtypes"], b["shapes"])
        if not self.marker.exists():
            self.marker.write_text("stuck once\n")
            print("stuck in update_weights_from_distributed", flush=True)
            self.stuck.set()
            await self._scheduler()
        if b.get("weight_version") is not None:
            self.version = str(b["weight_version"])
        return web.json_response({"success": True, "message": "updated"})

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/ready", self.ready)
        r.add_get("/health", self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/pause_generation", "/continue_generation"):
            r.add_post(path, self.ok)
        r.add_post("/flush_cache", self.flush)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update)
        return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--marker", type=Path, required=True)
    a = p.parse_args()
    print(f"stuck-engine stand-in on port {a.port}", flush=True)
    web.run_app(StuckEngine(a.marker).app(), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
