"""Loss statistics that add up across micro-batches and ranks, overall and by version lag.

A loss reports *raw* metrics: a flat `dict[str, float]` whose keys end in the reduction that
combines them, `"<stat>|<op>"`:

    clip_frac|sum, clip_frac|n              -> clip_frac = sum / n          (a token mean)
    is_weight|max                           -> is_weight_max                (max)
    is_weight|sq (with |sum and |n)         -> is_weight_ess = sum^2 / (n * sq), in (0, 1]
    tokens|cnt                              -> tokens                       (a count)

`<stat>` is a name, or a name and a staleness bucket `name/lag_k` (k = current_version - the
token's version). Every op but `max` adds, so the learner merges the raw dicts of its
micro-batches with `merge_metrics`, gathers them across ranks (all_gather_object, then
`merge_metrics` again; or an all-reduce, SUM for every key but MAX for `|max`), and calls
`finalize_metrics` once per step. `reduce_metrics` does merge + finalize in one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

_OPS = ("sum", "n", "sq", "max", "cnt")


class TokenStats:
    """Collects per-token statistics of one micro-batch without stalling the GPU.

    `mask: [B, T]` bool selects the tokens that count; `lag: [B, T]` int their version lag.
    Per-sequence statistics (`per_sequence`, `sequence_weight`) count each row with a token in
    the mask once, in the bucket of its oldest token's lag.

    Two host syncs in all: one in the constructor (the numbers of tokens and rows and the lag
    range), one in `raw()`. Everything between gathers by index and adds by `index_add_`, so a
    loss can call any number of statistics between the forward and the backward pass and the
    backward's kernels still queue behind the forward's (boolean indexing and `bincount` would
    each wait for the GPU to drain).
    """

    def __init__(self, mask: torch.Tensor, lag: torch.Tensor):
        self._mask = mask
        rows = mask.any(-1)  # [B]
        flat = mask.reshape(-1)
        lag_full = torch.where(mask, lag, torch.zeros_like(lag))
        edges = lag_full.new_zeros(2)  # [lowest lag, highest lag + 1] of the mask's tokens
        if lag.numel():
            edges = torch.stack([lag_full.amin(), torch.where(mask, lag + 1, 0).amax()])
        head = torch.cat([torch.stack([flat.sum(), rows.sum()]), edges.long()]).long()
        n_tok, n_rows, low, self._num_lags = head.tolist()  # the constructor's one sync
        if low < 0:
            raise ValueError(
                "a token's version is ahead of the learner's current_version "
                f"(lag {low}): versions must come from pushed weights"
            )
        # Positions of the mask's tokens (rows), in order: a stable sort of "not selected".
        self._idx = torch.argsort((~flat).to(torch.uint8), stable=True)[:n_tok]
        self._row_idx = torch.argsort((~rows).to(torch.uint8), stable=True)[:n_rows]
        self._lag = lag.reshape(-1)[self._idx]  # [N]
        # A sequence's lag is its oldest token's; rows without a token of the mask do not count.
        # (No rows: an empty index; amax over rows of no tokens would be an error.)
        self._row_lag = lag_full.amax(-1)[self._row_idx] if n_rows else self._row_idx
        self._keys: list[str] = []
        self._values: list[torch.Tensor] = []

    def _put(self, name: str, op: str, total: torch.Tensor, by_lag: torch.Tensor) -> None:
        self._keys.append(f"{name}|{op}")
        self._values.append(total.reshape(1).double())
        self._keys.extend(f"{name}/lag_{k}|{op}" for k in range(self._num_lags))
        self._values.append(by_lag.double())

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape != self._mask.shape:
            return x.detach()
        return x.detach().reshape(-1)[self._idx].double()

    def _by(self, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Sums of `x` by lag bucket (bincount's weighted sum, without its host sync)."""
        out = torch.zeros(self._num_lags, dtype=torch.float64, device=x.device)
        return out.index_add_(0, index, x.double())

    def _bincount(self, x: torch.Tensor) -> torch.Tensor:
        return self._by(self._lag, x)

    def count(self, name: str = "tokens") -> None:
        """Number of tokens (overall and per lag)."""
        ones = torch.ones_like(self._lag, dtype=torch.float64)
        self._put(name, "cnt", ones.sum(), self._bincount(ones))

    def mean(self, name: str, x: torch.Tensor) -> None:
        """Token mean of `x: [B, T]` (float or bool)."""
        v = self._select(x)
        ones = torch.ones_like(v)
        self._put(name, "sum", v.sum(), self._bincount(v))
        self._put(name, "n", ones.sum(), self._bincount(ones))

    def weight(self, name: str, x: torch.Tensor) -> None:
        """Mean, max and normalised effective sample size of a non-negative `x: [B, T]`."""
        self.mean(name, x)
        v = self._select(x)
        self._put(name, "sq", (v * v).sum(), self._bincount(v * v))
        if v.numel() == 0:
            return  # no max of nothing: a 0 would read as a real maximum
        top = torch.zeros(self._num_lags, dtype=v.dtype, device=v.device)
        top = top.scatter_reduce(0, self._lag, v, reduce="amax", include_self=False)
        self._put(name, "max", v.max(), top)

    def per_sequence(self, name: str, x: torch.Tensor, *, with_max: bool = False) -> None:
        """Sequence mean (and max) of `x: [B]`, one value per sequence, bucketed by its lag."""
        v = x.detach()[self._row_idx].double()
        ones = torch.ones_like(v)
        by = self._row_bincount
        self._put(name, "sum", v.sum(), by(v))
        self._put(name, "n", ones.sum(), by(ones))
        if with_max and v.numel():
            top = torch.zeros(self._num_lags, dtype=v.dtype, device=v.device)
            top = top.scatter_reduce(0, self._row_lag, v, reduce="amax", include_self=False)
            self._put(name, "max", v.max(), top)

    def sequence_weight(self, name: str, log_w: torch.Tensor) -> None:
        """Mean and normalised ESS of the sequence weights exp(`log_w: [B]`).

        log_w is clamped to [-300, 300] so the squares stay finite in float64 (a weight of
        e^300 already holds all the mass of any batch: its ESS is 1 / n either way)."""
        w = log_w.detach()[self._row_idx].double().clamp(-300.0, 300.0).exp()
        ones = torch.ones_like(w)
        by = self._row_bincount
        self._put(name, "sum", w.sum(), by(w))
        self._put(name, "n", ones.sum(), by(ones))
        self._put(name, "sq", (w * w).sum(), by(w * w))

    def _row_bincount(self, x: torch.Tensor) -> torch.Tensor:
        return self._by(self._row_lag, x)

    def raw(self) -> dict[str, float]:
        """The raw metrics (see the module docstring); lag buckets without tokens are left out."""
        if not self._values:
            return {}
        counts = self._bincount(torch.ones_like(self._lag, dtype=torch.float64))
        flat = torch.cat([*self._values, counts]).tolist()  # the one sync of raw()
        cut = len(flat) - self._num_lags
        values, present = flat[:cut], {k for k, c in enumerate(flat[cut:]) if c > 0}
        out = {}
        for key, value in zip(self._keys, values, strict=True):
            stat = key.rpartition("|")[0]
            _, sep, lag = stat.partition("/lag_")
            if sep and int(lag) not in present:
                continue
            out[key] = value
        return out


def merge_metrics(raws: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine raw metric dicts (micro-batches, ranks): `|max` keys by max, the others by sum."""
    out: dict[str, float] = {}
    for raw in raws:
        for key, value in raw.items():
            op = key.rpartition("|")[2]
            if op not in _OPS:
                raise ValueError(f"metric {key!r}: expected a '|op' suffix, one of {_OPS}")
            if key not in out:
                out[key] = float(value)
            elif op == "max":
                out[key] = max(out[key], float(value))
            else:
                out[key] += float(value)
    return out


def finalize_metrics(raw: Mapping[str, float]) -> dict[str, float]:
    """Turn merged raw metrics into named values: means, maxima, ESS, counts."""
    stats: dict[str, dict[str, float]] = {}
    for key, value in raw.items():
        stat, _, op = key.rpartition("|")
        stats.setdefault(stat, {})[op] = value
    out: dict[str, float] = {}
    for stat, ops in stats.items():
        name, sep, lag = stat.partition("/lag_")
        suffix = f"/lag_{lag}" if sep else ""
        if "cnt" in ops:
            out[stat] = ops["cnt"]
        if "n" in ops and ops["n"] > 0:
            out[stat] = ops.get("sum", 0.0) / ops["n"]
            if ops.get("sq", 0.0) > 0:
                out[f"{name}_ess{suffix}"] = ops["sum"] ** 2 / (ops["n"] * ops["sq"])
        if "max" in ops:
            out[f"{name}_max{suffix}"] = ops["max"]
    return out


def reduce_metrics(raws: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """`finalize_metrics(merge_metrics(raws))`: the step's metrics from its micro-batches'."""
    return finalize_metrics(merge_metrics(raws))
