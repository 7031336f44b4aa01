"""The embedded engine's HTTP server: SGLang's native API over a continuously batched HF model.

Binds `engine.host:engine.port` (127.0.0.1 by default; port 0 picks a free one) and serves
/generate, /health, /health_generate, /ready, /get_model_info (/model_info), /get_server_info
(/server_info), /get_weight_version, /update_weight_version, /pause_generation,
/continue_generation, /abort_request, /flush_cache and the weight-sync calls
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/update_weights_from_disk, /update_weights_from_tensor (`tensor_update.py`). Routes, field names, status codes and shapes follow SGLang 0.5.23: the
routes of `python/sglang/srt/entrypoints/http_server.py`, the request fields of `GenerateReqInput`
and of the weight-update requests in `python/sglang/srt/managers/io_struct.py`, the version spans
of `utils/weight_versions.py`. docs/sglang.md lists every endpoint and field with what SGLang does
and what this engine does. Client errors are 400 `{"error": {"message": ...}}`; engine errors are
5xx; the server keeps serving. With `engine.api_key` set, every endpoint but /health and
/health_generate needs `Authorization: Bearer <key>` (SGLang exempts them: the router probes them
without a key).

Connects to: the learner's TCPStore (weight-update group) when asked to. Waits on: the scheduler
thread, which owns the model (requests and weight updates are queued to it). Memory is bounded by
the runner's preallocated KV cache plus the token ids of waiting requests.

Per-token versions: each response's `meta_info` holds `weight_versions`, SGLang's spans
`[{version, start, end}, ...]` over the output tokens (end exclusive, one span per version that
produced tokens), and `weight_version`, the latest span's version.

Strict mode (`engine.embedded.strict_sglang`) fails where SGLang 0.5.23 fails: /flush_cache answers 400
while requests run, a weight update asked to flush (`flush_cache: true`, SGLang's default) while
requests run stops the engine for good (SGLang's scheduler asserts and exits), and /health answers
503 while generation is paused (SGLang's health probe is a generation that cannot run then).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import GREEDY_TEMPERATURE, SamplingParams
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.actors.engine.embedded.tensor_update import TensorUpdate
from slime_async.actors.engine.weight_sync import (
    WeightGroup,
    gpu_uuid,
    init_weight_group,
    receive_tensors,
)
from slime_async.config import EngineConfig, PushConfig
from slime_async.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# Top-level /generate fields of SGLang that the engine serves.
_GENERATE_FIELDS = {
    "input_ids",
    "text",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "return_routed_experts",
    "routed_experts_start_len",
}
# SGLang fields that change nothing here (sglang-router fills several of them in every request).
_INERT_FIELDS = {"model", "log_metrics", "no_logs", "background"}
# SGLang features the engine lacks: accepted only when off (false, null, 0 or empty); a request
# that turns one on gets a 400 naming it (docs/sglang.md lists them).
_OFF_ONLY_FIELDS = {
    "return_hidden_states",
    "return_bytes",
    "return_entropy",
    "token_ids_logprob",
    "lora_path",
    "custom_logit_processor",
    "image_data",
    "audio_data",
    "video_data",
    "session_params",
    "data_parallel_rank",
}
SGLANG_VERSION = "0.5.23"
"""The SGLang release whose HTTP API (routes, fields, status codes) this server follows."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_KEY_EXEMPT = frozenset({"/health", "/health_generate", "/ready"})


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

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str | None = None,
        *,
        group_timeout_s: float = PushConfig().group_timeout_s,
    ):
        """`cfg.embedded` holds this engine's own settings; `group_timeout_s` is how long its
        side of a weight-update group waits for the learner (`push.group_timeout_s`)."""
        path = model_path or cfg.model_path
        if not path:
            raise ValueError("engine.model_path is not set (the HF model directory to serve)")
        emb = cfg.embedded
        if emb.torch_threads > 0:
            torch.set_num_threads(emb.torch_threads)
        self.cfg = cfg
        self.group_timeout_s = group_timeout_s
        self.model_path = str(path)
        self.device = resolve_device(emb.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # NCCL weight groups use the current device
        self.gpu_uuid = gpu_uuid(self.device)
        """This engine's GPU (None on the CPU): the learner pushes over gloo to an engine that
        shares its own GPU, since NCCL refuses two ranks on one device (`weight_push`)."""
        num_blocks = None
        if emb.kv_cache_tokens is not None:
            num_blocks = -(-emb.kv_cache_tokens // emb.block_size) + 1  # + the scratch block
        self.runner = ModelRunner(
            path,
            self.device,
            _DTYPES[emb.dtype],
            emb.max_running_requests,
            emb.max_context_len,
            block_size=emb.block_size,
            num_blocks=num_blocks,
            mem_fraction=emb.mem_fraction,
            max_prefill_tokens=emb.max_prefill_tokens,
            compile=emb.compile,
            decode_attention=emb.decode_attention,
        )
        if emb.cuda_graphs and self.device.type == "cuda":
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
            strict=emb.strict_sglang,
            initial_version=emb.initial_weight_version,
            max_prefill_tokens=emb.max_prefill_tokens,
            prefix_sharing=emb.prefix_sharing,
            overlap=emb.overlap_schedule,
        )
        self.groups: dict[str, WeightGroup] = {}
        self.ignored_fields = 0
        """/generate requests that carried top-level fields SGLang ignores (each one logged)."""
        self.routed_unavailable = 0
        """return_routed_experts answers left without routed_experts: the request was aborted
        while waiting, before its forward passes ran (or ran again after a retraction); each
        logged."""
        self.started_at = time.time()

    # ---- app ------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 << 20)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        for path in ("/health", "/health_generate", "/get_weight_version", "/ready"):
            r.add_get(path, getattr(self, path[1:]))
        r.add_post("/update_weight_version", self.update_weight_version)
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
        self.tensor_update = TensorUpdate(self)  # the colocated push (tensors by handle)
        r.add_post("/update_weights_from_tensor", self.tensor_update.handle)
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
        if request.path in _KEY_EXEMPT:  # as SGLang: the router probes health without a key
            return await handler(request)
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

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        unknown = sorted(set(body) - _GENERATE_FIELDS - _INERT_FIELDS - _OFF_ONLY_FIELDS)
        if unknown:  # SGLang ignores unknown top-level keys: so do we, but never silently
            self.ignored_fields += 1
            log.warning("/generate: ignoring unknown top-level fields %s (as SGLang does)", unknown)
        used = sorted(k for k in _OFF_ONLY_FIELDS if body.get(k))
        if used:
            raise BadRequest(f"not supported by the embedded engine: {used} (see docs/sglang.md)")
        if self.scheduler.fatal is not None:
            return _error(503, f"engine stopped: {self.scheduler.fatal}")
        prompts, batched = self._prompts(body)
        rids = body.get("rid")
        sps = body.get("sampling_params")
        n_prompts = len(prompts)
        rids = rids if isinstance(rids, list) else [rids] * n_prompts
        sps = sps if isinstance(sps, list) else [sps] * n_prompts
        if len(rids) != n_prompts or len(sps) != n_prompts:
            raise BadRequest("rid and sampling_params lists must match the batch of prompts")
        want_logprob = bool(body.get("return_logprob", False))
        start = body.get("logprob_start_len")
        start = -1 if start is None else int(start)
        top_n = int(body.get("top_logprobs_num") or 0)
        if top_n < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {top_n}")
        with_text = bool(body.get("return_text_in_logprobs", False))
        jobs: list[tuple[list[int], str, SamplingParams]] = []
        for prompt, rid, sp in zip(prompts, rids, sps, strict=True):
            self._check_prompt(prompt)
            try:
                params = SamplingParams.from_request(sp, self.runner.vocab_size)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            if start >= len(prompt):
                raise BadRequest(
                    f"logprob_start_len {start} is not below the prompt length {len(prompt)}"
                )
            n = _parallel_samples(sp)
            base = str(rid) if rid is not None else uuid.uuid4().hex
            # n > 1: SGLang answers n results per prompt, one after the other.
            jobs += [(prompt, base if n == 1 else f"{base}_{j}", params) for j in range(n)]
        batched = batched or len(jobs) > 1
        want_routed = bool(body.get("return_routed_experts", False))
        if want_routed and not self.runner.family.moe_gates(self.runner.model):
            raise BadRequest("return_routed_experts: the model has no MoE layers")
        routed_start = body.get("routed_experts_start_len", 0)
        if not isinstance(routed_start, int) or routed_start < 0:
            raise BadRequest(
                f"routed_experts_start_len must be an integer >= 0, got {routed_start!r}"
            )
        for prompt, _, _ in jobs:
            if want_routed and routed_start > len(prompt):
                raise BadRequest(
                    f"routed_experts_start_len {routed_start} is higher than the number of input "
                    f"tokens {len(prompt)}"
                )
        opts = _Opts(want_logprob, start, top_n, with_text, want_routed, routed_start)
        if body.get("stream"):
            return await self._stream(request, jobs, opts, batched)
        reqs = self._make_requests(jobs, opts)
        results = await asyncio.gather(*(self._run(r) for r in reqs))
        failed = [r.error for r in results if r.error]
        if failed:
            return _error(500, failed[0])
        out = [await self._response(r, opts) for r in results]
        return web.json_response(out if batched else out[0])

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            return (ids if batched else [ids]), batched
        text = body.get("text")
        if text is None:
            raise BadRequest("give input_ids or text")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        # As SGLang's tokenizer manager: the model's tokenizer, its default special tokens.
        return [list(self.tokenizer.encode(t)) for t in texts], batched

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

    def _make_requests(self, jobs: list[tuple[list[int], str, SamplingParams]], opts: _Opts):
        reqs, groups = [], {}
        for prompt, rid, params in jobs:
            r = Request(
                rid,
                list(prompt),
                params,
                on_done=lambda r: None,
                top_logprobs_num=opts.top_n,
                return_routed=opts.want_routed,
                routed_start=opts.routed_start,
            )
            if params.sampling_seed is not None:
                r.generator = torch.Generator(device=self.runner.device).manual_seed(
                    params.sampling_seed
                )
            key = (id(prompt), params)
            if key in groups:  # the n samples of one prompt share its prefill
                groups[key].append(r)
                r.group = groups[key]
            else:
                groups[key] = [r]
                r.group = groups[key]
            reqs.append(r)
        for r in reqs:
            if r.group is not None and len(r.group) == 1:
                r.group = None
        return reqs

    async def _run(self, r: Request, on_token=None) -> Request:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Request] = loop.create_future()

        def on_done(req: Request) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

        r.on_done = on_done
        if on_token is not None:
            r.on_token = lambda req: loop.call_soon_threadsafe(on_token, len(req.output_ids))
        if r.params.max_new_tokens == 0:  # prompt scoring only: nothing to sample
            r.finish_reason = {"type": "length", "length": 0}
            return r
        self.scheduler.submit(r)
        return await done

    async def _stream(self, request, jobs, opts, batched) -> web.StreamResponse:
        """SSE as SGLang: one `data: {json}` chunk per new token (cumulative text and meta_info;
        with several prompts each chunk carries its `index`), then `data: [DONE]`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        reqs = self._make_requests(jobs, opts)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._run(r, on_token=lambda _n, i=i: queue.put_nowait(i)))
            for i, r in enumerate(reqs)
        ]
        for i, t in enumerate(tasks):
            t.add_done_callback(lambda _t, i=i: queue.put_nowait(-1 - i))
        pending = len(reqs)
        while pending:
            i = await queue.get()
            final = i < 0
            i = -1 - i if final else i
            r = reqs[i]
            if final:
                pending -= 1
                if r.error:
                    chunk = {"error": {"message": r.error}}
                else:
                    chunk = await self._response(r, opts)
            else:
                if r.finish_reason is not None:
                    continue  # its final chunk follows
                chunk = await self._response(r, opts, partial=True)
            if batched:
                chunk["index"] = i
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _response(self, r: Request, opts: _Opts, partial: bool = False) -> dict[str, Any]:
        n_out = len(r.output_ids)
        ids = list(r.output_ids[:n_out])
        versions = list(r.output_versions[:n_out])
        logprobs = list(r.output_logprobs[:n_out])
        text_ids = ids
        fr = None if partial else (r.finish_reason or {})
        fr_out = fr
        stopped = fr is not None and fr.get("type") == "stop" and not r.params.no_stop_trim
        if stopped and isinstance(fr.get("matched"), int):
            text_ids = ids[:-1]  # as SGLang: the stop token stays in output_ids, not in text
        text = self.tokenizer.decode(
            text_ids,
            skip_special_tokens=r.params.skip_special_tokens,
            spaces_between_special_tokens=r.params.spaces_between_special_tokens,
        )
        if (
            fr is not None
            and fr.get("type") == "stop"
            and isinstance(fr.get("matched"), str)
            and not r.params.no_stop_trim
        ):
            text = text[: text.find(fr["matched"])] if fr["matched"] in text else text
        spans = version_spans(versions, self.scheduler.version)
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": fr_out,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": n_out,
            "cached_tokens": r.cached_tokens,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": time.time() - r.created_at,
        }
        if opts.want_logprob:
            tok_text = (
                (lambda t: self.tokenizer.decode([t])) if opts.with_text else (lambda t: None)
            )
            meta["output_token_logprobs"] = [
                [lp, t, tok_text(t)] for lp, t in zip(logprobs, ids, strict=True)
            ]
            if opts.top_n:
                meta["output_top_logprobs"] = [
                    [[lp, t, tok_text(t)] for lp, t in top] for top in r.output_top[:n_out]
                ]
            if opts.start >= 0 and not partial:
                meta["input_token_logprobs"] = await self._prompt_logprobs(r, opts, tok_text)
        if opts.want_routed and not partial:
            routed = await self._routed_experts(r, opts.routed_start)
            if routed is not None:
                meta["routed_experts"] = routed
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def _routed_experts(self, r: Request, start: int) -> str | None:
        """SGLang's `meta_info.routed_experts`: base64 of little-endian int32
        `[prompt + completion - 1 - start, moe_layers, k]`, the experts of every fed token from
        `start` (routed_experts_start_len) on, as the forward pass that computed it chose them
        (so a response that spans a weight update carries each token's own routing). A prompt
        scored without generating (max_new_tokens 0) is routed by one forward pass now."""
        routed = r.routed
        if routed is None and r.params.max_new_tokens == 0:
            tokens = list(r.input_ids)
            full = await self._on_scheduler(
                lambda: self.runner.family.routed_experts(self.runner.model, tokens)
            )
            routed = full[start:]
        if routed is None:
            self.routed_unavailable += 1
            log.warning(
                "request %s: no routed experts to return (aborted before it ran, or retracted and "
                "aborted before it ran again: no forward pass holds its tokens; %d so far)",
                r.rid,
                self.routed_unavailable,
            )
            return None
        return base64.b64encode(routed.astype("<i4").tobytes()).decode("ascii")

    async def _prompt_logprobs(self, r: Request, opts: _Opts, tok_text) -> list[list]:
        """SGLang's input_token_logprobs from logprob_start_len on: [logprob, id, text]; the
        first prompt token has no log-prob (None). Scaled by the request's temperature."""
        temp = r.params.temperature if r.params.temperature >= GREEDY_TEMPERATURE else 1.0
        ids = r.input_ids
        lps = await self._on_scheduler(lambda: self.runner.prompt_logprobs(ids, temp))
        full = [None, *lps]
        return [[full[i], ids[i], tok_text(ids[i])] for i in range(opts.start, len(ids))]

    # ---- health and info ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.scheduler.alive():
            return _error(503, self.scheduler.fatal or "scheduler stopped")
        if self.cfg.embedded.strict_sglang and self.scheduler.paused:
            # SGLang's probe is a one-token generation, which cannot run while paused.
            return _error(503, "generation is paused")
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """As SGLang 0.5.23's GET /ready: at once, 200 when new requests are taken, 503 while
        generation is paused or the scheduler has stopped (the liveness probes' first choice)."""
        if not self.scheduler.alive():
            return web.Response(status=503)
        return web.Response(status=503 if self.scheduler.paused else 200)

    async def health_generate(self, request: web.Request) -> web.Response:
        early = await self.health(request)
        if early.status != 200 or self.scheduler.paused:
            return early
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        r = Request(
            "HEALTH_CHECK",
            [int(next(iter(self.runner.eos_token_ids), 0))],
            params,
            on_done=lambda r: None,
        )
        await self._run(r)
        return web.Response(status=200 if not r.error else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.scheduler.version,
                "served_model_name": self.model_path,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "version": SGLANG_VERSION,
                "engine": "slime_async.embedded",
                "device": str(self.device),
                "gpu_uuid": self.gpu_uuid,
                "dtype": self.cfg.embedded.dtype,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "enable_dp_attention": False,
                "api_key": None,
                "max_running_requests": self.runner.max_slots,
                "context_length": self.runner.max_context_len,
                "weight_version": self.scheduler.version,
                "paused": self.scheduler.paused,
                "strict_sglang": self.cfg.embedded.strict_sglang,
                "weight_groups": sorted(self.groups),
                "decode_steps": self.scheduler.steps,
                **self.scheduler.stats(),
                "decode_attention": self.runner.decode_attention,
                "memory": self.runner.memory_info(),
                "ignored_fields": self.ignored_fields,
                "routed_unavailable": self.routed_unavailable,
                "started_at": self.started_at,
                **self.scheduler.load(),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        if b.get("new_version") is None:
            raise BadRequest("update_weight_version needs new_version")
        new = str(b["new_version"])
        if b.get("abort_all_requests", False):
            await self._on_scheduler(lambda: self.scheduler.abort(abort_all=True))

        def apply() -> None:
            self.scheduler.version = new

        await self._on_scheduler(apply)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

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
        if not abort_all and not rid:  # SGLang: nothing to abort, still 200
            return web.json_response({"success": True, "message": "aborted 0 request(s)"})
        n = await self._on_scheduler(lambda: self.scheduler.abort(rid, abort_all))
        return web.json_response({"success": True, "message": f"aborted {n} request(s)"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # As SGLang: a text body, 200 when flushed, 400 when requests were running (strict).
        ok = await self._on_scheduler(self.scheduler.flush)
        if ok:
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(
            text="Cache not flushed: requests are running (strict_sglang, as SGLang).\n",
            status=400,
        )

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
            return _fail(f"weight-update group {name!r} already exists")

        def join() -> WeightGroup:
            return init_weight_group(
                addr, port, rank, world, name, backend, self.device, self.group_timeout_s
            )

        try:
            self.groups[name] = await self._on_scheduler(join)
        except Exception as e:
            return _fail(f"init of {name!r} with {addr}:{port} failed: {e}")
        return web.json_response(
            {"success": True, "message": f"joined {name} as rank {rank}/{world}"}
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        name = str(b.get("group_name", "weight_update_group"))
        group = self.groups.get(name)
        if group is None:
            return _fail(f"no weight-update group {name!r}: call init_weights_update_group first")
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), list(b["shapes"])
        except (KeyError, TypeError) as e:
            raise BadRequest(f"update_weights_from_distributed: missing or bad field {e}") from None
        version = _version(b.get("weight_version"))
        abort_all = bool(b.get("abort_all_requests", False))
        flush = bool(b.get("flush_cache", True))  # SGLang's default

        def update() -> None:
            tensors = receive_tensors(group, names, dtypes, shapes)
            if abort_all:
                self.scheduler.abort(abort_all=True, message="Abort by weight update")
            self.runner.load_weights(tensors)
            self._after_update(flush, "update_weights_from_distributed")

        return await self._update(update, version, f"updated {len(names)} tensors")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = str((await self._body(request)).get("group_name", "weight_update_group"))
        group = self.groups.pop(name, None)
        if group is None:
            return _fail(f"no weight-update group {name!r}")
        await self._on_scheduler(group.destroy)
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        if not b.get("model_path"):
            raise BadRequest("update_weights_from_disk needs model_path")
        version = _version(b.get("weight_version"))
        abort_all = bool(b.get("abort_all_requests", False))
        flush = bool(b.get("flush_cache", True))

        def update() -> None:
            if abort_all:
                self.scheduler.abort(abort_all=True, message="Abort by weight update")
            self.runner.load_from_disk(b["model_path"])
            self._after_update(flush, "update_weights_from_disk")

        return await self._update(update, version, f"loaded {b['model_path']}")

    def _after_update(self, flush: bool, call: str) -> None:
        """On the scheduler thread after new weights are in: SGLang flushes the cache when asked
        and asserts that the flush worked; in strict mode a failed flush stops the engine."""
        if flush and not self.scheduler.flush():
            self.scheduler.fail_fatally(
                f"{call}: Cache flush failed after updating weights (requests were running; "
                "pause in abort or retract mode and poll /flush_cache first)"
            )

    async def _update(self, fn, version: str | None, message: str) -> web.Response:
        try:
            await self._on_scheduler(fn)
        except (ValueError, OSError, RuntimeError) as e:
            return _fail(str(e))
        if self.scheduler.fatal is not None:
            return _error(500, f"engine stopped: {self.scheduler.fatal}")
        if version is not None:  # applied only when the update succeeded, as SGLang

            def apply() -> None:
                self.scheduler.version = version

            await self._on_scheduler(apply)
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


@dataclass(frozen=True)
class _Opts:
    """What a /generate response carries beyond tokens and text."""

    want_logprob: bool
    start: int
    top_n: int
    with_text: bool
    want_routed: bool = False
    routed_start: int = 0


def _parallel_samples(sp: object) -> int:
    n = sp.get("n", 1) if isinstance(sp, dict) else 1
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"sampling_params.n must be an integer >= 1, got {n!r}")
    return n


def _fail(message: str) -> web.Response:
    """A refused weight call, as SGLang answers it: 400 with success false and the reason."""
    return web.json_response(
        {"success": False, "message": message, "num_paused_requests": 0}, status=400
    )


def _version(v: object) -> str | None:
    """SGLang's weight_version: any string (numbers are taken as their text)."""
    return None if v is None else str(v)


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """Per-token versions -> SGLang's `weight_versions` spans [{version, start, end}] (end
    exclusive); no tokens: one empty span of the current version, as SGLang reports it."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


async def serve(engine: EmbeddedEngine, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start serving; returns the aiohttp runner (cleanup() stops it) and the bound URL."""
    runner = web.AppRunner(engine.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the OS's choice when port == 0
    return runner, f"http://{host}:{bound}"
