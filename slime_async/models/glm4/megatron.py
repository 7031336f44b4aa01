"""GLM-4 in megatron-core's local layer: its attention and its MLP each end in an RMSNorm
(`post_layernorm`) applied to their output before the residual add.

megatron.core is imported inside the functions: only after `megatron_compat.apply()`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


def post_normed_layer(spec: ModuleSpec, norm: type) -> ModuleSpec:
    """The layer `spec` with its attention and MLP modules followed by a `norm` each."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    sub = spec.submodules
    attn = dataclasses.replace(sub.self_attention, module=_post_normed(SelfAttention, norm))
    mlp = post_normed_mlp(sub.mlp, _post_normed(MLP, norm))
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp)
    )


def post_normed_mlp(mlp: Any, post_mlp: type) -> Any:
    """The MLP entry of a layer spec building `post_mlp` (an MLP subclass) instead of the MLP.

    megatron-core 0.16 describes the dense MLP as a `ModuleSpec`; 0.17+ as
    `functools.partial(MLP.as_mlp_submodule, submodules=...)`, which builds whatever class the
    classmethod is bound to."""
    if dataclasses.is_dataclass(mlp):
        return dataclasses.replace(mlp, module=post_mlp)
    if (
        isinstance(mlp, functools.partial)
        and getattr(mlp.func, "__name__", "") == "as_mlp_submodule"
    ):
        return functools.partial(post_mlp.as_mlp_submodule, *mlp.args, **mlp.keywords)
    raise TypeError(f"GLM-4's post-norm MLP: unexpected MLP spec {mlp!r} in megatron-core's layer")


def _post_normed(base: type, norm: type) -> type:
    class PostNorm(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_layernorm = norm(config, config.hidden_size, config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            return self.post_layernorm(out), bias

    PostNorm.__name__ = PostNorm.__qualname__ = f"PostNorm{base.__name__}"
    return PostNorm
