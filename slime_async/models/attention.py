"""Core attention on torch's fused kernels, for megatron-core's local layer spec (no Transformer Engine).

`SDPAttention` stands where the local spec puts megatron's `DotProductAttention` (which
materialises `[b, heads, s, s]` fp32 scores and their softmax for the backward pass). It takes
the same constructor and forward arguments, in the two layouts megatron's `Attention` hands over:

- padded rows (`sbhd`: query `[s, b, heads, d]`): `scaled_dot_product_attention` with
  `is_causal=True`. On a GPU torch picks the flash / cuDNN / memory-efficient kernel; on the CPU
  the math kernel computes the same fp32 softmax as megatron's (the fp32 path stays exact). The
  learner only ever asks for causal attention over right-padded rows, which a causal mask keeps
  away from every real token, so the `[1, 1, s, s]` mask megatron passes along is not read.
- packed rows (several documents in one row: megatron's `thd` query `[t, heads, d]` with
  `PackedSeqParams`, or, as the learner runs them, an ordinary `[t, 1, heads, d]` row inside
  `packed_rows()`, which also gives RoPE each token's own position): per-document causal
  attention. On a GPU with torch's variable-length flash
  kernel (`torch.nn.attention.varlen.varlen_attn`, bf16/fp16) only the blocks inside each
  document are computed; elsewhere (the CPU path, fp32, or a torch without it) one SDPA call over a block-diagonal
  causal mask (exact; it still spends `t^2` compute). Megatron applies RoPE per document from
  the same `cu_seqlens` before this module is called (megatron's thd path), or from each token's
  position id (`packed_rows`).

Grouped-query heads are expanded to the query heads before the call: every kernel accepts that,
and the copy is small next to the activations the model keeps anyway.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from slime_async.utils.device import to_device

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


def sdpa_attention_class():
    """The module class (built lazily: it subclasses megatron's MegatronModule)."""
    return _build_class()


@functools.cache
def _build_class():
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Causal attention through torch's SDPA / varlen kernels; megatron's core-attention API."""

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type=None,
            attention_type: str = "self",
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
            **_ignored,
        ):
            super().__init__(config=config)
            if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
                tp = pg_collection.tp.size()
            else:
                tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads = config.num_attention_heads // tp
            self.groups = (config.num_query_groups or config.num_attention_heads) // tp
            head_dim = config.kv_channels
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
            self.packed = None  # set by `packed_rows` for one forward pass
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError("SDPAttention: attention_dropout must be 0 (the learner's models)")

        def _expand(self, kv: torch.Tensor, head_dim: int) -> torch.Tensor:
            """[.., groups, ..] -> [.., heads, ..] along `head_dim` (grouped-query attention)."""
            if self.groups == self.heads:
                return kv
            return kv.repeat_interleave(self.heads // self.groups, dim=head_dim)

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_ignored,
        ) -> torch.Tensor:
            if attention_bias is not None:
                raise ValueError("SDPAttention: attention_bias is not supported")
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            if self.packed is not None:  # `packed_rows`: [t, 1, heads, d], one packed row
                out = self._packed(query[:, 0], key[:, 0], value[:, 0], self.packed)
                return out.unsqueeze(1)
            s, b = query.shape[:2]
            q = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
            k = self._expand(key.permute(1, 2, 0, 3), 1)
            v = self._expand(value.permute(1, 2, 0, 3), 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * d]

        def _packed(self, query, key, value, params) -> torch.Tensor:
            """query [t, heads, d], key/value [t, groups, d] -> [t, heads * d]."""
            if params.qkv_format != "thd":
                raise ValueError(f"SDPAttention: packed format {params.qkv_format!r} (want thd)")
            cu = params.cu_seqlens_q
            t = query.shape[0]
            k = self._expand(key, 1)
            v = self._expand(value, 1)
            kernel = varlen_kernel()
            usable = query.is_cuda and query.dtype != torch.float32 and kernel is not None
            if usable and varlen_works(query.device.index or 0) is None:
                scale = {}
                if varlen_accepts("scale"):
                    scale = {"scale": self.scale}
                elif not math.isclose(self.scale, query.shape[-1] ** -0.5):
                    raise ValueError("this torch's varlen_attn takes no scale; packing needs it")
                m = int(params.max_seqlen_q)
                return kernel(query, k, v, cu, cu, m, m, **scale).reshape(t, -1)
            mask = block_causal_mask(cu, t)  # [t, t] True = attend
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            return out.transpose(0, 1).reshape(t, -1)

    return SDPAttention


@functools.cache
def varlen_kernel():
    """torch's variable-length flash attention, causal, as `f(q, k, v, cu_q, cu_k, max_q, max_k,
    scale=)`; None where this torch has none (the keyword for causality changed across versions)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return functools.partial(varlen_attn, **causal)


@functools.cache
def varlen_accepts(keyword: str) -> bool:
    """Whether this torch's varlen kernel takes `keyword` (`scale`, `enable_gqa`: both arrived
    in later releases); False where there is no kernel."""
    kernel = varlen_kernel()
    return kernel is not None and keyword in inspect.signature(kernel.func).parameters


@functools.cache
def varlen_works(device_index: int = 0) -> str | None:
    """None when the varlen kernel gives SDPA's per-document causal attention on this GPU (bf16,
    grouped heads expanded, two documents); else why not. Checked once per process: the kernel's
    signature and availability changed across torch releases."""
    kernel = varlen_kernel()
    if kernel is None:
        return "torch.nn.attention.varlen.varlen_attn is missing or has no causal option"
    try:
        dev = torch.device("cuda", device_index)
        gen = torch.Generator(device=dev).manual_seed(0)
        t, h, d = 48, 4, 64
        q, k, v = (
            torch.randn(t, h, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in "qkv"
        )
        cu = torch.tensor([0, 17, t], dtype=torch.int32, device=dev)
        kw = {"scale": d**-0.5} if varlen_accepts("scale") else {}
        out = kernel(q, k, v, cu, cu, 31, 31, **kw).float()
        mask = block_causal_mask(cu, t)
        ref = F.scaled_dot_product_attention(
            q.float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
        ).transpose(0, 1)
        err = float((out - ref).abs().max())
    except Exception as e:  # any failure: the kernel is not usable here
        return f"varlen_attn failed: {type(e).__name__}: {e}"
    return None if err < 5e-2 else f"varlen_attn differs from SDPA by {err:.3g}"


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[t, t] bool, True where query i may attend key j: same document and j <= i."""
    pos = torch.arange(total, device=cu_seqlens.device)
    doc = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)  # [t] document index
    same = doc[:, None] == doc[None, :]
    return same & (pos[None, :] <= pos[:, None])


def packed_seq_params(doc_lens: list[int], device: torch.device):
    """megatron's `PackedSeqParams` (thd) for documents of `doc_lens` tokens packed in one row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(doc_lens, dtype=torch.int32).cumsum(0)
    cu = to_device(cu, device)
    longest = max(doc_lens)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def set_packed(model, params) -> None:
    """The documents (PackedSeqParams, or None for ordinary rows) that `model`'s SDPAttention
    modules see in their one row. It stays set after the forward pass: activation recomputation
    re-runs the attention during the backward pass and must see the same documents."""
    cores = model.__dict__.get("_sdpa_cores")
    if cores is None:  # found once per model: a walk over every module took ~1 ms a micro-batch
        cores = [m for m in model.modules() if type(m).__name__ == "SDPAttention"]
        model.__dict__["_sdpa_cores"] = cores
    if params is not None and not cores:
        raise ValueError("packed rows need learner.attention = sdpa")
    for m in cores:
        m.packed = params


@contextlib.contextmanager
def packed_rows(model, params, position_ids: torch.Tensor) -> Iterator[None]:
    """While active, `model` (a GPTModel with SDPAttention) treats its one input row as the
    documents of `params` (PackedSeqParams) laid end to end, without being given `params`.

    Megatron's own packed path (thd) applies RoPE one document at a time (a Python loop with a
    host sync per layer: on the H200 it made packed rows slower than padded ones); here RoPE
    takes each token's angle from its position id (`[t, 1, 1, d]`, rotated row by row by the
    ordinary path, and saved as an input by activation recomputation) and the attention modules
    get the documents' boundaries (`set_packed`, left set for the backward pass)."""
    set_packed(model, params)
    rotary = model.rotary_pos_emb
    pos = position_ids.reshape(-1)
    longest = int(params.max_seqlen_q)

    def forward(max_seq_len, *args, **kwargs):
        emb = type(rotary).forward(rotary, longest)  # [longest, 1, 1, d]
        return emb.index_select(0, pos)  # [t, 1, 1, d]: each token at its own position

    rotary.forward = forward
    try:
        yield
    finally:
        del rotary.forward


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (a user's cluster): its layer spec is then used."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True
