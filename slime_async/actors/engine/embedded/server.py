"""The embedded engine's HTTP server: SGLang's native API over a continuously batched HF model.

Binds `engine.host:engine.port` (127.0.0.1 by default; port 0 picks a free one) and serves
/generate, /health, /health_generate, /get_model_info (/model_info), /get_server_info
(/server_info), /get_weight_version, /pause_generation, /continue_generation, /abort_request,
/flush_cache and the weight-sync calls /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weights_from_disk.
Routes, field names and shapes follow SGLang 0.5.23: the routes of
`python/sglang/srt/entrypoints/http_server.py`, and the request fields of `GenerateReqInput` and of
the weight-update requests in `python/sglang/srt/managers/io_struct.py`. Errors are
`{"error": {"message": ...}}` with a 4xx status; the server keeps serving. With `engine.api_key`
set, every endpoint needs `Authorization: Bearer <key>`.

Connects to: the learner's TCPStore (weight-update group) when asked to. Waits on: the scheduler
thread, which owns the model (requests and weight updates are queued to it). Memory is bounded by
the runner's preallocated KV cache plus the token ids of waiting requests.

Per-token versions: each response's `meta_info` holds `weight_version` (a string, as in SGLang)
and, as an extension, `output_token_weight_versions` (one int per output token). sglang-router
passes response bodies through unchanged (tests/test_engine_router.py checks it); a client
talking to a real SGLang server, which lacks the field, takes every token as `weight_version`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import torch
from aiohttp import web

from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import SamplingParams
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.actors.engine.weight_sync import WeightGroup, init_weight_group, receive_tensors
from slime_async.config import EngineConfig
from slime_async.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# Top-level /generate fields of SGLang that the engine serves.
_GENERATE_FIELDS = {"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len"}
# SGLang fields that change nothing here (sglang-router fills several of them in every request).
_INERT_FIELDS = {"model", "log_metrics", "no_logs", "background", "stream"}
# SGLang features the engine lacks: accepted only when off (false, null, 0 or empty).
_OFF_ONLY_FIELDS = {
    "return_hidden_states",
    "return_bytes",
    "return_entropy",
    "return_text_in_logprobs",
    "top_logprobs_num",
    "token_ids_logprob",
    "lora_path",
    "custom_logit_processor",
    "image_data",
    "audio_data",
    "video_data",
    "session_params",
    "data_parallel_rank",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadRequest(ValueError):
    """A client error: answered with 400 and its message."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EmbeddedEngine:
    """Model runner + scheduler + tokenizer behind an aiohttp app."""

    def __init__(self, cfg: EngineConfig, model_path: str | None = None):
        path = model_path or cfg.model_path
        if not path:
            raise ValueError("engine.model_path is not set (the HF model directory to serve)")
        if cfg.torch_threads > 0:
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.model_path = str(path)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # NCCL weight groups use the current device
        self.runner = ModelRunner(
            path, self.device, _DTYPES[cfg.dtype], cfg.max_running_requests, cfg.max_context_len
        )
        if cfg.cuda_graphs and self.device.type == "cuda":
            t0 = time.perf_counter()
            try:
                sizes = self.runner.capture_cuda_graphs()
                log.info(
                    "captured decode CUDA graphs for batch sizes %s in %.1f s",
                    sizes,
                    time.perf_counter() - t0,
                )
            except Exception:  # eager decoding still works, only slower
                log.exception("CUDA graph capture failed; decoding eagerly")
                self.runner.drop_cuda_graphs()
        self.tokenizer = load_tokenizer(path)
        self.scheduler = Scheduler(
            self.runner,
            seed=cfg.seed,
            decode_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )
        self.groups: dict[str, WeightGroup] = {}
        self.started_at = time.time()

    # ---- app ------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 << 20)
        r = app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate", "/get_weight_version"):
            r.add_get(path, getattr(self, path[1:]))
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        for name in (
            "pause_generation",
            "continue_generation",
            "abort_request",
            "init_weights_update_group",
            "update_weights_from_distributed",
            "destroy_weights_update_group",
            "update_weights_from_disk",
        ):
            r.add_post(f"/{name}", getattr(self, name))
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.scheduler.start()

    async def _stop(self, app: web.Application) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(400, str(e))
        except web.HTTPException as e:
            if e.status == 404:
                return _error(404, f"unknown endpoint {request.method} {request.path}")
            if e.status == 405:
                return _error(405, f"method {request.method} not allowed on {request.path}")
            return _error(e.status, e.reason)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.cfg.api_key
        if key and request.headers.get("Authorization", "") != f"Bearer {key}":
            return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        return await handler(request)

    async def _body(self, request: web.Request, required: bool = True) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            if required:
                raise BadRequest(f"{request.path} needs a JSON body ({{}} at least)")
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the JSON body must be an object")
        return body

    async def _on_scheduler(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- /generate ---------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        unknown = sorted(set(body) - _GENERATE_FIELDS - _INERT_FIELDS - _OFF_ONLY_FIELDS)
        if unknown:
            raise BadRequest(f"unknown /generate fields: {unknown}")
        used = sorted(k for k in _OFF_ONLY_FIELDS if body.get(k))
        if body.get("stream"):
            used.append("stream")
        if used:
            raise BadRequest(f"not supported by the embedded engine: {used}")
        if "input_ids" not in body:
            raise BadRequest("missing input_ids (the embedded engine takes token ids, not text)")
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start is not None and start != -1:
            raise BadRequest("prompt log-probs (logprob_start_len >= 0) are not supported")
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        n = len(prompts)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * n
        sps = body.get("sampling_params")
        sps = sps if isinstance(sps, list) else [sps] * n
        if len(rids) != n or len(sps) != n:
            raise BadRequest("rid and sampling_params lists must match the batch of input_ids")
        reqs = []
        for prompt, rid, sp in zip(prompts, rids, sps, strict=True):
            self._check_prompt(prompt)
            try:
                params = SamplingParams.from_request(sp, self.runner.vocab_size)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            reqs.append((prompt, str(rid) if rid is not None else uuid.uuid4().hex, params))
        want_logprob = bool(body.get("return_logprob", False))
        results = await asyncio.gather(*(self._run(*r) for r in reqs))
        out = [self._response(r, want_logprob) for r in results]
        return web.json_response(out if batched else out[0])

    def _check_prompt(self, prompt: object) -> None:
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("input_ids must be a non-empty list of token ids")
        vocab = self.runner.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BadRequest(f"input_ids holds {t!r}, outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.runner.max_context_len:
            raise BadRequest(
                f"prompt of {len(prompt)} tokens does not fit the context of "
                f"{self.runner.max_context_len} tokens"
            )

    async def _run(self, prompt: list[int], rid: str, params: SamplingParams) -> Request:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Request] = loop.create_future()

        def on_done(r: Request) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

        self.scheduler.submit(Request(rid, list(prompt), params, on_done))
        return await done

    def _response(self, r: Request, want_logprob: bool) -> dict[str, Any]:
        ids = r.output_ids
        text_ids = ids
        fr = r.finish_reason or {}
        if (
            fr.get("type") == "stop"
            and isinstance(fr.get("matched"), int)
            and not r.params.no_stop_trim
        ):
            text_ids = ids[:-1]  # as SGLang: the stop token stays in output_ids, not in text
        text = self.tokenizer.decode(text_ids, skip_special_tokens=r.params.skip_special_tokens)
        if (
            fr.get("type") == "stop"
            and isinstance(fr.get("matched"), str)
            and not r.params.no_stop_trim
        ):
            text = text[: text.find(fr["matched"])] if fr["matched"] in text else text
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": fr,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": str(self.scheduler.version),
            "e2e_latency": time.time() - r.created_at,
            "output_token_weight_versions": list(r.output_versions),
        }
        if want_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(r.output_logprobs, ids, strict=True)
            ]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    # ---- health and info ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return (
            web.Response(status=200) if self.scheduler.alive() else _error(503, "scheduler stopped")
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.scheduler.paused:
            return web.Response(status=200)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        await self._run([int(next(iter(self.runner.eos_token_ids), 0))], "health_generate", params)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": str(self.scheduler.version),
                "served_model_name": self.model_path,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "engine": "slime_async.embedded",
                "device": str(self.device),
                "dtype": self.cfg.dtype,
                "tp_size": 1,
                "dp_size": 1,
                "max_running_requests": self.runner.max_slots,
                "context_length": self.runner.max_context_len,
                "weight_version": str(self.scheduler.version),
                "paused": self.scheduler.paused,
                "decode_steps": self.scheduler.steps,
                **self.scheduler.load(),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.scheduler.version)})

    # ---- generation control ------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await self._body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(
                f"pause_generation mode must be abort, retract or in_place, got {mode!r}"
            )
        await self._on_scheduler(lambda: self.scheduler.pause(mode))
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request)
        await self._on_scheduler(self.scheduler.resume)
        return web.json_response({"success": True, "message": "continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not rid:
            raise BadRequest("abort_request needs rid (matched by prefix) or abort_all=true")
        n = await self._on_scheduler(lambda: self.scheduler.abort(rid, abort_all))
        return web.json_response({"success": True, "message": f"aborted {n} request(s)"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache is kept across requests, so there is nothing to flush.
        return web.json_response({"success": True, "message": "flushed"})

    # ---- weight sync -------------------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        try:
            args = (
                str(b["master_address"]),
                int(b["master_port"]),
                int(b.get("rank_offset", 1)),
                int(b["world_size"]),
                str(b.get("group_name", "weight_update_group")),
                str(b.get("backend", "nccl" if self.device.type == "cuda" else "gloo")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"init_weights_update_group: missing or bad field {e}") from None
        addr, port, rank, world, name, backend = args
        if name in self.groups:
            raise BadRequest(f"weight-update group {name!r} already exists")

        def join() -> WeightGroup:
            return init_weight_group(
                addr, port, rank, world, name, backend, self.device, self.cfg.weight_sync_timeout_s
            )

        try:
            self.groups[name] = await self._on_scheduler(join)
        except Exception as e:
            return web.json_response({"success": False, "message": f"init failed: {e}"}, status=400)
        return web.json_response(
            {"success": True, "message": f"joined {name} as rank {rank}/{world}"}
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        name = str(b.get("group_name", "weight_update_group"))
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(
                f"no weight-update group {name!r}: call init_weights_update_group first"
            )
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), list(b["shapes"])
        except (KeyError, TypeError) as e:
            raise BadRequest(f"update_weights_from_distributed: missing or bad field {e}") from None
        version = self._parse_version(b.get("weight_version"))
        abort_all = bool(b.get("abort_all_requests", False))

        def update() -> None:
            tensors = receive_tensors(group, names, dtypes, shapes)
            if abort_all:
                self.scheduler.abort(abort_all=True, message="Abort by weight update")
            self.runner.load_weights(tensors)
            if version is not None:
                self.scheduler.version = version

        try:
            await self._on_scheduler(update)
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = str((await self._body(request)).get("group_name", "weight_update_group"))
        group = self.groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weight-update group {name!r}")
        await self._on_scheduler(group.destroy)
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        if "model_path" not in b:
            raise BadRequest("update_weights_from_disk needs model_path")
        version = self._parse_version(b.get("weight_version"))
        abort_all = bool(b.get("abort_all_requests", False))

        def update() -> None:
            if abort_all:
                self.scheduler.abort(abort_all=True, message="Abort by weight update")
            self.runner.load_from_disk(b["model_path"])
            if version is not None:
                self.scheduler.version = version

        try:
            await self._on_scheduler(update)
        except (ValueError, OSError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"loaded {b['model_path']}"})

    @staticmethod
    def _parse_version(v: object) -> int | None:
        if v is None:
            return None
        try:
            return int(str(v))
        except ValueError:
            raise BadRequest(
                f"weight_version must be an integer (as a string), got {v!r}"
            ) from None


async def serve(engine: EmbeddedEngine, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start serving; returns the aiohttp runner (cleanup() stops it) and the bound URL."""
    runner = web.AppRunner(engine.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the OS's choice when port == 0
    return runner, f"http://{host}:{bound}"
