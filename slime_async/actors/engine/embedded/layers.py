"""The per-layer math of the embedded engine's decoder, in small replaceable pieces.

Tokens are packed, `[T, ...]` (no batch dimension, no padding). `LayerMath` calls the HF model's
own modules (exact against HF, any dtype, any device) and is the hook for model families:
a subclass replaces `input_norm`, `qkv` (projections and q/k norms), `rotary`, `o_proj`,
`post_norm` or `mlp` (GLM-4's partial rotary, Qwen3-MoE's sparse MLP, ...); `attn_in` and
`attn_out` compose them around the attention, which the runner does over its paged cache.

`FusedLayerMath` (llama / qwen2 / qwen3): one q|k|v matmul and one gate|up matmul over packed
weights; on a GPU the pieces between two matmuls are compiled by `torch.compile` (norms, rotary,
residual adds and SiLU fused into a few kernels), which cuts a decode step's ~35 kernels per
layer to about ten. On a CPU it runs uncompiled: the packed matmuls alone save ops, and a CPU
step of a small model is mostly per-op overhead. The HF parameters become views into the packed tensors, so a weight update
(`copy_` into the HF-named parameter) updates the packed tensors in place, and CUDA graphs that
captured them see the new weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerMath:
    """HF-module math of one decoder layer (llama / qwen2 / qwen3 shapes)."""

    def __init__(self, model: torch.nn.Module, head_dim: int):
        self.layers = model.model.layers
        self.head_dim = head_dim

    def input_norm(self, li: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[li].input_layernorm(h)

    def qkv(self, li: int, x: torch.Tensor):
        """x: [T, hidden] -> q [T, H, D], k, v [T, Hkv, D] (q/k normed per head where the family does)."""
        attn = self.layers[li].self_attn
        t, d = x.shape[0], self.head_dim
        q = attn.q_proj(x).view(t, -1, d)
        k = attn.k_proj(x).view(t, -1, d)
        v = attn.v_proj(x).view(t, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """cos, sin: [T, 1, D]."""
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def o_proj(self, li: int, o: torch.Tensor) -> torch.Tensor:
        return self.layers[li].self_attn.o_proj(o)

    def post_norm(self, li: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[li].post_attention_layernorm(h)

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[li].mlp(x)

    def attn_in(self, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = self.qkv(li, self.input_norm(li, h))
        q, k = self.rotary(q, k, cos, sin)
        return q, k, v

    def attn_out(self, li: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o: [T, H * D] (the attention's output) -> the layer's output hidden states."""
        h = h + self.o_proj(li, o)
        return h + self.mlp(li, self.post_norm(li, h))


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


def fusable(model: torch.nn.Module) -> bool:
    """The fused path covers the dense llama / qwen2 / qwen3 layers with SiLU MLPs."""
    cfg, layer = model.config, model.model.layers[0]
    return (
        cfg.model_type in ("llama", "qwen2", "qwen3")
        and cfg.hidden_act == "silu"
        and layer.self_attn.o_proj.bias is None
        and layer.mlp.gate_proj.bias is None
    )
