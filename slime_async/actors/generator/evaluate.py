"""Pinned evaluation: one policy version, a held-out set, greedy and sampled, through the engines.

    learner --eval/request_v<v>.json--> Evaluator.watch (generator 0, next to the training loop)
        held-out JSONL (eval.data) --/generate, greedy + eval.samples sampled--> engines at v
        every token's version == v ? score with generator.reward : rerun / discard (counted)
    Evaluator --eval/result_v<v>.json--> learner (which held its next push until now)
              --metrics/eval.jsonl (step = v)--> progress line, plots, sweeps

"Pinned" means every token of every answer comes from version v. The learner writes the request
only once the engines hold v and pushes v + 1 only after the result exists (utils/eval_pin.py),
so no weight update can reach an answer; the check of each answer's per-token versions (the
engines' `weight_versions` spans) is what proves it. An answer with tokens of an older version
(an engine that had not yet taken v) is generated again (`eval/reruns`); one with a newer version
means the engines left v (the hold timed out, or several learners): the evaluation is discarded
(`eval/discarded`, logged) and reported as such, never as an accuracy. So is an evaluation whose
engine calls kept failing: the learner gets a result either way and never waits for nothing.

Seeded (`eval.seed`): sampled answer j of record i carries SGLang's `sampling_seed`, derived from
(eval.seed, i, j) and nothing else, so it is the same at every version, in every run and whatever
order the requests are served in: two runs evaluating the same policy give the same answers, and
two policies are compared on common random numbers. Every answer's outcome goes to
`eval/answers_v<v>.jsonl` (record, kind, correct, length, token ids) for problem-level pairing.

Answers are single-turn: the record's prompt (chat-templated like the generator's) and one
generation, scored by `generator.reward` (accuracy: its `correct` part when it has one, else
reward > 0, as the learner counts it). Requests share the engines with the training rollouts,
at most `eval.concurrency` at once. Memory: the held-out records and one version's answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from slime_async.actors.generator.dataset import PromptDataset
from slime_async.actors.generator.rewards import RewardFn
from slime_async.actors.generator.rollout import EngineLike, RolloutContext, Sample
from slime_async.config.eval import EvalConfig
from slime_async.config.generator import SamplingConfig
from slime_async.metrics import names as M
from slime_async.utils.eval_pin import (
    pending_requests,
    read_request,
    result_path,
    write_json_atomic,
)

log = logging.getLogger("slime_async.generator.eval")

POLL_S = 0.1
"""How often the run directory is checked for a new request."""


def answer_seed(seed: int, record: int, sample: int) -> int:
    """The `sampling_seed` of sampled answer `sample` of record `record` under `eval.seed`: a
    31-bit hash of the three (SGLang takes any int; 31 bits suit every server)."""
    digest = hashlib.blake2b(f"{seed}/{record}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def answers_path(run_dir: str | Path, version: int) -> Path:
    """Where the outcome of every answer of the evaluation of `version` is written."""
    return Path(run_dir) / "eval" / f"answers_v{version}.jsonl"


class VersionLeft(RuntimeError):
    """The engines serve a newer version than the one under evaluation."""


class Evaluator:
    """Evaluates the versions the learner asks for (see the module docstring)."""

    def __init__(
        self,
        cfg: EvalConfig,
        sampling: SamplingConfig,
        engine: EngineLike,
        tokenizer: Any,
        reward: RewardFn,
        run_dir: str | Path,
        *,
        prompt_key: str = "prompt",
        apply_chat_template: bool = True,
        metrics: Any = None,
    ):
        if not cfg.data:
            raise ValueError("eval.data: the held-out JSONL file is not set")
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.run_dir = Path(run_dir)
        self.metrics = metrics
        records = PromptDataset(cfg.data, prompt_key).records
        self.records = records[: cfg.max_examples] if cfg.max_examples else records
        self.prompt_key = prompt_key
        max_new = cfg.max_new_tokens or sampling.max_new_tokens
        self.greedy = sampling.model_copy(update={"temperature": 0.0, "max_new_tokens": max_new})
        temp = cfg.temperature if cfg.temperature is not None else sampling.temperature
        self.sampled = sampling.model_copy(update={"temperature": temp, "max_new_tokens": max_new})
        self.apply_chat_template = apply_chat_template
        self.reruns = 0
        self.discarded = 0
        self.seeds_ignored = 0
        """Engines found ignoring `sampling_seed` when the generator started (seeding.py)."""
        self.done: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------------- the watch
    async def watch(self, stop: asyncio.Event) -> None:
        """Evaluate every requested version until `stop` (a task next to the generator's loop)."""
        while not stop.is_set():
            for v in pending_requests(self.run_dir):
                await self.evaluate(v)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    async def evaluate(self, version: int) -> dict[str, Any]:
        """Evaluate `version`, write its result file (and metrics record); return the result."""
        t0 = time.perf_counter()
        try:
            rec = await self._evaluate(version)
            result = {"version": version, "status": "done", "metrics": rec}
            log.info(
                "eval v%d: greedy %.3f, sampled %.3f, pass@%d %.3f (%d records, %.1fs)",
                version,
                rec.get(M.EVAL_ACC_GREEDY, float("nan")),
                rec.get(M.EVAL_ACC_SAMPLED, float("nan")),
                self.cfg.samples,
                rec.get(M.EVAL_PASS_AT_K, float("nan")),
                len(self.records),
                rec[M.EVAL_SECONDS],
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # VersionLeft, or an engine that kept failing: never a hang
            self.discarded += 1
            log.warning(
                "eval v%d discarded: %s: %s (eval/discarded = %d)",
                version,
                type(e).__name__,
                e,
                self.discarded,
                exc_info=None if isinstance(e, VersionLeft) else e,
            )
            rec = {
                M.EVAL_DISCARDED: self.discarded,
                M.EVAL_RERUNS: self.reruns,
                M.EVAL_SECONDS: time.perf_counter() - t0,
            }
            result = {"version": version, "status": "discarded", "reason": str(e), "metrics": rec}
        if self.metrics is not None:
            self.metrics.log(version, rec)
        write_json_atomic(result_path(self.run_dir, version), result)
        self.done.append(result)
        return result

    # ----------------------------------------------------------------------------- one version
    async def _evaluate(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(self.cfg.concurrency)
        jobs: list[tuple[int, str, SamplingConfig]] = []
        for i in range(len(self.records)):
            if self.cfg.greedy:
                jobs.append((i, "greedy", self.greedy))
            jobs += [(i, f"s{j}", self.sampled) for j in range(self.cfg.samples)]

        async def one(
            i: int, kind: str, sampling: SamplingConfig
        ) -> tuple[int, str, bool, list[int]]:
            async with gate:
                return await self._answer(version, i, kind, sampling)

        answers = await asyncio.gather(*(one(*j) for j in jobs))
        results = [(i, kind, ok, len(ids)) for i, kind, ok, ids in answers]
        if self.cfg.answers:
            lines = [
                json.dumps(
                    {"record": i, "kind": kind, "correct": ok, "length": len(ids), "ids": ids}
                )
                for i, kind, ok, ids in answers
            ]
            path = answers_path(self.run_dir, version)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(line + "\n" for line in lines))
        greedy = [ok for _, kind, ok, _ in results if kind == "greedy"]
        sampled: dict[int, list[bool]] = {}
        for i, kind, ok, _ in results:
            if kind != "greedy":
                sampled.setdefault(i, []).append(ok)
        asked = read_request(self.run_dir, version)
        rec: dict[str, Any] = {
            M.EVAL_VERSION: version,
            # Where the weights sit in training (a version after a learner restart is past the
            # versions it left behind: the position counts updates).
            **{
                name: asked[key]
                for key, name in (("step", M.EVAL_LEARNER_STEP), ("position", M.EVAL_POSITION))
                if isinstance(asked.get(key), int)
            },
            M.EVAL_EXAMPLES: len(self.records),
            M.EVAL_RESPONSE_LEN: sum(n for *_, n in results) / max(len(results), 1),
            M.EVAL_RERUNS: self.reruns,
            M.EVAL_DISCARDED: self.discarded,
            M.EVAL_SEEDS_IGNORED: self.seeds_ignored,
        }
        if greedy:
            rec[M.EVAL_ACC_GREEDY] = sum(greedy) / len(greedy)
        if sampled:
            flat = [ok for oks in sampled.values() for ok in oks]
            rec[M.EVAL_ACC_SAMPLED] = sum(flat) / len(flat)
            rec[M.EVAL_PASS_AT_K] = sum(any(oks) for oks in sampled.values()) / len(sampled)
        rec[M.EVAL_SECONDS] = time.perf_counter() - t0
        return rec

    def _params(self, i: int, kind: str, sampling: SamplingConfig) -> SamplingConfig | dict:
        """The answer's sampling parameters: with `eval.seed`, a sampled answer's own seed."""
        if self.cfg.seed is None or kind == "greedy":
            return sampling
        return {
            **sampling.model_dump(),
            "sampling_seed": answer_seed(self.cfg.seed, i, int(kind[1:])),
        }

    async def _answer(
        self, version: int, i: int, kind: str, sampling: SamplingConfig
    ) -> tuple[int, str, bool, list[int]]:
        """One answer generated wholly at `version` and scored: (record, kind, correct, ids)."""
        record = self.records[i]
        params = self._params(i, kind, sampling)
        metadata = {k: v for k, v in record.items() if k != self.prompt_key}
        sample = Sample(record[self.prompt_key], metadata, f"eval/v{version}/{i}", i, 0)
        for attempt in range(self.cfg.max_reruns + 1):
            ctx = RolloutContext(
                self.engine,
                self.tokenizer,
                sampling,
                apply_chat_template=self.apply_chat_template,
                rid_prefix=f"eval/v{version}/{i}/{kind}/a{attempt}/",
            )
            out = await ctx.generate(ctx.prompt_ids(sample), params)
            newer = [v for v in out.versions if v > version]
            if newer:
                raise VersionLeft(f"an answer holds tokens of version {max(newer)}")
            if all(v == version for v in out.versions):
                break
            self.reruns += 1  # an engine still on an older version: generate it again
            log.warning(
                "eval v%d: answer %d/%s held versions %s; rerun %d",
                version,
                i,
                kind,
                sorted(set(out.versions)),
                attempt + 1,
            )
        else:
            raise VersionLeft(f"answer {i}/{kind} never came wholly from version {version}")
        text = ctx.decode(out.token_ids)
        info = {
            "full_text": text,
            "finish_reason": out.finish_reason,
            "turns": 1,
            "response_length": len(out.token_ids),
            "state": None,
        }
        reward, parts = await self.reward(sample, text, info)
        return i, kind, bool(parts.get("correct", reward > 0)), list(out.token_ids)
