"""`[engine]`: engines that speak SGLang's native HTTP API (embedded or external),
`[engine.embedded]`: what only the project's embedded engine reads, and `[engine.liveness]`: how
the roles that use an engine tell, while it runs, that it still answers."""

from typing import Literal

from pydantic import Field, model_validator

from slime_async.config.base import Section


class EmbeddedEngineConfig(Section):
    """Real SGLang servers take these on their own command line instead."""

    device: str = "auto"
    """torch device of the embedded engine: auto, cpu, cuda, cuda:1, ..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV-cache dtype."""
    max_running_requests: int = Field(64, ge=1)
    """Most requests decoded together (continuous batching); others wait in the queue."""
    max_context_len: int = Field(2048, ge=2)
    """Longest prompt + output of one request (capped by the model's max positions); sizes the KV cache."""
    cuda_graphs: bool = True
    """Replay the decode step from CUDA graphs (GPU only): far fewer launches."""
    torch_threads: int = Field(0, ge=0)
    """CPU threads of the engine's torch (0: torch's default)."""
    strict_sglang: bool = False
    """Fail where SGLang 0.5.23 fails (updates from distributed only inside a
    /begin_weight_update session, flush refused while requests run, /health as slow as SGLang's;
    docs/engines.md lists the rules); tests of the push use it."""
    initial_weight_version: str = "default"
    """The weight_version served before the first update (SGLang's "default", read as 0). It must
    name the weights loaded: an engine of the learner's base model serves version 0, so a positive
    version is refused there (a restarted engine would pass for one serving trained weights)."""
    mem_fraction: float = Field(0.8, gt=0, le=1)
    """On a GPU: the share of the GPU's memory the weights, activations and paged KV cache may
    take together; the cache gets what is left (and no more than is free)."""
    gpu_reserve_gib: float | Literal["auto"] = "auto"
    """GPU memory the engine leaves free for other processes on its GPU (GiB): it sizes its KV
    cache from what is free minus this, and refuses to start when one request of
    max_context_len does not fit. "auto": `slime-async run` sets it to the learner's estimated
    peak where a learner rank shares the engine's GPU (the estimate is printed at start), else
    0; an engine started by hand reads "auto" as 0."""
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV-cache block (a power of two; the Triton decode kernel needs >= 16)."""
    kv_cache_tokens: int | None = Field(None, ge=2)
    """Size the KV cache to this many tokens instead (on a CPU the default is
    max_running_requests x max_context_len; on a GPU mem_fraction decides)."""
    max_prefill_tokens: int = Field(8192, ge=1)
    """Most new prompt tokens packed into one prefill pass (one longer prompt still runs alone)."""
    prefix_sharing: bool = True
    """Prefill a shared prompt once: the n samples of a request, and later requests whose prompt
    starts with cached full blocks, share its KV blocks (flushed on every weight update; in strict
    mode, as SGLang, only by updates asked to flush and by /flush_cache)."""
    prefill_attention: Literal["auto", "varlen", "gathered"] = "auto"
    """Prefill attention over each prompt's cached and new keys: `varlen` (torch's
    variable-length flash kernel over the prompts' gathered keys, one kernel for the batch;
    CUDA, bf16/fp16), `gathered` (SDPA over each prompt's gathered blocks, padded to the
    longest, with a mask: its math path), `auto` (varlen where it runs and passes its check at
    start, logged where not)."""
    decode_attention: Literal["auto", "triton", "gathered"] = "auto"
    """Decode attention over the paged cache: `triton` (the project's paged kernel, CUDA),
    `gathered` (SDPA over each request's gathered blocks), `auto` (triton where it runs)."""
    decode_shared_prefix: Literal["auto", "on", "off"] = "auto"
    """Decode attention reads a prompt's KV blocks once for all the running requests that share
    them (the n samples of a group, through prefix_sharing) instead of once per request: `on`
    (needs the triton decode kernel and prefix_sharing), `off`, `auto` (on where it runs)."""
    compile: bool = True
    """GPU: fuse each layer's norms, rotary, SiLU and residual adds with torch.compile."""
    overlap_schedule: bool = True
    """Launch decode step t+1 before the host reads step t's tokens (host work overlaps the GPU),
    and prefill arriving requests behind the step in flight; off: the host reads every step and
    prefill before launching the next."""
    gc_warning_s: float = Field(0.05, gt=0)
    """A garbage collection of the engine's process longer than this is logged as a warning and
    counted (`gc_long_collections` in /get_server_info; every collection is timed there). The
    engine freezes what start-up made out of the collector's sight once it is ready, and again
    on POST /freeze_gc, as SGLang after its warm-up."""
    health_delay_s: float | None = Field(None, ge=0)
    """Least time GET /health and /health_generate take before answering (SGLang's answer no
    sooner than the first 1 s sleep of their wait loop); None: 1 s in strict mode, 0 otherwise."""
    health_timeout_s: float = Field(20.0, gt=0)
    """Strict mode: how long GET /health waits for its one-token generation before answering
    503 (SGLang's HEALTH_CHECK_TIMEOUT, 20 s; e.g. while generation is paused)."""

    @model_validator(mode="after")
    def _paged_cache(self) -> "EmbeddedEngineConfig":
        """Block sizes the cache and the kernel can use; one way to size the cache."""
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"engine.embedded.block_size must be a power of two, got {self.block_size}"
            )
        if self.decode_attention == "triton" and self.block_size < 16:
            raise ValueError(
                "engine.embedded.decode_attention = 'triton' needs engine.embedded.block_size "
                f">= 16 (got {self.block_size})"
            )
        if self.decode_shared_prefix == "on" and not self.prefix_sharing:
            raise ValueError(
                "engine.embedded.decode_shared_prefix = 'on' reads the KV blocks requests share; "
                "with engine.embedded.prefix_sharing off none are shared: turn one on or the "
                "other off"
            )
        if self.decode_shared_prefix == "on" and self.decode_attention == "gathered":
            raise ValueError(
                "engine.embedded.decode_shared_prefix = 'on' needs the triton decode kernel "
                "(engine.embedded.decode_attention 'auto' or 'triton', not 'gathered')"
            )
        if self.gpu_reserve_gib != "auto" and self.gpu_reserve_gib < 0:
            raise ValueError(
                f"engine.embedded.gpu_reserve_gib must be >= 0 or 'auto', got {self.gpu_reserve_gib}"
            )
        # Values, not fields_set: config.json (what every child reads) spells out every default.
        if self.kv_cache_tokens is not None and self.mem_fraction != _default("mem_fraction"):
            raise ValueError(
                "engine.embedded.kv_cache_tokens and engine.embedded.mem_fraction both size the "
                "KV cache: set one"
            )
        return self

    def changed(self) -> list[str]:
        """The keys set to something other than their default."""
        return [k for k in type(self).model_fields if getattr(self, k) != _default(k)]


SGLANG_HEALTH_MIN_S = 1.0
"""SGLang's GET /health and /health_generate run a one-token generation and answer no sooner than
the first 1 s sleep of their wait loop (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`, on by
default); while generation is paused they answer 503 after about 20 s."""


class LivenessConfig(Section):
    """Every role that uses an engine (each generator's pool, the learner's weight push) and
    `slime-async run`'s supervisor probe it every `probe_interval_s`: GET /ready first (SGLang
    0.5.23 and the embedded engine answer at once; 503 while paused or starting still means
    alive), GET /health where /ready is missing (remembered per engine). An engine that answers
    nothing for `hung_after_s` is reported as hung, counted and marked down; one that
    `slime-async run` started is restarted once it stays hung for `restart_after_s`."""

    probe_interval_s: float = Field(2.0, gt=0)
    """How often each role probes each engine it uses, while it runs (not only after a failure)."""
    ready_timeout_s: float = Field(5.0, gt=0)
    """Longest wait for one GET /ready answer (an engine that lacks /ready answers 404 at once)."""
    health_timeout_s: float = Field(30.0, gt=SGLANG_HEALTH_MIN_S)
    """Longest wait for one GET /health answer, for engines without /ready: SGLang's /health runs
    a one-token generation (at least 1 s, up to 20 s, then 503), so this must exceed 1 s; such an
    engine is reported hung only after a probe ran this long unanswered."""
    hung_after_s: float = Field(10.0, gt=0)
    """An engine that has answered no probe for this long (and whose last probe timed out) is
    reported as hung: logged with its URL and what timed out, counted, and marked down (requests
    in flight there are sent to another engine)."""
    restart_after_s: float = Field(45.0, ge=0)
    """`slime-async run` kills and restarts an engine it started that has been hung for this long
    (counted in supervisor/hung_restarts, the reason in logs/supervisor.log); 0: never (a hung
    engine that comes back by itself is marked up again and rejoins the weights)."""

    @model_validator(mode="after")
    def _deadlines(self) -> "LivenessConfig":
        """Deadlines in an order that can work."""
        if self.probe_interval_s >= self.hung_after_s:
            raise ValueError(
                f"engine.liveness.probe_interval_s = {self.probe_interval_s} must be below "
                f"engine.liveness.hung_after_s = {self.hung_after_s}: an engine would be "
                "reported hung between two probes"
            )
        if self.ready_timeout_s > self.hung_after_s:
            raise ValueError(
                f"engine.liveness.ready_timeout_s = {self.ready_timeout_s} exceeds "
                f"engine.liveness.hung_after_s = {self.hung_after_s}: a slow answer to /ready "
                "would already count as hung"
            )
        if self.restart_after_s and self.restart_after_s <= self.hung_after_s:
            raise ValueError(
                f"engine.liveness.restart_after_s = {self.restart_after_s} must exceed "
                f"engine.liveness.hung_after_s = {self.hung_after_s} (or be 0: never restart): "
                "an engine is restarted only after it was reported hung"
            )
        return self


class EngineConfig(Section):
    kind: Literal["embedded", "external"] = "embedded"
    """`embedded`: `slime-async run` starts our own engines; `external`: use `urls` (e.g. SGLang)."""
    urls: list[str] = []
    """Base URLs of the engines themselves (weights are pushed to each), e.g. http://10.0.0.5:30000."""
    router_url: str | None = None
    """An sglang-router in front of `urls`: generators send /generate there, weights still go to `urls`."""
    num_engines: int = Field(1, ge=1)
    """How many engines `slime-async run` starts; >1 puts sglang-router in front."""
    model_path: str | None = None
    """HF model directory the started engines serve (None: the learner's initial model)."""
    host: str = "127.0.0.1"
    """Address a started engine binds."""
    port: int = Field(30000, ge=0, le=65535)
    """Port of the (first) started engine, the next ones on the following ports; 0 picks free ones."""
    seed: int = 0
    """Seed of the first started engine's sampler, the next ones seed + i (unset: run.seed)."""
    api_key: str | None = None
    """If set, every endpoint but /health*, /ready and /metrics needs `Authorization: Bearer <key>`
    (with `admin_api_key` also set, the admin routes take only the admin key)."""
    admin_api_key: str | None = None
    """SGLang's --admin-api-key: if set, the admin routes (weight updates, pause, flush, abort,
    version) accept only this key, not `api_key`; /generate and the info routes still take
    `api_key` (and need no key when `api_key` is unset); /health*, /ready, /metrics need none."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    """sglang-router load-balancing policy when several engines are used."""
    router_port: int = Field(30100, ge=0, le=65535)
    """Port of the sglang-router that `slime-async run` starts (0 picks a free one)."""
    router_package: Literal["auto", "smg", "sglang-router"] = "auto"
    """Which router `slime-async run` starts: `smg` (sglang-router's successor), `sglang-router`,
    or `auto` (smg where installed, else sglang-router); one not installed is refused at start-up."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Client-side timeout of one /generate call."""
    max_retries: int = Field(10, ge=0)
    """Client-side retries of a failed call, with exponential back-off (doubling from 0.2 s,
    capped at 30 s: about 110 s in all, enough to ride out an engine's restart)."""
    deterministic_inference: bool = False
    """The engines run with SGLang's `--enable-deterministic-inference`. SGLang 0.5.23 honours a
    request's `sampling_seed` only then (without it the seed is ignored, so `eval.seed` pins
    nothing), and then draws every request that has none with seed 42: the samples of one prompt
    would all be one answer. With this on, the generator gives each rollout request a seed of its
    own (from generator.seed). It must match the engines' own setting (each engine's
    /server_info is checked when the generator starts). Started embedded engines take it as
    SGLang does; without it, a non-strict embedded engine still honours `sampling_seed` and a
    strict one ignores it, as SGLang."""
    liveness: LivenessConfig = LivenessConfig()
    """Health probes of running engines: what is probed, how often, when an engine is hung and
    when `slime-async run` restarts it."""
    embedded: EmbeddedEngineConfig = EmbeddedEngineConfig()
    """The embedded engine's own settings (with `kind = "external"`, any set to other than its
    default is refused)."""

    @model_validator(mode="after")
    def _embedded_only(self) -> "EngineConfig":
        """Keys that only the embedded engine reads are refused with external engines."""
        if self.kind == "external":
            used = [f"engine.embedded.{k}" for k in self.embedded.changed()]
            if used:
                raise ValueError(
                    f"{', '.join(used)}: only the embedded engine reads it, and "
                    "engine.kind = 'external' (real SGLang servers fail as they fail)"
                )
        return self


def _default(key: str):
    return EmbeddedEngineConfig.model_fields[key].default
