"""CUDA graphs of the decode step, one per batch-size bucket, over the paged KV cache.

Why: a decode step of a small model is a few hundred short kernels; a graph replays them in one
launch. Each graph reads its inputs from static buffers (token ids, positions, block tables) and
writes its logits to a static output; a batch of m requests runs the smallest bucket >= m, its
rows m.. padded to position 0 of the scratch block 0 (they write and read only there, and their
logits are dropped). The attention kernel reads each row's length from the device, so a graph
serves any lengths; the weights are updated in place, so graphs stay valid across updates.
Memory: one shared pool for all graphs (captured largest first, so smaller ones reuse it) and
one logits buffer `[max bucket, V]` (the model's dtype) that every graph's output layer writes.

With `decode_shared_prefix` on, each bucket of two rows or more has a second graph whose
attention reads the blocks its rows share once (`shared_prefix.py`); its groups are static
buffers too (rows [bucket // 2, group_max], tokens, start), filled each step from the host's
`find_groups`. A batch with no shared blocks replays the plain graph.
"""

from __future__ import annotations

import logging

import torch

from slime_async.actors.engine.embedded.shared_prefix import Groups, SharedPrefix

log = logging.getLogger(__name__)


def bucket_sizes(max_slots: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_slots]
    return sorted({*small, *range(16, max_slots, 16), max_slots})


class DecodeGraphs:
    """Captured decode steps of a ModelRunner, replayed by `run`."""

    def __init__(self, runner):
        self.runner = runner
        self.sizes = bucket_sizes(runner.max_slots)
        dev, top, mb = runner.device, max(self.sizes), runner.max_blocks_per_seq
        self.ids = torch.zeros((top,), dtype=torch.long, device=dev)
        self.pos = torch.zeros((top,), dtype=torch.long, device=dev)
        self.bt = torch.zeros((top, mb), dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        sharing = runner.decode_shared_prefix == "on"
        gm = runner.group_max
        self.g_rows = torch.full((max(1, top // 2), gm), -1, dtype=torch.int32, device=dev)
        self.g_tokens = torch.zeros((max(1, top // 2),), dtype=torch.int32, device=dev)
        self.g_start = torch.zeros((top,), dtype=torch.int32, device=dev)
        self.shared_steps = 0
        """Replays of a graph with shared blocks (the steps whose rows shared a prompt)."""

        def shared(b: int) -> SharedPrefix | None:
            if not sharing or b < 2:
                return None
            return SharedPrefix(self.g_rows[: b // 2], self.g_tokens[: b // 2], self.g_start[:b])

        with torch.inference_mode():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: compile, autotune, cuBLAS handles
                for b in reversed(self.sizes):
                    runner.decode_step(self.ids[:b], self.pos[:b], self.bt[:b])
                    if shared(b) is not None:
                        runner.decode_step(
                            self.ids[:b], self.pos[:b], self.bt[:b], shared=shared(b)
                        )
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            # One output buffer for every bucket, in the model's dtype (the sampler upcasts):
            # each graph's own logits would stay allocated with it (GBs over all buckets). The
            # output layer writes into it directly.
            self.logits = torch.empty((top, runner.vocab_size), dtype=runner.dtype, device=dev)
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.decode_step(
                        self.ids[:b], self.pos[:b], self.bt[:b], out=self.logits[:b]
                    )
                    del out
                self.graphs[b] = (graph, self.logits[:b])
                if shared(b) is not None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = runner.decode_step(
                            self.ids[:b], self.pos[:b], self.bt[:b], out=self.logits[:b],
                            shared=shared(b),
                        )  # fmt: skip
                        del out
                    self.shared_graphs[b] = graph
            torch.cuda.synchronize(dev)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        groups: Groups | None = None,
    ) -> torch.Tensor | None:
        """Replay the bucket for m = len(ids) rows; None if no bucket is large enough. `groups`:
        the rows that share leading blocks (`ModelRunner.groups`), read once where given."""
        m = ids.shape[0]
        size = next((b for b in self.sizes if b >= m), None)
        if size is None:
            return None
        # Padding rows: position 0 of block 0 (scratch). Staged in pinned memory, copied without
        # a host sync (the caching host allocator keeps the staging alive until the copy ran).
        pos = torch.zeros((size,), dtype=torch.long)
        pos[:m] = positions
        bt = torch.zeros((size, block_tables.shape[1]), dtype=torch.int32)
        bt[:m] = block_tables
        self.pos[:size].copy_(pos.pin_memory(), non_blocking=True)
        self.bt[:size].copy_(bt.pin_memory(), non_blocking=True)
        self.ids[:m].copy_(ids)
        graph, logits = self.graphs[size]
        if groups is not None and size in self.shared_graphs:
            half = size // 2
            rows = torch.full((half, self.g_rows.shape[1]), -1, dtype=torch.int32)
            tokens = torch.zeros((half,), dtype=torch.int32)
            start = torch.zeros((size,), dtype=torch.int32)
            k = len(groups.tokens)
            rows[:k] = torch.from_numpy(groups.rows)
            tokens[:k] = torch.from_numpy(groups.tokens)
            start[:m] = torch.from_numpy(groups.start)
            self.g_rows[:half].copy_(rows.pin_memory(), non_blocking=True)
            self.g_tokens[:half].copy_(tokens.pin_memory(), non_blocking=True)
            self.g_start[:size].copy_(start.pin_memory(), non_blocking=True)
            graph = self.shared_graphs[size]
            self.shared_steps += 1
        graph.replay()
        return logits[:m]
