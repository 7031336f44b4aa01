"""What a local run's fork server imports before it forks the roles (utils/forkserver.py).

The modules every role of a run on this machine would import by itself: torch; transformers
with the modeling module of each model family (the engine's model classes); megatron-core as the learner imports it
(`megatron_compat.apply`: on a CPU without torch's compiler, whose patches on a machine without
CUDA are the learner's anyway); and each role's own modules. A module that fails to import is
left out (the role that needs it fails in its own process, with its own log).
"""

from __future__ import annotations

import glob
import os

ROLE_MODULES = (
    "slime_async.queue.server",
    "slime_async.commands.buffer",
    "slime_async.actors.generator.process",
    "slime_async.commands.generator",
    "slime_async.actors.engine.embedded.server",
    "slime_async.commands.engine",
    "slime_async.actors.learner.process",
    "slime_async.actors.learner.trainer",
    "slime_async.commands.learner",
)


def modules() -> list[str]:
    """The fork server's imports, in order (`module` or `module:function` to call)."""
    return [
        "torch",
        "transformers.models.auto.modeling_auto",
        "slime_async.models.families:import_hf_modeling",
        "slime_async.megatron_compat:apply",
        *ROLE_MODULES,
    ]


def gpu_visible() -> str | None:
    """What makes a GPU visible here (None: none is): roles that may initialise CUDA are
    never forked from a process that imported torch (see utils/forkserver.py)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    # NVIDIA's device files, AMD's (ROCm), and WSL's GPU device
    devices = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/kfd") + glob.glob("/dev/dxg")
    return f"{devices[0]} exists" if devices else None
