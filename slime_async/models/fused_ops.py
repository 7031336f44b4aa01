"""The learner's pointwise layer ops as Triton kernels on a GPU: RMSNorm, RoPE and SwiGLU.

Megatron's local layer spec (no Transformer Engine, no Apex) runs these eagerly: torch's fused
RMSNorm forward is one kernel, but its backward reduces the weight's gradient with a generic
kernel that is slow for the q/k norms' 128-wide weights over every token and head (about 12 ms of
a 110 ms step at the 0.51B Qwen3 shape, 8 x 1,024 tokens, on an H100), and RoPE is a chunk, a
negation, a concatenation, two products and a sum each way (about 10 ms). Compiled, each is one
kernel forward and one or two backward, computed in fp32 and rounded once. With them the layers
use megatron's SwiGLU fusion (`bias_activation_fusion`), whose function is replaced by the
hand-written kernels of `swiglu_triton.py` (megatron's own, which megatron compiles with
torch.compile, spends 5-7x its bytes' time in the backward pass), checked here too.

- `rms_norm(x, weight, eps)`: torch's RMSNorm (`torch.nn.functional.rms_norm`): x in fp32 times
  rsqrt(mean(x^2) + eps), times the weight in fp32, rounded to x's dtype.
- `rope(t, freqs, ...)`: megatron's RoPE on `[s, b, heads, d]` (`_apply_rotary_pos_emb_bshd`:
  the first `freqs.shape[-1]` channels rotated, half-split or interleaved pairs, optionally the
  MLA reordering first, cos and sin of the angles times `mscale` in t's dtype; the rest passed
  through), in the same arithmetic order.

`compiled()` gives both compiled (`torch.compile`, automatic dynamic shapes: the token count
varies from one micro-batch to the next) after a check on the device that each runs forward and
backward and matches the eager function; None with the reason logged when it does not (the
layers then stay eager). Its `swiglu` is the Triton SwiGLU where it passes the same check (None,
logged, where not: megatron's compiled fusion then, itself checked). `fallbacks()` counts the
functions dynamo has since given up recompiling (past its recompile limit they run eagerly).
`install_rope(fn)` makes megatron's RoPE call `fn`, `install_swiglu(fn)` its MLP's SwiGLU fusion
(None: megatron's own again): its layers call the module-level functions by name. The CPU always
runs eager (tests compare these functions with megatron's and torch's own there).
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
    swiglu: Callable[..., torch.Tensor] | None
    """`swiglu_triton.megatron_swiglu` where it passed its check on the device, else None
    (megatron's compiled fusion)."""


@functools.cache
def compiled(device_index: int = 0) -> Compiled | None:
    """The ops compiled and checked on CUDA device `device_index`; None (logged) if not usable."""
    try:
        # dynamic: the token count changes between micro-batches and the heads between q and
        # k; what stays specialised (a batch of 1 for packed rows, grad mode, dtype) gives a few
        # graphs per function, under dynamo's recompile limit (past it dynamo runs them eagerly
        # and says so).
        norm, rope_fn = torch.compile(rms_norm, dynamic=True), torch.compile(rope, dynamic=True)
        dev = torch.device("cuda", device_index)
        gen = torch.Generator(device=dev).manual_seed(0)

        def randn(*shape, dtype=torch.bfloat16):
            return torch.randn(*shape, device=dev, generator=gen, dtype=dtype).requires_grad_()

        x, w = randn(5, 2, 64), randn(64)
        freqs = torch.rand(5, 1, 1, 32, device=dev, generator=gen) * 6.0
        q = randn(5, 2, 4, 64)
        for name, fn, ref, args in (
            ("rms_norm", norm, rms_norm, (x, w, 1e-6)),
            ("rope", rope_fn, rope, (q, freqs)),
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
        # A half width that no block divides: the tiles' masked edges run too.
        ops = Compiled(norm, rope_fn, _checked_triton_swiglu(randn(5, 3, 2 * 200)))
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


def _checked_triton_swiglu(y: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """`swiglu_triton.megatron_swiglu` if its kernels run forward and backward on y's device and
    give silu(a) * b and its gradient (eager torch autograd); None, logged, if not."""
    from slime_async.models import swiglu_triton

    try:
        if not swiglu_triton.available(y.device):
            raise RuntimeError("Triton does not import")
        out = swiglu_triton.megatron_swiglu(y, None)
        a, b = torch.chunk(y, 2, dim=-1)
        want = torch.nn.functional.silu(a.float()) * b.float()
        (grad,) = torch.autograd.grad(out.float().square().sum(), y)
        (grad_want,) = torch.autograd.grad(want.square().sum(), y)
        err = max(
            float((out.detach().float() - want.detach()).abs().max()),
            float((grad.float() - grad_want).abs().max() / (grad_want.abs().max() + 1)),
        )
        if not err < 0.1:
            raise RuntimeError(f"it differs from eager torch by {err:.3g}")
    except Exception as e:  # megatron's compiled fusion instead, said once
        log.warning(
            "learner.swiglu_kernel: the Triton SwiGLU is not usable here, the layers run "
            "megatron's compiled SwiGLU fusion (%s: %s)",
            type(e).__name__,
            e,
        )
        return None
    return swiglu_triton.megatron_swiglu


def install_swiglu(fn: Callable[..., torch.Tensor] | None) -> None:
    """megatron's MLP applies its SwiGLU fusion (`bias_activation_fusion`) through `fn`, with
    the signature of megatron's `bias_swiglu_impl`, or through megatron's own function again
    with None (process-wide: the MLP calls the name `bias_swiglu_impl` of its module)."""
    from megatron.core.transformer import mlp

    original = mlp.__dict__.setdefault("_slime_async_original_swiglu", mlp.bias_swiglu_impl)
    mlp.bias_swiglu_impl = original if fn is None else fn


def install_rope(fn: Callable[..., torch.Tensor] | None) -> None:
    """megatron's layers apply RoPE through `fn`, or through megatron's own function again with
    None (process-wide: megatron's layers call the module's function by name)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils.__dict__.setdefault(
        "_slime_async_original_bshd", rope_utils._apply_rotary_pos_emb_bshd
    )
    rope_utils._apply_rotary_pos_emb_bshd = original if fn is None else fn
