"""The learner's MoE layer: megatron-core's router, a dispatch without host syncs, grouped experts,
and the load-balancing and z losses as Hugging Face computes them.

`GroupedMoELayer` is megatron's `MoELayer` (its router, RouterReplay included, and, at expert
parallelism > 1, its all-to-all token dispatcher) with two changes:

- Without expert parallelism every expert is local, so no dispatcher is needed: the token-expert
  pairs are sorted by expert on the device (`grouped_experts.sort_by_expert`), run through the
  experts, put back and summed per token. Megatron's dispatcher would copy the per-expert token
  counts to the host and wait for them in every layer (its `tokens_per_expert` for the experts),
  which stalls the host until the GPU has caught up. With EP > 1 megatron's all-to-all
  dispatcher stays: `all_to_all_single` takes its split sizes as host integers, one read per
  layer that cannot be avoided.
- The losses (`MoeLosses`) follow transformers' Qwen3-MoE: the load-balancing loss of
  `load_balancing_loss_func`, pooled over every MoE layer and every real token (padding
  excluded), `num_experts * sum_e f_e * P_e` with f_e the fraction of (token, choice) pairs
  that picked expert e and P_e its mean router probability, each from the router's own choice;
  and the router z-loss, the mean over layers and real tokens of `logsumexp(logits)^2`
  (ST-MoE's; transformers' Switch Transformers computes the same). Each MoE layer attaches its
  share to its router probabilities: the load-balancing gradient needs f, which is known only
  once every layer ran, so it is applied in backward, when it is (recomputation-safe: a
  recomputed layer writes the same counts again).

`GroupedExperts` holds the local experts as two stacked weights, `weight1 [E_local, 2I, H]`
(each expert's gate rows, then up rows: megatron's `linear_fc1`) and `weight2 [E_local, H, I]`,
and runs them with `grouped_experts.swiglu_experts`. Checkpoints shard them along the expert
axis (global shape `[E, ...]`), so an EP 2 checkpoint loads at EP 1.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from slime_async.models.grouped_experts import sort_by_expert, swiglu_experts

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


class MoeLosses:
    """The HF-style auxiliary losses of one model's MoE layers for the forward passes under way.

    Before each training forward the learner calls `begin(valid, weight)`: `valid` `[s * b]`
    bool marks this rank's real tokens in the router's order (None: all), `weight` scales this
    micro-batch's share (its tokens over the step's)."""

    def __init__(
        self, num_layers: int, num_experts: int, topk: int, aux_coeff: float, z_coeff: float
    ):
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.aux_coeff, self.z_coeff = aux_coeff, z_coeff
        self.valid: torch.Tensor | None = None
        self.weight = 1.0
        self.recording = False
        """Between `begin` and `end`: a training forward (and its recomputations) is running."""
        self.tp_group = None
        """Set under sequence parallelism: each TP rank routes its own chunk of the tokens."""
        self.counts: dict[int, torch.Tensor] = {}
        """MoE layer -> [E] (token, choice) pairs per expert (global over TP), detached."""
        self.prob_sums: dict[int, torch.Tensor] = {}
        """MoE layer -> [E] sums of router probabilities over real tokens (global), detached."""
        self.tokens: torch.Tensor | None = None
        self.z_sums: dict[int, torch.Tensor] = {}
        self.totals: torch.Tensor | None = None
        """[2] (aux, z) summed over forwards, each weighted by its micro-batch's share."""
        self.forwards = 0

    @property
    def active(self) -> bool:
        return self.aux_coeff > 0 or self.z_coeff > 0

    def begin(self, valid: torch.Tensor | None, weight: float = 1.0) -> None:
        """A training forward starts (new dicts: a backward still running keeps its own)."""
        self.valid, self.weight, self.recording = valid, float(weight), self.active
        self.counts, self.prob_sums, self.z_sums, self.tokens = {}, {}, {}, None

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def attach(self, layer: int, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Record layer `layer`'s routing (logits `[T, E]`) and attach its loss shares to the
        router probabilities `probs` `[T, E]` (returned, the same values).

        The statistics are recorded without gradients too: under full recomputation the first
        pass runs without them and each layer's backward needs every layer's counts."""
        if not self.recording:
            return probs
        grad = torch.is_grad_enabled()
        valid = self.valid
        mask = (
            torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
            if valid is None
            else valid.to(device=logits.device, dtype=torch.float32)
        )
        if self.tokens is None:
            self.tokens = self._sum(mask.sum().detach().clone())
        n = self.tokens.clamp(min=1.0)
        scores = torch.softmax(logits.float(), dim=-1)  # [T, E], HF's routing weights
        if self.aux_coeff > 0:
            picked = torch.topk(scores.detach(), self.topk, dim=-1).indices  # [T, k]
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(0, picked.reshape(-1), mask.repeat_interleave(self.topk))
            prob_sum = (scores * mask[:, None]).sum(0)  # [E], differentiable
            self.counts[layer] = self._sum(counts)
            self.prob_sums[layer] = self._sum(prob_sum.detach().clone())
            if grad:
                state = (self.counts, n, self.weight)
                probs = _AuxGrad.apply(probs, prob_sum, self, state)
        if self.z_coeff > 0:
            lse2 = (torch.logsumexp(logits.float(), dim=-1).square() * mask).sum()
            self.z_sums[layer] = self._sum(lse2.detach().clone())
            if grad:
                share = lse2 * (self.weight * self.z_coeff) / (self.num_layers * n)
                probs = _AttachLoss.apply(probs, share)
        return probs

    def aux_grad(self, state) -> torch.Tensor:
        """d loss / d prob_sum of any layer: `coeff * E * f_e / (L * N)`, f pooled over the
        layers of the forward `state` (its counts, tokens and weight) belongs to."""
        counts, n, weight = state
        if len(counts) != self.num_layers:
            raise RuntimeError(
                f"MoE load-balancing loss: {len(counts)} of {self.num_layers} MoE layers "
                "recorded their routing before the backward pass"
            )
        f = torch.stack(list(counts.values())).sum(0) / (self.num_layers * n)
        return weight * self.aux_coeff * self.num_experts * f / (self.num_layers * n)

    def end(self) -> None:
        """Add this forward's loss values (unscaled by coeff: the losses as HF reports them);
        kept on the device, read by `take` once a step."""
        self.recording = False
        if not (self.counts or self.z_sums):
            return
        ln = self.num_layers * self.tokens.clamp(min=1.0)
        aux = z = torch.zeros((), dtype=torch.float32, device=self.tokens.device)
        if self.counts:
            f = torch.stack(list(self.counts.values())).sum(0) / ln
            p = torch.stack(list(self.prob_sums.values())).sum(0) / ln
            aux = self.num_experts * (f * p).sum()
        if self.z_sums:
            z = torch.stack(list(self.z_sums.values())).sum() / ln
        step = torch.stack([aux, z]) * self.weight
        self.totals = step if self.totals is None else self.totals + step
        self.forwards += 1

    def take(self) -> tuple[float, float, int]:
        """(load-balancing loss, z-loss, forward passes) summed since the last call, each
        forward weighted by its micro-batch's share."""
        totals, n = self.totals, self.forwards
        self.totals, self.forwards = None, 0
        if totals is None:
            return 0.0, 0.0, 0
        aux, z = totals.tolist()
        return aux, z, n


class _AuxGrad(torch.autograd.Function):
    """Identity on `probs`; in backward, `prob_sum` gets the load-balancing gradient."""

    @staticmethod
    def forward(ctx, probs, prob_sum, losses: MoeLosses, state):
        ctx.losses, ctx.state = losses, state
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.losses.aux_grad(ctx.state), None, None


class _AttachLoss(torch.autograd.Function):
    """Identity on `probs`; in backward, `loss` gets gradient 1 (its own graph does the rest)."""

    @staticmethod
    def forward(ctx, probs, loss):
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


@functools.cache
def moe_layer_class():
    """`GroupedMoELayer`, defined once megatron-core may be imported."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class GroupedMoELayer(MoELayer):
        """megatron's MoELayer, dispatching locally without expert parallelism, with HF's
        auxiliary losses (module docstring)."""

        losses: MoeLosses | None = None
        loss_index: int = 0

        def route(self, hidden_states, padding_mask=None):
            router = self.router
            logits = router.gating(router.apply_input_jitter(hidden_states))
            probs, routing_map = router.routing(logits, padding_mask=padding_mask)
            if self.losses is not None:
                flat = logits.reshape(-1, logits.shape[-1])
                probs = self.losses.attach(self.loss_index, flat, probs)
            return probs, routing_map

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if self.config.expert_model_parallel_size > 1 or intermediate_tensors is not None:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).bool()
            s, b, h = hidden_states.shape
            probs, routing_map = self.route(hidden_states, padding_mask)  # [T, E] each
            out = self.local_experts(hidden_states.reshape(-1, h), probs, routing_map)
            if self.use_shared_expert:
                out = out + self.shared_experts(hidden_states).reshape(-1, h)
            return out.view(s, b, h), None

        def local_experts(self, x, probs, routing_map):
            """x `[T, H]`, router probs and choice `[T, E]` -> `[T, H]`, no host read."""
            k = self.config.moe_router_topk
            # The k chosen experts and their weights (the router's probabilities for them).
            weights, ids = torch.topk(torch.where(routing_map, probs, -1.0), k, dim=-1)
            order, counts = sort_by_expert(ids, self.config.num_moe_experts)
            rows = x.index_select(0, order // k)  # [T * k, H] grouped by expert
            y = self.experts(rows, counts, weights.reshape(-1).index_select(0, order))[0]
            back = torch.zeros_like(y).index_copy(0, order, y)  # [T * k, H] in (t, j) order
            return back.view(-1, k, y.shape[-1]).sum(1)

    return GroupedMoELayer


@functools.cache
def grouped_experts_class():
    """`GroupedExperts`, defined once megatron-core may be imported."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):
        """The local experts as two stacked weights, run as grouped GEMMs (module docstring)."""

        def __init__(self, num_local_experts: int, config, pg_collection=None, **_ignored):
            super().__init__(config=config)
            self.num_local_experts = num_local_experts
            self.ep_group = pg_collection.ep if pg_collection is not None else None
            self.dp_group = pg_collection.expt_dp if pg_collection is not None else None
            e, h, i = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
            dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            kw = dict(dtype=config.params_dtype, device=dev)
            self.weight1 = torch.nn.Parameter(torch.empty(e, 2 * i, h, **kw))
            self.weight2 = torch.nn.Parameter(torch.empty(e, h, i, **kw))
            if config.perform_initialization:
                if config.use_cpu_initialization:  # as megatron's CPU init: the global RNG
                    self._init(config)
                else:
                    from megatron.core.tensor_parallel.random import (
                        get_cuda_rng_tracker,
                        get_expert_parallel_rng_tracker_name,
                    )

                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        self._init(config)
            for w in (self.weight1, self.weight2):
                # megatron's DDP keeps expert gradients apart when they are EP-sharded.
                w.allreduce = config.expert_model_parallel_size == 1

        def _init(self, config) -> None:
            for e in range(self.num_local_experts):
                config.init_method(self.weight1.data[e])
                config.output_layer_init_method(self.weight2.data[e])

        def forward(self, x, tokens_per_expert, probs):
            """x `[N, H]` grouped by local expert (`tokens_per_expert [E_local]` rows each),
            probs `[N]` -> (`[N, H]`, None)."""
            counts = tokens_per_expert.to(x.device, non_blocking=True)
            return swiglu_experts(x, self.weight1, self.weight2, counts, probs), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
            """Each weight sharded along its expert axis over EP (global shape `[E, ...]`),
            replicated over the expert-data-parallel ranks."""
            ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
            ep_size = self.ep_group.size() if self.ep_group is not None else 1
            dp_rank = self.dp_group.rank() if self.dp_group is not None else 0
            n = len(sharded_offsets)
            out = {}
            for name in ("weight1", "weight2"):
                out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}{name}",
                    getattr(self, name),
                    *sharded_offsets,
                    (n, ep_rank, ep_size),
                    replica_id=(0, 0, dp_rank),
                    prepend_axis_num=n,
                )
            return out

    return GroupedExperts


def moe_spec(spec, experts: str):
    """megatron's local MoE layer spec (a ModuleSpec in 0.16, a partial of MoELayer in 0.17+)
    with `GroupedMoELayer`, and `GroupedExperts` unless `experts` is "sequential" (megatron's
    SequentialMLP, one expert after another)."""
    is_partial = isinstance(spec, functools.partial)
    sub = spec.keywords["submodules"] if is_partial else spec.submodules
    if experts == "grouped":
        # A class, not a ModuleSpec: megatron 0.16 builds either, 0.17+ calls it.
        sub = dataclasses.replace(sub, experts=grouped_experts_class())
    elif experts != "sequential":
        raise ValueError(f"moe experts must be grouped or sequential (got {experts!r})")
    if is_partial:
        return functools.partial(
            moe_layer_class(), *spec.args, **{**spec.keywords, "submodules": sub}
        )
    return dataclasses.replace(spec, module=moe_layer_class(), submodules=sub)


def attach_losses(model: torch.nn.Module, losses: MoeLosses) -> None:
    """Give every GroupedMoELayer of `model` the shared `losses` and its MoE layer index."""
    layers = [m for m in model.modules() if hasattr(m, "loss_index") and hasattr(m, "router")]
    for i, m in enumerate(layers):
        m.losses, m.loss_index = losses, i


def losses_of(model: torch.nn.Module) -> MoeLosses | None:
    """The MoeLosses of `model`'s MoE layers (None: a dense model, or none attached)."""
    for m in model.modules():
        if getattr(m, "losses", None) is not None and hasattr(m, "router"):
            return m.losses
    return None
