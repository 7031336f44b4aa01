"""Old import path of the reward helpers, kept for existing plug-ins and run configs.

Import from `slime_async.api` instead; the code lives in `slime_async.actors.generator.rewards`.
"""

from slime_async.actors.generator.rewards import *  # noqa: F403
from slime_async.actors.generator.rewards import REWARDS, math_reward  # noqa: F401
