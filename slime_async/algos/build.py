"""`build_algorithm(cfg)`: resolve the configured estimator and loss once, at start-up.

The learner holds the returned `Algorithm` and calls, per step:

    keep = algo.keep_groups(rewards, lengths)              # [G'] (all unless the DAPO filter)
    adv = algo.advantages(AdvantageInput(rewards[keep], lengths[keep]))   # [G', n] | [G', n, T]
    ... per micro-batch:  out = algo.loss(LossInput(...)); out.loss.backward()
    metrics = reduce_metrics(raws of all micro-batches and ranks)

A user's function given by import path goes through the same registry check (signature) and
a dry run on a 2 x 3 batch, so a broken plug-in fails here, naming itself, not mid-run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slime_async.algos.api import ADVANTAGES, LOSSES, AdvantageInput, LossInput, LossOutput
from slime_async.algos.filters import keep_groups, shape_rewards
from slime_async.config.algo import AlgoConfig
from slime_async.utils.plugins import PluginError

_PER_TOKEN = ("logp", "behavior_logp", "advantages", "loss_mask", "versions")
_OPTIONAL = ("prox_logp", "ref_logp", "entropy")


def check_loss_input(inp: LossInput) -> None:
    """Raise ValueError naming the field if `inp`'s tensors do not share one `[B, T]` shape."""
    if inp.logp.dim() != 2:
        raise ValueError(f"LossInput.logp must be [B, T], got shape {tuple(inp.logp.shape)}")
    shape = inp.logp.shape
    for name in _PER_TOKEN + _OPTIONAL:
        t = getattr(inp, name)
        if t is not None and t.shape != shape:
            raise ValueError(
                f"LossInput.{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp"
            )
    if not inp.token_denominator > 0 or not inp.seq_denominator > 0:
        raise ValueError(
            "LossInput.token_denominator and seq_denominator must be > 0 (the step's totals), "
            f"got {inp.token_denominator} and {inp.seq_denominator}"
        )


@dataclass
class Algorithm:
    """The resolved estimator and loss, their config, and the estimator's persistent state."""

    cfg: AlgoConfig
    loss_fn: Callable[[LossInput, AlgoConfig], LossOutput]
    advantage_fn: Callable[[AdvantageInput, AlgoConfig, dict], torch.Tensor]
    state: dict = field(default_factory=dict)
    """Estimator state across steps (running baselines); save it with the checkpoint."""

    @property
    def needs_ref_logp(self) -> bool:
        """The learner must fill `LossInput.ref_logp` (a reference-model forward)."""
        return self.cfg.kl_coef > 0

    @property
    def ess_scaled_lr(self) -> bool:
        """The learner must scale each update's learning rate by `lr_scale_from` of the raw
        metrics of the update's micro-batches (all ranks): VCPO's step size."""
        return bool(getattr(self.loss_fn, "ess_scaled_lr", False))

    @property
    def needs_entropy(self) -> bool:
        """The learner must fill `LossInput.entropy` (with grad)."""
        return self.cfg.entropy_coef > 0

    def keep_groups(self, rewards: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
        """`[G']` long: indices of the groups of `rewards: [G, n]` to train on."""
        return keep_groups(rewards, response_lengths, self.cfg)

    def advantages(self, inp: AdvantageInput) -> torch.Tensor:
        """Shaped rewards -> the estimator -> `[G, n]` or `[G, n, T]`, checked."""
        if inp.rewards.dim() != 2 or inp.response_lengths.shape != inp.rewards.shape:
            raise ValueError(
                f"AdvantageInput: rewards {tuple(inp.rewards.shape)} and response_lengths "
                f"{tuple(inp.response_lengths.shape)} must both be [G, n]"
            )
        shaped = AdvantageInput(
            rewards=shape_rewards(inp.rewards, inp.response_lengths, self.cfg),
            response_lengths=inp.response_lengths,
            token_mask=inp.token_mask,
            all_reduce_sum=inp.all_reduce_sum,
        )
        adv = self.advantage_fn(shaped, self.cfg, self.state)
        g, n = inp.rewards.shape
        name = f"advantage estimator {self.cfg.advantage!r}"
        if not isinstance(adv, torch.Tensor) or tuple(adv.shape[:2]) != (g, n) or adv.dim() > 3:
            got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise PluginError(f"{name}: returned {got}, expected a tensor [{g}, {n}] or [G, n, T]")
        if not bool(torch.isfinite(adv).all()):
            raise PluginError(f"{name}: returned non-finite advantages for rewards {inp.rewards}")
        return adv

    def loss(self, inp: LossInput) -> LossOutput:
        """The configured loss on one micro-batch, with its input and output checked."""
        check_loss_input(inp)
        out = self.loss_fn(inp, self.cfg)
        if not isinstance(out, LossOutput) or not isinstance(out.loss, torch.Tensor):
            raise PluginError(f"loss {self.cfg.loss!r}: must return LossOutput(loss=tensor, ...)")
        if out.loss.numel() != 1:
            raise PluginError(
                f"loss {self.cfg.loss!r}: loss must be a scalar, got {tuple(out.loss.shape)}"
            )
        return out

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = copy.deepcopy(state)


def _dry_run(algo: Algorithm) -> None:
    """Call both functions once on a tiny batch (on a copy of the state)."""
    probe = Algorithm(algo.cfg, algo.loss_fn, algo.advantage_fn, copy.deepcopy(algo.state))
    try:
        probe.advantages(
            AdvantageInput(
                rewards=torch.tensor([[1.0, 0.0], [0.5, 0.25]]),
                response_lengths=torch.tensor([[3, 2], [1, 3]]),
            )
        )
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(
            f"advantage estimator {algo.cfg.advantage!r} failed on a 2x2 test batch: {e!r}"
        ) from e
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 3, generator=g)).requires_grad_()
    behavior = logp.detach() - 0.1
    inp = LossInput(
        logp=logp,
        behavior_logp=behavior,
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]),
        loss_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        versions=torch.tensor([[3, 3, 3], [2, 3, 3]]),
        current_version=3,
        token_denominator=5.0,
        seq_denominator=2.0,
        prox_logp=logp.detach(),
        ref_logp=behavior - 0.1 if probe.needs_ref_logp else None,
        entropy=torch.rand(2, 3, generator=g).requires_grad_() if probe.needs_entropy else None,
    )
    try:
        probe.loss(inp).loss.backward()
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"loss {algo.cfg.loss!r} failed on a 2x3 test batch: {e!r}") from e


def build_algorithm(cfg: AlgoConfig, *, dry_run: bool = True) -> Algorithm:
    """Resolve `cfg.advantage` and `cfg.loss` (names or import paths) and check them.

    Raises PluginError naming the function when it is unknown, has the wrong signature, or
    (with `dry_run`) fails or returns the wrong thing on a tiny test batch.
    """
    algo = Algorithm(
        cfg=cfg,
        loss_fn=LOSSES.resolve(cfg.loss, "algo.loss"),
        advantage_fn=ADVANTAGES.resolve(cfg.advantage, "algo.advantage"),
    )
    if dry_run:
        _dry_run(algo)
    return algo


ESS_KEYS = ("seq_is_weight|sum", "seq_is_weight|n", "seq_is_weight|sq")
"""The raw metrics of the answers' behaviour weights that VCPO's step size is computed from."""


def lr_scale_from(sums: list[float]) -> float:
    """sqrt of the normalised ESS (sum W)^2 / (n sum W^2) from the update's summed `ESS_KEYS`
    (1.0 when the update has no answers)."""
    total, n, sq = sums
    if n <= 0 or sq <= 0:
        return 1.0
    return min(1.0, (total * total / (n * sq)) ** 0.5)
