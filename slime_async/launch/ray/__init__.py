"""`run.launcher = "ray"`: the launch table of `slime-async run` on an existing Ray cluster.

    slime-async run CONFIG run.launcher='"ray"'      # on the head node of `ray start --head`

The driver (`launcher.py`) joins the cluster, reserves one placement group with a bundle per
process (`placement.py`: engines and learner ranks on the nodes their rules name, buffer, router
and generators on CPU resources), starts one actor per bundle (`actor.py`), asks each actor for
its node's address and free ports there, plans the same launch table as the local launcher
(`launch/table.py` with `RoleAddresses`) and supervises it with the same `Supervisor`: each role
is the same command line, run by its actor as a child process in its own process group.

Ray is optional (`pip install 'slime_async[ray]'`): nothing outside this package imports it, and
this package imports it only when a Ray run starts (`import_ray`).
"""

from __future__ import annotations

from types import ModuleType

from slime_async.config import ConfigError

RAY_EXTRA = "pip install 'slime_async[ray]'"


def import_ray() -> ModuleType:
    """The `ray` module, or a ConfigError naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"run.launcher = 'ray' needs Ray, which is not installed ({e}); install the extra: "
            f"{RAY_EXTRA}"
        ) from None
    return ray
