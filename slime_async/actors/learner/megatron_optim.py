"""The learner's GPU optimizer: megatron-core's DistributedDataParallel and (Distributed)Optimizer.

`MegatronOptim` offers `MasterAdamW`'s interface (zero_grad, reduce_gradients, grad_norm, step,
sharded_state_dict, load_sharded) over megatron-core's own machinery:

- `DistributedDataParallel` keeps every gradient in contiguous fp32 buckets (`main_grad`) and
  reduces them bucket by bucket; with `learner.overlap_grad_reduce` the reduction of a bucket
  starts during the last micro-batch's backward pass (`forward_context()` marks the others
  `no_sync`). Losses are already divided by the batch's global counts, so gradients are SUMMED
  over data-parallel ranks (megatron's `calculate_per_token_loss` scaling: 1).
- the optimizer keeps fp32 master weights and Adam moments; with
  `learner.use_distributed_optimizer` they are sharded over the data-parallel ranks (ZeRO-1):
  gradients are reduce-scattered, each rank steps its shard and the bf16 parameters are
  all-gathered back at the end of `step` (so every rank holds whole parameters again before the
  weight export reads them).

Replicated weights that see only part of the work on each TP rank (q/k norms, and under sequence
parallelism every norm and router) are summed over TP here, as `MasterAdamW` does: megatron
recognises them only by attributes its own norm classes set.
Checkpoints: the optimizer state goes through megatron's `sharded_state_dict` (model-space
sharded, so it reshards when TP or DP change) under the same "optimizer" key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
import torch.distributed as dist

from slime_async.actors.learner import multi_tensor
from slime_async.actors.learner.optim import tp_partial, trainable
from slime_async.config.learner import LearnerConfig

# megatron.core is imported inside functions: only after megatron_compat.apply() (see there).

log = logging.getLogger("slime_async.learner")


class MegatronOptim:
    """megatron DDP over `model` plus megatron's optimizer; `self.ddp` is what forward calls."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, build_optimizer: bool = True):
        """`build_optimizer=False`: the DDP wrapper alone (megatron's optimizers allocate on CUDA;
        the CPU test of the gradient reduction at DP 2 supplies its own step)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        self.model = model
        # Gradients SUMMED over DP (the losses are divided by global token/sequence counts).
        model.config.calculate_per_token_loss = True
        ddp_kwargs = dict(
            grad_reduce_in_fp32=True,
            average_in_collective=False,  # SUM (calculate_per_token_loss refuses averaging)
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        if cfg.ddp_bucket_size is not None:
            ddp_kwargs["bucket_size"] = cfg.ddp_bucket_size
        self.ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
            module=model,
        )
        bf16 = model.config.bf16
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=bf16,
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.opt = get_megatron_optimizer(opt_cfg, [self.ddp]) if build_optimizer else None
        self.fused_adam = False
        self.planned_copies = 0
        if self.opt is not None:
            multi_tensor.install()
            self.fused_adam = _fuse_adam(self.opt)
            self.planned_copies = _plan_copies(self.opt)
        self.names, self.params = trainable(model)
        self.tp_partial = tp_partial(self.names, self.params)
        self._micro = 0
        self._micro_total = 1

    # ------------------------------------------------------------ the learner's interface

    def begin(self, micro_batches: int) -> None:
        """A mini-batch of `micro_batches` backward passes starts (overlap: sync on the last)."""
        self._micro, self._micro_total = 0, max(1, micro_batches)

    def forward_context(self):
        """Around one micro-batch's forward + backward: all but the last skip the DP sync."""
        self._micro += 1
        if self.cfg.overlap_grad_reduce and self._micro < self._micro_total:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        if self.opt is not None:
            self.opt.zero_grad()

    def reduce_gradients(self, dp_group, tp_group=None, expert_dp_group=None) -> None:
        """DP reduction (megatron's buckets), then partial replicated gradients over TP."""
        if self.cfg.overlap_grad_reduce and self._micro == 0:
            # No backward ran here (an empty local share of the mini-batch): no bucket hook
            # started its reduction, which the other ranks' reductions wait for.
            self.ddp.start_grad_sync()
        self.ddp.finish_grad_sync()
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp == 1:
            return
        for p, partial in zip(self.params, self.tp_partial, strict=True):
            if partial:
                # The buffer layout is the same on the TP ranks of one DP rank, so after a
                # reduce-scatter each rank's own shard region lines up across TP as well.
                dist.all_reduce(p.main_grad, group=tp_group)

    def grad_norm(self, tp_group=None, ep_group=None) -> float:
        """Global L2 norm of the reduced gradients (megatron's: TP- and DP-shard aware)."""
        self.opt.prepare_grads()
        return float(self.opt.get_grad_norm())

    def step(self, lr: float, tp_group=None, norm: float | None = None, ep_group=None) -> float:
        """Clip to cfg.clip_grad, step at `lr` (bf16 parameters gathered back); the pre-clip norm.

        Call `grad_norm` first (it copies the model's gradients to the master ones), and
        `zero_grad` before the next backward pass (`Updates.update` does, once per update: the
        gradient buffer is as large as the fp32 master weights)."""
        if norm is None:
            norm = self.grad_norm()
        for group in self.opt.param_groups:
            group["lr"] = lr
        if not math.isfinite(norm):
            return norm
        if not (self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad):
            self.opt.step_with_ready_grads()
        elif self.fused_adam:
            # Megatron's clip (grads x max_norm / (norm + 1e-6)) as the fused kernel's divisor of
            # the gradients it reads: the same update without a pass of its own over them.
            divisor = torch.tensor(
                (norm + 1.0e-6) / self.cfg.clip_grad,
                dtype=torch.float32,
                device=self.params[0].device,
            )
            inner = _inner_optimizers(self.opt)
            for o in inner:
                o.grad_scale = divisor
            try:
                self.opt.step_with_ready_grads()
            finally:
                for o in inner:
                    del o.grad_scale
        else:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            # What megatron's ChainedOptimizer.step does with the norm already known.
            for opt in _chained(self.opt):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params, max_norm=self.cfg.clip_grad, total_norm=norm
                    )
            self.opt.step_with_ready_grads()
        return norm

    # ------------------------------------------------------------ dist_checkpointing

    # The DistributedOptimizer's state in megatron's canonical per-parameter form (reshards at
    # any TP / DP); its default, "fully_sharded_model_space", writes flattened ShardedTensors that
    # megatron-core 0.19's dist_checkpointing refuses ("flattened_range is not supported", on
    # the H200). Both 0.16 and 0.19 know "fully_reshardable".
    _METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}

    def sharded_state_dict(self, model_sharded: dict) -> dict:
        return self.opt.sharded_state_dict(model_sharded, is_loading=False, metadata=self._METADATA)

    def sharded_state_dict_for_load(self, model_sharded: dict) -> dict:
        self._init_empty_state()
        return self.opt.sharded_state_dict(model_sharded, is_loading=True, metadata=self._METADATA)

    def _init_empty_state(self) -> None:
        """Zero Adam moments and step for parameters that have none yet (a learner that has not
        stepped), so that the state to load into has its final shape. Without Apex/TE,
        megatron-core 0.19's DistributedOptimizer.state_dict() asserts one common `step` and
        fails on an empty state (measured on the H200). Nothing here changes a parameter; the
        loaded checkpoint replaces every value."""
        for opt in _chained(self.opt):
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if len(inner.state[p]) == 0:
                        inner.state[p]["step"] = torch.zeros(
                            (),
                            dtype=torch.float32,
                            device=p.device if group.get("fused") else "cpu",
                        )
                        inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    def load_sharded(self, loaded: dict, step: int) -> None:
        """Load megatron's optimizer state; works around one megatron-core 0.19 bug on the
        torch-Adam path (no Apex/TE): `load_state_dict` puts the checkpoint's Adam `step` into
        every parameter's state as a tensor, then `_set_main_param_and_optimizer_states` copies
        every tensor of that state from the loaded per-parameter tensors, which never carry
        `step` (`KeyError: 'step'`, on the H200). The per-parameter call
        gets `step: None`, which megatron skips, so `step` stays the checkpoint's."""
        patched = []
        for opt in _chained(self.opt):
            setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
            if setter is None:
                continue

            def with_step(model_param, tensors, _setter=setter):
                return _setter(model_param, {"step": None, **tensors})

            opt._set_main_param_and_optimizer_states = with_step
            patched.append(opt)
        try:
            self.opt.load_state_dict(loaded)
        finally:
            for opt in patched:
                del opt._set_main_param_and_optimizer_states  # the class's method again
        # The same megatron code puts ONE `step` tensor into every parameter's state; torch's
        # AdamW increments each state's step in place, so a shared tensor would advance once
        # per parameter per update and lose the bias correction (a resumed run's second loss
        # 0.8% off, on the H200). Each parameter gets its own copy.
        for opt in _chained(self.opt):
            for st in opt.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()
        _steps_on_device(self.opt)
        self.planned_copies = _plan_copies(self.opt)  # the tensors as they are after the load


def _chained(opt) -> list:
    """megatron's optimizers behind `opt` (a ChainedOptimizer's parts, e.g. dense and experts)."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def _inner_optimizers(opt) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in _chained(opt)]


def _fuse_adam(opt) -> bool:
    """torch's fused Adam kernel (one pass over parameter, gradient and moments) for megatron's
    torch AdamW fallback, whose default `foreach` path passes over them about ten times (AdamW:
    about 10 ms of a 148 ms step at the 0.51B shape on the H200, 5.4 ms fused on an H100). Only
    where every parameter is a CUDA float32 master weight (the kernel's requirement); the same
    update up to float rounding. True when every inner optimizer runs fused (the clip can then
    ride in the kernel: `step`)."""
    inner = _inner_optimizers(opt)
    usable = all(
        isinstance(o, torch.optim.Adam | torch.optim.AdamW)  # not Apex's or TE's fused Adam
        and all(p.is_cuda and p.dtype == torch.float32 for g in o.param_groups for p in g["params"])
        for o in inner
    )
    if not usable or not inner:
        return False
    for o in inner:
        for group in o.param_groups:
            group["fused"], group["foreach"] = True, False
    return True


def _plan_copies(opt) -> int:
    """The DistributedOptimizer's two per-parameter copies, planned once: each update megatron
    walks every parameter in Python to point its master's `.grad` at its slice of the fp32
    gradient buffer (`_copy_model_grads_to_main_grads`, a range lookup, a view and a slice per
    parameter) and to copy each fp32 master into its bf16 slice of the parameter buffer
    (`_copy_main_params_to_model_params`, one copy kernel per parameter: 226 at the 0.51B shape).
    The slices never move (the buffers are allocated once), so they are computed here with
    megatron's own range maps, and each update assigns the grads in one loop and copies every
    master with one `_foreach_copy_`. Only on the plain path megatron takes with this
    learner's configuration (no FSDP, no FP8 or precision-aware masters, an fp32 gradient
    buffer); elsewhere megatron's methods stay. The number of optimizers planned."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    planned = 0
    for o in _chained(opt):
        if not isinstance(o, DistributedOptimizer) or o.is_stub_optimizer:
            continue  # nothing per parameter to plan (the plain optimizer copies by foreach)
        if (
            o.ddp_config.use_megatron_fsdp
            or getattr(o.ddp_config, "fp8_param_gather", False)
            or getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        ):
            log.info("optimizer copies: megatron's own (FSDP, FP8 or precision-aware masters)")
            continue
        grads, shards, mains = [], [], []
        for model_group, main_group in (
            *zip(o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True),
            *zip(o.model_fp32_groups, o.shard_fp32_groups, strict=True),
        ):
            for model_param, main in zip(model_group, main_group, strict=True):
                ranges = o._get_model_param_range_map(model_param)
                own, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                grads.append((main, model_param.main_grad.view(-1)[own.start : own.end]))
                index, _, bucket = o.model_param_gbuf_map[model_param]
                buffer = o.buffers[index].buckets[bucket].param_data
                shards.append(buffer.view(-1)[world.start : world.end])
                mains.append(main)
        if any(g.dtype != m.dtype or g.shape != m.shape for m, g in grads):
            log.info("optimizer copies: megatron's own (the gradient buffer is not fp32)")
            continue
        o._copy_model_grads_to_main_grads = functools.partial(_point_grads, grads)
        o._copy_main_params_to_model_params = functools.partial(_copy_masters, shards, mains)
        planned += 1
    return planned


def _point_grads(grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for main, grad in grads:
        main.grad = grad


@torch.no_grad()
def _copy_masters(shards: list[torch.Tensor], mains: list[torch.Tensor]) -> None:
    if shards:
        torch._foreach_copy_(shards, mains)


def _steps_on_device(opt) -> None:
    """The fused kernel takes each parameter's Adam `step` on the parameter's device (a loaded
    checkpoint brings them to the host)."""
    for inner in _inner_optimizers(opt):
        for group in inner.param_groups:
            if not group.get("fused"):
                continue
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    inner.state[p]["step"] = step.to(p.device)
