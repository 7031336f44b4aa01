"""Continuous batching: one thread owns the model and steps every running request together.

    HTTP handlers --submit()--> waiting deque --admit (free slot)--> running[0..n-1] --finish--> on_done
                   --call(fn)--> command queue, run between steps (weight updates, abort, pause)

Each loop iteration: run queued commands; unless paused, admit waiting requests into free slots
and prefill them as one batch (each gets its first token), then one decode step for every running
request; finished requests leave at once and their slot is refilled at the next iteration.
Weight updates run as commands between two steps, so a running request continues under the new
weights and every token records the weight version (a string, as in SGLang) that sampled it.

Strict mode (`engine.strict_sglang`) imitates SGLang 0.5.23's failures: `flush()` fails while any
request holds KV (running; in_place pause keeps them), and `fail_fatally()` stops the loop for good
(SGLang's scheduler exits when a weight update's flush fails). A failed step finishes its requests
with an `error` mark, which the server answers with a 5xx (SGLang's answer to engine errors).

Memory: at most `max_running_requests` requests hold KV (the runner's preallocated cache); the
waiting deque holds only token ids and is bounded by the HTTP clients' concurrency.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from slime_async.actors.engine.embedded.model_runner import ModelRunner
from slime_async.actors.engine.embedded.sampling import SamplingParams, sample

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
    generator: torch.Generator | None = None
    """The request's own sampler stream (its sampling_seed), None: the engine's."""
    error: str | None = None
    """Set when an engine error (not the client) ended the request: answered with a 5xx."""
    on_token: Callable[[Request], None] | None = None
    """Called on the scheduler thread after each new token (SSE streaming)."""
    top_logprobs_num: int = 0
    """SGLang's top_logprobs_num: keep the N best (logprob, token) of each step."""
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    group: list[Request] | None = None
    """n > 1: the requests sharing this one's prompt; the first prefills, the others copy its KV."""

    @property
    def context_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


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
    ):
        self.runner = runner
        self._decode_text = decode_text or (lambda ids: "")
        self.version = initial_version
        """The served weight version (SGLang's `weight_version`, any string)."""
        self.strict = strict
        self.fatal: str | None = None
        """Why the loop stopped for good (strict mode's imitation of SGLang's scheduler exit)."""
        self.max_prefill_tokens = max_prefill_tokens
        self._gen = torch.Generator(device=runner.device).manual_seed(seed)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # index == KV slot
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._paused = False
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.steps = 0
        self.prefill_tokens = 0
        """Prompt tokens run through prefill (n > 1 shares one prefill per prompt)."""

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

    # ---- commands (run on the scheduler thread through call()) --------------------------------

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Abort") -> int:
        """Finish every request whose rid starts with `rid` (or all) with finish reason abort."""
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
        self._paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        elif mode == "retract":
            with self._cv:
                self._waiting.extendleft(reversed(self._running))
            self._running = []

    def resume(self) -> None:
        self._paused = False

    def flush(self) -> bool:
        """SGLang's flush_cache: there is no prefix cache here, so it always succeeds unless
        strict, where (as in SGLang) it fails while any request holds KV (is running)."""
        return not (self.strict and self._running)

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
                    and (self._paused or (not self._waiting and not self._running))
                ):
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # the caller gets the error; the engine serves on
                        fut.set_exception(e)
            if self._paused:
                continue
            if self._stop:
                break
            try:
                self._step()
            except Exception as e:  # a failed step fails its requests (5xx), not the server
                log.exception("engine step failed")
                for r in self._running:
                    r.error = f"engine error: {type(e).__name__}: {e}"
                    r.finish_reason = {"type": "abort", "message": r.error}
                self._release_finished()
        why = self.fatal or "engine shutting down"
        for r in [*self._running, *self._waiting]:
            r.error = why if self.fatal else None
            self._finish(r, {"type": "abort", "message": why})
        self._running = []
        self._waiting.clear()

    def _step(self) -> None:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        with self._cv:
            while self._waiting and len(self._running) + len(admitted) < self.runner.max_slots:
                nxt = self._waiting[0]
                if admitted and nxt.context_len > budget:
                    break
                admitted.append(self._waiting.popleft())
                budget -= nxt.context_len
        if admitted:
            first = len(self._running)
            self._running.extend(admitted)
            slots = list(range(first, first + len(admitted)))
            # n > 1: the prompt is prefilled once; the other samples copy its KV and logits.
            lead = {}
            prefill_rows: list[int] = []
            for i, r in enumerate(admitted):
                key = id(r.group) if r.group is not None and not r.output_ids else None
                if key is not None and key in lead:
                    continue
                if key is not None:
                    lead[key] = i
                prefill_rows.append(i)
            logits_p = self.runner.prefill(
                [slots[i] for i in prefill_rows],
                [admitted[i].input_ids + admitted[i].output_ids for i in prefill_rows],
            )
            self.prefill_tokens += sum(admitted[i].context_len for i in prefill_rows)
            row_of = {i: j for j, i in enumerate(prefill_rows)}
            index = []
            for i, r in enumerate(admitted):
                if i in row_of:
                    index.append(row_of[i])
                    continue
                src = lead[id(r.group)]
                self.runner.copy_slot(slots[src], slots[i], r.context_len)
                index.append(row_of[src])
            logits = logits_p[torch.tensor(index, device=logits_p.device)]
            self._sample_into(admitted, logits)
            self._release_finished()
        if self._running:
            feed = [r.output_ids[-1] for r in self._running]
            positions = [r.context_len - 1 for r in self._running]
            logits = self.runner.decode(feed, positions)
            self._sample_into(self._running, logits)
            self._release_finished()
        self.steps += 1

    def _sample_into(self, reqs: list[Request], logits: torch.Tensor) -> None:
        temperature = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32)
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        for i, r in enumerate(reqs):  # min_new_tokens: stop tokens cannot be drawn yet
            if len(r.output_ids) < r.params.min_new_tokens and self._stop_ids(r):
                banned[i, list(self._stop_ids(r))] = True
        if bool(banned.any()):
            # Out of place: the runner's logits are inference tensors (no in-place writes here).
            logits = logits.masked_fill(banned.to(logits.device), float("-inf"))
        gens = [r.generator for r in reqs]
        row_gens = gens if any(g is not None for g in gens) else None
        tokens, logprobs = sample(logits, temperature, top_k, top_p, self._gen, row_gens)
        tops = self._top_logprobs(reqs, logits, temperature)
        for i, (r, tok, lp) in enumerate(
            zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(self.version)
            if r.top_logprobs_num:
                r.output_top.append(tops[i])
            r.finish_reason = self._check_stop(r, tok)
            if r.on_token is not None:
                r.on_token(r)

    @staticmethod
    def _top_logprobs(reqs, logits: torch.Tensor, temperature: torch.Tensor) -> dict:
        """The N best (logprob, token) of each row that asks, at its temperature (greedy: 1)."""
        out = {}
        for i, r in enumerate(reqs):
            if r.top_logprobs_num:
                t = float(temperature[i])
                lp = torch.log_softmax(logits[i].float() / (t if t >= 1e-5 else 1.0), -1)
                v, idx = lp.topk(min(r.top_logprobs_num, lp.shape[-1]))
                out[i] = list(zip(v.tolist(), idx.tolist(), strict=True))
        return out

    def _stop_ids(self, r: Request) -> set[int]:
        if r.params.ignore_eos:  # as in SGLang, ignore_eos also disables stop_token_ids
            return set()
        return set(self.runner.eos_token_ids) | set(r.params.stop_token_ids)

    def _check_stop(self, r: Request, tok: int) -> dict[str, Any] | None:
        n = len(r.output_ids)
        if n >= r.params.min_new_tokens and tok in self._stop_ids(r):
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
        """Drop finished requests from `running`, keeping slots 0..n-1 dense."""
        i = 0
        while i < len(self._running):
            r = self._running[i]
            if r.finish_reason is None:
                i += 1
                continue
            last = len(self._running) - 1
            if i != last:
                moved = self._running[last]
                self.runner.move_slot(last, i, moved.context_len - 1)
                self._running[i] = moved
            self._running.pop()
            self._finish(r, r.finish_reason)

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        r.finish_reason = reason
        try:
            r.on_done(r)
        except Exception:
            log.exception("on_done of request %s failed", r.rid)
