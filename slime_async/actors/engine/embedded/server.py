"""The embedded engine's HTTP server: SGLang's native API over a continuously batched HF model.

Binds `engine.host:engine.port` (127.0.0.1 by default; port 0 picks a free one) and serves
/generate, /health, /health_generate, /ready, /get_model_info (/model_info), /get_server_info
(/server_info) here, the control routes of control.py (/get_weight_version,
/update_weight_version, /pause_generation, /continue_generation, /abort_request, /flush_cache)
and the weight-update routes of weights.py (/begin_weight_update, /end_weight_update,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/update_weights_from_disk, and /update_weights_from_tensor of tensor_update.py). Routes, field names, defaults, status codes and shapes follow SGLang
0.5.23: the routes of `srt/entrypoints/http_server.py`, the request fields of `GenerateReqInput`
and of the control requests in `srt/managers/io_struct.py`, the version spans of
`utils/weight_versions.py`. docs/sglang.md lists every endpoint and field with what SGLang does
and what this engine does. Client errors are 400 `{"error": {"message": ...}}`; engine errors are
5xx; the server keeps serving. Keys (`engine.api_key`, `engine.admin_api_key`) open routes as
SGLang's auth levels do (auth.py); /health*, /ready and /metrics need none.

Connects to: the learner's TCPStore (weight-update group) when asked to. Waits on: the scheduler
thread, which owns the model (requests and weight updates are queued to it). Memory is bounded by
the runner's preallocated KV cache plus the token ids of waiting requests.

Per-token versions: each response's `meta_info` holds `weight_versions`, SGLang's spans
`[{version, start, end}, ...]` over the output tokens (end exclusive, one span per version that
produced tokens), and `weight_version`, the latest span's version.

Strict mode (`engine.embedded.strict_sglang`) fails where SGLang 0.5.23 fails (docs/engines.md
lists each rule with its place in the wheel): updates from distributed only inside a
/begin_weight_update../end_weight_update session, /flush_cache refused while requests run (an
update asked to flush then answers 400 with its weights loaded), and /health as slow as SGLang's
one-token health generation (503 after `health_timeout_s` while paused).
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

from slime_async.actors.engine.embedded import auth
from slime_async.actors.engine.embedded.control import ControlRoutes
from slime_async.actors.engine.embedded.http import BadRequest, read_body
from slime_async.actors.engine.embedded.http import error as _error
from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import GREEDY_TEMPERATURE, SamplingParams
from slime_async.actors.engine.embedded.scheduler import Request, Scheduler
from slime_async.actors.engine.embedded.weights import WeightRoutes
from slime_async.actors.engine.weight_sync import gpu_uuid
from slime_async.config import EngineConfig, PushConfig
from slime_async.config.engine import SGLANG_HEALTH_MIN_S, EmbeddedEngineConfig
from slime_async.models.tokenizer import load_tokenizer
from slime_async.utils.gc_watch import GcWatch

log = logging.getLogger(__name__)


def gpu_reserve_bytes(emb: EmbeddedEngineConfig, device: torch.device) -> int:
    """What the engine keeps free on its GPU for another process (`gpu_reserve_gib`), logged.
    "auto" is resolved by `slime-async run` (the learner's estimated peak where it shares the
    GPU); an engine started by hand with "auto" keeps nothing back, and says so."""
    if device.type != "cuda":
        return 0
    if emb.gpu_reserve_gib == "auto":
        log.info(
            "engine.embedded.gpu_reserve_gib = auto and no learner shares this GPU as far as "
            "this engine knows (slime-async run sets it when one does): the KV cache takes "
            "up to engine.embedded.mem_fraction = %s",
            emb.mem_fraction,
        )
        return 0
    log.info(
        "keeping %.1f GiB of %s free for another process (engine.embedded.gpu_reserve_gib)",
        emb.gpu_reserve_gib,
        device,
    )
    return int(emb.gpu_reserve_gib * 2**30)


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
    "extra_key",
    "cache_salt",
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
DETERMINISTIC_DEFAULT_SEED = 42
"""What SGLang 0.5.23 draws a request without `sampling_seed` with under deterministic inference
(srt/sampling/sampling_batch_info.py): one seed for all of them."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _health_delay(emb: EmbeddedEngineConfig) -> float:
    """`health_delay_s`, or SGLang's 1 s (SGLANG_HEALTH_MIN_S) in strict mode and 0 otherwise."""
    if emb.health_delay_s is not None:
        return emb.health_delay_s
    return SGLANG_HEALTH_MIN_S if emb.strict_sglang else 0.0


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
            gpu_reserve_bytes=gpu_reserve_bytes(emb, self.device),
            max_prefill_tokens=emb.max_prefill_tokens,
            compile=emb.compile,
            prefill_attention=emb.prefill_attention,
            decode_attention=emb.decode_attention,
            decode_shared_prefix=emb.decode_shared_prefix if emb.prefix_sharing else "off",
        )
        self.runner.keep_prefixes_on_update = emb.strict_sglang
        t0 = time.perf_counter()
        if self.runner.warm_sampling():
            log.info("compiled the sampler's kernels in %.1f s", time.perf_counter() - t0)
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
        self.weights = WeightRoutes(self)
        """The weight-update routes (sessions, groups, updates)."""
        self.control = ControlRoutes(self)
        """The control routes (version, pause/continue, abort, flush)."""
        self.reported_version = emb.initial_weight_version
        """The weight_version /model_info, /server_info and /get_weight_version report: SGLang's
        tokenizer-side version, which an update sets only when the whole call succeeded
        (managers/tokenizer_control_mixin.py: `_update_weight_version_if_provided` after
        `success`), so an update whose flush was refused leaves it behind the version the
        scheduler serves (`scheduler.version`, the spans of new tokens)."""
        self.gc = GcWatch("engine", emb.gc_warning_s)
        """Every garbage collection of this process timed while it serves; a long one logged and
        counted."""
        self.health_delay_s = _health_delay(emb)
        """Least time /health and /health_generate take (SGLang's wait loop sleeps 1 s first)."""
        self.ignored_fields = 0
        """/generate requests that carried top-level fields SGLang ignores (each one logged)."""
        self.ignored_seeds = 0
        """Requests whose sampling_seed strict mode ignored (no deterministic inference)."""
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
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, getattr(self, path[1:]))
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        self.control.add_routes(r)
        self.weights.add_routes(r)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.gc.install()
        self.scheduler.start()

    async def _stop(self, app: web.Application) -> None:
        await asyncio.to_thread(self.scheduler.stop)
        self.gc.close()

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
        if not auth.allowed(
            request.method,
            request.path,
            request.headers.get("Authorization"),
            self.cfg.api_key,
            self.cfg.admin_api_key,
        ):
            level = auth.ROUTE_LEVELS.get(request.path, auth.Level.NORMAL).value
            return _error(
                401,
                f"Unauthorized: missing or wrong API key for {request.path} ({level} route; "
                "Authorization: Bearer <key>)",
            )
        return await handler(request)

    async def _body(self, request: web.Request, required: bool = True) -> dict[str, Any]:
        return await read_body(request, required)

    async def _on_scheduler(self, fn: Any) -> Any:
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
        as_batch = batched or _parallel_samples(sps[0]) > 1  # SGLang: n > 1 makes a batch
        spaces = list(
            zip(
                _cache_keys(body, "extra_key", n_prompts, as_batch),
                _cache_keys(body, "cache_salt", n_prompts, as_batch),
                strict=True,
            )
        )
        want_logprob = bool(body.get("return_logprob", False))
        start = body.get("logprob_start_len")
        start = -1 if start is None else int(start)
        top_n = int(body.get("top_logprobs_num") or 0)
        if top_n < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {top_n}")
        with_text = bool(body.get("return_text_in_logprobs", False))
        jobs: list[tuple[list[int], str, SamplingParams, tuple]] = []
        for prompt, rid, sp, space in zip(prompts, rids, sps, spaces, strict=True):
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
            jobs += [(prompt, base if n == 1 else f"{base}_{j}", params, space) for j in range(n)]
        batched = batched or len(jobs) > 1
        want_routed = bool(body.get("return_routed_experts", False))
        if want_routed and not self.runner.family.moe_gates(self.runner.model):
            raise BadRequest("return_routed_experts: the model has no MoE layers")
        routed_start = body.get("routed_experts_start_len", 0)
        if not isinstance(routed_start, int) or routed_start < 0:
            raise BadRequest(
                f"routed_experts_start_len must be an integer >= 0, got {routed_start!r}"
            )
        for prompt, *_ in jobs:
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

    def _make_requests(self, jobs: list[tuple[list[int], str, SamplingParams, tuple]], opts: _Opts):
        reqs, groups = [], {}
        for prompt, rid, params, (extra_key, cache_salt) in jobs:
            r = Request(
                rid,
                list(prompt),
                params,
                on_done=lambda r: None,
                top_logprobs_num=opts.top_n,
                return_routed=opts.want_routed,
                routed_start=opts.routed_start,
                extra_key=extra_key,
                cache_salt=cache_salt,
            )
            r.seed = self._seed_of(params.sampling_seed)
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

    def _seed_of(self, asked: int | None) -> int | None:
        """The seed a request draws with, as SGLang 0.5.23 decides it
        (srt/sampling/sampling_batch_info.py): with --enable-deterministic-inference
        (`engine.deterministic_inference`) its `sampling_seed`, else 42 for every request without
        one; without it, no seed at all: SGLang ignores `sampling_seed` (strict mode does too,
        counted in `ignored_seeds` and logged once), where a non-strict engine honours it."""
        if self.cfg.deterministic_inference:
            return DETERMINISTIC_DEFAULT_SEED if asked is None else asked
        if asked is not None and self.cfg.embedded.strict_sglang:
            if not self.ignored_seeds:
                log.warning(
                    "/generate: sampling_seed ignored, as SGLang ignores it without "
                    "--enable-deterministic-inference (engine.deterministic_inference = false)"
                )
            self.ignored_seeds += 1
            return None
        return asked

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
        """GET /health and /health_generate. Strict, as SGLang 0.5.23 (http_server.py:
        health_generate serves both routes, since `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is
        on by default, environ.py): a one-token generation, answered no sooner than the first
        sleep of its wait loop (`health_delay_s`, 1 s there); 503 once it has waited
        `health_timeout_s` (HEALTH_CHECK_TIMEOUT, 20 s) with no token (e.g. while paused).
        Otherwise /health answers whether the scheduler runs, /health_generate runs the
        generation (no timeout while paused: paused answers 200 at once), both after
        `health_delay_s` (0 by default)."""
        t0 = time.monotonic()
        status = await self._health_status(request.path == "/health_generate")
        await asyncio.sleep(max(0.0, t0 + self.health_delay_s - time.monotonic()))
        if status != 200:
            return _error(status, self.scheduler.fatal or "health check failed")
        return web.Response(status=200)

    health_generate = health

    async def _health_status(self, generate: bool) -> int:
        if not self.scheduler.alive():
            return 503
        strict = self.cfg.embedded.strict_sglang
        if not strict and (not generate or self.scheduler.paused):
            return 200
        r = Request(
            f"HEALTH_CHECK_{uuid.uuid4().hex}",
            [int(next(iter(self.runner.eos_token_ids), 0))],
            SamplingParams(max_new_tokens=1, temperature=0.0),
            on_done=lambda r: None,
        )
        timeout = self.cfg.embedded.health_timeout_s
        try:
            await asyncio.wait_for(self._run(r), timeout if strict else None)
        except TimeoutError:
            # http_server.py: health_generate gives up after HEALTH_CHECK_TIMEOUT with 503.
            await self._on_scheduler(lambda: self.scheduler.abort(r.rid))
            log.error("/health: no token from the scheduler in %.0f s", timeout)
            return 503
        return 503 if r.error else 200

    async def ready(self, request: web.Request) -> web.Response:
        """As SGLang 0.5.23's GET /ready: at once, 200 when new requests are taken, 503 while
        generation is paused or the scheduler has stopped (the liveness probes' first choice)."""
        if not self.scheduler.alive():
            return web.Response(status=503)
        return web.Response(status=503 if self.scheduler.paused else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.reported_version,
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
                # The layout as ServerArgs names it (arg_groups/fields/parallel.py; server_args.py
                # still reports enable_dp_attention = attn_dp_size > 1): one device here.
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "attn_dp_size": 1,
                "attn_cp_size": 1,
                "ep_size": 1,
                "enable_dp_attention": False,
                "api_key": None,
                "max_running_requests": self.runner.max_slots,
                "context_length": self.runner.max_context_len,
                "weight_version": self.reported_version,
                "paused": self.scheduler.paused,
                "strict_sglang": self.cfg.embedded.strict_sglang,
                # ServerArgs' fields: sampling_seed is honoured only with deterministic inference,
                # which sets the sampling backend to pytorch (arg_groups/overrides.py)
                "enable_deterministic_inference": self.cfg.deterministic_inference,
                "sampling_backend": "pytorch",
                "ignored_seeds": self.ignored_seeds,
                **self.weights.info(),
                "decode_steps": self.scheduler.steps,
                **self.scheduler.stats(),
                "prefill_attention": self.runner.prefill_attention,
                "decode_attention": self.runner.decode_attention,
                "decode_shared_prefix": self.runner.decode_shared_prefix,
                "decode_shared_steps": self.runner.graphs.shared_steps if self.runner.graphs else 0,
                "sampling_kernels": self.runner.sampling_kernels(),
                "cuda_graph_batch_sizes": self.runner.graphs.sizes if self.runner.graphs else [],
                "memory": self.runner.memory_info(),
                **self.gc.stats(),
                "ignored_fields": self.ignored_fields,
                "routed_unavailable": self.routed_unavailable,
                "started_at": self.started_at,
                **self.scheduler.load(),
            }
        )


@dataclass(frozen=True)
class _Opts:
    """What a /generate response carries beyond tokens and text."""

    want_logprob: bool
    start: int
    top_n: int
    with_text: bool
    want_routed: bool = False
    routed_start: int = 0


def _cache_keys(body: dict[str, Any], name: str, n: int, as_batch: bool) -> list[str | None]:
    """SGLang's extra_key or cache_salt for each of `n` prompts (srt/managers/io_struct.py:
    GenerateReqInput._normalize_extra_key / _normalize_cache_salt and, for one prompt,
    _normalize_single_inputs): one string for all, or, for a batch, a list of strings of its
    length; an empty string is no key."""
    v = body.get(name)
    if v is None or isinstance(v, str):
        return [v or None] * n
    if not isinstance(v, list):
        raise BadRequest(f"{name} must be a string or a list of strings, got {type(v).__name__}")
    if not as_batch:
        raise BadRequest(f"{name} must be one string for a single prompt, got a list")
    if len(v) != n:
        raise BadRequest(f"{name} holds {len(v)} keys for a batch of {n} prompts")
    if not all(isinstance(x, str) for x in v):
        raise BadRequest(f"{name} must hold only strings")
    return [x or None for x in v]


def _parallel_samples(sp: object) -> int:
    n = sp.get("n", 1) if isinstance(sp, dict) else 1
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"sampling_params.n must be an integer >= 1, got {n!r}")
    return n


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
