"""Weight gradients added straight into fp32 accumulators: the product of a backward pass's
bf16 matrices summed into an fp32 buffer by the matrix multiply itself.

`add_product(acc, a, b)` is `acc += a @ b`. For bf16 (or fp16) `a`, `b` and an fp32 `acc` on a
GPU, cuBLAS adds the product into `acc` in its epilogue (torch's `addmm` with `out_dtype`,
torch >= 2.8): no bf16 product is written, read back and converted. Elsewhere, or where torch
refuses that call (logged once per process), the product is converted and added.

`install_megatron()` gives megatron-core's linear layers this as their gradient-accumulation
fusion. With `gradient_accumulation_fusion` on, megatron's `LinearWithGradAccumulation...`
backward adds each weight gradient into the parameter's `main_grad` (the fp32 buffer of
megatron's DDP) through Apex's `fused_weight_gradient_mlp_cuda` and marks it
`grad_added_to_main_grad`, so DDP's hook skips its own `main_grad.add_(grad)`. Without Apex
megatron refuses the option; `install_megatron()` puts `add_product` where megatron looks for
that extension (module attributes of `megatron.core.tensor_parallel.layers`), and keeps a real
extension found at import. The layers then need `main_grad` on every weight they train: only a
model under megatron's DDP may be built with the option (`build_gpt_model(wgrad_fusion=...)`).
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

# Per process: whether torch's mixed-dtype addmm ran (True), was refused (False), or is untried.
_MIXED: dict[str, bool] = {}


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` in place; `acc` may be fp32 where `a`, `b` are bf16/fp16 (see module)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and acc.dtype == torch.float32 and _MIXED.get("addmm") is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except (RuntimeError, TypeError) as e:
            _MIXED["addmm"] = False
            log.warning(
                "weight gradients: %s x %s -> fp32 addmm refused (%s); converting the "
                "product instead",
                a.dtype,
                b.dtype,
                e,
            )
        else:
            _MIXED["addmm"] = True
            return
    acc += (a @ b).to(acc.dtype)


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    """Apex's `wgrad_gemm_accum_fp32/fp16(input, grad_output, main_grad)`: main_grad [out, in]
    += grad_output[tokens, out].T @ input[tokens, in] (megatron passes both as 2-D)."""
    add_product(main_grad, grad_output.t(), total_input)


# What megatron calls as `fused_weight_gradient_mlp_cuda`: the two entry points it uses.
EXTENSION = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_accumulate, wgrad_gemm_accum_fp16=_accumulate, __name__=__name__
)


def install_megatron() -> str:
    """Let megatron's linear layers take `gradient_accumulation_fusion`; which kernel they use:
    "apex" (the extension megatron imported) or "torch" (`add_product`). Idempotent; call it
    after `megatron_compat.apply()`."""
    from megatron.core.tensor_parallel import layers

    current = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    if current is EXTENSION:
        return "torch"
    if layers._grad_accum_fusion_available and current is not None:
        return "apex"
    layers.fused_weight_gradient_mlp_cuda = EXTENSION
    layers._grad_accum_fusion_available = True
    return "torch"
