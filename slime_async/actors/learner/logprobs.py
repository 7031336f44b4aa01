"""Per-token log-probs and entropy from the model's last hidden states, in chunks of tokens.

The output layer of a 150k-vocabulary model turns `N` tokens into `[N, V]` logits: in fp32 that
is 600 kB per token, and a softmax with its autograd saves several such tensors. Here the
GPTModel's output layer is bypassed (`hidden_output`: the model returns its final hidden states),
only the response positions are selected, and `ChunkedLogprobs` computes, `chunk` tokens at a
time, the logits of this rank's vocabulary slice, their TP-global max / log-sum-exp / target
logit / entropy, and keeps only those `[N]` statistics. The backward pass recomputes each chunk's
logits and produces the gradients of the hidden states and of the output weight directly:

    s = z / T, p = softmax(s), lse = log sum exp s
    d logp / d s_v = 1[v = label] - p_v
    d H / d s_v    = -p_v (s_v - lse + H)          (H = -sum p log p)

Under tensor parallelism each rank holds `V / tp` columns: the max, the exp-sums, the target
logit and sum(p * s) are all-reduced over the TP group in the forward pass (no autograd); the
backward needs no communication, because every TP rank computes the same loss and each gets
its own slice's gradient (the hidden states' gradient is summed over TP by
`copy_to_tensor_model_parallel_region`, as megatron's output layer does). Peak memory: a few
`[chunk, V / tp]` fp32 tensors, never `[N, V]`. On a GPU (`learner.logprob_kernel`), each
chunk's statistics and its logits' gradient come from two fused Triton kernels that read the
chunk's bf16 logits once (`logprobs_triton.py`; the gradient overwrites the logits in place)
instead of the elementwise torch ops, which stay the exact CPU path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_async.models import wgrad

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


def output_weight(model) -> torch.Tensor:
    """The `[V / tp, h]` output projection (the embedding when the two are tied)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


@contextlib.contextmanager
def hidden_output(model) -> Iterator[None]:
    """While active, `model(...)` returns `[b, s, h]` final hidden states instead of logits.

    The states come back as the output layer would see them: gathered from the sequence-parallel
    region, and routed through TP's copy (identity forward, all-reduce of the gradient backward).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    layer = model.output_layer
    tp = parallel_state.get_tensor_model_parallel_world_size()

    def forward(input_, weight=None, runtime_gather_output=None, **_ignored):
        if getattr(layer, "sequence_parallel", False) and tp > 1:
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        elif tp > 1:
            input_ = _SumGradOverTP.apply(input_, parallel_state.get_tensor_model_parallel_group())
        return input_, None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # back to the class's forward


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP group backward.

    megatron's `copy_to_tensor_model_parallel_region` all-reduces `grad.contiguous()` and returns
    the original: with a non-contiguous gradient (here: the one of GPTModel's final transpose)
    the sum lands in a temporary and is lost."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _tp():
    from slime_async import megatron_compat

    megatron_compat.apply()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, None, 0  # a plain call outside any learner (unit tests, benchmarks)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    start = parallel_state.get_tensor_model_parallel_rank()
    return tp, group, start


BANNED_LOGIT = -1e30
"""The logit a banned token gets: exp(s - max) is exactly 0 and 0 * s stays finite (-inf would
make the entropy's p * s a nan). Finite in bf16 and fp32 at every temperature >= 1e-5."""


def _ban(z: torch.Tensor, banned: torch.Tensor | None, ids: torch.Tensor | None) -> torch.Tensor:
    """`z: [c, V/tp]` logits of this rank's slice with `ids` (local column indices) set to
    BANNED_LOGIT on the rows `banned: [c]` bool; `z` itself when nothing is banned."""
    if banned is None or ids is None or ids.numel() == 0 or not bool(banned.any()):
        return z
    rows = banned.nonzero()[:, 0]
    z[rows[:, None], ids[None, :]] = BANNED_LOGIT
    return z


def _local_ids(stop_ids: torch.Tensor | None, start: int, v_local: int) -> torch.Tensor | None:
    if stop_ids is None:
        return None
    local = stop_ids - start
    return local[(local >= 0) & (local < v_local)]


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, h], weight [V/tp, h], labels [N], temperature [N]) -> logp [N], entropy [N].

    `banned: [N]` bool and `stop_ids: [S]` global ids: on the banned rows the stop ids are left
    out of the softmax (the engine's min_new_tokens), in the forward and the backward pass."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        temperature,
        with_entropy: bool,
        chunk: int,
        fused: bool,
        banned=None,
        stop_ids=None,
    ):
        ctx.set_materialize_grads(False)
        tp, group, tp_rank = _tp()
        n = hidden.shape[0]
        v_local = weight.shape[0]
        start = tp_rank * v_local
        ban_ids = _local_ids(stop_ids, start, v_local)
        # One pass over the chunks, each with its own (this rank's) row max m; the TP ranks'
        # partial sums are rescaled to the global max afterwards.
        m = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # rows: sum exp(s - m), target s (0 off this shard), sum exp(s - m) * (s - m)
        stats = torch.zeros(3, n, dtype=torch.float32, device=hidden.device)
        if fused:
            from slime_async.actors.learner import logprobs_triton

            local_all = labels - start
            local_all = torch.where((local_all >= 0) & (local_all < v_local), local_all, -1)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            if fused:  # one read of the chunk's logits (logprobs_triton.py)
                z = _ban(hidden[a:b] @ weight.t(), _rows(banned, a, b), ban_ids)
                st = logprobs_triton.row_stats(z, local_all[a:b], temperature[a:b], with_entropy)
                m[a:b] = st[0]
                stats[:, a:b] = st[1:]
                continue
            z = (hidden[a:b] @ weight.t()).float()
            s = _ban(z, _rows(banned, a, b), ban_ids) / temperature[a:b, None]
            local = labels[a:b] - start
            inside = (local >= 0) & (local < v_local)
            tgt = s.gather(-1, local.clamp(0, v_local - 1)[:, None])[:, 0]
            stats[1, a:b] = torch.where(inside, tgt, torch.zeros_like(tgt))
            m[a:b] = s.amax(dim=-1)
            s -= m[a:b, None]
            e = s.exp()
            stats[0, a:b] = e.sum(dim=-1)
            if with_entropy:
                stats[2, a:b] = (e * s).sum(dim=-1)
        if tp > 1:
            top = m.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            d = m - top
            stats[2] += d * stats[0]  # sum e * (s - top) = sum e * (s - m) + (m - top) * sum e
            scale = d.exp()
            stats[0] *= scale
            stats[2] *= scale
            dist.all_reduce(stats, group=group)
            m = top
        log_z = stats[0].log()
        lse = m + log_z  # [N] log-sum-exp of s over the whole vocabulary
        logp = stats[1] - lse
        entropy = log_z - stats[2] / stats[0] if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(hidden, weight, labels, temperature, lse, entropy)
        ctx.banned = banned
        ctx.ban_ids = ban_ids
        ctx.with_entropy = with_entropy
        ctx.chunk = chunk
        ctx.fused = fused
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, temperature, lse, entropy = ctx.saved_tensors
        _, _, tp_rank = _tp()
        n = hidden.shape[0]
        v_local = weight.shape[0]
        start = tp_rank * v_local
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if want_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        g_logp = torch.zeros(n, device=hidden.device) if g_logp is None else g_logp.float()
        use_ent = ctx.with_entropy and g_ent is not None
        if ctx.fused:
            from slime_async.actors.learner import logprobs_triton

            local_all = labels - start
            local_all = torch.where((local_all >= 0) & (local_all < v_local), local_all, -1)
            g_ent_f = g_ent.float() if use_ent else None
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            if ctx.fused:  # the chunk's logits, overwritten by their gradient in place
                gz = logprobs_triton.grad_in_place(
                    _ban(hidden[a:b] @ weight.t(), _rows(ctx.banned, a, b), ctx.ban_ids),
                    local_all[a:b],
                    temperature[a:b],
                    lse[a:b],
                    entropy[a:b],
                    g_logp[a:b],
                    None if g_ent_f is None else g_ent_f[a:b],
                )
                if want_h:
                    g_hidden[a:b] = gz @ weight
                if want_w:
                    wgrad.add_product(g_weight, gz.t(), hidden[a:b])
                continue
            t = temperature[a:b, None]
            s = _ban((hidden[a:b] @ weight.t()).float(), _rows(ctx.banned, a, b), ctx.ban_ids) / t
            s -= lse[a:b, None]  # log p (0 probability on a banned token)
            p = s.exp()  # [c, V/tp] probabilities of this slice
            # grad of s: g_logp * (1[label] - p) - g_ent * p * (log p + H)
            if use_ent:
                s += entropy[a:b, None]
                s *= p
                s *= -g_ent[a:b, None].float()
                g = s.sub_(p.mul_(g_logp[a:b, None]))
            else:
                g = p.mul_(-g_logp[a:b, None])
            local = labels[a:b] - start
            inside = (local >= 0) & (local < v_local)
            at_label = torch.where(inside, g_logp[a:b], torch.zeros_like(g_logp[a:b]))
            g.scatter_add_(1, local.clamp(0, v_local - 1)[:, None], at_label[:, None])
            g.div_(t)  # d/dz = d/ds / T
            gz = g.to(weight.dtype)
            if want_h:
                g_hidden[a:b] = gz @ weight
            if want_w:
                wgrad.add_product(g_weight, gz.t(), hidden[a:b])
        g_w = g_weight.to(weight.dtype) if want_w else None
        return g_hidden, g_w, None, None, None, None, None, None, None


def _rows(banned: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if banned is None else banned[a:b]


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool = False,
    chunk: int = 1024,
    fused: bool = False,
    banned: torch.Tensor | None = None,
    stop_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / T)[label] (and the entropy), fp32 `[N]`, with grad.

    hidden: [N, h]; weight: [V / tp, h] (this rank's vocabulary slice); labels: [N] global ids;
    temperature: [N]. Over the full vocabulary, no top-k/top-p: what SGLang reports as a token's
    log-prob (`log_softmax(logits / T)` before filtering). `fused`: each chunk's softmax
    statistics and gradient in one Triton kernel (`logprobs_triton.py`; a CUDA device).
    `banned: [N]` bool, `stop_ids: [S]` global ids: the rows where the engine drew with those
    ids banned (min_new_tokens, `stop_ban.py`) get the softmax over the other ids.
    """
    if hidden.shape[0] == 0:
        z = hidden.sum() * 0.0 + weight.sum() * 0.0  # keeps the graph connected
        empty = z.float().expand(0)
        return empty, (empty if with_entropy else None)
    if banned is not None and not bool(banned.any()):
        banned = None
    logp, ent = ChunkedLogprobs.apply(
        hidden,
        weight,
        labels,
        temperature.float(),
        with_entropy,
        max(1, int(chunk)),
        fused,
        banned,
        None if banned is None else stop_ids,
    )
    return logp, (ent if with_entropy else None)
