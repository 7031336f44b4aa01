"""Asyncio client for SGLang's native HTTP API (real SGLang servers, sglang-router, or the embedded
engine). Only SGLang's own field names are sent, since sglang-router drops unknown ones.

Every call has a timeout and is retried (`retry_async`, `engine_retry_policy`: exponential back-off
with jitter) on connection errors, timeouts and 5xx answers; a 4xx answer is the caller's fault
and raises `EngineRequestError` at once. Errors name the engine URL and the call.

Per-token versions: SGLang 0.5.23 (and the embedded engine) answer `meta_info.weight_versions`, a
list of spans `{version, start, end}` over the output tokens (end exclusive); each token gets the
version of its span. A server without spans (older SGLang) gives every token `weight_version`.
Versions are strings on the wire; the project's are integers ("default", SGLang's version before
any update, is 0).

Keys (SGLang 0.5.23, srt/utils/auth.py:decide_request_auth): a route marked ADMIN_OPTIONAL takes
only `--admin-api-key` when the server has one, else `--api-key`; every other route takes
`--api-key` (and /health*, /ready, /metrics none). The client sends the admin key (when given) on
the routes of `ADMIN_ROUTES` and the api key on all others.

Prefix keys: each /generate carries SGLang's `extra_key` = `prefix_key(v)`, where v is the weight
version of the latest answer this client received (0 before the first). SGLang's radix cache
keeps prefixes of different keys apart (srt/mem_cache/radix_cache.py: RadixKey.child_key_at), so a
new request never runs over prompt KV that requests under another version's key cached: a push
that keeps the cache (in_place pause, `flush_cache: false`) would otherwise let new requests reuse
KV computed by the old weights, silently. The answer reports what was reused
(`GenerateOutput.cached_tokens`) and under which key (`prefix_version`).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from slime_async.utils.retry import RetryPolicy, retry_async

log = logging.getLogger(__name__)

RETRY_JITTER = 0.5
"""Every client-side back-off of an engine call (this client's retries, the pool's fail-over, the
generator's rollout retries and resumes) is stretched by a random factor in [1, 1.5), so that the
callers an engine failed together do not all come back in the same instant."""


def engine_retry_policy(
    first_s: float, max_attempts: int | None, max_s: float = 30.0
) -> RetryPolicy:
    """The back-off shape of every retried engine call: doubling from `first_s`, capped, jittered."""
    return RetryPolicy(first_s=first_s, max_s=max_s, jitter=RETRY_JITTER, max_attempts=max_attempts)


ADMIN_ROUTES = frozenset(
    {
        # Every route srt/entrypoints/http_server.py (SGLang 0.5.23) marks
        # @auth_level(AuthLevel.ADMIN_OPTIONAL), in file order:
        "/set_internal_state",
        "/flush_cache",
        "/add_external_corpus",
        "/remove_external_corpus",
        "/list_external_corpora",
        "/hicache/storage-backend/clear",
        "/hicache/storage-backend",
        "/start_profile",
        "/stop_profile",
        "/set_trace_level",
        "/freeze_gc",
        "/start_expert_distribution_record",
        "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
        "/update_weights_from_disk",
        "/init_weights_send_group_for_remote_instance",
        "/send_weights_to_remote_instance",
        "/get_remote_instance_transfer_engine_info",
        "/remote_instance_transfer_engine_info",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/weights_checker",
        "/slow_down",
        "/pd_role_switch",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
        "/configure_logging",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }
)
"""Routes that take the admin key when the server has one (`EngineClient.key_for`); also the
prefix /dumper/ (http_server.py's /dumper/{method})."""


def is_admin_route(path: str) -> bool:
    """True for a route SGLang 0.5.23 marks ADMIN_OPTIONAL (`ADMIN_ROUTES`)."""
    path = path.split("?", 1)[0]
    return path in ADMIN_ROUTES or path.startswith("/dumper/")


class EngineError(RuntimeError):
    """A call to an engine failed (after retries, where they apply)."""

    def __init__(self, url: str, call: str, message: str, status: int | None = None):
        super().__init__(f"{call} to {url} failed: {message}")
        self.url, self.call, self.status, self.message = url, call, status, message


class EngineRequestError(EngineError):
    """The engine rejected the request (4xx): retrying it elsewhere would not help."""


@dataclass
class GenerateOutput:
    """One /generate result. logprobs and versions are per output token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    engine_url: str
    text: str = ""
    finish_message: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache (SGLang's `meta_info.cached_tokens`)."""
    prefix_version: int | None = None
    """The weight version the request's `extra_key` named (None: sent without a key)."""
    routed_experts: np.ndarray | None = field(default=None, repr=False)
    """Flat int32 experts of every token of prompt + output but the last (from
    `routed_experts_start_len` on when asked), per MoE layer and top-k slot (SGLang's
    `meta_info.routed_experts`, asked for by `return_routed_experts`)."""


def prefix_key(version: int) -> str:
    """The `extra_key` of requests sent while the engine serves weight version `version`."""
    return f"weights-{version}"


def parse_weight_version(value: object) -> int:
    """SGLang reports weight_version as a string ("default" before the first update): -> int."""
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def versions_from_spans(spans: list[Any], num_tokens: int) -> list[int]:
    """SGLang's `weight_versions` spans -> one version per output token. Spans are
    `{"version", "start", "end"}` objects (or `[version, start, end]` arrays), end exclusive, and
    must cover tokens 0..num_tokens-1 in order."""
    out: list[int] = []
    for span in spans:
        if isinstance(span, dict):
            v, start, end = span["version"], int(span["start"]), int(span["end"])
        else:
            v, start, end = span[0], int(span[1]), int(span[2])
        if start != len(out) or end < start:
            raise ValueError(f"weight_versions span {span!r} does not follow token {len(out)}")
        out += [parse_weight_version(v)] * (end - start)
    if len(out) != num_tokens:
        raise ValueError(f"weight_versions spans cover {len(out)} of {num_tokens} tokens")
    return out


def parse_generate_response(body: dict[str, Any], url: str) -> GenerateOutput:
    """A /generate response (SGLang's shape) -> GenerateOutput; raises EngineError if malformed."""
    try:
        meta = body["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        token_ids = [int(i) for i in ids] if ids is not None else [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        if pairs and len(logprobs) != len(token_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        version = parse_weight_version(meta.get("weight_version"))
        spans = meta.get("weight_versions")
        versions = (
            versions_from_spans(spans, len(token_ids))
            if spans is not None
            else [version] * len(token_ids)
        )
        fr = meta.get("finish_reason") or {}
        if isinstance(fr, str):
            fr = {"type": fr}
        return GenerateOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=str(fr.get("type", "unknown")),
            weight_version=version,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(token_ids))),
            engine_url=url,
            text=body.get("text", ""),
            finish_message=fr.get("message"),
            meta_info=meta,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            routed_experts=decode_routed_experts(meta.get("routed_experts")),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise EngineError(url, "POST /generate", f"malformed response: {e!r}") from None


def decode_routed_experts(value: Any) -> np.ndarray | None:
    """SGLang's `routed_experts`: base64 of little-endian int32 -> a flat int32 array."""
    if value is None:
        return None
    return np.frombuffer(base64.b64decode(value), dtype="<i4").astype(np.int32)


class EngineClient:
    """One engine (or one router) at `url`. Use as `async with EngineClient(url) as c:`."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 0.2,
        connect_timeout_s: float = 10.0,
        admin_api_key: str | None = None,
    ):
        """`api_key`: sent on every route but the admin ones; `admin_api_key`: sent on the admin
        routes (`ADMIN_ROUTES`) when set, else `api_key` is."""
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = 0
        """Calls sent again after a failure (each one logged with its reason)."""
        self.return_routed_experts = False
        """Ask /generate for the MoE experts of every token (routing replay)."""
        self.prefix_keys = True
        """Send each /generate SGLang's extra_key naming the weight version (module docstring)."""
        self.weight_version = 0
        """The weight version of the latest /generate answer (the version a new request is keyed
        by: the engine's own report, never the learner's, so a restarted engine's fresh weights
        are not taken for the version it will be pushed)."""
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No per-host connection cap: concurrency is the caller's (admission, pool).
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def key_for(self, path: str) -> str | None:
        """The key a call to `path` sends: the admin key on an admin route when this client has
        one, else the api key (SGLang's decide_request_auth)."""
        if self.admin_api_key and is_admin_route(path):
            return self.admin_api_key
        return self.api_key

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        max_retries: int | None = None,
    ) -> Any:
        """One API call with retries; returns the decoded JSON (None for an empty 200 body)."""
        name = f"{method} {path}"
        retries = self.max_retries if max_retries is None else max_retries
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.timeout_s, connect=self.connect_timeout_s
        )
        policy = engine_retry_policy(self.backoff_s, max_attempts=retries + 1)

        def on_retry(n: int, error: BaseException, delay: float) -> None:
            self.retries += 1
            log.warning("%s; retry %d of %d in %.2fs", error, n, retries, delay)

        return await retry_async(
            lambda _attempt: self._call_once(method, path, name, body, timeout),
            policy,
            retry_on=_retryable,
            on_retry=on_retry,
        )

    async def _call_once(
        self, method: str, path: str, name: str, body: Any, timeout: aiohttp.ClientTimeout
    ) -> Any:
        key = self.key_for(path)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            async with self._get_session().request(
                method, self.url + path, json=body, timeout=timeout, headers=headers
            ) as resp:
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise EngineError(self.url, name, f"{type(e).__name__}: {e}") from e
        if resp.status < 400:
            return _decode(raw) if raw else None
        message = f"HTTP {resp.status}: {_error_message(raw) or resp.reason or ''}"
        if resp.status < 500:
            raise EngineRequestError(self.url, name, message, resp.status)
        raise EngineError(self.url, name, message, resp.status)

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
        max_retries: int | None = None,
        routed_start: int = 0,
    ) -> GenerateOutput:
        """POST /generate for one prompt of token ids; with `return_routed_experts`, the
        routing of positions from `routed_start` on (SGLang's routed_experts_start_len)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        keyed = self.weight_version if self.prefix_keys else None
        if keyed is not None:
            body["extra_key"] = prefix_key(keyed)
        if self.return_routed_experts:
            body["return_routed_experts"] = True
            if routed_start:
                body["routed_experts_start_len"] = int(routed_start)
        out = await self.call("POST", "/generate", body, max_retries=max_retries)
        if not isinstance(out, dict):
            raise EngineError(
                self.url, "POST /generate", f"expected a JSON object, got {type(out).__name__}"
            )
        parsed = parse_generate_response(out, self.url)
        parsed.prefix_version = keyed
        self.weight_version = parsed.weight_version
        return parsed

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when GET /health answers 200 (no retries)."""
        try:
            await self.call("GET", "/health", timeout_s=timeout_s, max_retries=0)
            return True
        except EngineError:
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self.call("GET", "/health_generate", timeout_s=timeout_s, max_retries=0)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        return await self.call("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        """SGLang's /server_info (the current route), else the deprecated /get_server_info."""
        try:
            return await self.call("GET", "/server_info", max_retries=0)
        except EngineRequestError:
            return await self.call("GET", "/get_server_info")

    async def get_weight_version(self) -> int:
        """The served weight version: `weight_version` of /model_info (SGLang 0.5.23 has no
        /get_weight_version route), else /get_weight_version (older servers)."""
        try:
            info = await self.call("GET", "/model_info")
            if isinstance(info, dict) and "weight_version" in info:
                return parse_weight_version(info["weight_version"])
        except EngineRequestError:
            pass
        info = await self.call("GET", "/get_weight_version")
        return parse_weight_version(info.get("weight_version") if isinstance(info, dict) else info)

    async def pause_generation(self, mode: str = "abort") -> None:
        """mode: abort | retract | in_place."""
        await self.call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.call("POST", "/continue_generation", {})

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort requests whose rid starts with `rid`, or all of them."""
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        await self.call("POST", "/abort_request", body)

    async def flush_cache(self) -> bool:
        """True when the engine flushed (200); False when it refused (400: requests running)."""
        try:
            await self.call("POST", "/flush_cache", {}, max_retries=0)
        except EngineRequestError as e:
            if e.status == 400:
                return False
            raise
        return True

    async def update_weight_version(self, new_version: str, abort_all: bool = False) -> None:
        await self.call(
            "POST",
            "/update_weight_version",
            {"new_version": str(new_version), "abort_all_requests": abort_all},
        )

    # ---- weight sync -------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        return await self._weights_call(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | str | None = None,
        flush_cache: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._weights_call("/update_weights_from_distributed", body)

    async def begin_weight_update(self) -> dict[str, Any]:
        """POST /begin_weight_update {}: open the weight-update session every update from
        distributed or from tensor must run in (SGLang 0.5.23, srt/managers/
        scheduler_components/weight_updater.py: update_weights_from_distributed answers
        success false outside one; begin answers 400 while one is open)."""
        return await self._weights_call("/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        """POST /end_weight_update {}: close the session (400 when none is open)."""
        return await self._weights_call("/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, flush_cache: bool = False
    ) -> dict[str, Any]:
        """flush_cache is sent explicitly: SGLang's default (true) kills a server whose flush
        fails, and it fails while requests run."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._weights_call("/update_weights_from_disk", body)

    async def _weights_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        # Never retried: the peer side of a collective cannot be replayed.
        out = await self.call("POST", path, body, max_retries=0)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineRequestError(self.url, f"POST {path}", str(out.get("message")))
        return out or {}


def _retryable(e: BaseException) -> bool:
    """Connection errors, timeouts and 5xx are retried; a 4xx would fail the same way again."""
    return isinstance(e, EngineError) and not isinstance(e, EngineRequestError)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)[:500]
