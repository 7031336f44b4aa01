"""`[algo]`: advantage estimator, reward shaping and the policy loss (slime_async/algos/).

The defaults are for asynchronous GRPO on stale data: group-normalised advantages and the
decoupled PPO objective (AReaL), whose behaviour weight pi_prox/mu corrects for the policy that
sampled each token, truncated at 2 so a few very stale tokens cannot dominate a step.
"""

from typing import Literal

from pydantic import Field, model_validator

from slime_async.config.base import Section


class AlgoConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce, or `package.module:fn`."""
    advantage_std_norm: bool = True
    """grpo: divide by the group's reward std (Dr.GRPO argues against it: use advantage=dr_grpo)."""
    advantage_eps: float = Field(1e-6, gt=0)
    """Added to a reward std before dividing by it (grpo, reinforce_pp)."""
    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """reinforce: running baseline b <- decay * b + (1 - decay) * batch mean reward."""
    loss: str = "decoupled_ppo"
    """Policy loss: ppo_clip, decoupled_ppo, tis, mis, aipo, gspo, decoupled_gspo, m2po, dppo,
    seq_mask, cispo, vcpo, mu_band, or `pkg.m:fn` (docs/algorithms.md has each formula)."""
    eps_clip_low: float = Field(0.2, ge=0)
    """Lower PPO clip: ratio >= 1 - eps_clip_low."""
    eps_clip_high: float = Field(0.2, ge=0)
    """Upper PPO clip: ratio <= 1 + eps_clip_high (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual clip: for negative advantages the loss is at most -c * A (None: off; 3 is usual)."""
    ppo_old_policy: Literal["behavior", "prox"] = "behavior"
    """ppo_clip/gspo ratio denominator: mu (naive PPO) or pi_prox (the decoupled losses: pi_prox)."""
    gspo_eps_clip_low: float = Field(3e-4, ge=0)
    """gspo, decoupled_gspo: lower clip of the sequence-level ratio (GSPO's ranges are tiny)."""
    gspo_eps_clip_high: float = Field(4e-4, ge=0)
    """gspo, decoupled_gspo: upper clip of the sequence-level ratio."""
    prox_source: Literal["forward", "interpolate"] = "forward"
    """pi_prox: the learner's no-grad forward (or logp.detach()), or log-linear in versions."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Importance weight per token, per sequence (product), or the sequence's geometric mean."""
    is_mode: Literal["none", "truncate", "mask"] = "truncate"
    """Weight bound of decoupled_ppo/_gspo and aipo: none, clamp to [is_low, is_high], or 0 outside."""
    is_low: float = Field(0.0, ge=0)
    """Lower bound of the importance weight (0: none)."""
    is_high: float | None = Field(2.0, gt=0)
    """Upper bound of the importance weight, also AIPO's rho (None: none)."""
    is_veto: float | None = Field(None, gt=0, lt=1)
    """Drop a whole sequence if any token's weight is below this (catastrophic tokens; None: off)."""
    m2po_tau: float = Field(0.04, gt=0)
    """m2po: the micro-batch's second moment of log(pi_theta / mu) over its kept tokens is held at
    or below this by masking the tokens of largest (log ratio)^2 (M2PO's tau_M2 = 0.04)."""
    dppo_mask_low: float = Field(0.2, gt=0, le=1)
    """dppo: a token with a negative advantage is masked once pi_theta(y) - mu(y) < -this (a
    probability difference, the total-variation trust region of DPPO)."""
    dppo_mask_high: float = Field(0.2, gt=0, le=1)
    """dppo: a token with a positive advantage is masked once pi_theta(y) - mu(y) > this."""
    dppo_kl_tau: float = Field(1e-3, ge=0)
    """dppo: weight of the squared log-ratio penalty tau * (log pi_theta / mu)^2 on every token."""
    seq_mask_delta: float = Field(0.05, gt=0)
    """seq_mask: a sequence with a negative advantage whose mean log(mu / pi_theta) over its tokens
    exceeds this is left out of the step (off-policy sequence masking)."""
    cispo_eps_low: float | None = Field(None, ge=0, lt=1)
    """cispo: lower bound 1 - this of the stop-gradient weight pi_theta / pi_prox (None: none, as
    MiniMax-M1 ships it)."""
    cispo_eps_high: float = Field(0.28, gt=0)
    """cispo: upper bound 1 + this of the stop-gradient weight pi_theta / pi_prox."""
    band_growth: float = Field(0.25, ge=0)
    """mu_band: the clip range around mu at lag k is eps_clip_* x (1 + band_growth x k)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """token_mean (default: each token weighs the same), seq_mean_token_mean, or Dr.GRPO's sum."""
    aggregation_constant: float = Field(1024.0, gt=0)
    """seq_mean_token_sum_norm (Dr.GRPO): token sum / (sequences * this), e.g. the max length."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty against the reference (initial) policy; 0 disables it."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL value estimate (r = ref/pi): k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 - log r; each has
    the gradient of KL(pi || ref) (slime_async/algos/kl.py)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus; 0 disables it (and the entropy computation)."""
    overlong_max_len: int | None = Field(None, ge=1)
    """DAPO overlong penalty: responses longer than this get the full penalty (None: off)."""
    overlong_buffer_len: int = Field(0, ge=0)
    """Penalty ramps linearly over the last this many tokens before overlong_max_len."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Size of the full overlong penalty (subtracted from the reward)."""
    filter_zero_variance: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (their advantage is 0)."""
    filter_eps: float = Field(1e-6, ge=0)
    """A group whose reward std is at most this counts as zero-variance."""
    mini_batches: int = Field(4, ge=1)
    """Optimizer steps per batch: its trajectories split into this many mini-batches, each one
    AdamW update (PPO's inner loop). pi_prox is the policy at the start of the batch, so after
    the first update the clip and the behaviour weight see a ratio != 1: the trust region is
    active. One policy version per batch, whatever this is."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the batch's mini-batches (updates per batch = ppo_epochs * mini_batches)."""

    @model_validator(mode="after")
    def _consistent(self) -> "AlgoConfig":
        builtin = ":" not in self.loss  # a user's loss may read any field
        for key, users in _LOSS_ONLY.items():
            default = type(self).model_fields[key].default
            if builtin and getattr(self, key) != default and self.loss not in users:
                raise ValueError(
                    f"algo.{key} is read only by loss {' / '.join(users)}, but algo.loss = "
                    f"{self.loss!r}: it would do nothing"
                )
        if self.is_high is not None and self.is_low > self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must not exceed is_high ({self.is_high})")
        if self.overlong_max_len is not None and self.overlong_buffer_len > self.overlong_max_len:
            raise ValueError(
                f"overlong_buffer_len ({self.overlong_buffer_len}) must not exceed "
                f"overlong_max_len ({self.overlong_max_len})"
            )
        return self


_LOSS_ONLY = {
    "m2po_tau": ("m2po",),
    "dppo_mask_low": ("dppo",),
    "dppo_mask_high": ("dppo",),
    "dppo_kl_tau": ("dppo",),
    "seq_mask_delta": ("seq_mask",),
    "cispo_eps_low": ("cispo",),
    "cispo_eps_high": ("cispo",),
    "band_growth": ("mu_band",),
}
"""Settings of one built-in loss: away from their defaults with another built-in loss they are
refused (a resolved config.json holds every field at its value, so "set" means "not default")."""
