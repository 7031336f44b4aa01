"""The embedded engine's model: a Hugging Face causal LM run over a slot KV cache.

Why not HF `generate()` or a per-request `DynamicCache`: continuous batching needs requests of
different lengths to share one decode step. Stacking per-request caches every step copies the
whole KV cache each token; instead this module keeps one preallocated cache per layer,
`k, v: [S, Hkv, L, D]` (S = max running requests, L = max context length), and runs the HF
model's own submodules (embedding, norms, q/k/v/o projections, q/k norms of Qwen3, MLP, rotary
embedding, lm_head) with its own attention over that cache:

- Running requests occupy slots 0..n-1 (compacted when one leaves: the last slot's rows move into
  the hole), so a decode step attends over the views `k[:n, :, :Lmax]` without a gather; each
  row masks the positions past its own length.
- Prefill runs newly admitted prompts as one right-padded batch with a causal mask: a real token
  never sees the padding after it, so padding changes nothing, and each row's K/V is written into
  its slot.

Families: those of `families.py` (the ones the learner converts). Memory is bounded by the cache:
2 * layers * S * Hkv * L * D elements of `dtype`, allocated once at start.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.embedded import families


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    """One HF causal LM plus its slot KV cache. Not thread-safe: one scheduler thread drives it."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 64,
        max_context_len: int = 2048,
    ):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, local_files_only=True
        )
        cfg = model.config
        self.family = families.for_model(model)  # refuses a model type it does not serve
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{self.model_path}: sliding-window attention is not supported")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_slots = max_slots
        max_pos = int(getattr(cfg, "max_position_embeddings", max_context_len) or max_context_len)
        self.max_context_len = min(max_context_len, max_pos)
        attn = self.model.model.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        shape = (max_slots, self.num_kv_heads, self.max_context_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        self.eos_token_ids = _eos_ids(cfg)
        self._graph_sizes: list[int] = []  # batch sizes with a captured decode graph
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def layers(self):
        return self.model.model.layers

    # ---- forward passes ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run `prompts` (one per slot) from position 0; returns last-token logits [n, V]."""
        n, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((n, t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.arange(t, device=self.device)[None, :].expand(n, t)
        lengths = [len(p) for p in prompts]
        # Where each real (non-padding) token's K/V goes: one scatter per layer, not one per row.
        row_idx = torch.tensor(
            [i for i, ln in enumerate(lengths) for _ in range(ln)], device=self.device
        )
        pos_idx = torch.tensor([j for ln in lengths for j in range(ln)], device=self.device)
        slot_idx = torch.tensor(slots, device=self.device)[row_idx]

        def attend(layer: int, q, k, v):  # q: [n, H, t, D]; k, v: [n, Hkv, t, D]
            self.k_cache[layer][slot_idx, :, pos_idx] = k.transpose(1, 2)[row_idx, pos_idx]
            self.v_cache[layer][slot_idx, :, pos_idx] = v.transpose(1, 2)[row_idx, pos_idx]
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, scale=self._scale
            )

        h = self._forward(ids, pos, attend)  # [n, t, hidden]
        last = torch.tensor([ln - 1 for ln in lengths], device=self.device)
        h_last = h[torch.arange(n, device=self.device), last]  # [n, hidden]
        return self.model.lm_head(self.model.model.norm(h_last)).float()

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One step for slots 0..n-1: feed `tokens[i]` at `positions[i]`; returns logits [n, V]."""
        n = len(tokens)
        size = next((b for b in self._graph_sizes if b >= n), None)
        if size is None:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [n, 1]
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [n]
            return self._decode_step(ids, pos, max(positions) + 1)
        # Rows n..size-1 are padding: they write K/V at position 0 of free slots, never read.
        self._ids.zero_()
        self._pos.zero_()
        self._ids[:n, 0].copy_(torch.tensor(tokens, dtype=torch.long))
        self._pos[:n].copy_(torch.tensor(positions, dtype=torch.long))
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]

    def _decode_step(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """ids: [n, 1], pos: [n] on the device; attends over cache positions [0, span)."""
        n = ids.shape[0]
        rows = torch.arange(n, device=self.device)
        # attend_mask: [n, 1, 1, span], True where key position <= the row's own position.
        attend_mask = torch.arange(span, device=self.device)[None, :] <= pos[:, None]
        attend_mask = attend_mask[:, None, None, :]

        def attend(layer: int, q, k, v):  # q: [n, H, 1, D]; k, v: [n, Hkv, 1, D]
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
            return F.scaled_dot_product_attention(
                q,
                kc[:n, :, :span],
                vc[:n, :, :span],
                attn_mask=attend_mask,
                enable_gqa=True,
                scale=self._scale,
            )

        h = self._forward(ids, pos[:, None], attend)  # [n, 1, hidden]
        return self.model.lm_head(self.model.model.norm(h[:, 0])).float()

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> list[int]:
        """Capture the decode step for batch sizes 1, 2, 4, 8, 16, 32, ... and max_slots.

        Why: a decode step of a small model is a few hundred tiny kernels; launching them one by
        one costs more than running them. A graph replays them in one launch. Graphs attend over
        the whole cache length (masked), so one graph serves every step of its batch size; the
        weights and KV cache are updated in place, so graphs stay valid across weight updates.
        """
        if self.device.type != "cuda":
            return []
        small = [b for b in (1, 2, 4, 8) if b < self.max_slots]
        sizes = sorted({*small, *range(16, self.max_slots, 16), self.max_slots})
        self._ids = torch.zeros((self.max_slots, 1), dtype=torch.long, device=self.device)
        self._pos = torch.zeros((self.max_slots,), dtype=torch.long, device=self.device)
        span = self.max_context_len
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (cuBLAS handles, allocator) off the capture
            for _ in range(2):
                self._decode_step(self._ids, self._pos, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(sizes):  # largest first, so smaller graphs reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_step(self._ids[:b], self._pos[:b], span)
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sizes
        return sizes

    @property
    def _scale(self) -> float:
        return self.head_dim**-0.5

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack on ids/pos [n, t] with `attend` doing cache I/O; returns [n, t, hidden]."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)  # [n, t, D]
        cos, sin = cos[:, None], sin[:, None]
        n, t = ids.shape
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, t, -1, self.head_dim)
            k = attn.k_proj(x).view(n, t, -1, self.head_dim)
            v = attn.v_proj(x).view(n, t, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self.family.rotary(q, k, cos, sin)
            o = attend(li, q, k, v).transpose(1, 2).reshape(n, t, -1)
            h = h + self.family.attn_out(layer, attn.o_proj(o))
            h = h + self.family.mlp(layer, layer.post_attention_layernorm(h))
        return h

    def drop_cuda_graphs(self) -> None:
        self._graph_sizes, self._graphs = [], {}

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (compaction)."""
        for kc, vc in zip(self.k_cache, self.v_cache, strict=True):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Give slot `dst` the first `length` cached positions of `src` (n > 1 shares a prefill)."""
        self.move_slot(src, dst, length)

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int], temperature: float) -> list[float]:
        """log_softmax(logits / T) of each prompt token given the ones before it ([len(ids) - 1]);
        a plain forward without the KV cache (prompt scoring, SGLang's input_token_logprobs)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float() / temperature  # [t-1, V]
        logp = torch.log_softmax(logits, -1)
        return logp.gather(1, x[0, 1:, None])[:, 0].tolist()

    # ---- weights -------------------------------------------------------------------------

    def parameter_names(self) -> set[str]:
        return {n for n, _ in self.model.named_parameters(remove_duplicate=False)}

    @torch.inference_mode()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every name and shape is checked before any copy."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        targets = [families.param_view(params, name) for name, _ in named]
        for (name, t), target in zip(named, targets, strict=True):
            if target is None:
                raise ValueError(f"unknown parameter {name!r} for this model")
            if tuple(target.shape) != tuple(t.shape):
                raise ValueError(
                    f"parameter {name!r}: shape {tuple(t.shape)} != model's {tuple(target.shape)}"
                )
        for (_, t), target in zip(named, targets, strict=True):
            target.copy_(t.to(device=self.device, dtype=target.dtype))

    def load_from_disk(self, model_path: str | Path) -> None:
        """Load every safetensors tensor of an HF directory into the running model."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            named += [
                (k, v)
                for k, v in load_file(str(f)).items()
                if families.param_view(params, k) is not None
            ]
        if not named:
            raise ValueError(f"{model_path} holds none of this model's parameters")
        self.load_weights(named)


def _eos_ids(cfg) -> frozenset[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
