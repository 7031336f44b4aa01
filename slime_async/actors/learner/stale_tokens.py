"""The stale-token policy: model tokens older than the buffer's bound, masked or only counted.

A token's staleness is measured on the buffer's clock: the updates between the token's version and
the version the buffer knew at delivery (the group's staleness plus its oldest model-token
version), counted along the run's line of weights (`slime_async/queue/lineage.py`: a learner
restart leaves a gap of versions, which costs no update). A token of a superseded version (weights
the run left behind) has no staleness on the line: it counts as beyond the bound, and separately.
`buffer.stale_policy = "mask"` zeroes the loss mask of tokens beyond `buffer.max_staleness` and
reports the masked groups against the others; "drop" and "keep" train on them and report only
their count. The figures are the batch's, summed over data-parallel ranks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

import slime_async.metrics.names as M
from slime_async.actors.learner.batch import Row, TrainGroup
from slime_async.actors.learner.parallel import ParallelLayout
from slime_async.queue.lineage import SUPERSEDED_POSITION, Line


class StaleTokens:
    """`apply(groups, rows)`: the policy on one rank's rows, and the batch's metrics of it."""

    def __init__(self, layout: ParallelLayout, max_staleness: int | None, policy: str):
        """`max_staleness`: the buffer's bound (None: not checked); `policy`: drop, mask or keep."""
        self.layout = layout
        self.max_staleness = max_staleness
        self.policy = policy
        self.line = Line()
        """The run's line of weights (set by the learner process at start-up)."""

    def _clock(self, staleness: int, oldest: int) -> int:
        """The buffer's version at delivery as a position on the line: the group's staleness
        is a distance along it (or, from a superseded oldest token, the plain version gap)."""
        line = self.line
        if line.superseded(oldest):
            return line.position(staleness + oldest)
        return staleness + line.position(oldest)

    def apply(self, groups: Sequence[TrainGroup], rows: list[Row]) -> dict[str, float]:
        """Apply the policy to the model tokens of `rows` (one per trajectory of `groups`, in
        order) older than `max_staleness`; their metrics."""
        if self.max_staleness is None:
            return {}
        over_tokens = superseded_tokens = 0
        masked_groups: list[int] = []
        i = 0
        for k, g in enumerate(groups):
            mine = rows[i : i + len(g)]
            i += len(g)
            oldest = [o for t in g if (o := t.oldest_version()) is not None]
            if not oldest:
                continue
            clock = self._clock(g.staleness, min(oldest))
            hit = False
            for r in mine:
                model = r.per_token["loss_mask"] > 0
                positions = self.line.positions(r.per_token["versions"])
                over = model & (clock - positions > self.max_staleness)
                n = int(over.sum())
                over_tokens += n
                superseded_tokens += int((model & (positions == SUPERSEDED_POSITION)).sum())
                if n and self.policy == "mask":
                    r.per_token["loss_mask"] = np.where(over, 0.0, r.per_token["loss_mask"]).astype(
                        np.float32
                    )
                hit = hit or n > 0
            if hit:
                masked_groups.append(k)
        masked = set(masked_groups)
        # [over-bound tokens, masked groups, then (trajectories, length sum, reward sum) of the
        # masked groups and of the others]
        sums = np.zeros(9)
        sums[0], sums[1], sums[8] = over_tokens, len(masked), superseded_tokens
        for k, g in enumerate(groups):
            base = 2 if k in masked else 5
            for t in g:
                sums[base] += 1
                sums[base + 1] += float(t.loss_mask.sum())
                sums[base + 2] += float(t.reward)
        if self.layout.dp_size > 1:  # the batch's totals, not this rank's share
            t = torch.tensor(sums, dtype=torch.float64, device=self.layout.device)
            dist.all_reduce(t, group=self.layout.dp_group)
            sums = t.cpu().numpy()
        out = {
            M.STALE_OVER_BOUND_TOKENS: float(sums[0]),
            M.STALE_SUPERSEDED_TOKENS: float(sums[8]),
        }
        if self.policy != "mask":
            return out
        mn, kn = max(sums[2], 1.0), max(sums[5], 1.0)
        out.update(
            {
                M.STALE_MASKED_TOKENS: float(sums[0]),
                M.STALE_MASKED_GROUPS: float(sums[1]),
                M.STALE_MASKED_LEN: float(sums[3] / mn),
                M.STALE_MASKED_REWARD: float(sums[4] / mn),
                M.STALE_KEPT_LEN: float(sums[6] / kn),
                M.STALE_KEPT_REWARD: float(sums[7] / kn),
            }
        )
        return out
