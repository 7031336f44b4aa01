"""The plug-in API: everything a rollout, reward, loss or advantage plug-in uses, in one place.

    from slime_async.api import RolloutContext, Sample, Transcript, numeric_match

    async def rollout(ctx: RolloutContext, sample: Sample) -> Transcript: ...   # generator.rollout
    def reward(sample: Sample, response_text: str, info: dict) -> float: ...      # generator.reward
    class Judge: async def setup(self, ctx: SetupContext); async def teardown(self)  # .lifecycle
    def loss(inp: LossInput, cfg: AlgoConfig) -> LossOutput: ...                 # algo.loss
    def advantage(inp: AdvantageInput, cfg: AlgoConfig, state: dict) -> Tensor: ...  # algo.advantage

This import path is stable: the modules behind it may move, these names stay. Each object's own
docstring documents it; docs/plugins.md is the reference of every object and field, the README
shows a complete rollout plug-in and docs/algorithms.md the loss and advantage contracts.
Plug-ins are named in the config by registered name or by `package.module:function`.
"""

from slime_async.actors.generator.lifecycle import LIFECYCLES, SetupContext
from slime_async.actors.generator.rewards import (
    REWARDS,
    exact_match,
    final_answer,
    format_check,
    math_reward,
    numeric_match,
)
from slime_async.actors.generator.rollout import (
    ROLLOUTS,
    EngineFailure,
    Generation,
    PluginContractError,
    RolloutContext,
    Sample,
    Transcript,
    single_turn,
)
from slime_async.algos import ADVANTAGES, LOSSES, AdvantageInput, LossInput, LossOutput
from slime_async.config import AlgoConfig, SamplingConfig
from slime_async.utils.plugins import PluginError

__all__ = [
    "ADVANTAGES",
    "LIFECYCLES",
    "LOSSES",
    "REWARDS",
    "ROLLOUTS",
    "AdvantageInput",
    "AlgoConfig",
    "EngineFailure",
    "Generation",
    "LossInput",
    "LossOutput",
    "PluginContractError",
    "PluginError",
    "RolloutContext",
    "Sample",
    "SamplingConfig",
    "SetupContext",
    "Transcript",
    "exact_match",
    "final_answer",
    "format_check",
    "math_reward",
    "numeric_match",
    "single_turn",
]
