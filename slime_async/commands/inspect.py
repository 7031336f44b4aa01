"""`slime-async inspect RUN_DIR`: what the learner trained, decoded from the run's write-ahead log.

The buffer's write-ahead log (`<run_dir>/<buffer.wal_dir>`, format in `queue/wal.py`) records every
group put (the trajectories as the generator sent them), every batch delivered to the learner
(its group ids; the learner trains batch N at step N) with the policy version announced before
it, and every commit. This command replays it read-only and shows, per step, the groups of the
batch: the prompt, the model and environment segments of each response (told apart by the loss
mask), per-token policy versions and behaviour log-probs, the reward and its parts, the
temperature, and each group's staleness (version at delivery minus its oldest model token's
version, the learner's own measure).

    slime-async inspect runs/quickstart-...                  # one line per step
    slime-async inspect runs/quickstart-... --step 12        # step 12's groups, decoded
    slime-async inspect runs/quickstart-... --group gen0/e0/o17   # every token of one group
    slime-async inspect runs/quickstart-... --step 12 --json # the same for scripts

Segments whose groups were committed and compacted away (`buffer.wal_segment_bytes`) are gone
from the log; the command says which steps it can no longer show.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELP = "show what the learner trained in a run, decoded from its write-ahead log"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.json)")
    p.add_argument("--step", type=int, help="show this learner step's batch in full")
    p.add_argument("--group", help="show every token of this group (e.g. gen0/e0/o17)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--max-groups", type=int, default=4, help="groups shown per step in text (default 4)"
    )


@dataclass
class Step:
    """One delivered batch: the learner trains batch N at step N."""

    batch_id: int
    group_ids: list[str]
    version: int
    """Policy version the learner had announced when the batch was delivered."""
    committed: bool = False


@dataclass
class Log:
    """What the write-ahead log says was put, delivered and committed."""

    steps: dict[int, Step] = field(default_factory=dict)
    groups: dict[str, list[Any]] = field(default_factory=dict)
    """group id -> its trajectories (queue.schema.Trajectory), as put."""
    dropped: dict[str, str] = field(default_factory=dict)
    first_batch: int | None = None
    """The first batch id the log still knows about (earlier ones were compacted away)."""


def read_log(wal_dir: Path) -> Log:
    """Replay the write-ahead log in `wal_dir` read-only."""
    from slime_async.queue import wal as W
    from slime_async.queue.groups import unscoped
    from slime_async.queue.schema import decode_trajectory

    out = Log()
    version = 0
    reader = W.WriteAheadLog(wal_dir, "none", 1 << 62, snapshot=dict)
    for rtype, meta, blobs in reader.replay():
        if rtype == W.SNAPSHOT:
            version = int(meta.get("version", version))
            if out.first_batch is None:
                out.first_batch = int(meta.get("next_batch", 1))
        elif rtype == W.VERSION:
            version = int(meta["version"])
        elif rtype == W.PUT:
            for blob in blobs:
                t = decode_trajectory(blob)
                out.groups.setdefault(t.group_id, []).append(t)
        elif rtype == W.DELIVER:
            b = int(meta["batch"])
            if meta.get("g") and b not in out.steps:  # a redelivery repeats no group ids
                out.steps[b] = Step(b, [unscoped(k)[1] for k in meta["g"]], version)
        elif rtype == W.COMMIT:
            if int(meta["batch"]) in out.steps:
                out.steps[int(meta["batch"])].committed = True
        elif rtype == W.DROP:
            for key in meta["g"]:
                out.dropped[unscoped(key)[1]] = str(meta.get("why", ""))
    return out


def segments(t: Any) -> list[dict[str, Any]]:
    """The response as runs of equal loss mask: model (1) and env (0) segments, in order."""
    mask = [int(m) for m in t.loss_mask]
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append({"kind": "model" if mask[start] else "env", "start": start, "end": i})
            start = i
    return out


def oldest_model_version(trajs: list[Any]) -> int | None:
    vs = [v for t in trajs if (v := t.oldest_version()) is not None]
    return min(vs) if vs else None


class Decoder:
    """Token ids -> text with the model's tokenizer (ids as text when it cannot be loaded)."""

    def __init__(self, cfg: Any):
        from slime_async.actors.generator.process import tokenizer_path
        from slime_async.models.tokenizer import load_tokenizer

        self.tok = None
        self.problem = ""
        try:
            self.tok = load_tokenizer(tokenizer_path(cfg))
        except Exception as e:  # a moved model directory: still show the ids
            self.problem = f"{type(e).__name__}: {e}"

    def text(self, ids: Any) -> str:
        ids = [int(i) for i in ids]
        if self.tok is None:
            return " ".join(map(str, ids))
        return self.tok.decode(ids, skip_special_tokens=False)

    def token(self, i: int) -> str:
        return self.text([i])


def trajectory_record(t: Any, dec: Decoder, tokens: bool) -> dict[str, Any]:
    segs = []
    for s in segments(t):
        a, b = s["start"], s["end"]
        seg = {
            **s,
            "text": dec.text(t.response_ids[a:b]),
            "versions": sorted({int(v) for v in t.versions[a:b]}),
        }
        if s["kind"] == "model":
            seg["mean_logprob"] = float(t.logprobs[a:b].mean())
        segs.append(seg)
    rec = {
        "id": t.id,
        "reward": float(t.reward),
        "reward_parts": dict(t.reward_parts),
        "finish_reason": t.finish_reason,
        "temperature": t.temperature,
        "engine_id": t.engine_id,
        "prompt": dec.text(t.prompt_ids),
        "prompt_tokens": len(t.prompt_ids),
        "model_tokens": int(t.loss_mask.sum()),
        "env_tokens": int(len(t.loss_mask) - t.loss_mask.sum()),
        "oldest_version": t.oldest_version(),
        "metadata": dict(t.metadata),
        "segments": segs,
    }
    if tokens:
        rec["tokens"] = [
            {
                "id": int(tid),
                "text": dec.token(int(tid)),
                "loss_mask": int(m),
                "version": int(v),
                "logprob": float(lp),
            }
            for tid, m, v, lp in zip(
                t.response_ids, t.loss_mask, t.versions, t.logprobs, strict=True
            )
        ]
    return rec


def group_record(log: Log, gid: str, step: Step | None, dec: Decoder, tokens: bool) -> dict:
    trajs = log.groups.get(gid, [])
    oldest = oldest_model_version(trajs)
    staleness = step.version - oldest if step is not None and oldest is not None else None
    return {
        "group_id": gid,
        "step": step.batch_id if step is not None else None,
        "delivered_at_version": step.version if step is not None else None,
        "staleness": staleness,
        "dropped": log.dropped.get(gid),
        "trajectories": [trajectory_record(t, dec, tokens) for t in trajs],
    }


def step_summary(log: Log, s: Step) -> dict[str, Any]:
    trajs = [t for gid in s.group_ids for t in log.groups.get(gid, [])]
    stale = [
        s.version - o
        for gid in s.group_ids
        if (o := oldest_model_version(log.groups.get(gid, []))) is not None
    ]
    rewards = [float(t.reward) for t in trajs]
    return {
        "step": s.batch_id,
        "delivered_at_version": s.version,
        "committed": s.committed,
        "groups": len(s.group_ids),
        "trajectories": len(trajs),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "model_tokens": int(sum(int(t.loss_mask.sum()) for t in trajs)),
        "staleness_max": max(stale, default=None),
        "staleness_mean": sum(stale) / len(stale) if stale else None,
    }


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _print_traj(r: dict, tokens: bool) -> None:
    parts = ", ".join(f"{k} {v:g}" for k, v in r["reward_parts"].items())
    print(
        f"  trajectory {r['id']}: reward {r['reward']:.3f}"
        + (f" ({parts})" if parts else "")
        + f", finish {r['finish_reason']}, temperature {_fmt(r['temperature'], 'g')}, "
        f"{r['model_tokens']} model + {r['env_tokens']} env tokens"
    )
    print(f"    [prompt, {r['prompt_tokens']} tokens] {r['prompt']!r}")
    for s in r["segments"]:
        n = s["end"] - s["start"]
        vs = s["versions"]
        ver = f"v{vs[0]}" if len(vs) == 1 else f"v{vs[0]}..v{vs[-1]}"
        if s["kind"] == "model":
            extra = f", {ver}, mean log-prob {s['mean_logprob']:.3f}"
        else:
            extra = ", loss mask 0"
        print(f"    [{s['kind']}, {n} tokens{extra}] {s['text']!r}")
    if tokens:
        print("      pos  mask  version  log-prob  token")
        for i, tk in enumerate(r["tokens"]):
            print(
                f"      {i:>3}  {tk['loss_mask']:>4}  {tk['version']:>7}  {tk['logprob']:>8.4f}"
                f"  {tk['text']!r} ({tk['id']})"
            )


def main(args: argparse.Namespace) -> int:
    from slime_async.config import ConfigError, SlimeConfig

    run_dir = Path(args.run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.json)")
    cfg = SlimeConfig.read_json(cfg_path)
    cfg.run.run_dir = str(run_dir.resolve())  # the directory may have moved since
    wal_dir = cfg.paths().wal_dir
    if wal_dir is None or not wal_dir.is_dir():
        raise ConfigError(
            f"{run_dir}: this run kept no write-ahead log (buffer.wal_dir = "
            f"{cfg.buffer.wal_dir!r}), so nothing records what the learner trained; "
            'set buffer.wal_dir (e.g. "wal") to keep it'
        )
    from slime_async.queue.wal import WalFormatError

    try:
        log = read_log(wal_dir)
    except WalFormatError as e:
        raise ConfigError(str(e)) from None
    dec = Decoder(cfg)
    gone = (
        f"steps 1-{log.first_batch - 1} were compacted out of the log"
        if log.first_batch and log.first_batch > 1
        else ""
    )
    if args.group:
        step = next((s for s in log.steps.values() if args.group in s.group_ids), None)
        if args.group not in log.groups:
            raise ConfigError(f"group {args.group!r} is not in the log ({gone or 'never put'})")
        rec = group_record(log, args.group, step, dec, tokens=True)
        if args.json:
            print(json.dumps(rec, indent=2))
            return 0
        trained = f"trained at step {rec['step']}" if step is not None else "not delivered"
        print(
            f"group {args.group}: {trained}, staleness {_fmt(rec['staleness'], 'd')}"
            + (f", dropped ({rec['dropped']})" if rec["dropped"] else "")
        )
        for r in rec["trajectories"]:
            _print_traj(r, tokens=True)
        return 0
    if args.step is not None:
        s = log.steps.get(args.step)
        if s is None:
            known = f"{min(log.steps)}-{max(log.steps)}" if log.steps else "none"
            raise ConfigError(f"step {args.step} is not in the log (steps there: {known}) {gone}")
        summary = step_summary(log, s)
        groups = [group_record(log, g, s, dec, tokens=args.json) for g in s.group_ids]
        if args.json:
            print(json.dumps({**summary, "group_records": groups}, indent=2))
            return 0
        print(
            f"step {s.batch_id}: {summary['groups']} groups, {summary['trajectories']} "
            f"trajectories, delivered at policy version {s.version}"
            f"{', committed' if s.committed else ''}; reward {_fmt(summary['reward_mean'])}, "
            f"staleness mean {_fmt(summary['staleness_mean'], '.2f')} max "
            f"{_fmt(summary['staleness_max'], 'd')}"
        )
        for g in groups[: args.max_groups]:
            print(f"group {g['group_id']}: staleness {_fmt(g['staleness'], 'd')}")
            for r in g["trajectories"]:
                _print_traj(r, tokens=False)
        if len(groups) > args.max_groups:
            print(f"... {len(groups) - args.max_groups} more groups (--max-groups, or --group ID)")
        return 0
    rows = [step_summary(log, s) for s in sorted(log.steps.values(), key=lambda s: s.batch_id)]
    if args.json:
        print(json.dumps({"wal_dir": str(wal_dir), "note": gone, "steps": rows}, indent=2))
        return 0
    print(f"{run_dir}: {len(rows)} steps in {wal_dir}" + (f" ({gone})" if gone else ""))
    if dec.problem:
        print(f"(token ids shown as numbers: tokenizer not loaded: {dec.problem})")
    print("step  version  groups  trajs  reward  model tokens  staleness mean/max  committed")
    for r in rows:
        print(
            f"{r['step']:>4}  {r['delivered_at_version']:>7}  {r['groups']:>6}  "
            f"{r['trajectories']:>5}  {_fmt(r['reward_mean']):>6}  {r['model_tokens']:>12}  "
            f"{_fmt(r['staleness_mean'], '.2f'):>9} / {_fmt(r['staleness_max'], 'd'):<6}  "
            f"{'yes' if r['committed'] else 'no'}"
        )
    return 0
