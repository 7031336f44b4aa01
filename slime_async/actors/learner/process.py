"""The learner process (`slime-async learner`): buffer -> Megatron-core learner -> engines.

    buffer (consumer endpoint) --batch of whole groups--> rank 0 --groups split by DP rank--> ranks
    ranks --train_step--> version v+1 --every push.interval steps: HF-named buckets--> engines
    rank 0 --set_version(pushed version) after the push--> buffer (staleness + admission)
    rank 0 --commit through the last checkpointed batch--> buffer

Connects to: the buffer's consumer endpoint (rank 0 only) and every engine's HTTP endpoint
(rank 0: `WeightPusher`, a torch.distributed group with the engines; gloo on CPU, NCCL on GPU).
Waits on: a batch of `learner.groups_per_step` groups; that wait is the learner's idle time.
Memory: the model and optimizer, one batch, one weight bucket. Batches are committed only once a
checkpoint holds their effect (or right away when no checkpoints are taken mid-run), so a
learner killed between checkpoints gets the same batches again: no trajectory is lost or trained
on twice across a resume.

The version announced to the buffer is the one the engines hold: it is announced after each push,
not after each step. So the buffer's clock is the version new tokens are made with, a group started
now is never stale on arrival whatever push.interval is, and admission's budget counts from the
pushed version: batches trained since the last push stay in the budget until the next one (with
push.interval P the engines lag the learner by up to P - 1 versions, which the config requires
max_staleness to cover). A rollout admitted at version v starts on engines that already hold v,
which is what makes `run.mode = "sync"` (max_staleness 0) generate-train-push in lock step.

Every version names one set of weights, and versions never go back. A learner restarted from a
checkpoint at version c (or from the base model, version 0) while the run has used later versions
(the dead learner's steps after its last checkpoint: announced, on tokens, served by engines)
continues under a fresh version F, one past the highest the run has used, and records the break
(c, F) in the run's line of weights (`slime_async/queue/lineage.py`): versions c+1 .. F-1 are
superseded, F names c's weights, and staleness counts updates along the line. The line goes into
every checkpoint, and to the buffer with the version, before the push: from then on the buffer
drops (or, when the stale policy keeps stale groups, counts) groups with superseded tokens, and
generators use no engine still serving an older version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import slime_async.metrics.names as M
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.actors.learner import token_record
from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.checkpoint import is_checkpoint
from slime_async.actors.learner.stop_ban import stop_ban
from slime_async.actors.learner.trainer import Learner
from slime_async.config import PushConfig, SlimeConfig
from slime_async.metrics import MetricsLogger, int_histogram
from slime_async.queue.client import Batch, ConsumerClient
from slime_async.queue.lineage import SUPERSEDED_POSITION, Line, plan_restart
from slime_async.queue.schema import decode_trajectory, encode_trajectory
from slime_async.utils.eval_pin import read_result, request_path, write_json_atomic
from slime_async.utils.gc_watch import GcWatch, freeze
from slime_async.utils.readiness import announce_ready
from slime_async.utils.restart_requests import request_restart

log = logging.getLogger("slime_async.learner")


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest `step_<n>` checkpoint under `save_dir` (or `save_dir` itself), or None.

    A checkpoint directory appears under its final name only once complete (it is written as
    `step_<n>.partial` and renamed), so a crash mid-save leaves nothing half-read here.
    """
    root = Path(save_dir)
    if is_checkpoint(root):
        return root
    if not root.is_dir():
        return None
    steps = [
        (int(p.name.removeprefix("step_")), p)
        for p in root.glob("step_*")
        if p.name.removeprefix("step_").isdigit() and is_checkpoint(p)
    ]
    return max(steps)[1] if steps else None


def train_groups(batch: Batch) -> list[TrainGroup]:
    """The buffer's batch as the learner's typed groups, each with its staleness."""
    return [TrainGroup(tuple(g), s) for g, s in zip(batch.groups, batch.staleness, strict=True)]


def _learner_lags(line: Line, version: int, groups: Sequence[TrainGroup]) -> dict[str, int]:
    """The batch's oldest and newest model token on the learner's own clock: updates from each to
    `version` along `line`; tokens of superseded versions are left out (counted in the stale
    metrics)."""
    now = line.position(version)
    lags = [
        now - p
        for g in groups
        for t in g
        if t.loss_mask.any()
        for p in _extremes(line.positions(t.versions[t.loss_mask.astype(bool)]))
    ]
    return {M.STALENESS_LEARNER_MAX: max(lags), M.STALENESS_LEARNER_MIN: min(lags)} if lags else {}


def _extremes(positions: np.ndarray) -> list[int]:
    """The lowest and highest position that is not superseded (none when all are)."""
    on_line = positions[positions != SUPERSEDED_POSITION]
    return [int(on_line.min()), int(on_line.max())] if on_line.size else []


def batch_metrics(groups: Sequence[TrainGroup]) -> dict[str, Any]:
    """Reward, accuracy, lengths and staleness of one batch (before training on it)."""
    trajs = [t for g in groups for t in g]
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    # Accuracy: a reward's own "correct" part when it reports one, else reward > 0.
    correct = np.array(
        [float(t.reward_parts.get("correct", t.reward > 0)) for t in trajs], dtype=np.float64
    )
    lengths = np.array([int(t.loss_mask.sum()) for t in trajs], dtype=np.float64)
    per_traj_staleness = [g.staleness for g in groups for _ in g]
    out: dict[str, Any] = {
        M.REWARD: float(rewards.mean()) if len(trajs) else 0.0,
        M.ACCURACY: float(correct.mean()) if len(trajs) else 0.0,
        M.RESPONSE_LEN: float(lengths.mean()) if len(trajs) else 0.0,
        M.RESPONSE_LEN_MAX: float(lengths.max()) if len(trajs) else 0.0,
        M.TRAJECTORIES: len(trajs),
    }
    if per_traj_staleness:
        out[M.STALENESS_MEAN] = float(np.mean(per_traj_staleness))
        out[M.STALENESS_MAX] = int(max(per_traj_staleness))
        out[M.STALENESS_HIST] = int_histogram(per_traj_staleness)
    return out


def push_backend(setting: str, learner_on_gpu: bool) -> str:
    """The weight push's backend as the learner starts: auto stays auto on a GPU (the pusher
    chooses from the engines' devices at each connect) and is gloo on the CPU; ipc stays ipc."""
    if learner_on_gpu or setting == "ipc":
        return setting
    if setting == "nccl":
        raise ValueError(
            "push.backend = 'nccl' needs the learner on a GPU (this learner sees none): "
            "use 'auto' or 'gloo'"
        )
    return "gloo"


class _Rank0:
    """What only learner rank 0 holds: the buffer consumer, the weight pusher, the metrics."""

    def __init__(self, cfg: SlimeConfig, run_dir: Path | None, push: PushConfig):
        self.cfg = cfg
        self.consumer = ConsumerClient(cfg.buffer, "learner")
        self.pusher: WeightPusher | None = None
        if cfg.engine.urls:
            self.pusher = WeightPusher(
                cfg.engine.urls,
                push,
                api_key=cfg.engine.api_key,
                admin_api_key=cfg.engine.admin_api_key,
                # A restarted learner destroys its dead predecessor's group on the engines first.
                state_path=run_dir / "weight_group.json" if run_dir is not None else None,
                liveness=cfg.engine.liveness,
                # An engine stuck in its update call is restarted by `slime-async run`.
                request_restart=(
                    partial(request_restart, run_dir, by="learner") if run_dir is not None else None
                ),
            )
        self.metrics: MetricsLogger | None = None
        self.next_record: dict[str, Any] = {}
        """Facts logged with the next step's record: start-up facts with the first, a
        checkpoint's save time with the step after it."""
        self.run_dir = run_dir
        self.eval_pending: int | None = None
        """The version whose pinned evaluation was requested and not yet waited for."""
        if run_dir is not None:
            self.metrics = MetricsLogger(run_dir, "learner")

    def poll_batch(self, timeout_s: float = 1.0) -> Batch | None:
        """The next batch, if the buffer delivers one within `timeout_s`."""
        return self.consumer.get_batch(
            num_groups=self.cfg.learner.groups_per_step, timeout_s=timeout_s
        )

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        self.consumer.close()
        if self.metrics is not None:
            self.metrics.close()


def _scatter_groups(learner: Learner, groups: list[TrainGroup] | None) -> list[TrainGroup]:
    """Rank 0's batch, split over data-parallel ranks; TP ranks of one DP rank get the same."""
    if dist.get_world_size() == 1:
        return groups or []
    # Encoded with the wire schema so nothing but bytes (and ints) crosses the process group.
    payload = (
        [[(g.staleness, [encode_trajectory(t) for t in g]) for g in groups]]
        if groups is not None
        else [None]
    )
    dist.broadcast_object_list(payload, src=0)
    encoded = payload[0]
    dp_size = dist.get_world_size(learner.dp_group)
    mine = encoded[learner.dp_rank :: dp_size]
    return [TrainGroup(tuple(decode_trajectory(b) for b in blobs), s) for s, blobs in mine]


def run_learner(cfg: SlimeConfig, run_dir: Path | None, freeze_start_up: bool = False) -> int:
    """Train `learner.num_steps` optimizer steps on batches from the buffer; 0 when done.
    `freeze_start_up` (the `slime-async learner` process, which owns its heap): before the first
    step, what start-up made goes out of the garbage collector's sight (`gc_watch.freeze`)."""
    lc = cfg.learner
    if lc.torch_threads:
        torch.set_num_threads(lc.torch_threads)
    save_dir = cfg.paths().checkpoints
    resume_from = latest_checkpoint(lc.load) if lc.load else None
    if lc.load and resume_from is None:
        if lc.model_path is None:
            raise FileNotFoundError(f"learner.load = {lc.load}: no complete checkpoint there")
        # Stopped before its first checkpoint was complete: nothing was committed to the buffer
        # yet, so starting over from the model gets every batch again, none lost or repeated.
        log.warning("no complete checkpoint in %s: starting from %s", lc.load, lc.model_path)
    learner_cfg = lc.model_copy(update={"load": str(resume_from) if resume_from else None})
    # A greedy request is sampled (and its log-probs reported) at temperature 1 (SGLang's rule).
    temperature = cfg.generator.sampling.temperature or 1.0
    learner = Learner(
        learner_cfg,
        cfg.algo,
        temperature=temperature,
        max_staleness=cfg.buffer.max_staleness,
        stale_policy=cfg.buffer.stale_policy,
        # buffer.fixed_lag pairs every batch with one version: a batch that changes nothing must
        # still make one, or the next batch (generated at that version's successor) never comes
        version_per_batch=cfg.buffer.fixed_lag is not None,
        stop_ban=stop_ban(
            cfg.generator.sampling.min_new_tokens,
            cfg.generator.sampling.stop_token_ids,
            cfg.engine.model_path or lc.model_path,
        ),
    )
    backend = push_backend(cfg.push.backend, torch.cuda.is_available())
    push = cfg.push.model_copy(update={"backend": backend})
    rank0 = _Rank0(cfg, run_dir, push) if learner.is_rank0 else None
    gc_watch = GcWatch(f"learner rank {learner.rank}", lc.gc_warning_s).install()
    try:
        plan = None
        if rank0 is not None:
            cursor = int(learner.loaded_extra.get("buffer_cursor", 0))
            if cursor:
                retired = rank0.consumer.resume(cursor)
                log.info(
                    "resumed at step %d (buffer cursor %d, %d batches retired)",
                    learner.step,
                    cursor,
                    retired,
                )
            plan = _plan_versions(learner, rank0)
        version, breaks = _broadcast_object(plan)
        learner.line = Line.parse(breaks)
        if version != learner.version:
            if rank0 is not None:  # reported with the first step's record
                rank0.next_record[M.VERSION_FRESH] = float(version)
                rank0.next_record[M.VERSION_RESUMED_FROM] = float(learner.version)
            learner.version = version
        if rank0 is not None:
            # The version and line before any push: groups with superseded tokens are dropped
            # (or counted) from now on, and generators wait for engines serving this version.
            rank0.consumer.set_version(learner.version, lc.groups_per_step, breaks)
        has_pusher = _broadcast_flag(rank0 is not None and rank0.pusher is not None)
        if has_pusher:
            # Every engine gets this learner's weights before training: engines start from the
            # base model, and after a learner restart they may hold a dead learner's later
            # weights, or still be paused by its unfinished push (the push continues them).
            _push(learner, rank0, cfg.push.bucket_bytes)
            _resync(learner, rank0, cfg.push.bucket_bytes)
        if rank0 is not None:
            rank0.consumer.set_version(learner.version, lc.groups_per_step, breaks)
            _request_eval(cfg, rank0, learner, has_pusher, last=False)
        if dist.is_initialized():
            dist.barrier()
        if learner.is_rank0:
            announce_ready(f"version {learner.version}")
        if freeze_start_up:
            # What start-up made (megatron's model and optimizer, the modules imported) out of
            # the collector's sight: a full collection of it would stop this rank for a fraction
            # of a second at no particular step, and with several ranks the others wait for it
            # in the next collective.
            freeze(f"learner rank {learner.rank} start-up")
        code = _train(cfg, learner, rank0, save_dir, has_pusher, gc_watch)
        if rank0 is not None and run_dir is not None:
            # The buffer's final accounting, for the run's "nothing lost" check.
            stats = rank0.consumer.stats()
            (run_dir / "buffer_final.json").write_text(json.dumps(stats, indent=2) + "\n")
        return code
    finally:
        gc_watch.close()
        if rank0 is not None:
            rank0.close()
        learner.close()


def _plan_versions(learner: Learner, rank0: _Rank0) -> tuple[int, list[list[int]]]:
    """The version and line of weights this learner starts with (rank 0; see the module
    docstring), and the weight group built with the engines that answer."""
    stats = rank0.consumer.stats()
    served: dict[str, int | None] = {}
    if rank0.pusher is not None:
        served = rank0.pusher.served_versions()  # before the group: a dead learner's push shows
        rank0.pusher.connect()
    used = max(
        int(stats.get("version", 0)),
        int(stats.get("versions_used", 0)),
        *(v for v in served.values() if v is not None),
    )
    held = learner.version
    version, line = plan_restart(
        held,
        Line.parse(learner.loaded_extra.get("lineage")),
        Line.parse(stats.get("lineage")),
        used,
    )
    if version != held:
        log.warning(
            "the run has used versions up to %d; this learner holds the weights of version %d "
            "(step %d): they continue as version %d, and versions %d..%d (weights the run left "
            "behind) are superseded",
            used,
            held,
            learner.step,
            version,
            held + 1,
            version - 1,
        )
    return version, line.to_list()


def _push(learner: Learner, rank0: _Rank0 | None, bucket_bytes: int) -> float:
    """Every rank exports (TP gathers); rank 0 streams the buckets to the engines."""
    buckets = learner.export_hf_buckets(bucket_bytes)
    if rank0 is None or rank0.pusher is None:
        for _ in buckets:
            pass
        return 0.0
    stats = rank0.pusher.push(buckets, learner.version)
    return float(stats.get("seconds", 0.0))


RESYNC_ATTEMPTS = 3
"""Pushes in a row that may fail (an engine died midway) before the learner gives up."""


def _next_batch(
    learner: Learner, rank0: _Rank0 | None, has_pusher: bool, bucket_bytes: int
) -> tuple[Batch | None, float, float, int]:
    """Wait for the next batch (rank 0 asks the buffer, every rank waits with it); (the batch on
    rank 0, seconds waited, seconds spent pushing meanwhile, pushes made). While it waits, an
    engine that restarted or came back gets the current weights at once: a generator leaves an
    engine behind the learner out until it serves the learner's version, so with the resync only
    after the next step, an engine restarted while the buffer was empty stopped the run."""
    t0, resync_s, resyncs = time.perf_counter(), 0.0, 0
    next_log = WAIT_LOG_S
    while True:
        batch = rank0.poll_batch() if rank0 is not None else None
        if _broadcast_flag(batch is not None):
            return batch, time.perf_counter() - t0 - resync_s, resync_s, resyncs
        if has_pusher:
            seconds, n = _resync(learner, rank0, bucket_bytes)
            resync_s, resyncs = resync_s + seconds, resyncs + n
        waited = time.perf_counter() - t0
        if rank0 is not None and waited >= next_log:
            next_log += WAIT_LOG_S
            _report_wait(learner, rank0, waited)


WAIT_LOG_S = 60.0
"""While the learner waits for a batch, what the buffer holds is logged this often."""


def _report_wait(learner: Learner, rank0: _Rank0, waited: float) -> None:
    """Log what a long wait for a batch waits on; with buffer.fixed_lag past its timeout, stop
    (no group of the version the batch needs will come)."""
    try:
        st = rank0.consumer.stats()
    except Exception as e:  # the buffer does not answer: say so, keep waiting
        log.warning("waited %.0fs for a batch; the buffer's stats did not come: %s", waited, e)
        return
    need = rank0.cfg.learner.groups_per_step
    fixed = rank0.cfg.buffer.fixed_lag
    log.warning(
        "waited %.0fs for a batch of %d groups at version %d: the buffer holds %d ready, %d "
        "pending, %d grants outstanding, %d producers%s",
        waited,
        need,
        learner.version,
        st.get("groups_ready", 0),
        st.get("groups_pending", 0),
        st.get("grants_outstanding", 0),
        st.get("producers", 0),
        f"; buffer.fixed_lag = {fixed}: {st.get('fixed_lag')}" if fixed is not None else "",
    )
    limit = rank0.cfg.buffer.fixed_lag_timeout_s
    if fixed is not None and waited > limit:
        raise RuntimeError(
            f"buffer.fixed_lag = {fixed}: no batch of version {max(0, learner.version - fixed)} within "
            f"buffer.fixed_lag_timeout_s = {limit:.0f}s (the buffer holds "
            f"{st.get('groups_ready', 0)} ready groups)"
        )


def _resync(learner: Learner, rank0: _Rank0 | None, bucket_bytes: int) -> tuple[float, int]:
    """Push again while the pusher asks for it (an engine restarted, came back, or a push failed
    midway): the group is rebuilt with the live engines and they get the current weights.
    Returns the seconds spent and the pushes made (after one, the engines hold learner.version)."""
    seconds = 0.0
    for attempt in range(RESYNC_ATTEMPTS + 1):
        needed = rank0 is not None and rank0.pusher is not None and rank0.pusher.resync_needed()
        if not _broadcast_flag(needed):
            return seconds, attempt
        if attempt == RESYNC_ATTEMPTS:
            raise RuntimeError(f"the weight push failed {RESYNC_ATTEMPTS} times in a row")
        log.warning("weight resync of version %d (attempt %d)", learner.version, attempt + 1)
        seconds += _push(learner, rank0, bucket_bytes)
    return seconds, RESYNC_ATTEMPTS


def _broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _broadcast_flag(value: bool) -> bool:
    """Rank 0's `value` on every rank."""
    return bool(_broadcast_object(value))


def _buffer_drop_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The buffer's stale drops so far (count, mean length and reward of their trajectories)."""
    d = stats.get("dropped_stale") or {}
    return {
        M.BUFFER_DROPPED_ALL: float(sum((stats.get("dropped") or {}).values())),
        M.BUFFER_DROPPED_GROUPS: float(d.get("groups", 0)),
        M.BUFFER_DROPPED_LEN: float(d.get("mean_response_len", 0.0)),
        M.BUFFER_DROPPED_REWARD: float(d.get("mean_reward", 0.0)),
    }


def _train(
    cfg: SlimeConfig,
    learner: Learner,
    rank0: _Rank0 | None,
    save_dir: Path | None,
    has_pusher: bool,
    gc_watch: GcWatch,
) -> int:
    lc = cfg.learner
    pushed = learner.version  # what the engines hold (pushed at start-up when > 0)
    gc_mark = sum(gc_watch.seconds)  # collection seconds up to the last record
    while learner.step < lc.num_steps:
        t_step = time.perf_counter()
        info, given = {}, None
        batch, waited, push_s, resyncs = _next_batch(
            learner, rank0, has_pusher, cfg.push.bucket_bytes
        )
        if resyncs:
            pushed = learner.version
        if rank0 is not None:
            given = train_groups(batch)
            info = batch_metrics(given)
        groups = _scatter_groups(learner, given)
        if given:
            # Fixed lag k means learner_min == learner_max == k.
            info.update(_learner_lags(learner.line, learner.version, given))
        t_train = time.perf_counter()
        m = learner.train_step(groups)
        train_s = time.perf_counter() - t_train
        token_rec = learner.take_token_record()
        if token_rec is not None and rank0 is not None and rank0.run_dir is not None:
            token_record.write(
                rank0.run_dir, learner.step, learner.version, token_rec, lc.token_record_keep
            )
        last = learner.step == lc.num_steps
        due = learner.step % cfg.push.interval == 0 or last
        holds: dict[str, float] = {}
        if has_pusher and due and learner.version != pushed:
            if rank0 is not None:  # the other ranks wait in the export's collectives
                holds = _hold_push(cfg, rank0, pushed)
            push_s += _push(learner, rank0, cfg.push.bucket_bytes)
            pushed = learner.version
        if has_pusher:  # a failed push, or an engine that restarted: the current weights again
            resync_s, resyncs = _resync(learner, rank0, cfg.push.bucket_bytes)
            push_s += resync_s
            if resyncs:
                pushed = learner.version
        if rank0 is not None:
            # Announce the version the engines hold as soon as they hold it: admission opens
            # again. Without engines to lag behind, the learner's own version.
            # The line too, every time: a buffer restarted without its log learns it again.
            rank0.consumer.set_version(
                pushed if has_pusher else learner.version,
                lc.groups_per_step,
                learner.line.to_list(),
            )
            if pushed == learner.version:
                _request_eval(cfg, rank0, learner, has_pusher, last)
            if m.get(M.BATCH_SKIPPED):
                # Nothing of this batch reached the weights: retire it now, or it would hold
                # admission's budget until the next version (which it did not make).
                rank0.consumer.commit(batch.batch_id)
            step_s = time.perf_counter() - t_step
            record = {
                **info,
                **_buffer_drop_metrics(rank0.consumer.stats()),
                **rank0.next_record,
                **holds,
                **{k: v for k, v in m.items() if isinstance(v, int | float)},
                M.VERSION: learner.version,
                M.LINE_POSITION: learner.line.position(learner.version),
                M.LEARNER_WAIT_S: waited,
                M.LEARNER_WAIT_PCT: 100.0 * waited / max(step_s, 1e-9),
                M.TRAIN_SECONDS: train_s,
                M.TRAIN_TOKENS_PER_S: m.get(M.TOKENS, 0.0) / max(train_s, 1e-9),
                M.PUSH_S: push_s,
                **(rank0.pusher.metrics() if rank0.pusher is not None else {}),
                M.STEP_SECONDS: step_s,
                M.LEARNER_GC_S: sum(gc_watch.seconds) - gc_mark,
                M.LEARNER_GC_LONG: float(gc_watch.long),
            }
            gc_mark = sum(gc_watch.seconds)
            rank0.next_record = {}
            if rank0.metrics is not None:
                rank0.metrics.log(learner.step, record)
            log.info(
                "step %d reward %.3f acc %.3f staleness %.2f loss %.4f clip %.4f wait %.0f%% "
                "push %.2fs",
                learner.step,
                record.get(M.REWARD, 0.0),
                record.get(M.ACCURACY, 0.0),
                record.get(M.STALENESS_MEAN, 0.0),
                record.get(M.LOSS, 0.0),
                record.get(M.CLIP_FRAC, 0.0),
                record[M.LEARNER_WAIT_PCT],
                push_s,
            )
        last = learner.step == lc.num_steps
        checkpoint = save_dir is not None and (
            last or (lc.save_interval and learner.step % lc.save_interval == 0)
        )
        if checkpoint:
            # Every batch delivered so far is trained on: the cursor is exactly this step's.
            cursor = rank0.consumer.cursor() if rank0 is not None else 0
            n_hf = lc.save_hf_interval
            t_save = time.perf_counter()
            path = learner.save_checkpoint(
                save_dir / f"step_{learner.step}",
                extra={"buffer_cursor": cursor, "lineage": learner.line.to_list()},
                hf=bool(n_hf) and (last or learner.step % n_hf == 0),
            )
            save_s = time.perf_counter() - t_save
            if rank0 is not None:
                log.info("checkpoint %s written in %.2f s", path, save_s)
                rank0.next_record[M.CHECKPOINT_S] = save_s  # the save follows this step's record
        if rank0 is not None and (checkpoint or not lc.save_interval):
            # Commit what a checkpoint now holds; without mid-run checkpoints commit at once
            # (a crash would restart from scratch anyway).
            rank0.consumer.commit_through(batch.batch_id)
    if rank0 is not None and rank0.eval_pending is not None:
        _wait_eval(cfg, rank0)  # the last version's evaluation, before the run ends
    return 0


def _request_eval(
    cfg: SlimeConfig, rank0: _Rank0, learner: Learner, has_pusher: bool, last: bool
) -> None:
    """Ask generator 0 to evaluate the version the engines now hold, when it is due
    (eval.interval, and the last version): see slime_async/utils/eval_pin.py."""
    n, v = cfg.eval.interval, learner.version
    position = learner.line.position(v)  # due by updates made, whatever restarts skipped
    if not n or not (position % n == 0 or last) or rank0.eval_pending == v:
        return
    if rank0.run_dir is None or not has_pusher:
        log.warning(
            "eval.interval = %d: no evaluation without a run directory and engines to push to",
            n,
        )
        return
    request = {"version": v, "step": learner.step, "position": position}
    write_json_atomic(request_path(rank0.run_dir, v), request)
    rank0.eval_pending = v
    log.info("pinned evaluation of version %d requested (step %d)", v, learner.step)


def _wait_eval(cfg: SlimeConfig, rank0: _Rank0) -> tuple[float, dict[str, Any]]:
    """Block until the requested evaluation has its result; the seconds waited, the result."""
    v, t0 = rank0.eval_pending, time.perf_counter()
    limit = cfg.eval.hold_timeout_s
    while (result := read_result(rank0.run_dir, v)) is None:
        if time.perf_counter() - t0 > limit:
            raise RuntimeError(
                f"pinned evaluation of version {v}: no {request_path(rank0.run_dir, v).name} "
                f"answer (eval/result_v{v}.json) within eval.hold_timeout_s = {limit}s; is "
                "generator 0 running (it evaluates)?"
            )
        time.sleep(0.05)
    rank0.eval_pending = None
    log.info("pinned evaluation of version %d: %s", v, result.get("status"))
    return time.perf_counter() - t0, result


def _hold_push(cfg: SlimeConfig, rank0: _Rank0, serving: int) -> dict[str, float]:
    """Before the engines leave version `serving`: wait for its pinned evaluation, and with
    buffer.fixed_lag for the groups generated at it (none of them may cross the update). The
    last push too: with a lag > 0 the run never trains those groups, but a rollout still running
    at `serving` would cross the update and be dropped. The generators fill the last quota like
    any other: they run until the learner has finished (unless generator.num_epochs ends their
    data first: the timeout's error asks)."""
    out: dict[str, float] = {}
    if rank0.eval_pending is not None:
        out[M.EVAL_HOLD_S], result = _wait_eval(cfg, rank0)
        # The evaluated version's numbers ride on this step's record too (eval/version names it).
        out.update(
            {k: v for k, v in (result.get("metrics") or {}).items() if isinstance(v, int | float)}
        )
    if cfg.buffer.fixed_lag is not None:
        t0, limit = time.perf_counter(), cfg.buffer.fixed_lag_timeout_s
        while True:
            fl = rank0.consumer.stats().get("fixed_lag") or {}
            if fl.get("version") != serving or fl.get("arrived", 0) >= fl.get("quota", 0):
                break
            if time.perf_counter() - t0 > limit:
                raise RuntimeError(
                    f"buffer.fixed_lag: {fl.get('arrived')} of the {fl.get('quota')} groups of "
                    f"version {serving} arrived within buffer.fixed_lag_timeout_s = {limit}s "
                    "(every version's groups are generated, the last one's too: did the "
                    "generators stop, or run out of data with generator.num_epochs?)"
                )
            time.sleep(0.02)
        out[M.FIXED_LAG_WAIT_S] = time.perf_counter() - t0
    return out
