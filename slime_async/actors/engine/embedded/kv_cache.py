"""The paged KV cache: fixed-size blocks, per-request block tables, a prefix index over blocks.

    k[layer], v[layer]: [num_blocks, block_size, Hkv, D]   (block 0 is scratch: padding rows of a
                                                            CUDA-graph batch write and read there)
    a request's block table: the ids of the blocks that hold its positions 0, B, 2B, ... in order

A request holds `ceil(context_len / B)` blocks, so memory follows the real lengths, not
`max_context_len` per slot; a request that leaves frees its blocks without moving anyone's KV.

Sharing. A block is reference-counted. Full blocks of prompts are entered in a prefix index keyed
by the hash chain of their tokens (block i's key hashes block i-1's key and its own tokens, so a
key names the whole prefix): a request whose prompt starts with indexed blocks takes them (a ref
each) and prefills only the rest. The chain starts from the request's cache namespace, SGLang's
`(extra_key, cache_salt)`: as in SGLang 0.5.23's radix cache (srt/mem_cache/radix_cache.py:
RadixKey.child_key_at puts both into the key of the root's children, RadixKey._check_compatible
refuses to compare keys of two namespaces), prompts under different namespaces never share a
block, whatever their tokens; no namespace (both None) is SGLang's plain, unkeyed tree. Indexed blocks that no request holds stay cached until the pool
runs dry, then are evicted least recently used first. The index is cleared whenever the weights
change (cached KV of old weights would make new requests inexact) and by `flush`.

Memory: allocated once at start; `kv_bytes_per_token` * `block_size` * `num_blocks` in all.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

SCRATCH_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """The pool has no free or evictable block left."""


class BlockPool:
    """Block ids, their reference counts and the prefix index. Host-side only (no tensors)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() -> 1, 2, ..
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # indexed block -> its prefix key
        self._index: dict[bytes, int] = {}  # prefix key -> block
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Indexed blocks that no request holds, least recently used first (evictable)."""
        self.hits = 0
        """Prompt tokens served from the prefix index (not prefilled)."""
        self.evictions = 0
        """Indexed blocks evicted to make room."""

    # ---- allocation -------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or idle in the index and evictable)."""
        return len(self._free) + len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n > self.available:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.available} available")
        out = []
        for _ in range(n):
            if not self._free:
                self._evict_one()
            b = self._free.pop()
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of `blocks` (read-only sharing of full blocks)."""
        for b in blocks:
            if self._refs[b] == 0:
                self._idle.pop(b, None)
            self._refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if b in self._key_of:
                self._idle[b] = None  # cached: reusable by a later prompt until evicted
            else:
                self._free.append(b)

    def _evict_one(self) -> None:
        b, _ = self._idle.popitem(last=False)
        del self._index[self._key_of.pop(b)]
        self._free.append(b)
        self.evictions += 1

    # ---- the prefix index -------------------------------------------------------------------

    def keys(
        self, tokens: Sequence[int], namespace: tuple[str | None, str | None] | None = None
    ) -> list[bytes]:
        """The prefix keys of the full blocks of `tokens` under `namespace` (SGLang's
        `(extra_key, cache_salt)`; None or `(None, None)`: no namespace)."""
        bs, out, prev = self.block_size, [], b""
        if namespace is not None and namespace != (None, None):
            prev = hashlib.blake2b(repr(tuple(namespace)).encode(), digest_size=16).digest()
        for i in range(len(tokens) // bs):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(repr(list(tokens[i * bs : (i + 1) * bs])).encode())
            prev = h.digest()
            out.append(prev)
        return out

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The indexed blocks of the longest indexed prefix of `keys` (not yet shared)."""
        out = []
        for k in keys:
            b = self._index.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Index full blocks by their prefix keys (a key already indexed keeps its block)."""
        for k, b in zip(keys, blocks, strict=False):
            if k in self._index or b in self._key_of:
                continue
            self._index[k] = b
            self._key_of[b] = k

    def clear_index(self) -> int:
        """Forget every indexed prefix; idle cached blocks become free. Returns blocks freed."""
        n = len(self._idle)
        self._free.extend(self._idle)
        self._idle.clear()
        self._index.clear()
        self._key_of.clear()
        return n

    def in_use(self) -> int:
        return self.num_blocks - 1 - self.available


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for_memory(
    device: torch.device,
    mem_fraction: float,
    bytes_per_block: int,
    reserve_bytes: int,
    others_bytes: int = 0,
    min_blocks: int = 2,
) -> tuple[int, dict[str, int]]:
    """How many KV blocks fit on `device`: the engine's whole footprint (weights already loaded,
    activations `reserve_bytes`, the cache) stays within `mem_fraction` of the GPU's memory, and
    within what is free now less `others_bytes`, kept for another process on the same GPU (the
    learner: `engine.embedded.gpu_reserve_gib`). Fewer than `min_blocks` (one request of the
    longest context) is refused with the numbers. Memory this process freed but torch still
    caches (an earlier model's, an earlier engine's) is handed back first: it counts as free."""
    gc.collect()  # a dead engine or model held only by reference cycles
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    budget = int(mem_fraction * total) - ours - reserve_bytes
    budget = min(budget, free - others_bytes - reserve_bytes)
    n = budget // bytes_per_block
    info = {
        "total_bytes": total,
        "free_bytes": free,
        "weights_bytes": ours,
        "reserve_bytes": reserve_bytes,
        "others_bytes": others_bytes,
        "kv_bytes": max(n, 0) * bytes_per_block,
    }
    if n < min_blocks:
        kept = (
            f", kept free for the learner {others_bytes / 2**30:.1f} GiB "
            "(engine.embedded.gpu_reserve_gib)"
            if others_bytes
            else ""
        )
        raise ValueError(
            f"no room for the KV cache on {device}: it needs {min_blocks} blocks "
            f"({min_blocks * bytes_per_block / 2**30:.2f} GiB, one request of the longest "
            f"context) and {max(n, 0)} fit (total {total / 2**30:.1f} GiB, free "
            f"{free / 2**30:.1f} GiB, engine weights {ours / 2**30:.1f} GiB, activations "
            f"reserve {reserve_bytes / 2**30:.1f} GiB{kept}, "
            f"engine.embedded.mem_fraction = {mem_fraction}); lower max_context_len or "
            "max_running_requests, or give the engine a GPU of its own"
        )
    return int(n), info
