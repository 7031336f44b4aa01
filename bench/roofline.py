"""Hardware limits the benches print beside their measured figures (no torch, no GPU).

Decode (bench_engine.py): a step of B requests reads every weight once and each request's whole
KV cache, so at HBM bandwidth `hbm_tbps` a step takes at least

    bytes = weight_bytes + kv_bytes_per_token x (sum of the B requests' contexts)
    kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes

and generates B tokens. Over a decode of `new_tokens` tokens from `prompt_len`-token prompts,
step k (0-based) attends over prompt_len + k + 1 positions per request (the prompt, the k tokens
already generated, the new one); the limit is all tokens over the sum of the steps' times (the
time-weighted average, not the mean of per-step rates). Prefill, sampling and HTTP are not in
it: the figure bounds decode alone. Requests sharing a prompt in groups of `group` (GRPO's n
samples, with the engine's `decode_shared_prefix` on) read the prompt's KV once a group:

    kv_bytes_per_token x (sum over groups of the prompt + sum over requests of their own tokens)

With group 1 every request reads its whole context (the engine with `decode_shared_prefix` off,
or requests of different prompts).

Train step (bench_learner.py): model FLOPs per token of a forward + backward (3 x the forward's
2 FLOPs a multiply-add):

    6 x (non-embedding parameters)                      every token, every layer's matmuls
  + 6 x vocab x hidden x response_len / seq_len          the output layer, on the response
                                                         positions only (as the learner and the
                                                         HF baseline compute it); the embedding
                                                         itself is a lookup
  + 12 x layers x heads x head_dim x (seq_len + 1) / 2   causal attention: QK^T and PV, 2 FLOPs
                                                         a multiply-add each, forward + backward
                                                         = 3 x 4 = 12 per key a query attends
                                                         to; a causal query at position t sees t
                                                         keys, (seq_len + 1) / 2 on average

With GQA the kv heads only shrink the K/V projections (counted in the parameters): scores and
the weighted sum are computed per query head. MFU = tokens/s x FLOPs per token / peak FLOP/s
(`peak_tflops`, 989 for an H100/H200 dense bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

H200_HBM_TBPS = 4.8
H200_BF16_TFLOPS = 989.0


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step reads: the model's weights and its KV cache layout."""

    params: int
    dtype_bytes: int
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def decode_roofline(
    shape: DecodeShape,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    hbm_tbps: float,
    group: int = 1,
) -> dict:
    """The memory-bandwidth limit of decoding `new_tokens` tokens for each of `batch` requests
    with `prompt_len`-token prompts, `group` requests reading a prompt's keys once: tokens/s,
    mean step time, mean context, bytes per step."""
    if batch < 1 or prompt_len < 1 or new_tokens < 1 or hbm_tbps <= 0:
        raise ValueError(
            f"decode_roofline: batch {batch}, prompt_len {prompt_len}, new_tokens {new_tokens}, "
            f"hbm_tbps {hbm_tbps}: all must be positive"
        )
    if group < 1:
        raise ValueError(f"decode_roofline: group {group} must be positive")
    # sum over steps k = 0..new-1 of (prompt_len + k + 1), per request
    context_sum = new_tokens * (prompt_len + 1) + new_tokens * (new_tokens - 1) // 2
    # what the requests read: the prompt once a group, their own tokens each
    read_sum = new_tokens * prompt_len / group + context_sum - new_tokens * prompt_len
    total_bytes = new_tokens * shape.weight_bytes + shape.kv_bytes_per_token * batch * read_sum
    seconds = total_bytes / (hbm_tbps * 1e12)
    return {
        "roofline_tokens_per_s": batch * new_tokens / seconds,
        "roofline_step_ms": seconds / new_tokens * 1e3,
        "mean_context": context_sum / new_tokens,
        "bytes_per_step": total_bytes / new_tokens,
        "hbm_tbps": hbm_tbps,
        "prompt_read_by": group,
    }


@dataclass(frozen=True)
class TrainShape:
    """A dense decoder's shape, as bench_learner builds it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def non_embedding_params(self) -> int:
        """Attention (q, k, v, o; q/k norms), gated MLP (gate, up, down), the two RMSNorms of
        each layer, and the final norm. A tied or untied output layer is counted apart."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        attn += 2 * self.head_dim  # Qwen3's q_norm and k_norm
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


def train_flops_per_token(shape: TrainShape, seq_len: int, response_len: int) -> float:
    """Model FLOPs of one token of a forward + backward over `seq_len`-token sequences whose last
    `response_len` positions are scored (the formula in the module docstring)."""
    if not 0 < response_len <= seq_len:
        raise ValueError(f"response_len {response_len} must be in (0, seq_len = {seq_len}]")
    body = 6 * shape.non_embedding_params
    head = 6 * shape.vocab * shape.hidden * response_len / seq_len
    attention = 12 * shape.layers * shape.heads * shape.head_dim * (seq_len + 1) / 2
    return body + head + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak."""
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)
