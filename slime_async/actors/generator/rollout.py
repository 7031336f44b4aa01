"""The rollout-plugin API: what a user's asyncio rollout receives and returns.

A rollout plugin is an async function named by import path in `generator.rollout`:

    async def rollout(ctx: RolloutContext, sample: Sample) -> Transcript | list[Transcript]:
        t = ctx.new_transcript(ctx.prompt_ids(sample))
        out = await ctx.generate(t.ids)          # tokens, log-probs, versions as generated
        t.add_model(out)                          # loss mask 1, kept token-exact
        t.add_env(ctx.encode("<tool>42<eos>"))    # environment tokens, loss mask 0
        out = await ctx.generate(t.ids)           # the next turn continues from t.ids exactly
        t.add_model(out)
        return t

The generator calls the reward function on each returned transcript (unless the plugin set
`t.reward` itself), checks the result (equal lengths, masks, versions, finite reward) and
turns it into a wire `Trajectory`. Model text is never re-tokenised: the next turn is built
from the token ids the engine returned, so the trained sequence is exactly the generated one.

`ctx.generate` resumes a request that an engine aborted for a weight update: it sends the
prompt plus the tokens so far and keeps each token's policy version, so one response may hold
tokens of several versions. An abort that brought no token (the engine is mid-update) is
resumed after a back-off (`RESUME_BACKOFF_S` doubling up to `MAX_RESUME_BACKOFF_S`, jittered).

Prefix keys: every engine request carries SGLang's `extra_key` naming the weight version the
engine served at the latest answer (`EngineClient.generate`), so cached prompt KV is shared only
among requests keyed by one version. A resumed request is keyed by the version at which it
starts again, not by the one its first tokens came from: its prompt and partial output are
prefilled under the weights it will continue with, so it must not take KV that older weights
cached (the tokens so far keep their own versions; only the new tokens' context is recomputed).
Each answer's cached prompt tokens are counted, and so are the requests that took a cached prefix
under a key older than the weights that answered (`prefix_key_behind`: the engine was updated
after the latest answer this client saw, so the reused KV may be of the older weights; logged).

Routing replay (MoE): every segment's routed experts are kept, in order. The first request's
answer covers every fed token (`[0, end - 1)`); a resumed request asks only for the rows it does
not have yet (SGLang's `routed_experts_start_len`), so the tokens of an earlier segment keep the
experts the engine chose when it generated them, not those of the resumed request's prefill
under newer weights. An answer that covers the whole stream (an engine or router that ignored
the start) is cut to the new rows; a segment whose routing is missing or of the wrong size
leaves the generation without routing (`RolloutStats.routing_missing`, logged).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slime_async.actors.engine.client import EngineRequestError, engine_retry_policy
from slime_async.config.generator import SamplingConfig
from slime_async.queue.schema import Trajectory
from slime_async.utils.plugins import PluginError, Registry

log = logging.getLogger(__name__)

ROLLOUTS = Registry("rollout", params=("ctx", "sample"), is_async=True)

RESUME_BACKOFF_S = 0.05
"""Wait before resuming a request whose engine aborted it without a token (a weight update)."""
MAX_RESUME_BACKOFF_S = 1.0
"""Longest such wait: a weight update takes seconds, the request should follow it closely."""


class PluginContractError(PluginError):
    """A rollout or reward plugin returned something the generator cannot train on."""


class EngineFailure(RuntimeError):
    """An engine call failed after the engine client's own retries; the rollout is retried."""


class EngineLike(Protocol):
    """What the context needs from an engine: `EnginePool.generate`'s signature."""

    async def generate(
        self, input_ids: list[int], sampling_params: dict, rid: str | None = None
    ) -> Any:
        """Also takes `routed_start=` (SGLang's routed_experts_start_len) when a resumed
        request wants routing from a position on; engines that cannot route never see it."""
        ...


@dataclass
class Sample:
    """One rollout's input: a dataset record and where it sits in the run."""

    prompt: Any
    """The record's prompt field: text, or a list of chat messages."""
    metadata: dict[str, Any]
    """The rest of the JSONL record (answers, task parameters)."""
    group_id: str
    """Deterministic id of the group: the same prompt position gives the same id after a restart."""
    index: int
    """Row of the record in the dataset file."""
    epoch: int
    """Pass over the dataset this sample belongs to."""
    sample_index: int = 0
    """Which of the group's rollouts this is (0 <= sample_index < group_size)."""

    @property
    def id(self) -> str:
        """`<group_id>/<sample_index>`: names this rollout in logs and errors."""
        return f"{self.group_id}/{self.sample_index}"


@dataclass
class Generation:
    """The output of one `ctx.generate` call (several engine requests when resumed)."""

    token_ids: list[int]
    """Generated tokens, the stop token included when one matched."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token."""
    versions: list[int]
    """Policy version that produced each token."""
    finish_reason: str
    """stop | length (never abort: aborted requests are resumed)."""
    engine_id: str = ""
    """Engine that produced the last part (when the engine client reports it)."""
    resumes: int = 0
    """How often the request was resumed after an engine abort."""
    temperature: float | None = None
    """Temperature the engine sampled at and scaled `logprobs` by (greedy, 0, is recorded as 1.0,
    as SGLang reports greedy log-probs at 1.0); None when unknown (a hand-made Generation)."""
    routed_experts: np.ndarray | None = None
    """Flat int32 MoE experts of every token of the request's whole stream but the last, each
    segment's own (the engine's `routed_experts`, when asked for); None otherwise."""


def logprob_temperature(temperature: float) -> float:
    """The temperature behaviour log-probs are computed at: greedy (0) is sampled and scored at 1."""
    return float(temperature) if temperature > 0 else 1.0


class Transcript:
    """A token-exact rollout under construction: prompt + model and environment segments.

    Model tokens keep the ids, log-probs and versions the engine returned (loss mask 1).
    Environment tokens have loss mask 0, log-prob 0.0 and the version of the preceding model
    token. `ids` is the exact sequence to continue from in the next turn.
    """

    def __init__(self, prompt_ids: Sequence[int], tokenizer: Any = None):
        self.prompt_ids: list[int] = [int(t) for t in prompt_ids]
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] = []
        self.finish_reason: str = "stop"
        self.turns: int = 0
        self.engine_id: str = ""
        self.routed_experts: np.ndarray | None = None
        """The last model turn's routed experts (routing replay), covering `_routed_tokens` tokens."""
        self._routed_tokens = 0
        self.reward: float | None = None
        self.reward_parts: dict[str, float] = {}
        self.reward_text: str | None = None
        self.metadata: dict[str, str | int | float | bool] = {}
        self.temperatures: list[float] = []
        self._tokenizer = tokenizer
        self._last_model: list[int] = []

    @property
    def ids(self) -> list[int]:
        """prompt + response tokens, exactly as the next turn must continue from them."""
        return self.prompt_ids + self.response_ids

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_model(self, out: Generation) -> None:
        """Append the engine's tokens as generated (loss mask 1)."""
        n = len(out.token_ids)
        if len(out.logprobs) != n or len(out.versions) != n:
            raise PluginContractError(
                f"generation has {n} tokens but {len(out.logprobs)} log-probs and "
                f"{len(out.versions)} versions"
            )
        self.response_ids.extend(int(t) for t in out.token_ids)
        self.logprobs.extend(float(x) for x in out.logprobs)
        self.versions.extend(int(v) for v in out.versions)
        self.loss_mask.extend([1] * n)
        self.finish_reason = out.finish_reason
        self.engine_id = out.engine_id or self.engine_id
        self.turns += 1
        if out.temperature is not None and out.temperature not in self.temperatures:
            self.temperatures.append(float(out.temperature))
        self._last_model = list(out.token_ids)
        if out.routed_experts is not None:
            # SGLang's payload covers the whole stream up to this turn: it supersedes the last.
            self.routed_experts = out.routed_experts
            self._routed_tokens = len(self.prompt_ids) + len(self.response_ids) - 1

    @property
    def temperature(self) -> float | None:
        """The one temperature of the model turns (None: unknown, the run's default applies)."""
        return self.temperatures[0] if len(self.temperatures) == 1 else None

    def add_env(self, token_ids: Sequence[int]) -> None:
        """Append environment / tool tokens (loss mask 0, log-prob 0, version of the last model token)."""
        version = self.versions[-1] if self.versions else -1  # fixed up in finalize()
        n = len(token_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend([0.0] * n)
        self.versions.extend([version] * n)
        self.loss_mask.extend([0] * n)

    def last_model_text(self) -> str:
        """The last model turn decoded without special tokens (the default text a reward sees)."""
        if self._tokenizer is None:
            raise PluginContractError("transcript has no tokenizer to decode with")
        return self._tokenizer.decode(self._last_model, skip_special_tokens=True)

    def response_text(self, skip_special_tokens: bool = False) -> str:
        if self._tokenizer is None:
            raise PluginContractError("transcript has no tokenizer to decode with")
        return self._tokenizer.decode(self.response_ids, skip_special_tokens=skip_special_tokens)

    def finalize(self, plugin: str) -> None:
        """Check the transcript is trainable; give leading env tokens the first model version."""
        n = len(self.response_ids)
        lens = {len(self.logprobs), len(self.loss_mask), len(self.versions)}
        if lens != {n}:
            raise PluginContractError(
                f"rollout {plugin}: mismatched lengths: {n} response ids, "
                f"{len(self.logprobs)} log-probs, {len(self.loss_mask)} mask, "
                f"{len(self.versions)} versions"
            )
        if not any(self.loss_mask):
            raise PluginContractError(f"rollout {plugin}: transcript has no model tokens")
        if len(self.temperatures) > 1:
            raise PluginContractError(
                f"rollout {plugin}: model turns sampled at different temperatures "
                f"{self.temperatures}; the learner scores one trajectory at one temperature "
                "(use one temperature per transcript)"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise PluginContractError(f"rollout {plugin}: loss mask values must be 0 or 1")
        first = next(v for v, m in zip(self.versions, self.loss_mask, strict=True) if m)
        self.versions = [first if v < 0 else v for v in self.versions]
        bad = [
            i
            for i, (lp, m) in enumerate(zip(self.logprobs, self.loss_mask, strict=True))
            if m and not (math.isfinite(lp) and lp <= 1e-4)
        ]
        if bad:
            raise PluginContractError(
                f"rollout {plugin}: model token {bad[0]} has log-prob {self.logprobs[bad[0]]} "
                "(must be finite and <= 0)"
            )

    def to_trajectory(
        self, traj_id: str, group_id: str, group_size: int, created_at: float | None = None
    ) -> Trajectory:
        """The wire trajectory (call `finalize` first; `reward` must be set)."""
        if self.reward is None:
            raise PluginContractError(f"{traj_id}: transcript has no reward")
        return Trajectory(
            id=traj_id,
            group_id=group_id,
            group_size=group_size,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response_ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            loss_mask=np.asarray(self.loss_mask, dtype=np.uint8),
            versions=np.asarray(self.versions, dtype=np.int32),
            reward=float(self.reward),
            reward_parts=dict(self.reward_parts),
            finish_reason=self.finish_reason,
            engine_id=self.engine_id,
            created_at=time.time() if created_at is None else created_at,
            metadata=dict(self.metadata),
            temperature=self.temperature,
            routed_experts=self._routed_for_trajectory(),
        )

    def _routed_for_trajectory(self) -> np.ndarray | None:
        """The recorded routing when it covers every token but the last (not when environment
        tokens follow the last model turn: no engine routed them)."""
        routed = getattr(self, "routed_experts", None)
        if (
            routed is None
            or self._routed_tokens != len(self.prompt_ids) + len(self.response_ids) - 1
        ):
            return None
        return routed


def sampling_params(sampling: SamplingConfig | dict | None, base: SamplingConfig) -> dict:
    """SGLang `sampling_params` from the config defaults, overridden by `sampling`."""
    params = base.model_dump()
    if isinstance(sampling, SamplingConfig):
        params = sampling.model_dump()
    elif isinstance(sampling, dict):
        params.update(sampling)
    elif sampling is not None:
        raise PluginContractError(f"sampling must be a dict or SamplingConfig, not {sampling!r}")
    return params


@dataclass
class RolloutStats:
    """Counters shared by all contexts of one generator (its metrics take differences)."""

    tokens: int = 0
    requests: int = 0
    resumes: int = 0
    engine_errors: int = 0
    routing_missing: int = 0
    """Generations left without routed experts: a segment's answer lacked them or did not fit
    (routing replay; each logged)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the engines served from their prefix caches (SGLang's cached_tokens)."""
    tokens_over_cached_prefix: int = 0
    """Output tokens of requests that took part of their prompt from a prefix cache."""
    prefix_key_behind: int = 0
    """Requests that took a cached prefix under a key naming an older weight version than the one
    that answered them (the reused KV may be of older weights; each logged)."""


class RolloutContext:
    """What a rollout plugin gets: the engines, the tokenizer and transcript helpers.

    Members: `tokenizer` (the model's HF tokenizer), `eos_token_id`, `sampling` (the config's
    `SamplingConfig`), `state` (what the generator's lifecycle plug-in set up, else None),
    `encode`, `decode`, `apply_chat_template`, `prompt_ids`, `new_transcript`, `generate`.
    """

    def __init__(
        self,
        engine: EngineLike,
        tokenizer: Any,
        sampling: SamplingConfig | None = None,
        *,
        apply_chat_template: bool = True,
        max_resumes: int = 64,
        rid_prefix: str = "",
        stats: RolloutStats | None = None,
        state: Any = None,
    ):
        self.engine = engine
        self.state = state
        """What `generator.lifecycle` set up once for this generator (a judge client...)."""
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        self.use_chat_template = apply_chat_template
        self.max_resumes = max_resumes
        self.resume_policy = engine_retry_policy(
            RESUME_BACKOFF_S, max_attempts=max_resumes + 1, max_s=MAX_RESUME_BACKOFF_S
        )  # attempts = the first request and its resumes
        self.rid_prefix = rid_prefix
        self.stats = stats or RolloutStats()
        self._calls = 0

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (generation always stops on it)."""
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (markers in it still map to theirs)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` rendered by the tokenizer's chat template."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The sample's prompt as token ids: chat messages, or text (templated if configured)."""
        prompt = sample.prompt
        if isinstance(prompt, list):
            return self.apply_chat_template(prompt)
        if not isinstance(prompt, str):
            raise PluginContractError(
                f"prompt of {sample.group_id} must be text or a list of messages, "
                f"not {type(prompt).__name__}"
            )
        if self.use_chat_template:
            return self.apply_chat_template([{"role": "user", "content": prompt}])
        return self.encode(prompt)

    def new_transcript(self, prompt_ids: Sequence[int]) -> Transcript:
        return Transcript(prompt_ids, self.tokenizer)

    async def generate(
        self,
        token_ids: Sequence[int],
        sampling: SamplingConfig | dict | None = None,
    ) -> Generation:
        """Generate a continuation of `token_ids`; resumes across engine aborts (weight updates)."""
        params = sampling_params(sampling, self.sampling)
        least = int(params.get("min_new_tokens") or 0)
        if least != self.sampling.min_new_tokens:
            raise PluginContractError(
                f"sampling min_new_tokens = {least} differs from generator.sampling."
                f"min_new_tokens = {self.sampling.min_new_tokens}: the learner scores the first "
                "tokens of each turn by the configured value; set it there"
            )
        if not least:
            params.pop("min_new_tokens", None)  # SGLang's default: the request stays as it was
        budget = int(params["max_new_tokens"])
        ids = [int(t) for t in token_ids]
        temperature = logprob_temperature(float(params.get("temperature", 1.0)))
        out = Generation([], [], [], "length", temperature=temperature)
        self._calls += 1
        rid = f"{self.rid_prefix}{self._calls}"
        routing = _Routing()
        while True:
            params["max_new_tokens"] = budget - len(out.token_ids)
            if least:  # a resumed turn: its first tokens are already drawn under the ban
                params["min_new_tokens"] = max(0, least - len(out.token_ids))
            sent = ids + out.token_ids
            part = await self._request(sent, params, f"{rid}.{out.resumes}", routing.have)
            n = len(part.token_ids)
            if len(part.logprobs) != n or len(part.versions) != n:
                raise EngineFailure(
                    f"engine returned {n} tokens, {len(part.logprobs)} log-probs and "
                    f"{len(part.versions)} versions"
                )
            out.token_ids += list(part.token_ids)
            out.logprobs += list(part.logprobs)
            out.versions += list(part.versions)
            out.engine_id = str(getattr(part, "engine_url", "") or out.engine_id)
            routing.add(getattr(part, "routed_experts", None), len(sent) + n - 1)
            self.stats.tokens += n
            self._count_cache(part, rid)
            reason = _reason(part.finish_reason)
            done = reason != "abort" or len(out.token_ids) >= budget
            if done:
                out.finish_reason = reason if reason != "abort" else "length"
                out.routed_experts = routing.result(len(ids) + len(out.token_ids) - 1)
                if routing.asked and out.routed_experts is None:
                    self.stats.routing_missing += 1
                    log.warning(
                        "request %s: routed experts missing or misshapen for part of the "
                        "response (%s); the trajectory goes without routing (%d so far)",
                        rid,
                        routing.problem or "no segment returned them",
                        self.stats.routing_missing,
                    )
                return out
            out.resumes += 1
            self.stats.resumes += 1
            if self.resume_policy.exhausted(out.resumes):
                raise EngineFailure(f"request {rid} aborted {out.resumes} times")
            if n == 0:
                # An engine that aborts without progress is mid weight update: give it a moment.
                await asyncio.sleep(self.resume_policy.delay(out.resumes))

    def _count_cache(self, part: Any, rid: str) -> None:
        """Count what the answer took from the engine's prefix cache, and under which key."""
        cached = int(getattr(part, "cached_tokens", 0) or 0)
        if not cached:
            return
        self.stats.cached_prompt_tokens += cached
        self.stats.tokens_over_cached_prefix += len(part.token_ids)
        keyed = getattr(part, "prefix_version", None)
        if keyed is not None and part.versions and part.versions[0] > keyed:
            self.stats.prefix_key_behind += 1
            n = self.stats.prefix_key_behind
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: every one is counted
                log.warning(
                    "request %s: %d cached prompt tokens under the key of version %d, answered "
                    "by version %d (the engine was updated after the latest answer; the reused "
                    "KV may be of the older weights; %d so far, all counted in the generator's "
                    "records, logged at powers of two)",
                    rid,
                    cached,
                    keyed,
                    part.versions[0],
                    n,
                )

    async def _request(self, ids: list[int], params: dict, rid: str, routed_start: int) -> Any:
        self.stats.requests += 1
        extra = {"routed_start": routed_start} if routed_start else {}
        try:
            return await self.engine.generate(ids, dict(params), rid=rid, **extra)
        except (asyncio.CancelledError, EngineRequestError):
            raise  # a 4xx is the request's fault: retrying it would fail the same way
        except Exception as e:
            self.stats.engine_errors += 1
            raise EngineFailure(f"engine request failed: {type(e).__name__}: {e}") from e


def _reason(finish_reason: Any) -> str:
    """SGLang reports `{"type": "stop", ...}`; clients may pass that dict or just the type."""
    if isinstance(finish_reason, dict):
        return str(finish_reason.get("type", ""))
    return str(finish_reason or "")


def check_rollout_result(name: str, result: Any) -> list[Transcript]:
    """The plugin's result as a non-empty list of transcripts, or an error naming the plugin."""
    items = result if isinstance(result, list) else [result]
    if not items:
        raise PluginContractError(f"rollout {name!r} returned an empty list")
    for x in items:
        if not isinstance(x, Transcript):
            raise PluginContractError(
                f"rollout {name!r} returned {type(x).__name__}; expected a Transcript "
                "(ctx.new_transcript) or a list of them"
            )
    return items


@ROLLOUTS.register("single_turn")
async def single_turn(ctx: RolloutContext, sample: Sample) -> Transcript:
    """The prompt (chat-templated), one generation; the reward function scores the text."""
    t = ctx.new_transcript(ctx.prompt_ids(sample))
    t.add_model(await ctx.generate(t.ids))
    return t


class _Routing:
    """The routed experts of one `ctx.generate`, segment after segment (module docstring)."""

    def __init__(self):
        self.parts: list[np.ndarray] = []  # [rows, width] each, contiguous from position 0
        self.have = 0
        """Rows (fed positions from 0) collected so far: the next request's start."""
        self.width = 0
        self.asked = False
        self.problem: str | None = None

    def add(self, flat: np.ndarray | None, end: int) -> None:
        """A segment's answer, `flat` covering positions [0 or have, end)."""
        if flat is None:
            return
        self.asked = True
        if self.problem is not None:
            return
        if self.width == 0:  # the first answer starts at 0 (have is 0 until one arrives)
            if end <= 0 or flat.size % end:
                self.problem = f"{flat.size} ids for {end} routed tokens"
                return
            self.width = flat.size // end
        rows = flat.size // self.width if flat.size % self.width == 0 else -1
        if rows == end:  # the whole stream: the engine (or a router) ignored the start
            flat = flat.reshape(end, self.width)[self.have :]
        elif rows == end - self.have:
            flat = flat.reshape(rows, self.width)
        else:
            self.problem = f"{flat.size} ids for positions [{self.have}, {end})"
            return
        self.parts.append(flat)
        self.have = end

    def result(self, end: int) -> np.ndarray | None:
        """Flat routing of positions [0, end), or None when some are missing."""
        if not self.asked or self.problem is not None or self.have != end:
            if self.asked and self.problem is None and self.have != end:
                self.problem = f"routing for {self.have} of {end} routed tokens"
            return None
        return np.concatenate(self.parts, 0).reshape(-1).astype(np.int32)
