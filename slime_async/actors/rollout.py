"""Old import path of the rollout-plugin API, kept for existing plug-ins and run configs.

Import from `slime_async.api` instead; the code lives in `slime_async.actors.generator.rollout`.
"""

from slime_async.actors.generator.rollout import *  # noqa: F403
from slime_async.actors.generator.rollout import ROLLOUTS, single_turn  # noqa: F401
