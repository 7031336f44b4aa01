"""`[algo]`: advantage estimator and policy loss (slime_async/algos/)."""

from pydantic import Field

from slime_async.config.base import Section


class AlgoConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator: a registered name or `package.module:function`."""
    loss: str = "ppo_clip"
    """Policy loss: a registered name or `package.module:function`."""
    eps_clip_low: float = Field(0.2, ge=0)
    """Lower PPO clip: ratio >= 1 - eps_clip_low."""
    eps_clip_high: float = Field(0.2, ge=0)
    """Upper PPO clip: ratio <= 1 + eps_clip_high."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty against the reference (initial) policy; 0 disables it."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus; 0 disables it (and the entropy computation)."""
