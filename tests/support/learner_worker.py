"""Worker for the learner's multi-process tests, run under torchrun (gloo, CPU).

    torchrun --nproc-per-node 2 tests/support/learner_worker.py TASK OUT_DIR MODEL_DIR...

Also holds the test-only loss and advantage estimator (resolved by import path
`tests.support.learner_worker:pg_loss`), so the learner's tests do not depend on slime_async/algos.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from slime_async.actors.learner.batch import TrainGroup
from slime_async.actors.learner.trainer import Learner
from slime_async.algos.api import LossOutput
from slime_async.config import AlgoConfig, LearnerConfig
from slime_async.queue.schema import Trajectory
from tests.support.repo import torchrun_two_ranks

SEQS = [[2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 20, 21, 22], [2, 30, 31, 32, 33, 34, 35]]


def pg_loss(inp, cfg) -> LossOutput:
    """Importance-weighted policy gradient, token-mean over the whole step."""
    ratio = torch.exp(inp.logp - inp.behavior_logp)
    per_token = -ratio * inp.advantages * inp.loss_mask
    loss = per_token.sum() / inp.token_denominator
    m = inp.loss_mask
    if inp.entropy is not None:  # exercises the entropy's vocab-parallel backward
        loss = loss - cfg.entropy_coef * (inp.entropy * m).sum() / inp.token_denominator
    return LossOutput(
        loss, {"ratio|sum": float((ratio.detach() * m).sum()), "ratio|n": float(m.sum())}
    )


def ref_probe_loss(inp, cfg) -> LossOutput:
    """pg_loss plus how far the reference log-probs are from the current ones."""
    assert inp.ref_logp is not None and not inp.ref_logp.requires_grad
    out = pg_loss(inp, cfg)
    gap = ((inp.ref_logp - inp.logp.detach()).abs() * inp.loss_mask).max()
    out.metrics["ref_gap|max"] = float(gap)
    return out


PROX_CALLS: list[dict] = []
"""What `prox_probe_loss` saw, one entry per micro-batch call (cleared by the test)."""


def prox_probe_loss(inp, cfg) -> LossOutput:
    """pg_loss that records the pi_prox, pi_theta and mu it was given."""
    assert inp.prox_logp is not None and not inp.prox_logp.requires_grad
    PROX_CALLS.append(
        {
            "prox": inp.prox_logp.detach().clone(),
            "logp": inp.logp.detach().clone(),
            "mu": inp.behavior_logp.clone(),
            "mask": inp.loss_mask.clone(),
        }
    )
    return pg_loss(inp, cfg)


def centered_adv(inp, cfg, state) -> torch.Tensor:
    """Reward minus the group mean, one value per trajectory [G, n]."""
    return inp.rewards - inp.rewards.mean(dim=1, keepdim=True)


def make_groups(
    seed: int, num_groups: int, group_size: int = 2, vocab: int = 100
) -> list[TrainGroup]:
    """Deterministic trajectories with env tokens, stale versions and varied lengths."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(8, vocab, size=int(rng.integers(2, 6))).astype(np.int32)
        group = []
        for k in range(group_size):
            r = int(rng.integers(3, 9))
            mask = np.ones(r, dtype=np.uint8)
            mask[r // 2] = 0  # one environment token inside the response
            group.append(
                Trajectory(
                    id=f"s{seed}-g{g}-{k}",
                    group_id=f"s{seed}-g{g}",
                    group_size=group_size,
                    prompt_ids=prompt,
                    response_ids=rng.integers(8, vocab, size=r).astype(np.int32),
                    logprobs=(rng.normal(size=r).astype(np.float32) * 0.1 - 4.6) * mask,
                    loss_mask=mask,
                    versions=np.zeros(r, dtype=np.int32),
                    reward=float(rng.random()),
                )
            )
        groups.append(TrainGroup(tuple(group)))
    return groups


def make_sharp_model(out_dir: Path, family: str, **shape) -> Path:
    """A tiny HF model with O(1) weights: random-init ones give near-uniform attention and
    logits, which would hide layout bugs (RoPE, q/k norm, QKV order) below any tolerance."""
    # Imported here: transformers takes seconds to import, and the torchrun workers that run
    # this file never need it.
    from transformers import AutoModelForCausalLM

    from slime_async.models.toy import make_tiny_model

    make_tiny_model(out_dir, family=family, **shape)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(sum(map(ord, family)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else 1
                std = 0.5 if "bias" in name else 1.5 / fan_in**0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def learner_cfg(model_dir: str | None = None, **kw) -> LearnerConfig:
    base = dict(model_path=model_dir, lr=1e-3, clip_grad=0.0, micro_batch_tokens=24, seed=7)
    base.update(kw)
    return LearnerConfig(**base)


def algo_cfg(**kw) -> AlgoConfig:
    """The test loss and estimator; one update per batch unless `mini_batches` is given (the
    DP and TP comparisons split rows per rank, so only a single mini-batch is comparable)."""
    base = dict(
        loss="tests.support.learner_worker:pg_loss",
        advantage="tests.support.learner_worker:centered_adv",
    )
    return AlgoConfig(**{**base, "mini_batches": 1, **kw})


# Training compared across TP sizes: the clip is active (TP-aware grad norm) and so is the
# entropy term (its vocab-parallel backward).
TP_TRAIN = dict(clip_grad=0.05)
TP_ALGO = dict(entropy_coef=0.01)


def capture_grads(learner) -> dict:
    """Wrap the optimizer step to keep the DP-reduced gradients of the next step."""
    grads: dict = {}
    original = learner.optimizer.step

    def step(lr, tp_group, **kw):
        grads.update(
            {
                n: p.grad.detach().clone()
                for n, p in zip(learner.optimizer.names, learner.optimizer.params, strict=True)
            }
        )
        return original(lr, tp_group, **kw)

    learner.optimizer.step = step
    return grads


def task_tp2(out: Path, model_dirs: list[str]) -> None:
    """Log-probs and HF export at TP=2 for each model; train two steps and checkpoint the first."""
    for i, d in enumerate(model_dirs):
        learner = Learner(
            learner_cfg(d, tensor_parallel=2, **TP_TRAIN), algo_cfg(**TP_ALGO), temperature=0.7
        )
        pairs = learner.compute_logprobs(SEQS, with_entropy=True)
        logps, ents = [lp for lp, _ in pairs], [e for _, e in pairs]
        exported = {n: t.clone() for b in learner.export_hf_buckets(4096) for n, t in b}
        if i == 0:
            metrics = [learner.train_step(make_groups(step, 3)) for step in range(2)]
            learner.save_checkpoint(out / "ckpt_tp2", extra={"cursor": 17})
            after = [lp for lp, _ in learner.compute_logprobs(SEQS)]
        if learner.is_rank0:
            torch.save({"logp": logps, "entropy": ents, "export": exported}, out / f"tp2_{i}.pt")
            if i == 0:
                trained = {"logp": after, "version": learner.version, "metrics": metrics}
                torch.save(trained, out / "tp2_trained.pt")
        learner.close()


def task_dp2(out: Path, model_dirs: list[str]) -> None:
    """One step at DP=2, each rank on its own half of the groups; rank 0 saves the gradients."""
    learner = Learner(learner_cfg(model_dirs[0]), algo_cfg())
    groups = make_groups(100, 4)
    mine = groups[:1] if learner.rank == 0 else groups[1:]  # unequal shares on purpose
    grads = capture_grads(learner)
    metrics = learner.train_step(mine)
    if dist.get_rank() == 0:
        torch.save({"grads": grads, "metrics": metrics}, out / "dp2.pt")
    learner.close()


def task_dp2_minibatches(out: Path, model_dirs: list[str]) -> None:
    """DP=2 with more mini-batches than rank 0 has rows (its last ones are empty locally)."""
    learner = Learner(learner_cfg(model_dirs[0]), algo_cfg(mini_batches=4))
    groups = make_groups(100, 4)
    mine = groups[:1] if learner.rank == 0 else groups[1:]  # 2 rows against 6
    metrics = [learner.train_step(mine) for _ in range(2)]
    if dist.get_rank() == 0:
        torch.save({"metrics": metrics, "version": learner.version}, out / "dp2_mb.pt")
    learner.close()


DDP_ROUNDS = ((False, False, False), (False, True, False), (True, True, False), (True, False, True))
"""(use_distributed_optimizer, overlap_grad_reduce, wgrad fusion) of task_dp2_ddp's rounds; the
last is the learner's GPU default (the linear layers add their weight gradients into
`main_grad` themselves, `models/wgrad.py`)."""


def task_dp2_ddp(out: Path, model_dirs: list[str]) -> None:
    """task_dp2 with megatron-core's DistributedDataParallel reducing the gradients (bucketed;
    all-reduce, or reduce-scatter for the DistributedOptimizer; with and without overlapping the
    last micro-batch's backward). megatron's optimizers allocate on CUDA, so the step here only
    records the reduced `main_grad`s (a reduce-scatter leaves each rank its shard of the buffer:
    the shards are gathered back to compare whole gradients). Rank 0 saves them."""
    from slime_async.actors.learner.megatron_optim import MegatronOptim
    from slime_async.models import wgrad

    for sharded, overlap, fusion in DDP_ROUNDS:
        # A fresh model each round: DDP's gradient hooks stay on the parameters it wrapped.
        learner = Learner(learner_cfg(model_dirs[0]), algo_cfg())
        if fusion:  # what build_gpt_model(wgrad_fusion=True) sets: read by each forward
            wgrad.install_megatron()
            for module in learner.model.modules():
                if hasattr(module, "gradient_accumulation_fusion"):
                    module.gradient_accumulation_fusion = True
        cfg = learner.cfg.model_copy(
            update={
                "use_distributed_optimizer": sharded,
                "overlap_grad_reduce": overlap,
                "ddp_bucket_size": 5000,
            }
        )
        opt = MegatronOptim(learner.model, cfg, build_optimizer=False)
        grads: dict = {}

        def grad_norm(*_a, opt=opt, grads=grads, sharded=sharded, dp=learner.dp_group, **_k):
            if sharded:
                for buffer in opt.ddp.buffers:
                    for bucket in buffer.buckets:
                        parts = list(bucket.grad_data.view(2, -1).unbind(0))
                        mine = parts[dist.get_rank()].clone()
                        dist.all_gather(parts, mine, group=dp)
            grads.update(
                {n: p.main_grad.clone() for n, p in zip(opt.names, opt.params, strict=True)}
            )
            return 1.0

        opt.grad_norm = grad_norm
        opt.step = lambda *_a, opt=opt, **_k: opt.zero_grad()
        updates = learner.updates
        updates.optimizer, updates.optimizer_kind, updates.train_model = opt, "megatron", opt.ddp
        groups = make_groups(100, 4)
        mine = groups[:1] if learner.rank == 0 else groups[1:]  # unequal micro-batch counts
        metrics = learner.train_step(mine)
        if dist.get_rank() == 0:
            torch.save(
                {"grads": grads, "metrics": metrics},
                out / f"dp2_ddp_{sharded}_{overlap}_{fusion}.pt",
            )
        learner.close()


def task_moe_ep2(out: Path, model_dirs: list[str]) -> None:
    """A Qwen3-MoE learner at EP 2 with grouped and with sequential experts: log-probs, one
    update on different data per rank, log-probs after it, the HF export."""
    seqs = [[2, 5, 6, 7, 8, 9, 10, 11, 12], [2, 20, 21, 22], [2, 30, 31, 32, 33, 34, 35]]
    for experts in ("grouped", "sequential"):
        cfg = learner_cfg(model_dirs[0], expert_parallel=2, moe_experts=experts)
        learner = Learner(cfg, algo_cfg(), 0.7)
        res = {"logp": [lp for lp, _ in learner.compute_logprobs(seqs)]}
        groups = make_groups(3, 4)
        res["metrics"] = learner.train_step(groups[:2] if learner.rank == 0 else groups[2:])
        res["after"] = [lp for lp, _ in learner.compute_logprobs(seqs)]
        res["export"] = {n: t.clone() for b in learner.export_hf_buckets(4096) for n, t in b}
        if dist.get_rank() == 0:
            torch.save(res, out / f"ep2_{experts}.pt")
        learner.close()


def run_two_ranks(task: str, out: Path, model_dirs: list[str], timeout: float) -> None:
    """Run `task` of this file under torchrun with 2 gloo ranks; fail with its log if it fails."""
    torchrun_two_ranks(
        __file__, [task, str(out), *model_dirs], out, f"the {task} job to finish", timeout
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    # One process group for all the learners of a task: re-creating it after a learner's
    # close() would rendezvous again on torchrun's store.
    dist.init_process_group("gloo")
    task, out_dir, *dirs = sys.argv[1:]
    tasks = {
        "tp2": task_tp2,
        "dp2": task_dp2,
        "dp2_mb": task_dp2_minibatches,
        "dp2_ddp": task_dp2_ddp,
        "moe_ep2": task_moe_ep2,
    }
    tasks[task](Path(out_dir), dirs)


@pytest.fixture()
def learner_factory():
    """`make(cfg, algo=None, temperature=1.0, **kw)` -> a Learner, closed after the test."""
    made = []

    def make(cfg, algo=None, temperature=1.0, **kw):
        learner = Learner(cfg, algo or algo_cfg(), temperature, **kw)
        made.append(learner)
        return learner

    try:
        yield make
    finally:
        for learner in made:
            learner.close()
