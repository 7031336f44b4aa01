"""Prompts from a JSONL file, in a seeded order per epoch, with a cursor that survives restarts.

The generator walks an endless stream of items k = 0, 1, 2, ...: item k is prompt `offset` of
epoch `e`'s permutation (numpy's PCG64 seeded with (seed, e)), restricted to this generator's
shard. Items finish out of order (groups take different times), so the cursor is a watermark
`next` (every item before it is done) plus the set of items after it that are done already.
It is written atomically (temp file, fsync, rename) after the buffer acknowledges a group, so a
restarted generator neither skips a prompt nor pushes an acknowledged group again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slime_async.config import ConfigError

STATE_VERSION = 1


class DatasetError(ConfigError):
    """The prompt file or the cursor state is unusable; the message names the file and line."""


class PromptDataset:
    """All records of a JSONL prompt file (each a JSON object with a prompt field)."""

    def __init__(self, path: str | Path, prompt_key: str = "prompt"):
        self.path = Path(path)
        self.prompt_key = prompt_key
        if not self.path.is_file():
            raise DatasetError(f"{self.path}: prompt dataset not found")
        data = self.path.read_bytes()
        self.digest = hashlib.sha256(data).hexdigest()[:16]
        self.records: list[dict[str, Any]] = []
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{self.path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"{self.path}:{lineno}: expected a JSON object")
            if prompt_key not in rec:
                raise DatasetError(f"{self.path}:{lineno}: no {prompt_key!r} field")
            self.records.append(rec)
        if not self.records:
            raise DatasetError(f"{self.path}: no prompts")

    def __len__(self) -> int:
        return len(self.records)

    def permutation(self, seed: int, epoch: int) -> np.ndarray:
        """Row order of `epoch`: [N] int64, the same for the same (seed, epoch)."""
        return np.random.default_rng([seed, epoch]).permutation(len(self.records))


@dataclass(frozen=True)
class Item:
    """One prompt of the stream."""

    k: int
    """Position in this generator's stream (0, 1, 2, ...)."""
    epoch: int
    """Pass over the dataset."""
    offset: int
    """Position in the epoch's permutation (shared by all shards)."""
    row: int
    """Row in the JSONL file."""


class PromptStream:
    """The deterministic sequence of items of one shard; `at(k)` is None past the last epoch."""

    def __init__(
        self,
        dataset: PromptDataset,
        seed: int = 0,
        num_shards: int = 1,
        shard_index: int = 0,
        num_epochs: int | None = None,
    ):
        if not 0 <= shard_index < num_shards:
            raise DatasetError(f"shard_index {shard_index} is not in [0, {num_shards})")
        self.dataset = dataset
        self.seed = seed
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.num_epochs = num_epochs
        self.per_epoch = len(range(shard_index, len(dataset), num_shards))
        if self.per_epoch == 0:
            raise DatasetError(
                f"{dataset.path}: {len(dataset)} prompts leave shard {shard_index} of "
                f"{num_shards} empty"
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def at(self, k: int) -> Item | None:
        epoch, j = divmod(k, self.per_epoch)
        if self.num_epochs is not None and epoch >= self.num_epochs:
            return None
        if epoch != self._perm_epoch:
            self._perm = self.dataset.permutation(self.seed, epoch)
            self._perm_epoch = epoch
        offset = self.shard_index + j * self.num_shards
        return Item(k, epoch, offset, int(self._perm[offset]))

    def identity(self) -> dict[str, Any]:
        """What must not change between a run and its restart for the cursor to stay valid."""
        return {
            "dataset_digest": self.dataset.digest,
            "dataset_size": len(self.dataset),
            "seed": self.seed,
            "num_shards": self.num_shards,
            "shard_index": self.shard_index,
        }


@dataclass
class Cursor:
    """Items done: every k < next, plus `ahead` (done out of order, all >= next)."""

    next: int = 0
    ahead: set[int] = field(default_factory=set)

    def done(self, k: int) -> bool:
        return k < self.next or k in self.ahead

    def mark_done(self, k: int) -> None:
        if k < self.next:
            return
        self.ahead.add(k)
        while self.next in self.ahead:
            self.ahead.remove(self.next)
            self.next += 1

    def pending(self) -> Iterator[int]:
        """Items not done, in order, forever."""
        k = self.next
        while True:
            if k not in self.ahead:
                yield k
            k += 1


class CursorStore:
    """The cursor in a JSON file, checked against the stream it was written for."""

    def __init__(self, path: str | Path | None, stream: PromptStream):
        self.path = Path(path) if path else None
        self.stream = stream

    def load(self) -> Cursor:
        if self.path is None or not self.path.exists():
            return Cursor()
        try:
            state = json.loads(self.path.read_text())
            cursor = Cursor(int(state["next"]), {int(k) for k in state["ahead"]})
            saved = {key: state[key] for key in self.stream.identity()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"{self.path}: unreadable generator state: {e!r}") from None
        changed = {
            key: (saved[key], now)
            for key, now in self.stream.identity().items()
            if saved[key] != now
        }
        if changed:
            raise DatasetError(
                f"{self.path}: the generator state was written for another dataset or order "
                f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}); "
                "resuming would skip or repeat prompts. Restore the old settings or delete the file."
            )
        return cursor

    def save(self, cursor: Cursor) -> None:
        if self.path is None:
            return
        item = self.stream.at(cursor.next)
        state = {
            "version": STATE_VERSION,
            "next": cursor.next,
            "epoch": item.epoch if item else None,
            "offset": item.offset if item else None,
            "ahead": sorted(cursor.ahead),
            **self.stream.identity(),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
