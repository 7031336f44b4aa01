"""`slime-async inspect RUN_DIR --top-grad K | --top-ratio K [--step N]`: the tokens behind a
gradient spike, from the learner's token records (`actors/learner/token_record.py`).

`--top-grad` ranks the model tokens of the recorded steps (or of step N) by gradient size,
|d loss / d logp| x (1 - p), within sqrt(2) of the norm of the loss's gradient at the token's
logits: the tokens that pushed the weights hardest. `--top-ratio` ranks them by how far the
learner's log-prob is from the engine's, |log pi_theta - log mu|: the most off-policy tokens.
Each token is shown with its step (and the step's gradient norm), trajectory, position, text and
the text just before it, both log-probs, the ratio and the advantage; only the trajectories of
the tokens shown are decoded from the write-ahead log.
"""

from __future__ import annotations

import argparse
import heapq
import json
from typing import Any

CONTEXT_TOKENS = 8


def show_top(
    args: argparse.Namespace, log: Any, records: Any, dec: Any, grad_norms: dict[int, float]
) -> int:
    """Print the top tokens (text or --json); `log`/`records`/`dec` are inspect's readers."""
    import numpy as np

    from slime_async.actors.learner import token_record
    from slime_async.config import ConfigError

    by_grad = args.top_grad is not None
    k = args.top_grad if by_grad else args.top_ratio
    if k < 1:
        raise ConfigError(f"--top-{'grad' if by_grad else 'ratio'} {k}: give K >= 1")
    steps = records.steps if args.step is None else [args.step]
    if not records.steps:
        raise ConfigError(
            f"{records.run_dir}: no token records (token_records/step_N.npz): the learner "
            "records them every learner.token_record_interval steps; this run had it at 0, or "
            "predates them"
        )
    if args.step is not None and args.step not in records.steps:
        known = f"{records.steps[0]}-{records.steps[-1]}"
        raise ConfigError(f"step {args.step} has no token record (recorded steps: {known})")

    best: list[tuple[float, int, int, int]] = []  # (score, step, trajectory index, position)
    for step in steps:
        rec = token_record.read(records.run_dir, step)
        if rec is None:
            continue
        model = rec["loss_mask"].astype(bool)
        if by_grad:
            score = token_record.grad_size(rec["grad"], rec["logp"])
        else:
            score = np.abs(rec["logp"] - rec["behavior_logp"])
        score = np.where(model & np.isfinite(score), score, -np.inf)
        top = np.argsort(score)[::-1][:k]
        owner = np.searchsorted(rec["offsets"], top, side="right") - 1
        for flat, i in zip(top.tolist(), owner.tolist(), strict=True):
            if score[flat] == -np.inf:
                continue
            item = (float(score[flat]), step, i, flat - int(rec["offsets"][i]))
            if len(best) < k:
                heapq.heappush(best, item)
            elif item > best[0]:
                heapq.heapreplace(best, item)
    # Only the steps of the tokens shown are read again (one record in memory at a time above).
    kept = {s: token_record.read(records.run_dir, s) for s in {b[1] for b in best}}
    rows = [
        _token_row(log, kept[s], s, i, pos, dec, grad_norms)
        for _, s, i, pos in sorted(best, reverse=True)
    ]
    if args.json:
        print(json.dumps({"by": "grad" if by_grad else "ratio", "tokens": rows}, indent=2))
        return 0
    scope = f"step {args.step}" if args.step is not None else f"{len(steps)} recorded steps"
    what = "gradient size |dL/dlogp| x (1 - p)" if by_grad else "|log pi_theta - log mu|"
    print(f"top {len(rows)} model tokens of {scope} by {what}:")
    print(
        "  step  grad norm  trajectory                 pos  version     mu   learner   ratio  "
        "advantage  grad size  token (after ...)"
    )
    for r in rows:
        print(
            f"  {r['step']:>4}  {_g(r['step_grad_norm']):>9}  {r['trajectory']:<25}  {r['pos']:>3}"
            f"  {_g(r['version'], 'd'):>7}  {r['logprob']:>6.3f}  {r['learner_logprob']:>8.3f}"
            f"  {r['ratio']:>6.3g}  {r['advantage']:>+9.4f}  {r['grad_size']:>9.3g}"
            f"  {r['text']!r} (after {r['context']!r})"
        )
    return 0


def _g(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _token_row(
    log: Any, rec: dict[str, Any], step: int, i: int, pos: int, dec: Any, grad_norms: dict
) -> dict[str, Any]:
    import numpy as np

    from slime_async.actors.learner.token_record import grad_size

    tid = str(rec["ids"][i])
    a = int(rec["offsets"][i]) + pos
    traj = _trajectory(log, step, tid)
    logp, mu = float(rec["logp"][a]), float(rec["behavior_logp"][a])
    row: dict[str, Any] = {
        "step": step,
        "step_grad_norm": grad_norms.get(step),
        "trajectory": tid,
        "pos": pos,
        "logprob": mu,
        "learner_logprob": logp,
        "prox_logprob": float(rec["prox_logp"][a]),
        "ratio": float(np.exp(logp - mu)),
        "advantage": float(rec["advantage"][a]),
        "grad": float(rec["grad"][a]),
        "grad_size": float(grad_size(rec["grad"][a : a + 1], rec["logp"][a : a + 1])[0]),
        "version": None,
        "token_id": None,
        "text": "?",
        "context": "?",
    }
    if traj is not None:  # the log still holds it (compaction may have removed it)
        ids = traj.response_ids
        row["version"] = int(traj.versions[pos])
        row["token_id"] = int(ids[pos])
        row["text"] = dec.token(int(ids[pos]))
        row["context"] = dec.text(ids[max(0, pos - CONTEXT_TOKENS) : pos])
    return row


def _trajectory(log: Any, step: int, tid: str) -> Any:
    s = log.steps.get(step)
    if s is None:
        return None
    log.load(s.group_ids)
    for gid in s.group_ids:
        for t in log.groups.get(gid, []):
            if t.id == tid:
                return t
    return None
