"""The learner's optimizer: torch AdamW on fp32 master weights, DP gradient all-reduce, TP-aware clip.

Megatron's DDP and DistributedOptimizer create tensors on "cuda" and check
`'torch.cuda.FloatTensor'` type strings, so they cannot run on the CPU path; this one optimizer
serves CPU and GPU alike.
With bf16 parameters it keeps fp32 master copies (and fp32 Adam moments), steps those and
copies them back; with fp32 parameters the masters are the parameters themselves.
Its state goes into dist_checkpointing as ShardedTensors shaped like the model's parameters,
so optimizer state reshards with the model when TP changes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slime_async.config.learner import LearnerConfig
from slime_async.models.convert import is_expert, partition_dim

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Linear warm-up to cfg.lr over lr_warmup_steps, then cosine to min_lr (or constant)."""
    if cfg.lr_warmup_steps and step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if not cfg.lr_decay_steps:
        return cfg.lr
    done = min(1.0, (step - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * done))


def trainable(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    """The names and parameters of `model` that train, in its own order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def tp_partial(names: list[str], params: list[torch.nn.Parameter]) -> list[bool]:
    """Replicated weights that see only part of the work on each TP rank: the q/k norms (each
    rank has its own heads) and, under sequence parallelism, every norm and the router (each rank
    has its own sequence chunk). Their gradients are summed over TP. By name, not by megatron's
    attributes: megatron sets those only when it initialises the weights itself."""
    return [
        partition_dim(n) is None
        and not is_expert(n)
        and (
            n.endswith(("q_layernorm.weight", "k_layernorm.weight"))
            or bool(getattr(p, "sequence_parallel", False))
        )
        for n, p in zip(names, params, strict=True)
    ]


class MasterAdamW:
    """AdamW over fp32 masters of `model`'s trainable parameters."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig):
        """`model`: a megatron GPTModel, or any module whose parameters are not TP-sharded."""
        self.cfg = cfg
        self.names, self.params = trainable(model)
        # By name, not by megatron's `tensor_model_parallel` attribute: megatron leaves that
        # unset when it skips initialisation (weights loaded from HF or a checkpoint).
        self.tp_sharded = [partition_dim(n) is not None for n in self.names]
        # MoE experts live on one expert-parallel rank each: their gradients are reduced over
        # the expert-data-parallel group, their norm summed over the EP group.
        self.expert = [is_expert(n) for n in self.names]
        self.tp_partial = tp_partial(self.names, self.params)
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True)
            for p in self.params
        ]
        # Norms and biases are not decayed (the usual AdamW practice).
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        self.order = decay + no_decay  # the optimizer's own parameter order
        # Allocate the moments now, so a checkpoint can be loaded into them before any step.
        for m in self.masters:
            self.opt.state[m] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def reduce_gradients(self, dp_group, tp_group=None, expert_dp_group=None) -> None:
        """SUM gradients over data-parallel ranks (losses are already divided by global counts);
        partial ones over TP first; experts' over the expert-data-parallel group."""
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        for p, partial in zip(self.params, self.tp_partial, strict=True):
            if tp > 1 and partial:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=tp_group)
        for p, expert in zip(self.params, self.expert, strict=True):
            group = expert_dp_group if expert and expert_dp_group is not None else dp_group
            if dist.get_world_size(group) == 1:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)

    def grad_norm(self, tp_group, ep_group=None) -> float:
        """Global L2 norm: TP-sharded parameters summed over TP ranks, experts over EP ranks,
        replicated ones once."""
        dev = self.params[0].device
        sharded = torch.zeros((), dtype=torch.float32, device=dev)
        replicated = torch.zeros((), dtype=torch.float32, device=dev)
        experts = torch.zeros((), dtype=torch.float32, device=dev)
        for p, is_sharded, is_exp in zip(self.params, self.tp_sharded, self.expert, strict=True):
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if is_exp:
                experts += sq
            elif is_sharded:
                sharded += sq
            else:
                replicated += sq
        if dist.get_world_size(tp_group) > 1:
            dist.all_reduce(sharded, group=tp_group)
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            dist.all_reduce(experts, group=ep_group)
        return float((sharded + replicated + experts).sqrt())

    def step(self, lr: float, tp_group, norm: float | None = None, ep_group=None) -> float:
        """Clip to cfg.clip_grad, step at `lr`, copy masters back; returns the pre-clip norm.

        `norm`: the gradient norm if the caller computed it already. A non-finite norm applies
        nothing (the caller counts it)."""
        if norm is None:
            norm = self.grad_norm(tp_group, ep_group)
        scale = 1.0
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (norm + 1e-6)
        for p, m in zip(self.params, self.masters, strict=True):
            g = torch.zeros_like(m) if p.grad is None else p.grad.detach().float()
            if scale != 1.0:
                g = g * scale
            m.grad = g
        for group in self.opt.param_groups:
            group["lr"] = lr
        if math.isfinite(norm):
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    if p is not m:
                        p.copy_(m)
        self.zero_grad()
        return norm

    # ------------------------------------------------------------ dist_checkpointing

    def sharded_state_dict(self, model_sharded: dict) -> dict:
        """Moments (and bf16 masters) as ShardedTensors keyed like the model's parameters."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        sharded, _ = extract_sharded_tensors_and_factories(model_sharded)
        by_param = {id(t.data): t for t in nested_values(sharded)}
        out: dict = {}
        for name, p, m in zip(self.names, self.params, self.masters, strict=True):
            sh = by_param.get(id(p))
            if sh is None:
                raise RuntimeError(f"parameter {name} has no sharded tensor in the model state")
            state = self.opt.state[m]
            entry = {
                k: make_sharded_optimizer_tensor(sh, state[k], prefix=f"optimizer.state.{k}")
                for k in ("exp_avg", "exp_avg_sq")
            }
            if m is not p:
                entry["master"] = make_sharded_optimizer_tensor(
                    sh, m.data, prefix="optimizer.master"
                )
            out[name] = entry
        return out

    def load_sharded(self, loaded: dict, step: int) -> None:
        """Copy tensors returned by dist_checkpointing.load into the moments and masters."""
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters, strict=True):
                entry = loaded[name]
                state = self.opt.state[m]
                state["exp_avg"].copy_(entry["exp_avg"])
                state["exp_avg_sq"].copy_(entry["exp_avg_sq"])
                state["step"] = torch.tensor(float(step))
                if m is not p:
                    m.copy_(entry["master"])
