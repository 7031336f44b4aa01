"""`slime-async inspect RUN_DIR`: what the learner trained, decoded from the run's write-ahead log
and the learner's token records.

The buffer's write-ahead log (`<run_dir>/<buffer.wal_dir>`, format in `queue/wal/`) records every
group put (the trajectories as the generator sent them), every batch delivered to the learner
(its group ids; the learner trains batch N at step N) with the policy version announced before
it, and every commit. An index of it (`queue/wal_index.py`, cached beside the log and brought up
to date from the segments that changed) gives the step table without decoding the log; a step or
a group decodes only the records that hold its groups. Shown per step: the groups of the batch,
the prompt, the model and environment segments of each response (told apart by the loss mask),
per-token policy versions and behaviour log-probs, the reward and its parts, the temperature,
each group's staleness (version at delivery minus its oldest model token's version, the
learner's own measure), and the step's gradient norm (`metrics/learner.jsonl`).

Where the learner recorded the step (`token_records/step_N.npz`, `learner.token_record_interval`)
each token also shows its advantage, the learner's log-prob (pi_theta as the loss last saw it),
the ratio pi_theta / mu to the engine's log-prob, and its gradient size: |d loss / d logp| x
(1 - p), within a factor sqrt(2) of the norm of the loss's gradient at that token's logits
(`--top-grad`: the tokens that move the weights most; `--top-ratio`: the most off-policy ones).

    slime-async inspect runs/quickstart-...                  # one line per step
    slime-async inspect runs/quickstart-... --step 12        # step 12's groups, decoded
    slime-async inspect runs/quickstart-... --group gen0/e0/o17   # every token of one group
    slime-async inspect runs/quickstart-... --top-grad 10    # the 10 largest gradients, all steps
    slime-async inspect runs/quickstart-... --step 152 --top-ratio 10
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
    top = p.add_mutually_exclusive_group()
    top.add_argument(
        "--top-grad",
        type=int,
        metavar="K",
        help="the K tokens with the largest gradient (of --step N, else of every recorded step)",
    )
    top.add_argument(
        "--top-ratio",
        type=int,
        metavar="K",
        help="the K model tokens furthest off-policy: largest |log pi_theta / mu|",
    )


@dataclass
class Log:
    """What the write-ahead log says was put, delivered and committed, through its index;
    trajectories are decoded only for the groups asked for (`load`)."""

    wal_dir: Path
    index: Any
    """queue.wal_index.WalIndex"""
    groups: dict[str, list[Any]] = field(default_factory=dict)
    """group id -> its trajectories (queue.schema.Trajectory), as put, once loaded."""

    @property
    def steps(self) -> dict[int, Any]:
        return self.index.steps

    @property
    def dropped(self) -> dict[str, str]:
        return self.index.dropped

    @property
    def first_batch(self) -> int | None:
        return self.index.first_batch

    def load(self, group_ids: list[str]) -> None:
        from slime_async.queue.wal_index import read_groups

        missing = [g for g in group_ids if g not in self.groups]
        if missing:
            self.groups.update(read_groups(self.wal_dir, self.index, missing))


def read_log(wal_dir: Path) -> Log:
    """The write-ahead log in `wal_dir`, read-only, through its (cached) index."""
    from slime_async.queue.wal_index import load_index

    return Log(wal_dir, load_index(wal_dir))


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


def learner_tokens(rec: dict[str, Any] | None, i: int) -> dict[str, float] | None:
    """Token `i` of a trajectory's token record: what the learner saw of it."""
    if rec is None:
        return None
    import numpy as np

    from slime_async.actors.learner.token_record import grad_size

    logp, mu = float(rec["logp"][i]), float(rec["behavior_logp"][i])
    return {
        "advantage": float(rec["advantage"][i]),
        "learner_logprob": logp,
        "prox_logprob": float(rec["prox_logp"][i]),
        "ratio": float(np.exp(logp - mu)) if rec["loss_mask"][i] else None,
        "grad": float(rec["grad"][i]),
        "grad_size": float(grad_size(rec["grad"][i : i + 1], rec["logp"][i : i + 1])[0]),
    }


def trajectory_record(
    t: Any, dec: Decoder, tokens: bool, rec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`rec`: the trajectory's token record (`actors/learner/token_record.py`), or None."""
    import numpy as np

    from slime_async.actors.learner.token_record import grad_size

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
            if rec is not None:
                seg["mean_learner_logprob"] = float(rec["logp"][a:b].mean())
        segs.append(seg)
    out = {
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
        "recorded": rec is not None,
    }
    if rec is not None:
        model = rec["loss_mask"].astype(bool)
        ratio = np.exp(rec["logp"] - rec["behavior_logp"])[model]
        out["advantage"] = float(rec["advantage"][model].mean()) if model.any() else None
        out["ratio_max"] = float(ratio.max()) if ratio.size else None
        out["grad_size_max"] = float(grad_size(rec["grad"], rec["logp"]).max())
    if tokens:
        out["tokens"] = [
            {
                "id": int(tid),
                "text": dec.token(int(tid)),
                "loss_mask": int(m),
                "version": int(v),
                "logprob": float(lp),
                **(learner_tokens(rec, i) or {}),
            }
            for i, (tid, m, v, lp) in enumerate(
                zip(t.response_ids, t.loss_mask, t.versions, t.logprobs, strict=True)
            )
        ]
    return out


class Records:
    """The learner's token records of the run, read once per step asked for."""

    def __init__(self, run_dir: Path):
        from slime_async.actors.learner import token_record

        self._tr = token_record
        self.run_dir = run_dir
        self.steps = token_record.recorded_steps(run_dir)
        self._cache: dict[int, dict[str, dict[str, Any]] | None] = {}

    def of(self, step: int | None) -> dict[str, dict[str, Any]]:
        """trajectory id -> its per-token arrays at `step` (empty: not recorded)."""
        if step is None:
            return {}
        if step not in self._cache:
            rec = self._tr.read(self.run_dir, step)
            self._cache[step] = self._tr.per_trajectory(rec) if rec is not None else None
        return self._cache[step] or {}


def group_record(
    log: Log, gid: str, step: Any, dec: Decoder, tokens: bool, records: Records
) -> dict:
    log.load([gid])
    trajs = log.groups.get(gid, [])
    oldest = oldest_model_version(trajs)
    staleness = step.version - oldest if step is not None and oldest is not None else None
    recs = records.of(step.batch_id if step is not None else None)
    return {
        "group_id": gid,
        "step": step.batch_id if step is not None else None,
        "delivered_at_version": step.version if step is not None else None,
        "staleness": staleness,
        "dropped": log.dropped.get(gid),
        "trajectories": [trajectory_record(t, dec, tokens, recs.get(t.id)) for t in trajs],
    }


def step_summary(log: Log, s: Any, grad_norms: dict[int, float]) -> dict[str, Any]:
    """One row of the step table, from the index alone."""
    infos = [log.index.groups[g] for g in s.group_ids if g in log.index.groups]
    stale = [s.version - g.oldest for g in infos if g.oldest is not None]
    n = sum(g.n for g in infos)
    return {
        "step": s.batch_id,
        "delivered_at_version": s.version,
        "committed": s.committed,
        "groups": len(s.group_ids),
        "trajectories": n,
        "reward_mean": sum(g.reward for g in infos) / n if n else None,
        "model_tokens": int(sum(g.model_tokens for g in infos)),
        "staleness_max": max(stale, default=None),
        "staleness_mean": sum(stale) / len(stale) if stale else None,
        "grad_norm": grad_norms.get(s.batch_id),
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
    if r["recorded"]:
        print(
            f"    learner: advantage {_fmt(r['advantage'], '+.3f')}, ratio pi/mu max "
            f"{_fmt(r['ratio_max'], '.3f')}, gradient size max {_fmt(r['grad_size_max'], '.3g')}"
        )
    print(f"    [prompt, {r['prompt_tokens']} tokens] {r['prompt']!r}")
    for s in r["segments"]:
        n = s["end"] - s["start"]
        vs = s["versions"]
        ver = f"v{vs[0]}" if len(vs) == 1 else f"v{vs[0]}..v{vs[-1]}"
        if s["kind"] == "model":
            extra = f", {ver}, mean log-prob {s['mean_logprob']:.3f}"
            if "mean_learner_logprob" in s:
                extra += f" (learner {s['mean_learner_logprob']:.3f})"
        else:
            extra = ", loss mask 0"
        print(f"    [{s['kind']}, {n} tokens{extra}] {s['text']!r}")
    if tokens:
        learner = r["recorded"]
        head = "      pos  mask  version  log-prob"
        if learner:
            head += "  learner    ratio  advantage  grad size"
        print(head + "  token")
        for i, tk in enumerate(r["tokens"]):
            line = f"      {i:>3}  {tk['loss_mask']:>4}  {tk['version']:>7}  {tk['logprob']:>8.4f}"
            if learner:
                line += (
                    f"  {tk['learner_logprob']:>7.4f}  {_fmt(tk['ratio'], '>7.3f')}"
                    f"  {tk['advantage']:>+9.4f}  {tk['grad_size']:>9.3g}"
                )
            print(line + f"  {tk['text']!r} ({tk['id']})")


def learner_grad_norms(run_dir: Path) -> dict[int, float]:
    """step -> the step's gradient norm, from metrics/learner.jsonl."""
    from slime_async.metrics import GRAD_NORM, metrics_path, read_metrics

    return {
        r["step"]: r[GRAD_NORM]
        for r in read_metrics(metrics_path(run_dir, "learner"))
        if isinstance(r.get(GRAD_NORM), int | float)
    }


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
    records = Records(run_dir)
    gone = (
        f"steps 1-{log.first_batch - 1} were compacted out of the log"
        if log.first_batch and log.first_batch > 1
        else ""
    )
    if args.top_grad is not None or args.top_ratio is not None:
        from slime_async.commands.inspect_top import show_top

        return show_top(args, log, records, Decoder(cfg), learner_grad_norms(run_dir))
    if args.group:
        step = next((s for s in log.steps.values() if args.group in s.group_ids), None)
        if args.group not in log.index.groups:
            raise ConfigError(f"group {args.group!r} is not in the log ({gone or 'never put'})")
        dec = Decoder(cfg)
        rec = group_record(log, args.group, step, dec, tokens=True, records=records)
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
    grad_norms = learner_grad_norms(run_dir)
    if args.step is not None:
        s = log.steps.get(args.step)
        if s is None:
            known = f"{min(log.steps)}-{max(log.steps)}" if log.steps else "none"
            raise ConfigError(f"step {args.step} is not in the log (steps there: {known}) {gone}")
        summary = step_summary(log, s, grad_norms)
        shown = s.group_ids if args.json else s.group_ids[: args.max_groups]
        log.load(shown)
        dec = Decoder(cfg)
        groups = [group_record(log, g, s, dec, args.json, records) for g in shown]
        if args.json:
            print(json.dumps({**summary, "group_records": groups}, indent=2))
            return 0
        print(
            f"step {s.batch_id}: {summary['groups']} groups, {summary['trajectories']} "
            f"trajectories, delivered at policy version {s.version}"
            f"{', committed' if s.committed else ''}; reward {_fmt(summary['reward_mean'])}, "
            f"staleness mean {_fmt(summary['staleness_mean'], '.2f')} max "
            f"{_fmt(summary['staleness_max'], 'd')}, grad norm {_fmt(summary['grad_norm'], '.4g')}"
            + ("" if s.batch_id in records.steps else " (no token record of this step)")
        )
        for g in groups:
            print(f"group {g['group_id']}: staleness {_fmt(g['staleness'], 'd')}")
            for r in g["trajectories"]:
                _print_traj(r, tokens=False)
        if len(s.group_ids) > args.max_groups:
            more = len(s.group_ids) - args.max_groups
            print(f"... {more} more groups (--max-groups, or --group ID)")
        return 0
    rows = [
        step_summary(log, s, grad_norms)
        for s in sorted(log.steps.values(), key=lambda s: s.batch_id)
    ]
    if args.json:
        print(json.dumps({"wal_dir": str(wal_dir), "note": gone, "steps": rows}, indent=2))
        return 0
    print(f"{run_dir}: {len(rows)} steps in {wal_dir}" + (f" ({gone})" if gone else ""))
    print(
        "step  version  groups  trajs  reward  model tokens  staleness mean/max  grad norm  "
        "committed"
    )
    for r in rows:
        print(
            f"{r['step']:>4}  {r['delivered_at_version']:>7}  {r['groups']:>6}  "
            f"{r['trajectories']:>5}  {_fmt(r['reward_mean']):>6}  {r['model_tokens']:>12}  "
            f"{_fmt(r['staleness_mean'], '.2f'):>9} / {_fmt(r['staleness_max'], 'd'):<6}  "
            f"{_fmt(r['grad_norm'], '.4g'):>9}  {'yes' if r['committed'] else 'no'}"
        )
    if grad_norms:
        top = max(grad_norms, key=lambda k: grad_norms[k])
        print(
            f"largest grad norm: {grad_norms[top]:.4g} at step {top}; its tokens: "
            f"slime-async inspect {run_dir} --step {top} --top-grad 10"
        )
    return 0
