"""The embedded engine's model: a Hugging Face causal LM run over a paged KV cache.

Why not HF `generate()` or a per-request `DynamicCache`: continuous batching needs requests of
different lengths to share one step. This module runs the HF model's own weights (embedding,
rotary, the per-layer math of layers.py, final norm, lm_head) over packed tokens, `[T, ...]`,
with attention over a paged KV cache (kv_cache.py: fixed-size blocks, a block table per request):

- `prefill`: the new tokens of many prompts packed into one forward pass without padding (the
  matmuls see only real tokens); each prompt's K/V is written into its blocks and its queries
  attend over its own cached keys (a prefix-index hit is read, not recomputed).
- `decode`: one token per request; attention reads only each request's own blocks up to its own
  length (attention.py: a Triton paged kernel on CUDA; on a CPU SDPA over the blocks gathered
  with one plan that every layer shares, `_decode_cpu`). On a GPU the
  step is replayed from a CUDA graph per batch-size bucket (cuda_graphs.py); the inputs (token,
  position, block table) live in static buffers, the weights are updated in place, so one graph
  serves every step of its bucket across weight updates.

Families: those of `slime_async.models.families` (the ones the learner converts); `self.math`
(the fused layers of layers.py, or the family's `LayerMath`) is the per-layer hook. Memory: the weights, the KV cache (sized once at start: on a GPU from
`mem_fraction` of its memory less what it keeps free for another process there,
`gpu_reserve_bytes`; on a CPU `max_slots * max_context_len` tokens unless given), and
the activations of one prefill of at most `max_prefill_tokens` or one decode of `max_slots`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.embedded import attention, pick_kernels, shared_prefix
from slime_async.actors.engine.embedded.kv_cache import (
    BlockPool,
    blocks_for_memory,
    kv_bytes_per_token,
)
from slime_async.actors.engine.embedded.layers import FusedLayerMath, fusable
from slime_async.actors.engine.embedded.sampling import (
    EAGER_PICKS,
    Picks,
    SeededDraw,
    greedy_pick,
    seeded_argmax,
    thresholds_hold,
)
from slime_async.actors.engine.embedded.shared_prefix import Groups, SharedPrefix
from slime_async.models.families import FAMILIES
from slime_async.models.family import Family
from slime_async.models.layer_math import LayerMath
from slime_async.utils.device import to_device

log = logging.getLogger(__name__)

_GATHERED_OPERANDS = ("kv_slots", "q_pos", "kv_len", "q_rows", "tok_rows")
"""The prefill plan's operands of the gathered path, in `attention.gather_plan`'s order."""


def _passed(err: str | None, forced: bool, what: str, instead: str) -> bool:
    """A start-up check's outcome (`err`: None or what went wrong): True where it passed; where
    it failed, refused (RuntimeError) when the setting forced the path, else logged as an error
    naming what runs `instead`, and False."""
    if err is None:
        return True
    if forced:
        raise RuntimeError(f"{what} failed its check: {err}")
    log.error("%s failed its check (%s): %s instead", what, err, instead)
    return False


class ModelRunner:
    """One HF causal LM plus its paged KV cache. Not thread-safe: one scheduler thread drives it."""

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 64,
        max_context_len: int = 2048,
        block_size: int = 16,
        num_blocks: int | None = None,
        mem_fraction: float = 0.8,
        gpu_reserve_bytes: int = 0,
        max_prefill_tokens: int = 8192,
        fused: bool | None = None,
        compile: bool = True,
        decode_attention: str = "auto",
        decode_shared_prefix: str = "auto",
        prefill_attention: str = "auto",
    ):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, local_files_only=True
        )
        cfg = model.config
        self.family = _family(self.model_path, cfg.model_type)
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{self.model_path}: sliding-window attention is not supported")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_slots = max_slots
        self.max_prefill_tokens = max_prefill_tokens
        max_pos = int(getattr(cfg, "max_position_embeddings", max_context_len) or max_context_len)
        self.max_context_len = min(max_context_len, max_pos)
        attn = self.model.model.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.eos_token_ids = _eos_ids(cfg)
        cuda = self.device.type == "cuda"
        # Packed q|k|v and gate|up matmuls on any device (on a CPU without torch.compile: a CPU
        # step of a small model is mostly per-op overhead, and packing saves three ops a layer).
        fused = fusable(self.model, self.family) if fused is None else fused
        self.math: LayerMath = (
            FusedLayerMath(self.model, self.head_dim, compile=compile and cuda)
            if fused
            else self.family.layer_math(self.model, self.head_dim)
        )
        # The seeded draw (requests with a sampling_seed, e.g. pinned evaluation): its hash and
        # Gumbel noise are some 40 elementwise ops over [rows, vocab]; compiled on a GPU they are
        # one kernel (integer ops, so the draws are the same as eager's and the CPU's).
        self.seeded_draw: SeededDraw = (
            torch.compile(seeded_argmax, dynamic=True) if compile and cuda else seeded_argmax
        )
        # The unfiltered draws (greedy, or at a temperature without top-k/top-p): on a GPU the
        # Triton kernels of pick_kernels.py, one pass over the [rows, V] logits in the model's
        # dtype (checked against the eager picks at start: `warm_sampling`).
        self.picks: Picks = (
            Picks(
                pick_kernels.greedy_pick, pick_kernels.temperature_pick, pick_kernels.filtered_pick
            )
            if cuda and pick_kernels.available(self.device)
            else EAGER_PICKS
        )
        # ---- the paged KV cache
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(self.max_context_len / block_size)
        layers = len(self.model.model.layers)
        # MoE: the experts each cached token went through, one row per KV slot (routing replay).
        moe = getattr(self.math, "moe_layers", [])
        self.routed_shape = (len(moe), int(getattr(cfg, "num_experts_per_tok", 0) or 0))
        routed_bytes = 4 * self.routed_shape[0] * self.routed_shape[1]
        per_token = kv_bytes_per_token(layers, self.num_kv_heads, self.head_dim, dtype)
        per_block = block_size * (per_token + routed_bytes)
        self.memory: dict[str, int | float] = {"mem_fraction": mem_fraction}
        if num_blocks is not None and cuda and gpu_reserve_bytes:
            free, _ = torch.cuda.mem_get_info(self.device)
            need = num_blocks * per_block + self._activation_bytes() + gpu_reserve_bytes
            if need > free:
                raise ValueError(
                    f"engine.embedded.kv_cache_tokens: {num_blocks} blocks "
                    f"({num_blocks * per_block / 2**30:.1f} GiB) with the activations and the "
                    f"{gpu_reserve_bytes / 2**30:.1f} GiB kept free for the learner "
                    f"(engine.embedded.gpu_reserve_gib) need {need / 2**30:.1f} GiB, and "
                    f"{free / 2**30:.1f} GiB is free on {self.device}"
                )
        if num_blocks is None:
            if cuda:
                num_blocks, info = blocks_for_memory(
                    self.device,
                    mem_fraction,
                    per_block,
                    self._activation_bytes(),
                    others_bytes=gpu_reserve_bytes,
                    min_blocks=self.max_blocks_per_seq + 1,  # + the scratch block
                )
                self.memory.update(info)
            else:  # every slot can hold a whole context, as the old slot cache
                num_blocks = max_slots * self.max_blocks_per_seq + 1
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.routed: torch.Tensor | None = None
        """[num_blocks * block_size, moe_layers, k] int32: the experts of the token at each KV
        slot, written by the forward pass that wrote its K/V (None: a dense model)."""
        if moe:
            self.routed = torch.zeros(
                (num_blocks * block_size, *self.routed_shape), dtype=torch.int32, device=self.device
            )
        self.pool = BlockPool(num_blocks, block_size)
        self.keep_prefixes_on_update = False
        """Keep the prefix index through a weight update (strict mode: SGLang's radix cache
        outlives an update that does not flush)."""
        self._param_table: dict[str, torch.Tensor] | None = None
        self.memory.update(
            num_blocks=num_blocks, block_size=block_size, kv_bytes=num_blocks * per_block
        )
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens)",
            num_blocks,
            block_size,
            num_blocks * per_block / 2**30,
            num_blocks * block_size,
        )
        self.decode_attention = self._pick_attention(decode_attention)
        self.group_max = shared_prefix.group_size(self.num_heads, self.num_kv_heads)
        self.decode_shared_prefix = self._pick_shared_prefix(decode_shared_prefix)
        """'on': decode steps read the KV blocks their rows share once (`shared_prefix.py`)."""
        self.prefill_attention = self._pick_prefill(prefill_attention)
        """'varlen': prefills through torch's variable-length flash kernel; 'gathered': SDPA
        over each sequence's gathered blocks (the CPU, or where the kernel failed its check)."""
        log.info(
            "prefill attention: %s; decode attention: %s; a shared prompt's keys read once a "
            "group: %s",
            self.prefill_attention,
            self.decode_attention,
            self.decode_shared_prefix,
        )
        self.graphs = None  # cuda_graphs.DecodeGraphs once captured

    def _activation_bytes(self) -> int:
        """A bound on the activations besides the cache: one prefill of max_prefill_tokens (layer
        intermediates, in the weights' dtype) and one decode's logits and sampling (fp32)."""
        cfg, el = self.config, torch.empty((), dtype=self.dtype).element_size()
        width = 6 * cfg.hidden_size + 3 * cfg.intermediate_size
        width += 3 * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        prefill = self.max_prefill_tokens * width * el
        # Prefill attention over gathered blocks: scores of each prompt's queries over its keys
        # (fp32, all heads; SDPA's math path when a mask is given) and the gathered K/V.
        keys = min(self.max_context_len, self.max_prefill_tokens)
        prefill += self.max_prefill_tokens * keys * self.num_heads * 4 * 2
        # Logits (the graphs' buffer and the eager ones), then the sampler's scaled logits,
        # log-softmax, softmax, sort and cumsum (top-p), multinomial: fp32 [max_slots, V] each.
        sampling = self.max_slots * self.vocab_size * 4 * 10
        return int(prefill + sampling + (1 << 30))

    def _pick_attention(self, choice: str) -> str:
        d_ok = self.head_dim & (self.head_dim - 1) == 0 and self.block_size >= 16
        if choice == "gathered":
            return "gathered"
        if not (attention.triton_available(self.device) and d_ok):
            if choice == "triton":
                raise ValueError(
                    "engine.embedded.decode_attention = 'triton' needs a CUDA device with Triton, a "
                    "power-of-two head_dim and engine.embedded.block_size >= 16"
                )
            return "gathered"
        if self.device.type == "cuda" and not _passed(
            self._check_kernel(), choice == "triton", "the paged decode kernel", "gathered SDPA"
        ):
            return "gathered"
        return "triton"

    def _pick_shared_prefix(self, choice: str) -> str:
        runs = self.decode_attention == "triton" and self.device.type == "cuda"
        if choice == "on" and not runs:
            raise ValueError(
                "engine.embedded.decode_shared_prefix = 'on' needs the triton decode kernel on a "
                f"CUDA device (here: {self.decode_attention} attention on {self.device})"
            )
        if choice == "off" or not runs:
            return "off"
        if not _passed(
            self._check_shared(),
            choice == "on",
            "the shared-prefix decode kernel",
            "each row reading its own blocks",
        ):
            return "off"
        return "on"

    def _pick_prefill(self, choice: str) -> str:
        """'varlen' ("auto" or "varlen") on a CUDA device in a 16-bit dtype where torch's varlen
        kernel exists and matches the gathered reference at this model's head shape (a cached
        prefix, a prompt of several blocks, a single token); else 'gathered', the reason logged
        ("varlen" refused where it cannot run)."""
        if choice == "gathered":
            return "gathered"
        why = (
            f"a CUDA device (here {self.device})"
            if self.device.type != "cuda"
            else f"a 16-bit dtype (here {self.dtype})"
            if self.dtype not in (torch.bfloat16, torch.float16)
            else None
        )
        if why is not None:
            if choice == "varlen":
                raise ValueError(f"engine.embedded.prefill_attention = 'varlen' needs {why}")
            return "gathered"
        if not _passed(
            self._check_prefill(),
            choice == "varlen",
            "the varlen prefill attention",
            "gathered SDPA",
        ):
            return "gathered"
        return "varlen"

    def _check_prefill(self) -> str | None:
        """The varlen prefill against the gathered path on random blocks: None, or what went
        wrong."""
        try:
            from slime_async.models.attention import varlen_kernel

            if varlen_kernel() is None:
                return "torch.nn.attention.varlen.varlen_attn is missing or has no causal option"
            g = torch.Generator(device=self.device).manual_seed(0)
            dev, bs, d = self.device, self.block_size, self.head_dim
            kc = torch.randn(9, bs, self.num_kv_heads, d, generator=g, device=dev).to(self.dtype)
            vc = torch.randn(kc.shape, generator=g, device=dev).to(self.dtype)
            # (new tokens, start): a cached prefix, a whole prompt over blocks, one token
            lens, starts = [5, 2 * bs + 1, 1], [bs + 3, 0, bs]
            tables = [[3, 1, 0], [5, 8, 2], [7, 4, 0]]
            plans = {k: self._prefill_plan(lens, starts, tables, k) for k in ("varlen", "gathered")}
            q = torch.randn(sum(lens), self.num_heads, d, generator=g, device=dev)
            q = q.to(self.dtype)
            got = self._prefill_attend(plans["varlen"], "varlen")(q, kc, vc).float()
            ref = self._prefill_attend(plans["gathered"], "gathered")
            ref = ref(q.float(), kc.float(), vc.float())
            err = ((got - ref).norm() / ref.norm()).item()
            tol = 1e-4 if self.dtype == torch.float32 else 2e-2
            return None if err < tol else f"relative error {err:.2e} > {tol}"
        except Exception as e:  # no kernel for this dtype or head width, ...
            return f"{type(e).__name__}: {e}"

    def groups(self, block_tables: torch.Tensor, positions: torch.Tensor) -> Groups | None:
        """The rows of a decode batch that share leading blocks (`shared_prefix.find_groups`),
        None where there are none or sharing is off. Host tensors in, host arrays out."""
        if self.decode_shared_prefix != "on" or block_tables.shape[0] < 2:
            return None
        found = shared_prefix.find_groups(
            block_tables.numpy(), positions.numpy() + 1, self.block_size, self.group_max
        )
        return found if len(found.tokens) else None

    def _check_kernel(self) -> str | None:
        """The Triton kernel against the reference: rows over scattered blocks, a block twice,
        a one-token row."""
        bs = self.block_size
        tables = [[3, 1, 4, 1], [5, 8, 2, 6], [7, 0, 0, 0]]
        return self._check_decode(tables, [3 * bs + 1, 4 * bs, 1])

    def _check_shared(self) -> str | None:
        """The shared-prefix path: three rows sharing two blocks, one row alone."""
        bs = self.block_size
        tables = [[1, 2, 3, 0], [1, 2, 4, 5], [1, 2, 6, 0], [7, 8, 0, 0]]
        return self._check_decode(tables, [2 * bs + 3, 3 * bs + 1, 3 * bs, bs + 2], shared=True)

    def _check_decode(self, tables: list[list[int]], lens: list[int], shared: bool = False):
        """The decode kernel (with the shared-prefix kernel when `shared`) on random blocks of
        this model's head shape against the gathered reference: None, or what went wrong."""
        try:
            g = torch.Generator(device=self.device).manual_seed(0)
            dev, bs, d = self.device, self.block_size, self.head_dim
            kc = torch.randn(9, bs, self.num_kv_heads, d, generator=g, device=dev).to(self.dtype)
            vc = torch.randn(kc.shape, generator=g, device=dev).to(self.dtype)
            q = torch.randn(len(tables), self.num_heads, d, generator=g, device=dev)
            q = q.to(self.dtype)
            bt = torch.tensor(tables, dtype=torch.int32, device=dev)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            prefix = None
            if shared:
                found = shared_prefix.find_groups(
                    np.array(tables, dtype=np.int32), np.array(lens), bs, self.group_max
                )
                groups = SharedPrefix(*(torch.from_numpy(a).to(dev) for a in found))
                prefix = shared_prefix.prefix_partials(q, kc, vc, bt, groups, d**-0.5)
            got = attention.paged_decode(q, kc, vc, bt, lens_t, d**-0.5, prefix=prefix).float()
            ref = attention.decode_reference(q.float(), kc.float(), vc.float(), bt, lens_t, d**-0.5)
            err = ((got - ref).norm() / ref.norm()).item()
            tol = 1e-4 if self.dtype == torch.float32 else 2e-2
            return None if err < tol else f"relative error {err:.2e} > {tol}"
        except Exception as e:  # no compiler, unsupported shape, ...
            return f"{type(e).__name__}: {e}"

    @property
    def layers(self):
        return self.model.model.layers

    @property
    def _scale(self) -> float:
        return self.head_dim**-0.5

    # ---- forward passes ------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, attend):
        """The decoder stack on packed ids/pos [T]: K/V written at cache `slots` [T], then
        `attend(layer, q)` -> [T, H, D]. Returns hidden states [T, hidden]."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h[None], pos[None])  # [1, T, D]
        cos, sin = cos[0, :, None], sin[0, :, None]
        t = ids.shape[0]
        for li in range(len(self.layers)):
            q, k, v = self.math.attn_in(li, h, cos, sin)
            attention.write_kv(self.k_cache[li], self.v_cache[li], slots, k, v)
            o = attend(li, q)
            h = self.math.attn_out(li, h, o.reshape(t, -1))
        if self.routed is not None:
            for j, ids in enumerate(self.math.picked):
                self.routed.select(1, j).index_copy_(0, slots, ids.to(torch.int32))
        return h

    def _logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] in the model's dtype (the sampler upcasts them; HF's float() of the
        same values), written into `out` when given (a CUDA graph's static buffer)."""
        x = self.model.model.norm(h)
        head = self.model.lm_head
        if out is not None and head.bias is None:
            return torch.mm(x, head.weight.t(), out=out)
        logits = head(x)
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def prefill(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """seqs: (new tokens, position of the first, block table) per sequence; the blocks cover
        the cached prefix [0, start) and the new tokens. Returns last-token logits [n, V]."""
        dev = self.device
        lens_new = [len(toks) for toks, _, _ in seqs]
        ids = torch.tensor([t for toks, _, _ in seqs for t in toks], dtype=torch.long)
        kind = "gathered" if dev.type == "cpu" else self.prefill_attention
        starts, tables = [s for _, s, _ in seqs], [b for _, _, b in seqs]
        plan = self._prefill_plan(lens_new, starts, tables, kind)
        last = plan.pop("last")
        pos, slots = plan.pop("pos"), plan.pop("slots")
        if dev.type == "cpu":  # operands shared by every layer built once (attention.py)
            gathered = attention.gather_plan(*(plan[k] for k in _GATHERED_OPERANDS))

            def attend(li: int, q: torch.Tensor) -> torch.Tensor:
                return attention.attend_gathered(
                    q, self.k_cache[li], self.v_cache[li], gathered, self._scale
                )

            h = self._forward(ids, pos, slots, attend)
            return self._logits(h[last])
        attend_with = self._prefill_attend(plan, kind)

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            return attend_with(q, self.k_cache[li], self.v_cache[li])

        # Pinned, asynchronous copies: the host does not wait for the decode step in flight.
        h = self._forward(*(to_device(x, dev) for x in (ids, pos, slots)), attend)
        return self._logits(h[to_device(last, dev)])

    def _prefill_plan(
        self, lens_new: list[int], starts: list[int], tables: list[list[int]], kind: str
    ) -> dict[str, torch.Tensor | int]:
        """A prefill's host-side operands: each new token's position and cache slot, each
        sequence's last token, and the attention's operands of `kind`: "gathered" the padded
        [n, m_max] queries over [n, l_max] keys, "varlen" the keys end to end and both
        cumulative lengths."""
        bs, n = self.block_size, len(lens_new)
        total = [s + m for s, m in zip(starts, lens_new, strict=True)]
        m_max, l_max = max(lens_new), max(total)
        pos = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, lens_new, strict=True)])
        width = math.ceil(l_max / bs)
        table = torch.zeros((n, width), dtype=torch.long)
        for i, blocks in enumerate(tables):
            nb = math.ceil(total[i] / bs)
            table[i, :nb] = torch.tensor(blocks[:nb], dtype=torch.long)
        row_of_tok = torch.repeat_interleave(torch.arange(n), torch.tensor(lens_new))
        slots = table[row_of_tok, pos // bs] * bs + pos % bs
        offs = torch.tensor([0, *lens_new[:-1]]).cumsum(0)
        kp = torch.arange(l_max)
        kv_slots = table[:, kp // bs] * bs + kp % bs  # [n, l_max]: each sequence's keys
        plan: dict[str, torch.Tensor | int] = {
            "pos": pos,
            "slots": slots,
            "last": offs + torch.tensor(lens_new) - 1,
            "m_max": m_max,
            "l_max": l_max,
        }
        if kind == "varlen":
            plan["kv_packed"] = kv_slots[kp[None, :] < torch.tensor(total)[:, None]]
            plan["cu_q"] = torch.tensor([0, *lens_new], dtype=torch.int32).cumsum(
                0, dtype=torch.int32
            )
            plan["cu_k"] = torch.tensor([0, *total], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return plan
        j = torch.arange(m_max)
        valid_q = j[None, :] < torch.tensor(lens_new)[:, None]
        plan["q_rows"] = torch.where(valid_q, offs[:, None] + j[None, :], 0)
        plan["q_pos"] = torch.where(valid_q, torch.tensor(starts)[:, None] + j[None, :], 0)
        plan["kv_slots"] = kv_slots
        plan["kv_len"] = torch.tensor(total)
        # each packed token's row in the padded [n * m_max] queries (the output gathered back)
        plan["tok_rows"] = row_of_tok * m_max + (torch.arange(len(pos)) - offs[row_of_tok])
        return plan

    def _prefill_attend(self, plan: dict, kind: str):
        """`attend(q, k_cache, v_cache) -> [T, H, D]` of a prefill on the device, through torch's
        varlen flash kernel ("varlen") or SDPA over gathered, padded blocks ("gathered")."""
        dev = self.device
        used = ("kv_packed", "cu_q", "cu_k") if kind == "varlen" else _GATHERED_OPERANDS
        on = {k: to_device(plan[k], dev) for k in used} | {k: plan[k] for k in ("m_max", "l_max")}
        if kind == "varlen":
            return lambda q, kc, vc: attention.varlen_prefill(
                q, kc, vc, on["kv_packed"], on["cu_q"], on["cu_k"], on["m_max"], on["l_max"],
                self._scale,
            )  # fmt: skip
        return lambda q, kc, vc: attention.gathered_attention(
            q, kc, vc, on["q_rows"], on["q_pos"], on["kv_slots"], on["kv_len"], self._scale,
            on["tok_rows"],
        )  # fmt: skip

    @torch.inference_mode()
    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """One step: feed ids [m] (on the device) at positions [m] (host, int64) with block
        tables [m, max_blocks_per_seq] (host, int32); returns logits [m, V] (the model's dtype).

        From a CUDA graph when one is captured for a bucket >= m (the returned tensor is the
        graph's output buffer: read it before the next step)."""
        groups = self.groups(block_tables, positions)
        if self.graphs is not None:
            out = self.graphs.run(ids, positions, block_tables, groups)
            if out is not None:
                return out
        span = int(positions.max()) + 1 if positions.numel() else 1
        if self.device.type == "cpu":
            return self._decode_cpu(ids, positions, block_tables, span)
        pos = positions.to(self.device, non_blocking=True)
        bt = block_tables.to(self.device, non_blocking=True)
        shared = None
        if groups is not None:
            shared = SharedPrefix(
                *(torch.from_numpy(a).to(self.device, non_blocking=True) for a in groups)
            )
        return self.decode_step(ids, pos, bt, span, shared=shared)

    def _decode_cpu(
        self, ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor, span: int
    ) -> torch.Tensor:
        """The decode step on a CPU: keys 0..span-1 of each request gathered by one plan that
        every layer shares (attention.py's CPU path); no CUDA graph, no kernel."""
        bs = self.block_size
        bt = bt.long()
        slots = bt.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        kp = torch.arange(span)
        plan = attention.gather_plan(bt[:, kp // bs] * bs + kp % bs, pos[:, None], pos + 1)

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            return attention.attend_gathered(
                q, self.k_cache[li], self.v_cache[li], plan, self._scale
            )

        return self._logits(self._forward(ids, pos, slots, attend))

    def decode_step(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        bt: torch.Tensor,
        span: int | None = None,
        out: torch.Tensor | None = None,
        shared: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """The decode computation on device tensors (what a CUDA graph captures); `span` bounds
        the keys the gathered path reads (None: the table's width); logits go to `out` if given;
        `shared`: rows that share leading blocks read them once (the triton kernel)."""
        bs = self.block_size
        lens = (pos + 1).to(torch.int32)
        slots = bt.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        kernel = self.decode_attention == "triton"

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k_cache[li], self.v_cache[li]
            if kernel:
                prefix = None
                if shared is not None:
                    prefix = shared_prefix.prefix_partials(q, kc, vc, bt, shared, self._scale)
                return attention.paged_decode(q, kc, vc, bt, lens, self._scale, prefix=prefix)
            return attention.decode_reference(q, kc, vc, bt, lens, self._scale, span)

        return self._logits(self._forward(ids, pos, slots, attend), out)

    def copy_block(self, src: int, dst: int) -> None:
        """Give block `dst` the contents of `src` (copy-on-write of a shared prompt's last block)."""
        for kc, vc in zip(self.k_cache, self.v_cache, strict=True):
            kc[dst] = kc[src]
            vc[dst] = vc[src]
        if self.routed is not None:
            bs = self.block_size
            self.routed[dst * bs : (dst + 1) * bs] = self.routed[src * bs : (src + 1) * bs]

    def routed_rows(self, blocks: list[int], start: int, end: int) -> np.ndarray:
        """[end - start, moe_layers, k] int32 (host): the experts of positions [start, end) of a
        sequence held in `blocks`, as the forward passes that computed them chose."""
        if self.routed is None:
            raise ValueError("the model has no MoE layers: no routed experts")
        bs = self.block_size
        pos = torch.arange(start, end)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // bs] * bs + pos % bs
        return self.routed[slots.to(self.device)].cpu().numpy()

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int], temperature: float) -> list[float]:
        """log_softmax(logits / T) of each prompt token given the ones before it ([len(ids) - 1]);
        a plain forward without the KV cache (prompt scoring, SGLang's input_token_logprobs)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float() / temperature  # [t-1, V]
        logp = torch.log_softmax(logits, -1)
        return logp.gather(1, x[0, 1:, None])[:, 0].tolist()

    # ---- CUDA graphs -----------------------------------------------------------------------

    @torch.inference_mode()  # as the scheduler calls them: another grad mode recompiles
    def warm_sampling(self) -> bool:
        """Compile the sampler's kernels now rather than at the first request that needs one
        (seconds in which the whole batch would wait): the seeded draw for one row and for
        several (torch compiles a size of 1 apart), the pick kernels (checked against the eager
        picks). False if they run eager; a failed compile or check is logged and that kernel
        stays eager (the same draws)."""
        compiled = False
        if self.seeded_draw is not seeded_argmax:
            try:
                for n in (1, 2):
                    zeros = torch.zeros(n, dtype=torch.long, device=self.device)
                    logp = torch.zeros(n, self.vocab_size, device=self.device)
                    self.seeded_draw(logp, zeros, zeros)
                compiled = True
            except Exception:  # no compiler for this device or build: eager gives the same draws
                log.exception("compiling the seeded draw failed; seeded rows are drawn eagerly")
                self.seeded_draw = seeded_argmax
        if self.picks is not EAGER_PICKS:
            try:
                err = self._check_picks()
            except Exception:
                log.exception("compiling the sampler's picks failed; they run eagerly")
                self.picks = EAGER_PICKS
            else:
                if err is None:
                    compiled = True
                else:
                    log.error("the sampler's pick kernels failed their check (%s): eager", err)
                    self.picks = EAGER_PICKS
        if self.picks.filtered is not EAGER_PICKS.filtered:
            try:
                err = self._check_filtered()
            except Exception:
                err = "it raised"
                log.exception("the top-k/top-p kernels failed to run")
            if err is not None:  # the unfiltered picks stay on their kernels
                log.error("the top-k/top-p kernels failed their check (%s): sorted eagerly", err)
                self.picks = self.picks._replace(filtered=EAGER_PICKS.filtered)
        return compiled

    def sampling_kernels(self) -> dict[str, str]:
        """Which draw runs where ("triton" or "eager"; "compiled" for the seeded draw), as
        /server_info reports it: a kernel that failed its start-up check shows as eager."""
        out = {
            name: "eager" if fn is getattr(EAGER_PICKS, name) else "triton"
            for name, fn in self.picks._asdict().items()
        }
        out["seeded"] = "eager" if self.seeded_draw is seeded_argmax else "compiled"
        return out

    def _check_picks(self) -> str | None:
        """The pick kernels (compiled by this first call) against the eager picks on random
        logits of this vocabulary: the greedy tokens equal, the log-probs within fp32 rounding;
        a draw's tokens in range and its log-probs those of its tokens."""
        g = torch.Generator(device=self.device).manual_seed(0)
        logits = torch.randn(3, self.vocab_size, generator=g, device=self.device).to(self.dtype)
        want, lp_want = greedy_pick(logits)
        got, lp_got = self.picks.greedy(logits)
        if not torch.equal(got, want) or (lp_got - lp_want).abs().max().item() > 1e-4:
            return (
                f"greedy {got.tolist()} / {lp_got.tolist()} != {want.tolist()} / {lp_want.tolist()}"
            )
        temp = torch.tensor([1.0, 0.5, 1.0], device=self.device)
        greedy = torch.tensor([False, False, True], device=self.device)
        tok, lp = self.picks.temperature(logits, temp, greedy, g)
        ref = torch.log_softmax(logits.float() / temp[:, None], -1)
        if not (int(tok.min()) >= 0 and int(tok.max()) < self.vocab_size and tok[2] == want[2]):
            return f"drawn tokens {tok.tolist()} (greedy row's {want[2].item()})"
        if (lp - ref.gather(1, tok[:, None])[:, 0]).abs().max().item() > 1e-4:
            return "drawn tokens' log-probs differ from log_softmax(logits / T)"
        return None

    def _check_filtered(self) -> str | None:
        """The top-k/top-p kernels (compiled by this first call) on random logits of this
        vocabulary: thresholds those of the sort (`thresholds_hold`: up to fp32 summation
        order), draws at or above them with unfiltered log-probs, a greedy row's token the
        argmax."""
        g = torch.Generator(device=self.device).manual_seed(1)
        logits = torch.randn(3, self.vocab_size, generator=g, device=self.device).to(self.dtype)
        want = logits.float().argmax(-1)
        temp = torch.tensor([1.0, 0.5, 1.0], device=self.device)
        greedy = torch.tensor([False, False, True], device=self.device)
        top_k = torch.tensor([self.vocab_size, 5, 40], device=self.device)
        top_p = torch.tensor([0.9, 1.0, 0.5], device=self.device)
        got = pick_kernels.thresholds(logits, temp.reciprocal(), top_k, top_p)
        x = logits.float() * temp.reciprocal()[:, None]
        if not thresholds_hold(x, got, top_k, top_p).all():
            return f"top-k/top-p thresholds {got.tolist()} are not the sort's"
        tok, lp = self.picks.filtered(logits, temp, greedy, top_k, top_p, g)
        if not (x.gather(1, tok[:, None])[:, 0] >= got).all() or tok[2] != want[2]:
            return f"filtered draws {tok.tolist()} below their thresholds {got.tolist()}"
        if (lp - torch.log_softmax(x, -1).gather(1, tok[:, None])[:, 0]).abs().max().item() > 1e-4:
            return "filtered draws' log-probs differ from log_softmax(logits / T)"
        return None

    def capture_cuda_graphs(self) -> list[int]:
        """Capture the decode step for batch sizes 1, 2, 4, 8, 16, 32, ... and max_slots (GPU)."""
        if self.device.type != "cuda":
            return []
        from slime_async.actors.engine.embedded.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self)
        return self.graphs.sizes

    def drop_cuda_graphs(self) -> None:
        self.graphs = None

    def memory_info(self) -> dict[str, int | float]:
        info = dict(self.memory)
        if self.device.type == "cuda":
            info["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            info["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            # A retry is an allocation that failed until the allocator freed its whole cache
            # (a device synchronization and cudaFree of every cached segment): steps stall.
            stats = torch.cuda.memory_stats(self.device)
            info["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            info["device_mallocs"] = int(stats.get("num_device_alloc", 0))
        info["blocks_in_use"] = self.pool.in_use()
        return info

    # ---- weights -------------------------------------------------------------------------

    def parameter_names(self) -> set[str]:
        return {n for n, _ in self.model.named_parameters(remove_duplicate=False)}

    @torch.inference_mode()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (in place: CUDA graphs and packed weights see
        them); every name and shape is checked before any copy. Cached prefixes are forgotten
        (their KV came from the old weights), unless `keep_prefixes_on_update` (strict mode):
        SGLang 0.5.23 keeps its radix cache through an update that is not asked to flush
        (scheduler_components/weight_updater.py: flush_cache_after_weight_update flushes only
        when `flush_cache` is true), so requests of the same `extra_key` reuse that KV there."""
        params = self._params()
        # A checkpoint name may fill a slice of a fused parameter (Qwen3-MoE's experts).
        targets = [self.family.param_view(params, name) for name, _ in named]
        for (name, t), target in zip(named, targets, strict=True):
            if target is None:
                raise ValueError(f"unknown parameter {name!r} for this model")
            if target.shape != t.shape:
                raise ValueError(
                    f"parameter {name!r}: shape {tuple(t.shape)} != model's {tuple(target.shape)}"
                )
        # One grouped copy for the tensors already of the parameter's device and dtype (a push
        # by handle or broadcast: all of them), one copy each for the rest.
        same = [
            (target, t)
            for (_, t), target in zip(named, targets, strict=True)
            if t.device == target.device and t.dtype == target.dtype
        ]
        if same:
            torch._foreach_copy_(*map(list, zip(*same, strict=True)))
        for (_, t), target in zip(named, targets, strict=True):
            if t.device != target.device or t.dtype != target.dtype:
                target.copy_(t.to(device=self.device, dtype=target.dtype))
        if not self.keep_prefixes_on_update:
            self.pool.clear_index()

    def _params(self) -> dict[str, torch.Tensor]:
        """The model's parameters by HF name (tied ones under each name), built once: the set is
        fixed after construction and every weight load copies into these tensors in place."""
        if self._param_table is None:
            self._param_table = dict(self.model.named_parameters(remove_duplicate=False))
        return self._param_table

    def load_from_disk(self, model_path: str | Path) -> None:
        """Load every safetensors tensor of an HF directory into the running model."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        params = self._params()
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            tensors = load_file(str(f)).items()
            named += [(k, v) for k, v in tensors if self.family.param_view(params, k) is not None]
        if not named:
            raise ValueError(f"{model_path} holds none of this model's parameters")
        self.load_weights(named)


def _family(model_path: str, model_type: str) -> Family:
    """The model's family; a model type the engine does not serve is refused, naming those it does."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"{model_path}: model_type {model_type!r} is not served by the embedded engine "
            f"(families: {', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]


def _eos_ids(cfg) -> frozenset[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
