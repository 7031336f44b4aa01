"""Continuous batching over the paged KV cache: one thread owns the model and steps every request.

    HTTP handlers --submit()--> waiting deque --admit (slot + KV blocks)--> running --finish--> on_done
                   --call(fn)--> command queue, run between steps (weight updates, abort, pause)

Each loop iteration: run queued commands; unless paused, admit waiting requests (a free slot, KV
blocks for their tokens, the prefill token budget) and prefill them as one packed batch (each gets
its first token), then one decode step for every running request. Finished requests free their
blocks at once; nobody's KV moves.

Shared prompts: the full blocks of each prompt enter the runner's prefix index (kv_cache.py); a
request whose prompt starts with indexed blocks takes them and prefills only the rest, and
requests of one batch with the same tokens (the n samples of a group) are prefilled once: the
others share its full blocks and copy its last, partial one (copy-on-write). Both happen only
between requests of one cache namespace (SGLang's `extra_key` and `cache_salt`, in strict mode
and out of it): a request under another namespace prefills its prompt even when the tokens
match. `prefix_sharing` off turns both off.

Overlap: the decode step t+1 is launched (its inputs come from step t's sampled tokens, still on
the GPU) before the host reads step t's tokens, so the host's bookkeeping of step t (appending,
stop checks, streaming) runs while the GPU computes step t+1. A request that finished at step t
(a stop token) wasted its row of step t+1; its token is dropped. Requests known to finish at t
(length) are left out of t+1. Requests arriving meanwhile do not stop that pipeline: they are
admitted (with the slots and blocks free now) and prefilled behind step t on the device, and step
t+1 takes their first tokens from the prefill's output on the device as it takes the others' from
step t; the host reads both while t+1 runs. Before anything else touches the running requests
(commands, a retraction) every step in flight is read first, so commands see every token, and
each step runs under one weight version: the version recorded with its tokens.

Strict mode (`engine.embedded.strict_sglang`) imitates SGLang 0.5.23's failures: `flush()` fails while any
request runs (an in_place pause keeps them) or, unpaused, waits. `fail_fatally()` stops the loop
for good (SGLang's scheduler process exiting). A failed step finishes its requests
with an `error` mark, which the server answers with a 5xx (SGLang's answer to engine errors).

Memory: the runner's KV cache bounds the tokens held; when a decode step finds no free block, the
newest running request is retracted (its blocks freed, re-queued at the front, recomputed later;
counted in `retractions` and logged). The waiting deque holds only token ids and is bounded by the
HTTP clients' concurrency.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import SamplingParams, sample
from slime_async.utils.device import to_device

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class Request:
    """One /generate request as the scheduler sees it. Fields are written by the scheduler thread."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    seed: int | None = None
    """The request's sampling_seed (its draws depend on it and the position only), None: the
    engine's random stream."""
    error: str | None = None
    """Set when an engine error (not the client) ended the request: answered with a 5xx."""
    on_token: Callable[[Request], None] | None = None
    """Called on the scheduler thread after each new token (SSE streaming)."""
    top_logprobs_num: int = 0
    """SGLang's top_logprobs_num: keep the N best (logprob, token) of each step."""
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    group: list[Request] | None = None
    """n > 1: the requests sharing this one's prompt (they share its prefill and its blocks)."""
    cached_tokens: int = 0
    """Prompt tokens taken from shared KV blocks instead of prefilled (SGLang's cached_tokens)."""
    extra_key: str | None = None
    """SGLang's extra_key: shares cached prefixes only with requests of the same key."""
    cache_salt: str | None = None
    """SGLang's cache_salt: a second part of the same namespace."""
    slot: int = -1
    """Row of the scheduler's block-table and sampling-parameter arrays while running."""
    blocks: list[int] = field(default_factory=list)
    """KV blocks holding this request's positions 0, B, 2B, ... while running."""
    issued: int = 0
    """Output tokens sampled on the device, including one of a step whose result is unread."""
    stop_set: frozenset[int] = frozenset()
    limit: int = 0
    """Output tokens this request may reach (max_new_tokens, or the context's end)."""
    return_routed: bool = False
    """SGLang's return_routed_experts: keep the experts of positions [routed_start, end - 1)."""
    routed_start: int = 0
    """SGLang's routed_experts_start_len (absolute, at most the prompt's length)."""
    routed: Any = None
    """[end - 1 - routed_start, moe_layers, k] int32 numpy, read from the runner's per-slot
    record as the request finished (before its blocks are freed); None if it never ran."""

    @property
    def context_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        """The prefix cache's namespace of this request: (extra_key, cache_salt)."""
        return (self.extra_key, self.cache_salt)


@dataclass
class _Step:
    """A decode step launched on the device whose tokens the host has not read yet."""

    rows: list[Request]
    tokens: torch.Tensor  # [m] on the device (the next step's inputs)
    tokens_host: torch.Tensor  # [m] pinned host copy, valid once `done` completed
    logprobs_host: torch.Tensor
    tops: dict[int, tuple[torch.Tensor, torch.Tensor]]  # row -> host (logprobs, ids), top N
    done: Any  # torch.cuda.Event, or None on a CPU
    version: str
    started: Any = None  # torch.cuda.Event recorded before the step's kernels (GPU)
    kind: Literal["decode", "prefill"] = "decode"


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x` started without waiting (pinned memory on CUDA): valid once the
    step's `done` event has completed."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)


@dataclass
class StepTiming:
    """Cumulative timing of the scheduler loop (in `stats()`, so /get_server_info shows it).

    On a GPU each step is bracketed by two CUDA events (start before its kernels, end after the
    sampled tokens' copy to the host): `decode_device_s` is the device's time for the decode
    steps, `prefill_device_s` for the prefills, `wait_s` the host's time blocked on a step still
    running, `loop_s` the wall time of the loop's working iterations. Device time near `loop_s`
    means the GPU bounds the loop; device time well below it, with `wait_s` near 0, means host
    work (scheduling, bookkeeping, HTTP in the same process) does. `prefill_s`: the host's wall
    time admitting and launching prefills (requests arriving over many steps each bring one; the
    decode step in flight runs meanwhile)."""

    loop_s: float = 0.0
    wait_s: float = 0.0
    prefill_s: float = 0.0
    prefill_device_s: float = 0.0
    decode_steps: int = 0
    """Decode steps timed on the device (GPU only)."""
    decode_rows: int = 0
    decode_device_s: float = 0.0

    def mark(self, device: torch.device) -> Any:
        """A recorded timing event on a GPU (the start of a decode step); None elsewhere."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stats(self) -> dict[str, float | int]:
        return {
            "loop_s": round(self.loop_s, 4),
            "host_wait_s": round(self.wait_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "prefill_device_s": round(self.prefill_device_s, 4),
            "decode_steps_timed": self.decode_steps,
            "decode_rows_timed": self.decode_rows,
            "decode_device_s": round(self.decode_device_s, 4),
        }


class Scheduler:
    """Owns a ModelRunner; `submit` requests and `call` commands from any thread."""

    def __init__(
        self,
        runner: ModelRunner,
        seed: int = 0,
        max_prefill_tokens: int = 8192,
        decode_text: Callable[[list[int]], str] | None = None,
        strict: bool = False,
        initial_version: str = "default",
        prefix_sharing: bool = True,
        overlap: bool = True,
    ):
        self.runner = runner
        self._decode_text = decode_text or (lambda ids: "")
        self.version = initial_version
        """The served weight version (SGLang's `weight_version`, any string)."""
        self.strict = strict
        self.fatal: str | None = None
        """Why the loop stopped for good (strict mode's imitation of SGLang's scheduler exit)."""
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_sharing = prefix_sharing
        self.overlap = overlap
        self._gen = torch.Generator(device=runner.device).manual_seed(seed)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._inflight: list[_Step] = []
        """Steps launched on the device whose tokens the host has not read, in launch order."""
        self._free_slots = list(range(runner.max_slots - 1, -1, -1))
        slots, width = runner.max_slots, runner.max_blocks_per_seq
        self._bt = torch.zeros((slots, width), dtype=torch.int32)  # block tables by slot
        self._temp = torch.ones(slots, dtype=torch.float32)
        self._top_k = torch.full((slots,), -1, dtype=torch.long)
        self._top_p = torch.ones(slots, dtype=torch.float32)
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._paused = False
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.steps = 0
        self.prefill_tokens = 0
        self.prefill_batches = 0
        """Prompt tokens run through prefill (shared prompts are prefilled once)."""
        self.cached_tokens = 0
        """Prompt tokens taken from shared blocks (prefix index or a same-batch twin)."""
        self.retractions = 0
        """Running requests re-queued because the KV cache ran out of blocks (each logged)."""
        self.wasted_rows = 0
        """Decode rows computed for requests that had already stopped (overlap; dropped)."""
        self.timing = StepTiming()
        """Where the decode loop's time goes: device time of the steps, host waits for them."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ---- called from other threads -----------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the scheduler thread between two steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    def stats(self) -> dict[str, int]:
        pool = self.runner.pool
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_batches": self.prefill_batches,
            "cached_tokens": self.cached_tokens,
            "retractions": self.retractions,
            "wasted_decode_rows": self.wasted_rows,
            "prefix_evictions": pool.evictions,
            "kv_blocks_free": pool.available,
            "kv_blocks_total": pool.num_blocks - 1,
            **self.timing.stats(),
        }

    # ---- commands (run on the scheduler thread through call()) --------------------------------

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Abort") -> int:
        """Finish every request whose rid starts with `rid` (or all) with finish reason abort."""
        self._drain()
        hit = lambda r: abort_all or (rid is not None and r.rid.startswith(rid))  # noqa: E731
        n = 0
        with self._cv:
            waiting = [r for r in self._waiting if hit(r)]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            self._finish(r, {"type": "abort", "message": message})
            n += 1
        for r in [r for r in self._running if hit(r)]:
            r.finish_reason = {"type": "abort", "message": message}
            n += 1
        self._release_finished()
        return n

    def pause(self, mode: PauseMode) -> None:
        """Stop stepping. abort: finish running requests; retract: requeue them (recomputed on
        resume); in_place: keep them and their KV. New requests wait until `resume`."""
        self._drain()
        self._paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        elif mode == "retract":
            running, self._running = self._running, []
            for r in running:
                self._unplace(r)
            with self._cv:
                self._waiting.extendleft(reversed(running))

    def resume(self) -> None:
        self._paused = False

    def flush(self) -> bool:
        """SGLang's flush_cache: forget the prefix index. Strict, as SGLang 0.5.23
        (managers/scheduler.py: Scheduler.flush_cache flushes only when is_fully_idle, which
        ignores the waiting queue only while the engine is paused): fails while any request
        runs (an in_place pause keeps them), or waits while generation is not paused."""
        if self.strict and (self._running or (self._waiting and not self._paused)):
            return False
        self.runner.pool.clear_index()
        return True

    def fail_fatally(self, reason: str) -> None:
        """Stop the loop for good, failing every request (SGLang's scheduler process exits)."""
        log.error("engine stops: %s", reason)
        self.fatal = reason
        with self._cv:
            self._stop = True
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        dev = self.runner.device
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # per thread: NCCL groups and graphs follow the engine's GPU
        while True:
            with self._cv:
                while (
                    not self._stop
                    and not self._commands
                    and not self._inflight
                    and (self._paused or (not self._waiting and not self._running))
                ):
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if commands:
                self._guarded(self._drain)  # commands see every token of the step in flight
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # the caller gets the error; the engine serves on
                        fut.set_exception(e)
            if self._stop:
                break
            if self._paused:
                self._guarded(self._drain)
                continue
            started = time.perf_counter()
            self._guarded(self._step)
            self.timing.loop_s += time.perf_counter() - started
        why = self.fatal or "engine shutting down"
        self._inflight = []
        for r in [*self._running, *self._waiting]:
            r.error = why if self.fatal else None
            self._finish(r, {"type": "abort", "message": why})
        self._running = []
        self._waiting.clear()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            with torch.inference_mode():
                fn()
        except Exception as e:  # a failed step fails its requests (5xx), not the server
            log.exception("engine step failed")
            self._inflight = []
            for r in self._running:
                r.error = f"engine error: {type(e).__name__}: {e}"
                r.finish_reason = {"type": "abort", "message": r.error}
            self._release_finished()

    def _step(self) -> None:
        if self._waiting and self._free_slots:
            started = time.perf_counter()
            admitted = self._admit()  # while the step in flight runs
            if admitted:
                self._prefill(admitted)  # queued behind it on the device
                if not self.overlap:
                    self._drain()
            self.timing.prefill_s += time.perf_counter() - started
        if self._running:
            nxt = self._launch()
            self._drain()  # step t's (and a prefill's) bookkeeping while the device runs t + 1
            if nxt is not None:
                self._inflight.append(nxt)
            if not self.overlap:
                self._drain()
        else:
            self._drain()
        self.steps += 1

    # ---- admission and prefill -----------------------------------------------------------------

    def _admit(self) -> list[Request]:
        """Move waiting requests into running while slots, KV blocks and the prefill budget last;
        give each its blocks (shared prefix blocks first)."""
        pool, bs = self.runner.pool, self.runner.block_size
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        twins: dict[tuple, Request] = {}  # (namespace, tokens) -> the request prefilling them
        with self._cv:
            while self._waiting and self._free_slots:
                r = self._waiting[0]
                tokens = r.input_ids + r.output_ids
                n = len(tokens)
                twin_key = (r.namespace, tuple(tokens))
                lead = twins.get(twin_key) if self.prefix_sharing else None
                if lead is not None:  # a twin in this batch: its full blocks, a copy of the tail
                    shared = lead.blocks[: n // bs]
                    need = math.ceil(n / bs) - len(shared)
                    compute = 0
                else:
                    keys = pool.keys(tokens, r.namespace) if self.prefix_sharing else []
                    shared = pool.match(keys[: (n - 1) // bs])  # >= 1 token left to compute
                    need = math.ceil(n / bs) - len(shared)
                    compute = n - len(shared) * bs
                if admitted and compute > budget:
                    break
                pool.share(shared)
                if need > pool.available:
                    pool.release(shared)
                    if not admitted and not self._running:  # can never fit
                        self._waiting.popleft()
                        r.error = (
                            f"request of {n} tokens needs {need} KV blocks; the cache has "
                            f"{pool.available} (engine.embedded.mem_fraction / block_size)"
                        )
                        log.error("refused %s: %s", r.rid, r.error)
                        self._finish(r, {"type": "abort", "message": r.error})
                        continue
                    break
                self._waiting.popleft()
                r.blocks = shared + pool.allocate(need)
                r.cached_tokens = n - compute
                budget -= compute
                if lead is None and self.prefix_sharing:
                    pool.register(keys, r.blocks)
                    twins[twin_key] = r
                r._lead = lead  # type: ignore[attr-defined]
                r._compute = compute  # type: ignore[attr-defined]
                self._place(r)
                admitted.append(r)
        return admitted

    def _place(self, r: Request) -> None:
        r.slot = self._free_slots.pop()
        self._bt[r.slot].zero_()
        self._bt[r.slot, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        self._temp[r.slot] = r.params.temperature
        self._top_k[r.slot] = r.params.top_k
        self._top_p[r.slot] = r.params.top_p
        if r.params.ignore_eos:  # as in SGLang, ignore_eos also disables stop_token_ids
            r.stop_set = frozenset()
        else:
            r.stop_set = frozenset(self.runner.eos_token_ids) | frozenset(r.params.stop_token_ids)
        r.limit = min(r.params.max_new_tokens, self.runner.max_context_len - len(r.input_ids))
        self._running.append(r)

    def _unplace(self, r: Request) -> None:
        """Give back a request's slot and blocks (finished, aborted or retracted)."""
        if r.slot >= 0:
            self.runner.pool.release(r.blocks)
            self._free_slots.append(r.slot)
        r.slot, r.blocks = -1, []
        r.issued = len(r.output_ids)

    def _prefill(self, admitted: list[Request]) -> None:
        """Launch one packed prefill of the admitted requests and the draw of their first tokens
        (a step in flight: read by the next `_drain`)."""
        self.prefill_batches += 1
        started = self.timing.mark(self.runner.device)
        leads = [r for r in admitted if r._lead is None]  # type: ignore[attr-defined]
        seqs = []
        for r in leads:
            tokens = r.input_ids + r.output_ids
            start = len(tokens) - r._compute  # type: ignore[attr-defined]
            seqs.append((tokens[start:], start, r.blocks))
        logits = self.runner.prefill(seqs)
        self.prefill_tokens += sum(len(s[0]) for s in seqs)
        row = {id(r): i for i, r in enumerate(leads)}
        bs = self.runner.block_size
        index = []
        for r in admitted:
            lead = r._lead  # type: ignore[attr-defined]
            if lead is not None:
                n = r.context_len
                if n % bs:  # copy-on-write: the partial last block is the twin's own
                    self.runner.copy_block(lead.blocks[n // bs], r.blocks[n // bs])
            index.append(row[id(lead if lead is not None else r)])
            self.cached_tokens += r.cached_tokens
            del r._lead, r._compute  # type: ignore[attr-defined]
        logits = logits[to_device(torch.tensor(index), logits.device)]
        for r in admitted:
            r.issued = len(r.output_ids)
        step = self._sample(admitted, logits)
        step.started, step.kind = started, "prefill"
        self._inflight.append(step)

    # ---- decode ------------------------------------------------------------------------------

    def _launch(self) -> _Step | None:
        """Launch one decode step for every running request that may still produce a token."""
        rows, positions, slots, need = self._decode_batch()
        pool = self.runner.pool
        if len(need) > pool.available:
            self._drain()
            while self._running and len(self._need_blocks()) > pool.available:
                self._retract(self._running[-1])
            rows, positions, slots, need = self._decode_batch()
        for r in need:
            b = pool.allocate(1)[0]
            self._bt[r.slot, len(r.blocks)] = b
            r.blocks.append(b)
        if not rows:
            return None
        ids = self._fed_tokens(rows)
        if ids is None:
            self._drain()
            rows, positions, slots, _ = self._decode_batch()
            if not rows:
                return None
            ids = torch.tensor([r.output_ids[-1] for r in rows], dtype=torch.long)
            ids = to_device(ids, self.runner.device)
        slots_t = torch.tensor(slots, dtype=torch.long)
        started = self.timing.mark(self.runner.device)
        logits = self.runner.decode(ids, torch.tensor(positions), self._bt[slots_t])
        step = self._sample(rows, logits, slots_t)
        step.started = started
        return step

    def _fed_tokens(self, rows: list[Request]) -> torch.Tensor | None:
        """The tokens `rows` feed to the next decode step, on the device: each row's last draw,
        from the steps in flight (the latest holding the row); None when some row's last token
        is only on the host (nothing in flight for it)."""
        if not self._inflight:
            return None
        last = self._inflight[-1]
        same = len(self._inflight) == 1 and len(last.rows) == len(rows)
        if same and all(map(operator.is_, last.rows, rows)):
            return last.tokens  # the common case: the same batch as the step in flight
        row_of: dict[int, int] = {}
        base = 0
        for step in self._inflight:
            row_of.update((id(r), base + i) for i, r in enumerate(step.rows))
            base += len(step.rows)
        idx = [row_of.get(id(r), -1) for r in rows]
        if -1 in idx:
            return None
        tokens = [step.tokens for step in self._inflight]
        drawn = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        return drawn[to_device(torch.tensor(idx), drawn.device)]

    def _decode_batch(self):
        """One pass over running: the rows to decode, their positions and slots, and the rows
        whose position starts a new block."""
        bs = self.runner.block_size
        rows, positions, slots, need = [], [], [], []
        for r in self._running:
            if r.finish_reason is None and r.issued < r.limit:
                p = len(r.input_ids) + r.issued - 1  # the position of the token fed
                rows.append(r)
                positions.append(p)
                slots.append(r.slot)
                if p // bs >= len(r.blocks):
                    need.append(r)
        return rows, positions, slots, need

    def _need_blocks(self) -> list[Request]:
        return self._decode_batch()[3]

    def _retract(self, r: Request) -> None:
        self.retractions += 1
        log.warning(
            "KV cache full: request %s retracted after %d tokens (re-queued, recomputed later; "
            "%d retractions so far)",
            r.rid,
            len(r.output_ids),
            self.retractions,
        )
        self._running.remove(r)
        self._unplace(r)
        with self._cv:
            self._waiting.appendleft(r)

    def _sample(
        self, rows: list[Request], logits: torch.Tensor, slots: torch.Tensor | None = None
    ) -> _Step:
        """Sample one token per row on the device; start copying them to the host."""
        if slots is None:
            slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        temperature, top_k, top_p = self._temp[slots], self._top_k[slots], self._top_p[slots]
        ban_rows, ban_ids = [], []
        extras = [
            (i, r)
            for i, r in enumerate(rows)
            if r.params.min_new_tokens or r.seed is not None or r.top_logprobs_num
        ]
        for i, r in extras:  # min_new_tokens: stop tokens cannot be drawn yet
            if r.issued < r.params.min_new_tokens and r.stop_set:
                ban_rows += [i] * len(r.stop_set)
                ban_ids += list(r.stop_set)
        if ban_rows:
            # Out of place: the runner's logits are a graph's output or inference tensors.
            dev = logits.device
            logits = logits.index_put(
                (to_device(torch.tensor(ban_rows), dev), to_device(torch.tensor(ban_ids), dev)),
                torch.full((), float("-inf"), dtype=logits.dtype, device=dev),
            )
        # (row, seed, position of the last token in the sequence: SGLang's for the seeded draw)
        seeded = [
            (i, r.seed, len(r.input_ids) + r.issued - 1) for i, r in extras if r.seed is not None
        ]
        tokens, logprobs = sample(
            logits,
            temperature,
            top_k,
            top_p,
            self._gen,
            seeded or None,
            self.runner.seeded_draw,
            self.runner.picks,
        )
        tops = self._top_logprobs(extras, logits, temperature)
        cuda = tokens.device.type == "cuda"
        tok_host, lp_host = _to_host(tokens), _to_host(logprobs)
        done = None
        if cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        for r in rows:
            r.issued += 1
        return _Step(rows, tokens, tok_host, lp_host, tops, done, self.version)

    def _drain(self) -> None:
        """Read the steps in flight (if any), in launch order, into their requests: tokens,
        log-probs, versions, stops."""
        steps, self._inflight = self._inflight, []
        for step in steps:
            self._read(step)

    def _read(self, step: _Step) -> None:
        if step.done is not None:
            waited = time.perf_counter()
            step.done.synchronize()
            self.timing.wait_s += time.perf_counter() - waited
        if step.started is not None:
            elapsed = step.started.elapsed_time(step.done) / 1e3
            if step.kind == "prefill":
                self.timing.prefill_device_s += elapsed
            else:
                self.timing.decode_steps += 1
                self.timing.decode_rows += len(step.rows)
                self.timing.decode_device_s += elapsed
        for i, (r, tok, lp) in enumerate(
            zip(step.rows, step.tokens_host.tolist(), step.logprobs_host.tolist(), strict=True)
        ):
            if r.finish_reason is not None or r.slot < 0:
                self.wasted_rows += 1
                continue
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(step.version)
            if r.top_logprobs_num:
                values, ids = step.tops[i]
                r.output_top.append(list(zip(values.tolist(), ids.tolist(), strict=True)))
            r.finish_reason = self._check_stop(r, tok)
            if r.on_token is not None:
                r.on_token(r)
        self._release_finished()

    @staticmethod
    def _top_logprobs(rows, logits: torch.Tensor, temperature: torch.Tensor) -> dict:
        """The N best (logprob, token) of each row (index, request) that asks, at its
        temperature (greedy: 1): host copies started now, read by `_drain` once the step is done
        (reading them here would wait for the step just launched)."""
        out = {}
        for i, r in rows:
            if r.top_logprobs_num:
                t = float(temperature[i])
                lp = torch.log_softmax(logits[i].float() / (t if t >= 1e-5 else 1.0), -1)
                out[i] = tuple(_to_host(x) for x in lp.topk(min(r.top_logprobs_num, lp.shape[-1])))
        return out

    def _check_stop(self, r: Request, tok: int) -> dict[str, Any] | None:
        n = len(r.output_ids)
        if n >= r.params.min_new_tokens and tok in r.stop_set:
            return {"type": "stop", "matched": tok}
        if r.params.stop and n >= r.params.min_new_tokens:
            tail = self._decode_text(r.output_ids[-32:])
            for s in r.params.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if n >= r.params.max_new_tokens:
            return {"type": "length", "length": n}
        if r.context_len >= self.runner.max_context_len:
            return {"type": "length", "length": n}
        return None

    def _release_finished(self) -> None:
        """Drop finished requests from `running`, freeing their slots and blocks."""
        done = [r for r in self._running if r.finish_reason is not None]
        if not done:
            return
        self._running = [r for r in self._running if r.finish_reason is None]
        for r in done:
            if r.return_routed and r.slot >= 0 and r.context_len > 1:
                # Every position but the last was fed by this request's forward passes (or by
                # the one that cached a shared prefix): their experts sit at its KV slots.
                end = r.context_len - 1
                r.routed = self.runner.routed_rows(r.blocks, min(r.routed_start, end), end)
            self._unplace(r)
            self._finish(r, r.finish_reason)

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        r.finish_reason = reason
        try:
            r.on_done(r)
        except Exception:
            log.exception("on_done of request %s failed", r.rid)
