"""The learner's pointwise layer ops as torch.compile'd (Triton) kernels on a GPU: RMSNorm and RoPE.

Megatron's local layer spec (no Transformer Engine, no Apex) runs these eagerly: torch's fused
RMSNorm forward is one kernel, but its backward reduces the weight's gradient with a generic
kernel that is slow for the q/k norms' 128-wide weights over every token and head (about 12 ms of
a 110 ms step at the 0.51B Qwen3 shape, 8 x 1,024 tokens, on an H100), and RoPE is a chunk, a
negation, a concatenation, two products and a sum each way (about 10 ms). Compiled, each is one
kernel forward and one or two backward, computed in fp32 and rounded once. With them the layers
use megatron's own SwiGLU fusion (`bias_activation_fusion`, which megatron compiles with
torch.compile), checked here too.

- `rms_norm(x, weight, eps)`: torch's RMSNorm (`torch.nn.functional.rms_norm`): x in fp32 times
  rsqrt(mean(x^2) + eps), times the weight in fp32, rounded to x's dtype.
- `rope(t, freqs, ...)`: megatron's RoPE on `[s, b, heads, d]` (`_apply_rotary_pos_emb_bshd`:
  the first `freqs.shape[-1]` channels rotated, half-split or interleaved pairs, optionally the
  MLA reordering first, cos and sin of the angles times `mscale` in t's dtype; the rest passed
  through), in the same arithmetic order.

`compiled()` gives both compiled (`torch.compile`, automatic dynamic shapes: the token count
varies from one micro-batch to the next) after a check on the device that each runs forward and
backward and matches the eager function; None with the reason logged when it does not (the
layers then stay eager). `fallbacks()` counts the functions dynamo has since given up recompiling
(past its recompile limit they run eagerly). `install_rope(fn)` makes megatron's RoPE call `fn` (None: megatron's
own again): its layers call the module-level function by name. The CPU always runs eager (tests compare these functions with
megatron's and torch's own there).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from slime_async.models.layer_math import rotate_half

log = logging.getLogger("slime_async.learner")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over halves (the engine's `rotate_half`), or over (even, odd)
    pairs when `interleaved`."""
    if interleaved:
        pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1)
        return pairs.flatten(-2)
    return rotate_half(x)


def rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    multi_latent_attention: bool | None = None,
) -> torch.Tensor:
    """megatron's bshd RoPE (both its keyword spellings of the MLA reordering)."""
    if multi_latent_attention is not None:
        mla_rotary_interleaved = bool(multi_latent_attention)
    dim = freqs.shape[-1]
    x, rest = t[..., :dim], t[..., dim:]
    if mla_rotary_interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    x = x * cos + _rotate_half(x, rotary_interleaved) * sin
    return torch.cat((x, rest), dim=-1)


class _RecompileLimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: from then on the function named runs
    eagerly (slower, same results). Dynamo says so only in its own log; the learner reports the
    count as a metric and says it in its own log too."""

    MARK = "torch._dynamo hit config."

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.MARK):
            self.count += 1
            log.warning(
                "learner.torch_compile: a compiled function runs eagerly from now on (slower, "
                "same results; learner/compile_fallbacks counts these): %s",
                " ".join(message.split("\n")[:2]),
            )


@functools.cache
def _hits() -> _RecompileLimitHits:
    handler = _RecompileLimitHits()
    logging.getLogger("torch._dynamo.convert_frame").addHandler(handler)
    return handler


def fallbacks() -> int:
    """torch.compile'd functions of this process (the ones here, megatron's SwiGLU, any other)
    that dynamo gave up recompiling since `watch_fallbacks()` was first called."""
    return _hits().count


def watch_fallbacks() -> None:
    """Start counting (idempotent)."""
    _hits()


class Compiled(NamedTuple):
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope: Callable[..., torch.Tensor]


@functools.cache
def compiled(device_index: int = 0) -> Compiled | None:
    """Both ops compiled and checked on CUDA device `device_index`; None (logged) if not usable."""
    try:
        # dynamic: the token count changes between micro-batches and the heads between q and
        # k; what stays specialised (a batch of 1 for packed rows, grad mode, dtype) gives a few
        # graphs per function, under dynamo's recompile limit (past it dynamo runs them eagerly
        # and says so).
        ops = Compiled(torch.compile(rms_norm, dynamic=True), torch.compile(rope, dynamic=True))
        dev = torch.device("cuda", device_index)
        gen = torch.Generator(device=dev).manual_seed(0)

        def randn(*shape, dtype=torch.bfloat16):
            return torch.randn(*shape, device=dev, generator=gen, dtype=dtype).requires_grad_()

        x, w = randn(5, 2, 64), randn(64)
        freqs = torch.rand(5, 1, 1, 32, device=dev, generator=gen) * 6.0
        q = randn(5, 2, 4, 64)
        for name, fn, ref, args in (
            ("rms_norm", ops.rms_norm, rms_norm, (x, w, 1e-6)),
            ("rope", ops.rope, rope, (q, freqs)),
        ):
            out, want = fn(*args), ref(*args)
            inputs = [a for a in args[:2] if a.requires_grad]  # x and w; q (freqs: none)
            grads = torch.autograd.grad(out.float().square().sum(), inputs)
            wants = torch.autograd.grad(want.float().square().sum(), inputs)
            err = max(
                [float((out.float() - want.float()).abs().max())]
                + [
                    float((g.float() - h.float()).abs().max() / (h.float().abs().max() + 1))
                    for g, h in zip(grads, wants, strict=True)
                ]
            )
            if not err < 0.1:
                raise RuntimeError(f"compiled {name} differs from eager by {err:.3g}")
        _check_megatron_swiglu(randn(5, 2, 128))
        watch_fallbacks()
    except Exception as e:  # any failure: eager layers, said once
        log.warning(
            "learner.torch_compile: the compiled RMSNorm/RoPE are not usable here, the layers "
            "run eagerly (%s: %s)",
            type(e).__name__,
            e,
        )
        return None
    return ops


def _check_megatron_swiglu(y: torch.Tensor) -> None:
    """megatron's SwiGLU fusion (`bias_activation_fusion`, torch.compile'd by megatron itself)
    runs forward and backward here and gives silu(a) * b."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    a, b = torch.chunk(y, 2, dim=-1)
    out = bias_swiglu_impl(y, None)
    want = torch.nn.functional.silu(a) * b
    out.float().sum().backward()
    err = float((out.float() - want.float()).abs().max())
    if not err < 0.1 or y.grad is None:
        raise RuntimeError(f"megatron's fused SwiGLU differs from silu(a) * b by {err:.3g}")


def install_rope(fn: Callable[..., torch.Tensor] | None) -> None:
    """megatron's layers apply RoPE through `fn`, or through megatron's own function again with
    None (process-wide: megatron's layers call the module's function by name)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils.__dict__.setdefault(
        "_slime_async_original_bshd", rope_utils._apply_rotary_pos_emb_bshd
    )
    rope_utils._apply_rotary_pos_emb_bshd = original if fn is None else fn
