"""The generator: prompts -> groups of rollouts (asyncio plugins) -> rewards -> the buffer.

    dataset (JSONL) --cursor--> start group k  <-- sink.admission(want): the staleness budget
                                    |  group_size rollouts, each `await plugin(ctx, sample)`
                                    v
                     ctx.generate --HTTP--> engines (EnginePool or one sglang-router URL)
                                    |  transcripts: token-exact, versions per token
                                    v
                     reward(sample, text, info) -> checks -> Trajectory x n
                                    |
                                    v
                     sink.put_group(group)  --ack-->  cursor.mark_done(k), state file

Connects to: the buffer's producer endpoint (ProducerClient: ZeroMQ) and the engines (HTTP).
Sends: whole groups only. Waits on: admission grants, engine responses, buffer acks; never on
the learner. Memory is bounded by `max_inflight` rollouts (max_inflight // group_size groups)
plus the dataset held in memory.

Failures: an engine call that fails after the engine client's retries (`EngineFailure`) makes
the rollout run again after a back-off (`engine_retry_policy`: doubling from `retry_backoff_s` up
to 30 s, jittered; forever, or `rollout_max_attempts` attempts); nothing is lost.
A reward call that raises or takes longer than `reward_timeout_s` is retried `reward_retries`
times with back-off. A group whose rollout or reward still fails (or breaks its contract) is
redone from its prompt up to `group_redos` times, then dropped: not pushed, its prompt marked
done. Every failed attempt is logged with the plug-in's name, the sample id, the exception type
and the traceback, and counted; when `max_plugin_errors` of the last `plugin_error_window` group
attempts failed, the generator stops with `GeneratorError` (a rate, not a total over the run).
A group the buffer stored but dropped at once (`AckStatus.STALE`: beyond max_staleness, or with
buffer.fixed_lag too late or spanning a weight update; the buffer logs which) is counted as
dropped (`gen/groups_stale`), never as pushed.

Lifecycle: `generator.lifecycle` is set up once before the first group and torn down once at
the end, whatever ended the run (lifecycle.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slime_async.actors.engine.client import engine_retry_policy
from slime_async.actors.generator.dataset import (
    Cursor,
    CursorStore,
    Item,
    PromptDataset,
    PromptStream,
)
from slime_async.actors.generator.lifecycle import Lifecycle, SetupContext
from slime_async.actors.generator.rewards import RewardFn, check_own_reward, resolve_reward
from slime_async.actors.generator.rollout import (
    ROLLOUTS,
    EngineFailure,
    EngineLike,
    PluginContractError,
    RolloutContext,
    RolloutStats,
    Sample,
    Transcript,
    check_rollout_result,
)
from slime_async.config.generator import GeneratorConfig
from slime_async.metrics import (
    GEN_ADMISSION_REQUESTS,
    GEN_ADMISSION_WAIT_S,
    GEN_BUFFER_BUSY,
    GEN_BUFFER_RESENDS,
    GEN_BUFFER_SEND_WAITS,
    GEN_CACHED_PROMPT_TOKENS,
    GEN_ENGINE_BEHIND,
    GEN_ENGINE_ERRORS,
    GEN_ENGINE_FAILOVERS,
    GEN_ENGINES_BACK,
    GEN_ENGINES_DOWN,
    GEN_ENGINES_HUNG,
    GEN_GROUPS_DROPPED,
    GEN_GROUPS_PUSHED,
    GEN_GROUPS_REDONE,
    GEN_GROUPS_STALE,
    GEN_GROUPS_STARTED,
    GEN_HUNG_CANCELLED,
    GEN_INFLIGHT,
    GEN_PLUGIN_ERROR_RATE,
    GEN_PLUGIN_ERRORS,
    GEN_PREFIX_KEY_BEHIND,
    GEN_RESPONSE_LEN_MAX,
    GEN_RESPONSE_LEN_MEAN,
    GEN_RESUMES,
    GEN_REWARD_MEAN,
    GEN_REWARD_RETRIES,
    GEN_REWARD_STD,
    GEN_ROLLOUT_RETRIES,
    GEN_ROUTING_MISSING,
    GEN_TOKENS_OVER_CACHED_PREFIX,
    GEN_TOKENS_PER_S,
    GEN_TRAJECTORIES_PUSHED,
    GENERATOR_IDLE_PCT,
    IdleMeter,
    MetricsLogger,
)
from slime_async.queue.client import BufferRejected
from slime_async.queue.messages import AckStatus
from slime_async.queue.schema import Trajectory
from slime_async.utils.retry import RetryPolicy, retry_async

log = logging.getLogger("slime_async.generator")

MAX_BACKOFF_S = 30.0
"""Longest back-off between two attempts of a rollout (before jitter)."""

TOTALS = {
    "groups_started": GEN_GROUPS_STARTED,
    "groups_pushed": GEN_GROUPS_PUSHED,
    "trajectories_pushed": GEN_TRAJECTORIES_PUSHED,
    "groups_dropped": GEN_GROUPS_DROPPED,
    "groups_stale": GEN_GROUPS_STALE,
    "groups_redone": GEN_GROUPS_REDONE,
    "plugin_errors": GEN_PLUGIN_ERRORS,
    "reward_retries": GEN_REWARD_RETRIES,
    "rollout_retries": GEN_ROLLOUT_RETRIES,
    "admission_requests": GEN_ADMISSION_REQUESTS,
    "admission_wait_s": GEN_ADMISSION_WAIT_S,
}
"""The generator's running totals: key in `stats()` -> metric name in its records."""


class GeneratorError(RuntimeError):
    """The generator cannot go on (too many plugin errors, an engine that never answers)."""


class PluginFailure(RuntimeError):
    """A plug-in (rollout, reward) raised or broke its contract on one sample."""

    def __init__(self, plugin: str, sample_id: str, cause: BaseException):
        super().__init__(f"{plugin} failed on sample {sample_id}: {type(cause).__name__}: {cause}")
        self.plugin = plugin
        self.sample_id = sample_id
        self.cause = cause


class GroupSink(Protocol):
    """Where finished groups go: admission (the staleness budget) and whole-group puts.

    `slime_async.queue.client.ProducerClient` (the buffer's producer endpoint) is the one in use.
    """

    async def admission(self, want: int) -> int: ...

    async def put_group(self, trajs: list[Trajectory]) -> Any: ...


class Generator:
    """One generator: a loop that keeps admitted groups in flight and pushes them whole.

    gen = Generator(cfg, EnginePool(urls), tokenizer)    # resolves and checks the plugins
    async with ProducerClient(buffer_cfg, cfg.producer_id) as sink:
        stats = await gen.run(sink)
    """

    def __init__(
        self,
        cfg: GeneratorConfig,
        engine: EngineLike,
        tokenizer: Any,
        *,
        dataset: PromptDataset | None = None,
        metrics: MetricsLogger | None = None,
        run_dir: str | Path | None = None,
        evaluator: Any = None,
    ):
        self.cfg = cfg
        self.evaluator = evaluator
        """Pinned evaluation (evaluate.py): watches for the learner's requests beside the loop."""
        self.engine = engine
        self.sink: GroupSink | None = None
        self.tokenizer = tokenizer
        self.rollout_fn: Callable = ROLLOUTS.resolve(cfg.rollout, "generator.rollout")
        self.reward: RewardFn = resolve_reward(cfg.reward, "generator.reward")
        self.lifecycle = Lifecycle(cfg.lifecycle)
        self.state: Any = None  # what the lifecycle plug-in set up (ctx.state, info["state"])
        self.run_dir = Path(run_dir) if run_dir else None
        self.dataset = dataset or PromptDataset(cfg.dataset, cfg.prompt_key)
        self.stream = PromptStream(
            self.dataset, cfg.seed, cfg.num_shards, cfg.shard_index, cfg.num_epochs
        )
        self.store = CursorStore(cfg.state_path, self.stream)
        self.cursor: Cursor = self.store.load()
        self.metrics = metrics
        self.max_groups = max(1, cfg.max_inflight // cfg.group_size)
        self.version = 0
        self.rollout_stats = RolloutStats()
        self._idle = IdleMeter()
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._spare_grants = 0  # grants of dropped groups, reused before asking again
        self._pushing: set[int] = set()
        self._inflight_rollouts = 0
        self.retry = engine_retry_policy(
            cfg.retry_backoff_s, max_attempts=cfg.rollout_max_attempts or None, max_s=MAX_BACKOFF_S
        )
        self.reward_retry = RetryPolicy(
            cfg.reward_backoff_s, MAX_BACKOFF_S, jitter=0.5, max_attempts=cfg.reward_retries + 1
        )
        # Outcome of the last `plugin_error_window` group attempts (True: failed).
        self._attempts: deque[bool] = deque(maxlen=cfg.plugin_error_window)
        self._totals: dict[str, float] = dict.fromkeys(TOTALS, 0)
        self._window: dict[str, list[float]] = {"reward": [], "response_len": []}
        self._window_t0 = time.perf_counter()
        self._window_tokens = 0

    # ----- the loop ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop starting groups; in-flight rollouts are cancelled (redone after a restart), and
        so are pushes the buffer refused and that only wait to be sent again (its disk full)."""
        self._stop.set()
        abandon = getattr(self.sink, "abandon_refused", None)
        if abandon is not None:
            abandon()

    async def run(self, sink: GroupSink) -> dict[str, float]:
        """Push groups into `sink` until the epochs are done or `stop()`; return stats.

        Plugins, dataset and cursor were checked in the constructor, before any connection.
        """
        self.sink = sink
        setup_ctx = SetupContext(self.cfg, self.tokenizer, self.run_dir)
        async with contextlib.AsyncExitStack() as stack:  # teardown runs however _run ends
            try:
                self.state = await stack.enter_async_context(self.lifecycle.running(setup_ctx))
            except Exception as e:
                log.error("generator.lifecycle %r: setup failed", self.cfg.lifecycle, exc_info=e)
                raise GeneratorError(
                    f"generator.lifecycle {self.cfg.lifecycle!r}: setup failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
            return await self._run(sink)

    async def _run(self, sink: GroupSink) -> dict[str, float]:
        inflight: dict[int, asyncio.Task] = {}
        pending = self.cursor.pending()
        next_item: Item | None = self.stream.at(next(pending))
        logger = asyncio.create_task(self._log_periodically())
        watch = asyncio.create_task(self.evaluator.watch(self._stop)) if self.evaluator else None
        log.info(
            "generator %s: %d prompts, resuming at item %d, %d groups of %d in flight at most",
            self.cfg.producer_id,
            len(self.dataset),
            self.cursor.next,
            self.max_groups,
            self.cfg.group_size,
        )
        try:
            while not self._stop.is_set() and self._fatal is None:
                if next_item is None and not inflight:
                    break
                free = self.max_groups - len(inflight)
                if next_item is not None and free > 0:
                    granted = await self._admit(free, idle=not inflight)
                    for _ in range(granted):
                        if next_item is None:
                            self._spare_grants += 1
                            continue
                        inflight[next_item.k] = asyncio.create_task(self._group(next_item))
                        self._totals["groups_started"] += 1
                        next_item = self.stream.at(next(pending))
                    if granted == 0:
                        await self._wait_any(inflight, self.cfg.admission_poll_s)
                else:
                    await self._wait_any(inflight, None)
                for k in [k for k, t in inflight.items() if t.done()]:
                    inflight.pop(k).result()  # errors are handled inside; re-raise the unexpected
        finally:
            if watch is not None and next_item is None and not self._stop.is_set():
                # The dataset is done; the learner may still ask for its last evaluation.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(
                        [watch, asyncio.ensure_future(self._stop.wait())],
                        return_when="FIRST_COMPLETED",
                    )
            await self._shutdown(inflight)
            logger.cancel()
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            with contextlib.suppress(asyncio.CancelledError):
                await logger
            self._log_metrics()
        if self._fatal is not None:
            raise GeneratorError(str(self._fatal)) from self._fatal
        return self.stats()

    async def _admit(self, want: int, idle: bool) -> int:
        """Groups that may start now: spare grants first, then the buffer's admission."""
        spare = min(self._spare_grants, want)
        self._spare_grants -= spare
        if spare == want:
            return spare
        t0 = time.perf_counter()
        self._totals["admission_requests"] += 1
        if idle:
            with self._idle.waiting():
                granted = await self.sink.admission(want - spare)
        else:
            granted = await self.sink.admission(want - spare)
        self._totals["admission_wait_s"] += time.perf_counter() - t0
        return spare + max(0, min(int(granted), want - spare))

    async def _wait_any(self, inflight: dict[int, asyncio.Task], timeout: float | None) -> None:
        t0 = time.perf_counter()
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            if inflight:
                await asyncio.wait(
                    [*inflight.values(), stop], timeout=timeout, return_when="FIRST_COMPLETED"
                )
            else:
                with self._idle.waiting():
                    await asyncio.wait([stop], timeout=timeout)
        finally:
            stop.cancel()
        if timeout is not None:
            self._totals["admission_wait_s"] += time.perf_counter() - t0

    async def _shutdown(self, inflight: dict[int, asyncio.Task]) -> None:
        # A group being pushed finishes (it may already be in the buffer); the rest is redone.
        for k, task in inflight.items():
            if k not in self._pushing:
                task.cancel()
        if inflight:
            await asyncio.wait(list(inflight.values()), timeout=60)

    # ----- one group --------------------------------------------------------------------------

    def group_id(self, item: Item) -> str:
        """Deterministic from (producer, epoch, offset): a restart re-creates the same ids."""
        return f"{self.cfg.producer_id}/e{item.epoch}/o{item.offset}"

    async def _group(self, item: Item) -> None:
        gid = self.group_id(item)
        redos = self.cfg.group_redos
        for redo in range(redos + 1):
            try:
                trajs = await self._build_group(item, gid, redo)
            except Exception as e:
                if self._fatal is not None:
                    return
                self._plugin_error(gid, _first_leaf(e), redo)
                if self._fatal is not None:
                    return
                if redo < redos:
                    self._totals["groups_redone"] += 1
                    log.warning(
                        "group %s: redone from its prompt (redo %d of %d)", gid, redo + 1, redos
                    )
                    continue
                self._drop(item, gid, f"failed {redo + 1} time(s), last: {_first_leaf(e)}")
                return
            self._attempts.append(False)
            break
        self._pushing.add(item.k)
        try:
            now = time.time()
            for t in trajs:
                t.enqueued_at = now
            status = await self.sink.put_group(trajs)
        except asyncio.CancelledError:
            raise
        except BufferRejected as e:  # the buffer refused the group's content
            self._drop(item, gid, f"refused by the buffer: {e}")
            return
        except Exception as e:  # BufferUnavailable: nothing this generator can fix
            self._fatal = e
            self._stop.set()
            return
        finally:
            self._pushing.discard(item.k)
        if status == AckStatus.STALE:
            # Stored, then dropped at once by the buffer as beyond max_staleness: not trained on.
            # The grant was used up and the id is retired, so the prompt is not redone.
            self._totals["groups_stale"] += 1
            self._totals["groups_dropped"] += 1
            log.warning(
                "group %s dropped by the buffer at arrival: beyond buffer.max_staleness, or with "
                "buffer.fixed_lag too late or spanning a weight update (the buffer's log names "
                "which)",
                gid,
            )
            self.cursor.mark_done(item.k)
            self.store.save(self.cursor)
            return
        self._totals["groups_pushed"] += 1
        self._totals["trajectories_pushed"] += len(trajs)
        for t in trajs:
            self._window["reward"].append(t.reward)
            self._window["response_len"].append(int(t.loss_mask.sum()))  # model tokens
            if t.versions.size:
                self.version = max(self.version, int(t.versions.max()))
        self.cursor.mark_done(item.k)
        self.store.save(self.cursor)

    async def _build_group(self, item: Item, gid: str, redo: int = 0) -> list[Trajectory]:
        """Run the group's rollouts concurrently, score them concurrently, make trajectories."""
        record = self.dataset.records[item.row]
        metadata = {k: v for k, v in record.items() if k != self.cfg.prompt_key}
        prompt = record[self.cfg.prompt_key]
        created_at = time.time()
        async with asyncio.TaskGroup() as tg:  # one failing rollout cancels its siblings
            tasks = [
                tg.create_task(
                    self._rollout(Sample(prompt, metadata, gid, item.row, item.epoch, i), redo)
                )
                for i in range(self.cfg.group_size)
            ]
        transcripts = [(sample, tr) for t in tasks for sample, trs in [t.result()] for tr in trs]
        async with asyncio.TaskGroup() as tg:  # a reward that finally fails cancels the others
            for sample, tr in transcripts:
                tg.create_task(self._score(sample, tr))
        trajs = []
        for n, (sample, tr) in enumerate(transcripts):
            tr.metadata.update(_scalars(metadata))
            tr.metadata.update(
                epoch=item.epoch,
                offset=item.offset,
                row=item.row,
                sample_index=sample.sample_index,
                turns=tr.turns,
            )
            trajs.append(tr.to_trajectory(f"{gid}/{n}", gid, len(transcripts), created_at))
        return trajs

    async def _rollout(self, sample: Sample, redo: int = 0) -> tuple[Sample, list[Transcript]]:
        """Run the plugin for one sample; engine failures retry it after a back-off."""
        name = self.cfg.rollout
        again = f"r{redo}" if redo else ""

        async def attempt(n: int) -> tuple[Sample, list[Transcript]]:
            ctx = RolloutContext(
                self.engine,
                self.tokenizer,
                self.cfg.sampling,
                apply_chat_template=self.cfg.apply_chat_template,
                max_resumes=self.cfg.max_resumes,
                rid_prefix=f"{sample.group_id}/{sample.sample_index}/{again}a{n}/",
                stats=self.rollout_stats,
                state=self.state,
            )
            self._inflight_rollouts += 1
            try:
                return sample, check_rollout_result(name, await self.rollout_fn(ctx, sample))
            except (EngineFailure, asyncio.CancelledError):
                raise
            except Exception as e:
                raise PluginFailure(f"rollout {name!r}", sample.id, e) from e
            finally:
                self._inflight_rollouts -= 1

        def on_retry(n: int, e: BaseException, delay: float) -> None:
            self._totals["rollout_retries"] += 1
            log.warning(
                "rollout %s/%d: %s; retry %d in %.1fs",
                sample.group_id,
                sample.sample_index,
                e,
                n,
                delay,
            )

        try:
            return await retry_async(attempt, self.retry, retry_on=EngineFailure, on_retry=on_retry)
        except EngineFailure as e:
            # The counter counts failed attempts, so the last one too.
            self._totals["rollout_retries"] += 1
            self._fatal = GeneratorError(
                f"rollout of {sample.group_id} failed {self.retry.max_attempts} times; last: {e}"
            )
            self._stop.set()
            raise

    async def _score(self, sample: Sample, tr: Transcript) -> None:
        rollout = f"rollout {self.cfg.rollout!r}"
        try:
            tr.finalize(self.cfg.rollout)
            if tr.reward is not None:  # the plugin scored it itself
                tr.reward, tr.reward_parts = check_own_reward(self.cfg.rollout, tr)
                return
            text = tr.reward_text if tr.reward_text is not None else tr.last_model_text()
        except PluginContractError as e:
            raise PluginFailure(rollout, sample.id, e) from e
        info = {
            "full_text": tr.response_text(),
            "finish_reason": tr.finish_reason,
            "turns": tr.turns,
            "response_length": tr.num_model_tokens,
            "state": self.state,
        }
        name = f"reward {self.cfg.reward!r}"
        timeout = self.cfg.reward_timeout_s

        async def call(attempt: int) -> tuple[float, dict[str, float]]:
            if timeout is None:
                return await self.reward(sample, text, info)
            try:
                return await asyncio.wait_for(self.reward(sample, text, info), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"no answer within generator.reward_timeout_s = {timeout}"
                ) from None

        def on_retry(n: int, e: BaseException, delay: float) -> None:
            self._totals["reward_retries"] += 1
            log.warning(
                "%s on sample %s: %s: %s; retry %d of %d in %.1fs",
                name,
                sample.id,
                type(e).__name__,
                e,
                n,
                self.cfg.reward_retries,
                delay,
                exc_info=(type(e), e, e.__traceback__),
            )

        try:
            tr.reward, tr.reward_parts = await retry_async(
                call,
                self.reward_retry,
                retry_on=lambda e: not isinstance(e, PluginContractError),
                on_retry=on_retry,
            )
        except Exception as e:
            raise PluginFailure(name, sample.id, e) from e

    def _plugin_error(self, gid: str, err: BaseException, redo: int) -> None:
        """Count and log one failed group attempt; stop once the window's budget is spent."""
        self._totals["plugin_errors"] += 1
        self._attempts.append(True)
        n, window = sum(self._attempts), len(self._attempts)
        limit = self.cfg.max_plugin_errors
        cause = err.cause if isinstance(err, PluginFailure) else err
        log.error(
            "group %s, attempt %d of %d: %s (%d of the last %d group attempts failed; the "
            "generator stops at %d)",
            gid,
            redo + 1,
            self.cfg.group_redos + 1,
            err,
            n,
            window,
            limit,
            exc_info=(type(cause), cause, cause.__traceback__),
        )
        if n >= limit:
            self._fatal = GeneratorError(
                f"{n} of the last {window} group attempts failed (generator.max_plugin_errors = "
                f"{limit} in generator.plugin_error_window = {self.cfg.plugin_error_window}); "
                f"last, group {gid}: {err}"
            )
            self._stop.set()

    def _drop(self, item: Item, gid: str, why: str) -> None:
        self._totals["groups_dropped"] += 1
        self._spare_grants += 1  # the buffer never sees this group, so its grant is still ours
        self.cursor.mark_done(item.k)
        self.store.save(self.cursor)
        log.error("group %s dropped: %s", gid, why)

    # ----- metrics ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """A snapshot: totals since start and the gauges of now."""
        return {
            **self._totals,
            "inflight_rollouts": self._inflight_rollouts,
            "tokens_generated": self.rollout_stats.tokens,
            "engine_requests": self.rollout_stats.requests,
            "engine_errors": self.rollout_stats.engine_errors,
            "resumes": self.rollout_stats.resumes,
            "routing_missing": self.rollout_stats.routing_missing,
            "cached_prompt_tokens": self.rollout_stats.cached_prompt_tokens,
            "tokens_over_cached_prefix": self.rollout_stats.tokens_over_cached_prefix,
            "prefix_key_behind": self.rollout_stats.prefix_key_behind,
            "policy_version": self.version,
            "cursor_next": self.cursor.next,
        }

    def _engine_failovers(self) -> int:
        """Failures the engine pool absorbed (0 for an engine without `stats`, e.g. in tests)."""
        stats = getattr(self.engine, "stats", None)
        return sum(stats()["failures"].values()) if callable(stats) else 0

    def _engine_liveness(self) -> dict[str, float]:
        """The pool's liveness counts (none for an engine without them, e.g. in tests)."""
        stats = getattr(self.engine, "stats", None)
        s = stats() if callable(stats) else {}
        if "liveness" not in s:
            return {}
        return {
            GEN_ENGINES_HUNG: s["liveness"]["hung"],
            GEN_ENGINES_DOWN: s["liveness"]["down"],
            GEN_ENGINES_BACK: s["liveness"]["back"],
            GEN_HUNG_CANCELLED: s["hung_cancelled"],
        }

    def _engine_behind(self) -> int:
        """Answers the pool threw away as made by weights behind the learner's version."""
        stats = getattr(self.engine, "stats", None)
        return sum(stats().get("behind", {}).values()) if callable(stats) else 0

    def _take_window(self) -> dict[str, float]:
        now = time.perf_counter()
        dt = max(now - self._window_t0, 1e-9)
        tokens = self.rollout_stats.tokens - self._window_tokens
        rewards, lens = self._window["reward"], self._window["response_len"]
        rec = {
            GEN_TOKENS_PER_S: tokens / dt,
            GENERATOR_IDLE_PCT: self._idle.take_pct(),
            GEN_INFLIGHT: self._inflight_rollouts,
            GEN_REWARD_MEAN: _mean(rewards),
            GEN_REWARD_STD: _std(rewards),
            GEN_RESPONSE_LEN_MEAN: _mean(lens),
            GEN_RESPONSE_LEN_MAX: max(lens, default=math.nan),
            **{TOTALS[k]: v for k, v in self._totals.items()},
            GEN_RESUMES: self.rollout_stats.resumes,
            GEN_ROUTING_MISSING: self.rollout_stats.routing_missing,
            GEN_CACHED_PROMPT_TOKENS: self.rollout_stats.cached_prompt_tokens,
            GEN_TOKENS_OVER_CACHED_PREFIX: self.rollout_stats.tokens_over_cached_prefix,
            GEN_PREFIX_KEY_BEHIND: self.rollout_stats.prefix_key_behind,
            GEN_ENGINE_ERRORS: self.rollout_stats.engine_errors,
            GEN_ENGINE_FAILOVERS: self._engine_failovers(),
            **self._engine_liveness(),
            GEN_ENGINE_BEHIND: self._engine_behind(),
            GEN_PLUGIN_ERROR_RATE: _mean([float(x) for x in self._attempts]),
            # the producer client's own retries (a sink without them, e.g. in tests, has none)
            GEN_BUFFER_RESENDS: getattr(self.sink, "resends", 0),
            GEN_BUFFER_BUSY: getattr(self.sink, "busy_replies", 0),
            GEN_BUFFER_SEND_WAITS: getattr(self.sink, "send_waits", 0),
        }
        self._window_t0, self._window_tokens = now, self.rollout_stats.tokens
        self._window = {"reward": [], "response_len": []}
        return rec

    def _log_metrics(self) -> None:
        rec = self._take_window()
        log.info(
            "v%d pushed %d groups | %.0f tok/s | idle %.0f%% | in flight %d | reward %.3f | "
            "len %.1f | dropped %d | retries %d",
            self.version,
            rec[GEN_GROUPS_PUSHED],
            rec[GEN_TOKENS_PER_S],
            rec[GENERATOR_IDLE_PCT],
            rec[GEN_INFLIGHT],
            rec[GEN_REWARD_MEAN],
            rec[GEN_RESPONSE_LEN_MEAN],
            rec[GEN_GROUPS_DROPPED],
            rec[GEN_ROLLOUT_RETRIES],
        )
        if self.metrics is not None:
            self.metrics.log(self.version, rec)

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.log_interval_s)
            self._log_metrics()


def _first_leaf(e: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _scalars(d: dict[str, Any]) -> dict[str, str | int | float | bool]:
    return {
        k: v
        for k, v in d.items()
        if isinstance(v, str | int | bool) or (isinstance(v, float) and math.isfinite(v))
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
