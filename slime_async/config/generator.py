"""`[generator]`: prompts -> rollouts (asyncio plugins) -> rewards -> buffer."""

from pydantic import Field, model_validator

from slime_async.config.base import Section


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: all)."""
    max_new_tokens: int = Field(256, ge=1)
    """Most tokens generated per turn."""
    stop_token_ids: list[int] = []
    """Extra token ids that end generation (the tokenizer's EOS always does)."""
    min_new_tokens: int = Field(0, ge=0)
    """Fewest tokens of each model turn before a stop token may end it (SGLang's field): the
    engine draws the first this many with EOS and stop_token_ids banned, and the learner scores
    them with the same ids left out of its softmax, so pi_prox / mu compares like with like."""


class GeneratorConfig(Section):
    dataset: str = "examples/arithmetic/train.jsonl"
    """JSONL file of prompts, one JSON object per line."""
    prompt_key: str = "prompt"
    """Field of each JSONL record that holds the prompt (the rest is task metadata)."""
    apply_chat_template: bool = True
    """Wrap a text prompt as one user message with the tokenizer's chat template."""
    tokenizer_path: str | None = None
    """Model directory whose tokenizer is used (None: engine.model_path, then learner.model_path)."""
    rollout: str = "single_turn"
    """Rollout plugin, an async function: a registered name (single_turn) or `package.module:function`."""
    reward: str = "exact_match"
    """Reward function (sync or async) by registered name or import path."""
    lifecycle: str | None = None
    """Plug-in set up once per generator and torn down at its end, `package.module:name`: an
    object or class with `setup(ctx)` / `teardown()` (sync or async), or a function returning an
    async context manager; what it sets up is `ctx.state` in rollouts and `info["state"]` in rewards."""
    reward_timeout_s: float | None = Field(60.0, gt=0)
    """Longest one reward call may take before it counts as failed (None: no limit)."""
    reward_retries: int = Field(2, ge=0)
    """Retries of a reward call that raised or timed out, with back-off, before its group fails."""
    reward_backoff_s: float = Field(0.5, gt=0)
    """First back-off before a reward retry; doubles per retry (up to 30 s, + up to 50% jitter)."""
    group_redos: int = Field(1, ge=0)
    """Times a group whose rollout or reward failed is redone from its prompt before it is dropped."""
    group_size: int = Field(8, ge=1)
    """Rollouts per prompt (n samples of one prompt form a group)."""
    max_inflight: int = Field(64, ge=1)
    """Upper limit of concurrent rollouts (the buffer's admission may allow fewer)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters sent to the engines."""
    producer_id: str = "gen0"
    """Identity of this generator towards the buffer (sequence numbers are per producer)."""
    seed: int = 0
    """Shuffling seed of the dataset, each epoch a new permutation (unset in a full config: run.seed)."""
    num_epochs: int | None = Field(None, ge=1)
    """Passes over the dataset before the generator finishes (None: run until stopped)."""
    num_shards: int = Field(1, ge=1)
    """Generators sharing one dataset; each takes every num_shards-th prompt of a permutation."""
    shard_index: int = Field(0, ge=0)
    """This generator's shard (0 <= shard_index < num_shards)."""
    state_path: str | None = None
    """Cursor file, rewritten after each acknowledged group (None: <run_dir>/state/<producer_id>.json)."""
    max_plugin_errors: int = Field(10, ge=1)
    """Failed group attempts (a rollout or reward error) within the last `plugin_error_window`
    attempts that stop the generator (1: the first error stops it)."""
    plugin_error_window: int = Field(100, ge=1)
    """Group attempts over which plug-in errors are counted: the budget is a rate, not a total."""
    rollout_max_attempts: int = Field(0, ge=0)
    """Attempts of one rollout whose engine calls keep failing (0: retry forever, with back-off)."""
    retry_backoff_s: float = Field(1.0, gt=0)
    """First back-off after an engine failure; doubles per attempt up to 30 s (+ up to 50% jitter)."""
    admission_poll_s: float = Field(0.05, gt=0)
    """Wait between admission requests while the buffer grants nothing."""
    max_resumes: int = Field(64, ge=0)
    """Times one generate call is resumed after an engine abort (weight update) before failing."""
    prefix_keys: bool = True
    """Send each /generate SGLang's extra_key naming the engine's weight version, so that its
    prefix cache never serves a request KV that another version's weights computed (a push that
    keeps the cache: in_place). Off: requests share cached prefixes whatever their version."""
    log_interval_s: float = Field(10.0, gt=0)
    """Seconds between metric log lines."""
    import_dirs: list[str] = []
    """Directories plug-in modules are imported from besides the working directory and installed
    packages. A relative entry is relative to the config file that sets it (the shipped configs
    set [".."] or ["../.."]: the checkout, where `examples/` is); the config files' own
    directories are appended when the config is loaded (all kept in the run's config.json)."""

    @model_validator(mode="after")
    def _error_budget(self) -> "GeneratorConfig":
        if self.max_plugin_errors > self.plugin_error_window:
            raise ValueError(
                f"generator.max_plugin_errors ({self.max_plugin_errors}) exceeds "
                f"generator.plugin_error_window ({self.plugin_error_window}): the budget could "
                "never be spent; lower max_plugin_errors or widen the window"
            )
        return self
