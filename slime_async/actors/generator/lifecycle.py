"""Plug-in lifecycle: what a generator sets up once before its first rollout and tears down last.

`generator.lifecycle = "my_judge:Judge"` names one of:

- an object or a class (instantiated with no arguments) with `setup(ctx)` and/or `teardown()`,
  each sync or `async def`; the state handed to plug-ins is what `setup` returns, or the object
  itself when `setup` returns None;
- a function `fn(ctx)` returning an async context manager (`@contextlib.asynccontextmanager`);
  the state is what it yields.

Rollouts see the state as `ctx.state`, rewards as `info["state"]`. Setup runs once per generator
before the first group starts; teardown runs once when the generator ends, whatever ended it
(done, `stop()`, an error, cancellation), provided setup returned.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_async.config.generator import GeneratorConfig
from slime_async.utils.plugins import PluginError, Registry, check_signature

LIFECYCLES = Registry("lifecycle")
"""Nothing built in: installed packages' `lifecycle.<name>` entry points, else import paths."""


@dataclass
class SetupContext:
    """What `setup(ctx)` receives."""

    config: GeneratorConfig
    """The generator's config section (`config.producer_id`, `config.sampling`, ...)."""
    tokenizer: Any
    """The model's tokenizer (the same object as `RolloutContext.tokenizer`)."""
    run_dir: Path | None
    """The run directory (None outside `slime-async run`): a place for the plug-in's own files."""


class Lifecycle:
    """A resolved `generator.lifecycle`; `async with lc.running(ctx) as state: ...`."""

    def __init__(self, path: str | None):
        self.path = path
        self.obj: Any = None
        self.kind = "none"
        if path is None:
            return
        name = f"generator.lifecycle {path!r}"
        obj = LIFECYCLES.resolve(path, "generator.lifecycle")
        if inspect.isclass(obj):
            try:
                obj = obj()
            except Exception as e:
                raise PluginError(
                    f"{name}: cannot create it with no arguments: {type(e).__name__}: {e}"
                ) from None
        setup, teardown = getattr(obj, "setup", None), getattr(obj, "teardown", None)
        if setup is not None or teardown is not None:
            if setup is not None:
                check_signature(setup, f"{name}.setup", ("ctx",))
            if teardown is not None:
                check_signature(teardown, f"{name}.teardown", ())
            self.kind = "hooks"
        elif callable(obj):
            check_signature(obj, name, ("ctx",))
            self.kind = "context_manager"
        else:
            raise PluginError(
                f"{name}: expected an object or class with setup(ctx)/teardown(), or a function "
                f"returning an async context manager; got {type(obj).__name__}"
            )
        self.obj = obj

    @contextlib.asynccontextmanager
    async def running(self, ctx: SetupContext) -> AsyncIterator[Any]:
        """Set up, yield the state, tear down (always, once setup returned)."""
        if self.kind == "none":
            yield None
            return
        if self.kind == "context_manager":
            cm = self.obj(ctx)
            if not hasattr(cm, "__aenter__"):
                raise PluginError(
                    f"generator.lifecycle {self.path!r} returned {type(cm).__name__}, not an "
                    "async context manager"
                )
            async with cm as state:
                yield state
            return
        state = self.obj
        setup = getattr(self.obj, "setup", None)
        if setup is not None:
            result = await _maybe_await(setup(ctx))
            if result is not None:
                state = result
        try:
            yield state
        finally:
            teardown = getattr(self.obj, "teardown", None)
            if teardown is not None:
                try:
                    await _maybe_await(teardown())
                except Exception as e:
                    raise PluginError(
                        f"generator.lifecycle {self.path!r}: teardown failed: "
                        f"{type(e).__name__}: {e}"
                    ) from e


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x
