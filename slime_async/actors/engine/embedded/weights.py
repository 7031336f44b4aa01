"""The embedded engine's weight-update routes: update sessions, weight-update groups, updates.

Serves /begin_weight_update, /end_weight_update, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weights_from_disk and
/update_weights_from_tensor (tensor_update.py),
with SGLang 0.5.23's request fields and defaults (`srt/managers/io_struct.py`) and its answers
(`{success, message}`, 200 or 400; `srt/entrypoints/http_server.py`).

Sessions (`srt/managers/scheduler_components/weight_updater.py`,
`SchedulerWeightUpdaterManager`): begin opens one session (a second begin is refused), end closes
it (an end without begin is refused). In strict mode an update from distributed outside a session
is refused before the engine joins the broadcast, as SGLang's scheduler refuses it, so the
learner's broadcast waits with no receiver (real runs block there); outside strict mode it is
served, logged once and counted (`updates_outside_session` of /server_info). Updates from disk need
no session (the wheel checks none there).

Connects to: the learner's TCPStore when a group is joined (`weight_sync.init_weight_group`).
Waits on: the scheduler thread, which receives and loads every update between two steps.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from slime_async.actors.engine.embedded.http import BadRequest, fail, read_body
from slime_async.actors.engine.embedded.tensor_update import TensorUpdate
from slime_async.actors.engine.weight_sync import WeightGroup, init_weight_group, receive_tensors

if TYPE_CHECKING:
    from slime_async.actors.engine.embedded.server import EmbeddedEngine

log = logging.getLogger(__name__)

SELECTORS = ("target", "draft", "all")
"""`selector` of BeginWeightUpdateReqInput / UpdateWeightsFromDistributedReqInput (io_struct.py:
a Literal, "all" by default); the embedded engine has one runner (no draft model)."""

FLUSH_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
"""weight_updater.py: SchedulerWeightUpdaterManager.flush_cache_after_weight_update's answer
when an update asked to flush and the flush was refused: the weights are loaded and the new
version recorded already; the call answers 400 with this message."""


class WeightRoutes:
    """Weight-update routes of one EmbeddedEngine; `add_routes` wires them into its app."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine
        self.strict = engine.cfg.embedded.strict_sglang
        self.groups: dict[str, WeightGroup] = {}
        self.session: str | None = None
        """The open session's selector (None: no session open)."""
        self.outside_session = 0
        """Updates served outside a session (non-strict only; strict refuses them)."""
        self.flush_failed = 0
        """Updates whose requested flush was refused (weights loaded; answered 400)."""
        self.tensors = TensorUpdate(engine, self)
        """/update_weights_from_tensor: the colocated push (tensors by handle)."""

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for name in (
            "begin_weight_update",
            "end_weight_update",
            "init_weights_update_group",
            "update_weights_from_distributed",
            "destroy_weights_update_group",
            "update_weights_from_disk",
        ):
            router.add_post(f"/{name}", getattr(self, name))
        router.add_post("/update_weights_from_tensor", self.tensors.handle)

    def info(self) -> dict[str, Any]:
        """What /server_info reports about weight updates."""
        return {
            "weight_groups": sorted(self.groups),
            "weight_update_session": self.session is not None,
            "updates_outside_session": self.outside_session,
            "update_flush_failed": self.flush_failed,
        }

    async def _on_scheduler(self, fn: Any) -> Any:
        return await self.engine._on_scheduler(fn)

    async def _abort_all(self) -> None:
        sched = self.engine.scheduler
        await self._on_scheduler(
            lambda: sched.abort(abort_all=True, message="Abort by weight update")
        )

    # ---- sessions ----------------------------------------------------------------------------

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        selector = _selector(b)
        # weight_updater.py: SchedulerWeightUpdaterManager.begin_weight_update refuses a second
        # begin while a session is open.
        if self.session is not None:
            return _session_fail(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session = selector
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_body(request)
        # weight_updater.py: SchedulerWeightUpdaterManager.end_weight_update refuses an end
        # without a begin.
        if self.session is None:
            return _session_fail(
                "no weight-update session is open; call begin_weight_update() first"
            )
        self.session = None
        return web.json_response({"success": True, "message": "Success"})

    def _outside_session(self, call: str) -> web.Response | None:
        """The wheel's refusal of an update outside a session (strict), else None (counted and
        logged once outside strict mode)."""
        if self.session is not None:
            return None
        if self.strict:
            # weight_updater.py: SchedulerWeightUpdaterManager.update_weights_from_distributed
            # (and update_weights_from_tensor) answer this before receiving anything.
            return _session_fail(
                f"{call} must run between begin_weight_update() and end_weight_update()"
            )
        self.outside_session += 1
        if self.outside_session == 1:
            log.warning(
                "%s outside a weight-update session (no /begin_weight_update): served, but "
                "SGLang 0.5.23 refuses it (counted in updates_outside_session of /server_info; "
                "logged once)",
                call,
            )
        return None

    # ---- groups ------------------------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        eng = self.engine
        if self.strict and "rank_offset" not in b:
            # io_struct.py: InitWeightsUpdateGroupReqInput.rank_offset has no default.
            raise BadRequest("init_weights_update_group: missing field 'rank_offset'")
        try:
            args = (
                str(b["master_address"]),
                int(b["master_port"]),
                int(b.get("rank_offset", 1)),
                int(b["world_size"]),
                str(b.get("group_name", "weight_update_group")),
                # io_struct.py defaults to "nccl" (a GPU server); a CPU engine can only use gloo.
                str(b.get("backend", "nccl" if eng.device.type == "cuda" else "gloo")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"init_weights_update_group: missing or bad field {e}") from None
        addr, port, rank, world, name, backend = args
        if name in self.groups:
            return fail(f"weight-update group {name!r} already exists")

        def join() -> WeightGroup:
            return init_weight_group(
                addr, port, rank, world, name, backend, eng.device, eng.group_timeout_s
            )

        try:
            self.groups[name] = await self._on_scheduler(join)
        except Exception as e:
            return fail(f"init of {name!r} with {addr}:{port} failed: {e}")
        return web.json_response(
            {"success": True, "message": f"joined {name} as rank {rank}/{world}"}
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = str((await read_body(request)).get("group_name", "weight_update_group"))
        group = self.groups.pop(name, None)
        if group is None:
            return fail(f"no weight-update group {name!r}")
        await self._on_scheduler(group.destroy)
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    # ---- updates -----------------------------------------------------------------------------

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        name = str(b.get("group_name", "weight_update_group"))
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), list(b["shapes"])
        except (KeyError, TypeError) as e:
            raise BadRequest(f"update_weights_from_distributed: missing or bad field {e}") from None
        _selector(b)
        # io_struct.py: UpdateWeightsFromDistributedReqInput: flush_cache True,
        # abort_all_requests False by default.
        flush = bool(b.get("flush_cache", True))
        eng = self.engine
        if b.get("abort_all_requests", False):
            # tokenizer_control_mixin.py: update_weights_from_distributed aborts every request
            # first, before the scheduler looks at the session.
            await self._abort_all()
        refused = self._outside_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        group = self.groups.get(name)
        if group is None:
            return fail(f"no weight-update group {name!r}: call init_weights_update_group first")

        def update() -> None:
            eng.runner.load_weights(receive_tensors(group, names, dtypes, shapes))

        return await self._update(
            update, b, flush, "update_weights_from_distributed", f"updated {len(names)} tensors"
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        if not b.get("model_path"):
            raise BadRequest("update_weights_from_disk needs model_path")
        # io_struct.py: UpdateWeightFromDiskReqInput: flush_cache True, abort_all_requests False.
        flush = bool(b.get("flush_cache", True))
        eng = self.engine
        if b.get("abort_all_requests", False):
            await self._abort_all()  # tokenizer_manager.py: update_weights_from_disk, first

        def update() -> None:
            eng.runner.load_from_disk(b["model_path"])

        return await self._update(
            update, b, flush, "update_weights_from_disk", f"loaded {b['model_path']}"
        )

    async def _update(
        self, fn, body: dict[str, Any], flush: bool, call: str, message: str
    ) -> web.Response:
        """Load (on the scheduler thread), record the version, then flush when asked.

        As the wheel (weight_updater.py: SchedulerWeightUpdaterManager.update_weights_from_disk
        and update_weights_from_distributed): the version is recorded once the weights loaded
        (record_weight_version_after_update), and then the flush runs; a refused flush turns
        the answer into a 400 (flush_cache_after_weight_update) with the weights and the
        version already in place. The engine serves on."""
        version = _version(body.get("weight_version"))
        sched = self.engine.scheduler

        def load_record_flush() -> bool:
            fn()
            if version is not None:
                sched.version = version
            return not flush or sched.flush()

        try:
            flushed = await self._on_scheduler(load_record_flush)
        except (ValueError, OSError, RuntimeError) as e:
            return fail(str(e), num_paused_requests=0)
        if not flushed:
            self.flush_failed += 1
            log.error(
                "%s: %s Serving version %s; /model_info still reports %s, as SGLang (%d so far)",
                call,
                FLUSH_FAILED,
                sched.version,
                self.engine.reported_version,
                self.flush_failed,
            )
            return fail(FLUSH_FAILED, num_paused_requests=0)
        if version is not None:
            # tokenizer_control_mixin.py: the reported version follows only a successful call.
            self.engine.reported_version = version
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


def _selector(body: dict[str, Any]) -> str:
    selector = body.get("selector", "all")
    if selector not in SELECTORS:
        raise BadRequest(f"selector must be one of {list(SELECTORS)}, got {selector!r}")
    return selector


def _session_fail(message: str) -> web.Response:
    """A session rule's refusal: 400 `{success: false, message}` (http_server.py)."""
    return web.json_response({"success": False, "message": message}, status=400)


def _version(v: object) -> str | None:
    """SGLang's weight_version: any string (numbers are taken as their text)."""
    return None if v is None else str(v)
