"""An index of the buffer's write-ahead log, for `slime-async inspect`: built once, cached beside
the log, brought up to date by re-reading only the segments that changed.

Reading a whole log means decoding every trajectory (about 11 s for a 22 MB log of 250 steps on
the 2-core machine). The index keeps, per segment, what the step table needs and where each
group's data lies:

- `groups`: group id -> trajectories, reward sum, model tokens, oldest model-token version and
  the ordinals of the PUT records holding it in that segment;
- `delivers`: (batch id, group ids, the policy version announced before it), first delivery
  only (a redelivery repeats no group ids);
- `commits`, `drops` (group id -> reason), and the snapshot's next batch id.

Every segment starts with a SNAPSHOT record carrying the version, so a segment's entries depend
on no other segment, and the log's view is the merge of its segments' entries in order. A segment
is identified by (name, size, mtime): one that is new, or changed other than by growing, is read
whole; one that grew (the live tail; segments are append-only) is read on from the records
already indexed, the earlier ones skipped undecoded; one that compaction deleted drops out. The cache (`<wal_dir>.index.json`, written
atomically) carries a format number; a cache of another format, or unreadable, is rebuilt. Where
the run directory is read-only the index is built in memory and not kept.

`read_groups(wal_dir, index, group_ids)` then decodes only the PUT records of those groups, in the
segments that hold them. The log is read through `WriteAheadLog.replay` (its framing and
checksums), one segment at a time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_async.queue import wal as W
from slime_async.queue.groups import unscoped
from slime_async.queue.schema import Trajectory, decode_trajectory

log = logging.getLogger(__name__)

FORMAT = 2


class _Segment(W.WriteAheadLog):
    """The log's reader limited to one segment file."""

    def __init__(self, directory: Path, index: int):
        super().__init__(directory, "none", 1 << 62, snapshot=dict)
        self._only = index

    def segments(self) -> list[int]:
        return [self._only]


def segment_files(wal_dir: Path) -> dict[int, Path]:
    """The log's segments, by index."""
    reader = W.WriteAheadLog(wal_dir, "none", 1 << 62, snapshot=dict)
    return {i: wal_dir / f"wal-{i:08d}.log" for i in reader.segments()}


def _signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def scan_segment(wal_dir: Path, index: int, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """One segment's entries (see the module docstring).

    `resume`: the entries of an earlier scan of this segment when the file has only grown since
    (segments are append-only): its records are skipped undecoded, the new ones added."""
    entry: dict[str, Any] = resume or {
        "groups": {},
        "delivers": [],
        "commits": [],
        "drops": {},
        "records": 0,
        "version": 0,
    }
    skip = int(entry["records"])
    version = int(entry["version"])
    ordinal = -1
    for ordinal, (rtype, meta, blobs) in enumerate(_Segment(wal_dir, index).replay()):
        if ordinal < skip:
            continue
        if rtype == W.SNAPSHOT:
            version = int(meta.get("version", version))
            entry.setdefault("next_batch", int(meta.get("next_batch", 1)))
        elif rtype == W.VERSION:
            version = int(meta["version"])
        elif rtype == W.PUT:
            for blob in blobs:
                t = decode_trajectory(blob, validate=False)  # validated when it was put
                g = entry["groups"].setdefault(
                    t.group_id,
                    {"n": 0, "reward": 0.0, "model_tokens": 0, "oldest": None, "records": []},
                )
                g["n"] += 1
                g["reward"] += float(t.reward)
                g["model_tokens"] += int(t.loss_mask.sum())
                oldest = t.oldest_version()
                if oldest is not None:
                    g["oldest"] = oldest if g["oldest"] is None else min(g["oldest"], oldest)
                if not g["records"] or g["records"][-1] != ordinal:
                    g["records"].append(ordinal)
        elif rtype == W.DELIVER:
            if meta.get("g"):
                # group keys are scoped to their producer in the log; the index holds group ids
                gids = [unscoped(k)[1] for k in meta["g"]]
                entry["delivers"].append([int(meta["batch"]), gids, version])
        elif rtype == W.COMMIT:
            entry["commits"].append(int(meta["batch"]))
        elif rtype == W.DROP:
            for key in meta["g"]:
                entry["drops"][unscoped(key)[1]] = str(meta.get("why", ""))
    entry["records"] = max(skip, ordinal + 1)
    entry["version"] = version
    return entry


@dataclass
class GroupInfo:
    n: int = 0
    reward: float = 0.0
    model_tokens: int = 0
    oldest: int | None = None
    where: list[tuple[int, int]] = field(default_factory=list)
    """(segment, PUT record ordinal) holding its trajectories."""


@dataclass
class StepInfo:
    batch_id: int
    group_ids: list[str]
    version: int
    """The policy version announced when the batch was delivered."""
    committed: bool = False


@dataclass
class WalIndex:
    """The merged view of the log: steps, groups, drops, and the first batch still in it."""

    steps: dict[int, StepInfo] = field(default_factory=dict)
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    first_batch: int | None = None
    segments_read: int = 0
    """Segments (re-)read to bring the cache up to date (0: all from the cache)."""


def cache_path(wal_dir: Path) -> Path:
    return wal_dir.with_name(wal_dir.name + ".index.json")


def load_index(wal_dir: str | Path) -> WalIndex:
    """The index of the log in `wal_dir`, from the cache where it is current (see above)."""
    wal_dir = Path(wal_dir)
    path = cache_path(wal_dir)
    cached: dict[str, Any] = {}
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") == FORMAT:
            cached = raw["segments"]
    except (OSError, ValueError, KeyError, TypeError):
        cached = {}
    segments: dict[str, Any] = {}
    read = 0
    for index, seg_path in sorted(segment_files(wal_dir).items()):
        sig = _signature(seg_path)
        old = cached.get(str(index))
        if old is not None and old.get("sig") == sig:
            segments[str(index)] = old
            continue
        # Only grown (the live tail): read on from the records already indexed.
        grown = old is not None and old.get("sig", [0])[0] < sig[0]
        resume = {k: v for k, v in old.items() if k != "sig"} if grown else None
        segments[str(index)] = {"sig": sig, **scan_segment(wal_dir, index, resume)}
        read += 1
    if read or set(segments) != set(cached):
        _write_cache(path, {"format": FORMAT, "segments": segments})
    out = merge(segments)
    out.segments_read = read
    return out


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError as e:  # a read-only run directory: the index still serves this call
        log.warning("write-ahead log index not cached at %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def merge(segments: dict[str, Any]) -> WalIndex:
    """The log's view from its segments' entries, oldest segment first."""
    out = WalIndex()
    for key in sorted(segments, key=int):
        seg = segments[key]
        if out.first_batch is None and "next_batch" in seg:
            out.first_batch = int(seg["next_batch"])
        for gid, g in seg["groups"].items():
            info = out.groups.setdefault(gid, GroupInfo())
            info.n += g["n"]
            info.reward += g["reward"]
            info.model_tokens += g["model_tokens"]
            if g["oldest"] is not None:
                info.oldest = g["oldest"] if info.oldest is None else min(info.oldest, g["oldest"])
            info.where.extend((int(key), r) for r in g["records"])
        for batch, gids, version in seg["delivers"]:
            out.steps.setdefault(batch, StepInfo(batch, list(gids), version))
        for batch in seg["commits"]:
            if batch in out.steps:
                out.steps[batch].committed = True
        out.dropped.update(seg["drops"])
    return out


def read_groups(
    wal_dir: str | Path, index: WalIndex, group_ids: Iterable[str]
) -> dict[str, list[Trajectory]]:
    """The trajectories of `group_ids` (as put), decoding only the records that hold them."""
    wanted = set(group_ids)
    by_segment: dict[int, set[int]] = {}
    for gid in wanted:
        for seg, ordinal in index.groups[gid].where if gid in index.groups else ():
            by_segment.setdefault(seg, set()).add(ordinal)
    out: dict[str, list[Trajectory]] = {gid: [] for gid in wanted}
    for seg, ordinals in sorted(by_segment.items()):
        for ordinal, (rtype, _meta, blobs) in enumerate(_Segment(Path(wal_dir), seg).replay()):
            if rtype != W.PUT or ordinal not in ordinals:
                continue
            for blob in blobs:
                t = decode_trajectory(blob)
                if t.group_id in out:
                    out[t.group_id].append(t)
    return out
