"""CUDA graphs of the policy's forward and backward pass at fixed micro-batch shapes.

A dense model's training step at the seed's small sizes is bound by the host: megatron's layers
cost more Python per layer than the GPU spends on them. `ModelGraphs` records the model's part of
a training micro-batch (token ids -> final hidden states, and that backward into the gradient
buffer) as two CUDA graphs per shape and replays them: the host then launches two graphs instead
of some thousand kernels. The output layer, the log-probs, the loss and its statistics stay eager
(they read data-dependent sizes and wait for the GPU once a micro-batch, `algos/metrics.py`).

- Shapes: rows of `ids [b, s]` are padded on the right to a multiple of `SEQ_MULTIPLE` tokens
  (a causal mask keeps the padding away from every real token; the caller cuts the hidden states
  back to `s`), and each `(b, padded s)` is one pair of graphs. A shape's first micro-batch runs
  eagerly; its second is captured (after one warm-up pass on a side stream whose gradient is
  zero) and every later one replays. At most `max_shapes` shapes are captured; the graphs share
  one memory pool, safe because each micro-batch's forward and backward finish before the next
  micro-batch's begin.
- Gradients: the backward graph adds each parameter's gradient into megatron DDP's fp32 buffer
  (`main_grad`, a fixed address) as DDP's own hook does, skipping the weights whose layers add
  theirs there themselves (`grad_added_to_main_grad`, the fused weight gradients): a replay
  accumulates exactly as the eager pass does. It takes the gradients with `autograd.grad`, not
  `backward()` (no gradient accumulator or DDP hook runs inside the graph). The learner builds
  its model on a CUDA stream of its own when graphs are on (`trainer.py`): autograd makes a
  parameter's accumulator stream wait for its gradient even under `autograd.grad`, and a
  capture may not make the legacy default stream wait. Parameters without the buffer (no DDP)
  are refused at start.
- The forward replay returns a copy of the graph's hidden states, attached to autograd by a
  function whose backward copies the incoming gradient into the graph's input and replays the
  backward graph: the eager loss's `backward()` runs it in place.
- Nothing silent: replays, captures and every micro-batch that ran eagerly (with its reason) are
  counted for the step's metrics (`take_counts`); after a capture that fails (logged with its
  error) no further shape is captured: shapes captured before keep replaying, others run
  eagerly.

Where graphs apply is resolved at start (`options.resolve_cuda_graphs`): a GPU, a dense model at
TP 1, megatron's optimizer without overlapped gradient reduction, SDPA attention, no activation
recomputation. Packed micro-batches run eagerly (their documents' boundaries vary per batch).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

log = logging.getLogger("slime_async.learner")

SEQ_MULTIPLE = 64
"""Rows are padded on the right to a multiple of this many tokens for a graph: fewer shapes to
capture, at most SEQ_MULTIPLE - 1 tokens of extra work a row."""

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The eager forward: (ids [b, s], position ids [b, s]) -> hidden states [b, s, h]."""


class _Shape(NamedTuple):
    """The captured pair of one micro-batch shape, with its fixed inputs and outputs."""

    ids: torch.Tensor
    pos: torch.Tensor
    hidden: torch.Tensor
    grad: torch.Tensor
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph


class _Replay(torch.autograd.Function):
    """Forward: replay a shape's forward graph, return a copy of its hidden states. Backward:
    the gradient into the graph's input, replay its backward graph (parameter gradients land in
    the DDP buffer; the token ids take none)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, shape: _Shape) -> torch.Tensor:
        ctx.shape = shape
        shape.forward.replay()
        return shape.hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape: _Shape = ctx.shape
        shape.grad.copy_(grad)
        shape.backward.replay()
        return None, None


class ModelGraphs:
    """CUDA graphs of one model's training forward and backward, one pair per micro-batch shape."""

    def __init__(self, device: torch.device, params: list[torch.nn.Parameter], max_shapes: int):
        """`params`: the trained parameters, each with megatron DDP's `main_grad`."""
        missing = [p.shape for p in params if getattr(p, "main_grad", None) is None]
        if missing:
            raise ValueError(
                f"CUDA graphs need megatron DDP's main_grad on every trained "
                f"parameter; {len(missing)} have none (first of shape {missing[0]})"
            )
        self.device = device
        self.params = params
        self.max_shapes = max_shapes
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._seen: set[tuple[int, int]] = set()
        self._pool = None
        # What the replayed output hangs on in autograd: a leaf that wants a gradient (the
        # replayed function then has a backward), which it never gets.
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.failed: str | None = None
        """Why no further shape is captured (a capture failed), or None."""
        self._counts: Counter[str] = Counter()

    def count_eager(self, reason: str) -> None:
        """A training micro-batch that ran eagerly, for `reason` (a metric key's last part)."""
        self._counts[f"eager/{reason}"] += 1

    def take_counts(self) -> dict[str, float]:
        """Replays and captures (0 included) and eager micro-batches by reason since the last
        call."""
        out = {"replays": 0.0, "captures": 0.0, **{k: float(v) for k, v in self._counts.items()}}
        self._counts.clear()
        return out

    def hidden(self, run: Forward, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Hidden states `[b, s', h]` (s' >= s: padded rows, cut back by the caller) of one
        training micro-batch, through a graph of its shape where one is or can be captured,
        else through `run`."""
        b, s = ids.shape
        key = (b, -(-s // SEQ_MULTIPLE) * SEQ_MULTIPLE)
        shape = self._shapes.get(key)
        if shape is None:
            eager = (
                "capture_failed"
                if self.failed is not None
                else "first_seen"
                if key not in self._seen
                else "shape_limit"
                if len(self._shapes) >= self.max_shapes
                else None
            )
            self._seen.add(key)
            if eager is None:
                shape = self._capture(run, key, ids.dtype)
                eager = "capture_failed" if shape is None else None
            if eager is not None:
                self.count_eager(eager)
                return run(ids, pos)
        shape.ids[:, :s].copy_(ids)
        if s < key[1]:
            shape.ids[:, s:].zero_()
        shape.pos[:, :s].copy_(pos)  # the padding's positions stay those of the capture
        self._counts["replays"] += 1
        return _Replay.apply(self._anchor, shape)

    def _capture(self, run: Forward, key: tuple[int, int], dtype: torch.dtype) -> _Shape | None:
        b, s = key
        ids = torch.zeros(b, s, dtype=dtype, device=self.device)
        pos = torch.arange(s, device=self.device).expand(b, -1).contiguous()
        try:
            # Warm-up off the capture: lazy initialisation (cuBLAS workspaces, compiled kernels,
            # autograd's hooks) happens here, not inside the graph. A zero gradient adds nothing
            # to the parameters' gradients.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self._own_flags():
                warm = run(ids, pos)
                grad = torch.zeros_like(warm)
                self._backward(warm, grad)
                del warm
            torch.cuda.current_stream(self.device).wait_stream(side)
            fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with self._own_flags():
                with torch.cuda.graph(fwd, pool=self._pool):
                    hidden = run(ids, pos)
                with torch.cuda.graph(bwd, pool=fwd.pool()):
                    self._backward(hidden, grad)
            self._pool = fwd.pool()
        except Exception as e:  # a capture that fails: no more captures, said once
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.warning(
                "learner: CUDA graph capture of micro-batch shape %s failed; no further shape "
                "is captured (micro-batches of other shapes run eagerly): %s",
                key,
                self.failed,
            )
            return None
        shape = _Shape(ids, pos, hidden.detach(), grad, fwd, bwd)
        self._shapes[key] = shape
        self._counts["captures"] += 1
        log.info(
            "learner: CUDA graphs of micro-batch shape %d x %d captured (%d of at most %d)",
            b,
            s,
            len(self._shapes),
            self.max_shapes,
        )
        return shape

    def _backward(self, hidden: torch.Tensor, grad: torch.Tensor) -> None:
        """d(hidden . grad) into the parameters' `main_grad`, as megatron DDP's hook adds it."""
        grads = torch.autograd.grad(hidden, self.params, grad, allow_unused=True)
        for p, g in zip(self.params, grads, strict=True):
            if g is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(g)

    @contextlib.contextmanager
    def _own_flags(self) -> Iterator[None]:
        """`grad_added_to_main_grad` cleared for a pass of the captured part alone (its fused
        layers set theirs), the update's own flags back after it."""
        saved = [getattr(p, "grad_added_to_main_grad", False) for p in self.params]
        for p in self.params:
            p.grad_added_to_main_grad = False
        try:
            yield
        finally:
            for p, flag in zip(self.params, saved, strict=True):
                p.grad_added_to_main_grad = flag
