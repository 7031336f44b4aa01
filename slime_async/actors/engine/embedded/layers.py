"""The embedded engine's fused decoder layer, for the families whose layers are the plain
`LayerMath` of `slime_async.models.layer_math` (llama / qwen2 / qwen3).

`FusedLayerMath`: one q|k|v matmul and one gate|up matmul over packed weights; on a GPU the
pieces between two matmuls are compiled by `torch.compile` (norms, rotary, residual adds and SiLU
fused into a few kernels), which cuts a decode step's ~35 kernels per layer to about ten. On a
CPU it runs uncompiled: the packed matmuls alone save ops, and a CPU step of a small model is
mostly per-op overhead. The HF parameters become views into the packed tensors, so a weight
update (`copy_` into the HF-named parameter) updates the packed tensors in place, and CUDA
graphs that captured them see the new weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from slime_async.models.family import Family
from slime_async.models.layer_math import LayerMath, rotate_half

log = logging.getLogger(__name__)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (fp32 statistics, weight applied in the input's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _fused_in(h, ln_w, eps: float, qkv_w, qkv_b, qn_w, kn_w, cos, sin, nq: int, nkv: int):
    d = cos.shape[-1]
    x = _rms(h, ln_w, eps)
    qkv = F.linear(x, qkv_w, qkv_b)
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], -1)
    q, k, v = q.view(-1, nq, d), k.view(-1, nkv, d), v.reshape(-1, nkv, d)
    if qn_w is not None:
        q, k = _rms(q, qn_w, eps), _rms(k, kn_w, eps)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _fused_out(h, o, o_w, ln_w, eps: float, gu_w, down_w):
    h = h + F.linear(o, o_w)
    x = _rms(h, ln_w, eps)
    g, u = F.linear(x, gu_w).chunk(2, -1)
    return h + F.linear(F.silu(g) * u, down_w)


def _pack(mods: list[torch.nn.Module], attr: str) -> torch.Tensor | None:
    """Concatenate `attr` of `mods` into one tensor and make each module's parameter a view of it."""
    parts = [getattr(m, attr) for m in mods]
    if any(p is None for p in parts):
        return None
    packed = torch.cat([p.data for p in parts], 0)
    off = 0
    for p in parts:
        n = p.shape[0]
        p.data = packed[off : off + n]
        off += n
    return packed


class FusedLayerMath(LayerMath):
    """Packed q|k|v and gate|up weights, the glue compiled; see the module docstring."""

    def __init__(self, model: torch.nn.Module, head_dim: int, compile: bool = True):
        super().__init__(model, head_dim)
        cfg = model.config
        self.nq, self.nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.w = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            self.w.append(
                dict(
                    ln=layer.input_layernorm.weight,
                    qkv=_pack(qkv, "weight"),
                    qkv_b=_pack(qkv, "bias"),
                    qn=a.q_norm.weight if hasattr(a, "q_norm") else None,
                    kn=a.k_norm.weight if hasattr(a, "k_norm") else None,
                    o=a.o_proj.weight,
                    post=layer.post_attention_layernorm.weight,
                    gu=_pack([m.gate_proj, m.up_proj], "weight"),
                    down=m.down_proj.weight,
                )
            )
        self._in, self._out = _fused_in, _fused_out
        if compile:
            self._in = torch.compile(_fused_in, fullgraph=True)
            self._out = torch.compile(_fused_out, fullgraph=True)

    def attn_in(self, li, h, cos, sin):
        w = self.w[li]
        return self._in(
            h,
            w["ln"],
            self.eps,
            w["qkv"],
            w["qkv_b"],
            w["qn"],
            w["kn"],
            cos,
            sin,
            self.nq,
            self.nkv,
        )

    def attn_out(self, li, h, o):
        w = self.w[li]
        return self._out(h, o, w["o"], w["post"], self.eps, w["gu"], w["down"])


def fusable(model: torch.nn.Module, family: Family) -> bool:
    """The fused path covers the layers a family leaves to the plain `LayerMath`, with SiLU MLPs
    and no biases outside q/k/v."""
    cfg, layer = model.config, model.model.layers[0]
    return (
        family.layer_math is LayerMath
        and cfg.hidden_act == "silu"
        and layer.self_attn.o_proj.bias is None
        and layer.mlp.gate_proj.bias is None
    )
