"""The per-layer math of the embedded engine's decoder, in small replaceable pieces.

Tokens are packed, `[T, ...]` (no batch dimension, no padding). `LayerMath` calls the HF model's
own modules (exact against HF, any dtype, any device) and is the hook for model families: a
family's subclass (its folder's `engine.py`) replaces `input_norm`, `qkv` (projections and q/k
norms), `rotary`, `o_proj`, `post_norm` or `mlp`; `attn_in` and `attn_out` compose them around
the attention, which the engine's runner does over its paged cache.
"""

from __future__ import annotations

import torch


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
