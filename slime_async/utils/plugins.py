"""The one plug-in mechanism: named registries for what ships, import paths for the user's own.

    LOSSES = Registry("loss")
    @LOSSES.register("ppo_clip")
    def ppo_clip(...): ...

    fn = LOSSES.resolve("ppo_clip")                  # a registered name
    fn = LOSSES.resolve("my_pkg.losses:my_loss")     # or `package.module:attribute`

`check_signature` makes a wrong user function fail at start-up with a message naming it.

Installed packages add names through entry points of the group `slime_async.plugins`, each named
`<kind>.<name>` (kinds: rollout, reward, loss, advantage, lifecycle):

    [project.entry-points."slime_async.plugins"]
    "reward.keyword" = "my_env.rewards:keyword"

A registry lists them with its own names and loads one only when it is asked for by name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any


class PluginError(ValueError):
    """A plug-in cannot be found or has the wrong shape; the message names it."""


def _import_module(name: str) -> Any:
    """Import `name`; user plug-ins live in the working directory (`examples.x:fn`), which the
    `slime-async` console script does not put on sys.path the way `python -m` does."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = name.split(".", 1)[0]
        if e.name != top or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


def searched_places() -> str:
    """Where an import looked, for an error message: sys.path without the standard library."""
    stdlib = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    cwd = os.getcwd()
    places = []
    for entry in sys.path:
        path = entry or cwd
        if path in stdlib or path.endswith((".zip", "lib-dynload")):
            continue
        if path == cwd:
            places.append(f"{path} (the working directory)")
        elif "site-packages" in path:
            places.append(f"{path} (installed packages)")
        else:
            places.append(path)
    return ", ".join(dict.fromkeys(places))


_EXAMPLES_HINT = (
    "; the shipped examples are in the slime_async checkout, not in the installed package: "
    "name the checkout in generator.import_dirs (relative to the config file, as "
    'configs/quickstart.toml does with import_dirs = [".."])'
)


def import_object(path: str, key: str | None = None) -> Any:
    """Import `package.module:attribute` (dots after the colon walk attributes). `key`, the
    config key that names it, leads every error message."""
    where = f"{key} = {path!r}" if key else repr(path)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{where}: expected an import path of the form 'package.module:name'")
    try:
        obj: Any = _import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(f"{missing}."):
            hint = _EXAMPLES_HINT if missing == "examples" else ""
            raise PluginError(
                f"{where}: no module named {missing!r}; searched {searched_places()}{hint}"
            ) from None
        raise PluginError(  # the plug-in's module itself imports something missing
            f"{where}: importing module {module_name!r} failed: {e}"
        ) from None
    except Exception as e:
        raise PluginError(
            f"{where}: importing module {module_name!r} failed: {type(e).__name__}: {e}"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            origin = getattr(sys.modules.get(module_name), "__file__", None)
            at = f" ({origin})" if origin else ""
            raise PluginError(
                f"{where}: module {module_name!r}{at} has no attribute {attr!r}"
            ) from None
    return obj


def check_signature(
    fn: Callable,
    name: str,
    params: Sequence[str],
    *,
    is_async: bool | None = None,
) -> None:
    """Check that `fn` can be called with the positional `params` (extra ones must have defaults).

    `is_async=True` requires a coroutine function, `False` forbids one, `None` allows both.
    """
    if not callable(fn):
        raise PluginError(f"{name}: {fn!r} is not callable")
    if is_async is True and not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{name}: must be an `async def` function")
    if is_async is False and inspect.iscoroutinefunction(fn):
        raise PluginError(f"{name}: must be a plain (not async) function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*params)
    except TypeError as e:
        want = ", ".join(params)
        raise PluginError(f"{name}: signature {sig} does not accept ({want}): {e}") from None
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            raise PluginError(f"{name}: required keyword-only parameter {p.name!r} is never passed")


ENTRY_POINT_GROUP = "slime_async.plugins"
"""The entry-point group installed packages register their plug-ins in (`<kind>.<name>`)."""


class Registry:
    """Named functions of one kind (built in, or from installed packages' entry points), plus
    import paths for the user's own."""

    def __init__(
        self,
        kind: str,
        params: Sequence[str] = (),
        is_async: bool | None = None,
        entry_kind: str | None = None,
    ):
        self.kind = kind
        self.params = tuple(params)
        self.is_async = is_async
        self.entry_kind = entry_kind or kind
        """The `<kind>` of this registry's entry-point names (`reward.keyword`)."""
        self._items: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            if name in self._items:
                raise PluginError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return deco

    def installed(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        """Entry points of installed packages for this kind, by name (read now, not cached:
        a package installed after start-up is seen)."""
        prefix = f"{self.entry_kind}."
        found: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name.startswith(prefix) and len(ep.name) > len(prefix):
                found.setdefault(ep.name[len(prefix) :], []).append(ep)
        return found

    def names(self) -> list[str]:
        """Built-in and installed names."""
        return sorted({*self._items, *self.installed()})

    def resolve(self, name_or_path: str, key: str | None = None) -> Callable:
        """A registered name, an installed package's entry point, or an import path; the
        result's signature is checked. `key`, the config key naming it, leads every error."""
        where = f"{key}: " if key else ""
        if ":" in name_or_path:
            fn = import_object(name_or_path, key)
        else:
            eps = self.installed().get(name_or_path, [])
            if name_or_path in self._items and eps:
                raise PluginError(
                    f"{where}{self.kind} {name_or_path!r} is built in and also an entry point of "
                    f"{_providers(eps)}: rename the entry point"
                )
            if len(eps) > 1:
                raise PluginError(
                    f"{where}{self.kind} {name_or_path!r} is an entry point of several installed "
                    f"packages ({_providers(eps)}): uninstall one, or name it by import path"
                )
            if name_or_path in self._items:
                fn = self._items[name_or_path]
            elif eps:
                fn = _load_entry_point(eps[0], f"{where}{self.kind} {name_or_path!r}")
            else:
                raise PluginError(
                    f"{where}unknown {self.kind} {name_or_path!r}: registered are {self.names()} "
                    f"(built in, or installed packages' {ENTRY_POINT_GROUP!r} entry points "
                    f"'{self.entry_kind}.<name>'), or give an import path 'package.module:function'"
                )
        if self.params:
            name = f"{self.kind} {name_or_path!r}"
            check_signature(
                fn, f"{key}: {name}" if key else name, self.params, is_async=self.is_async
            )
        return fn


def _providers(eps: list[importlib.metadata.EntryPoint]) -> str:
    return ", ".join(f"{ep.dist.name if ep.dist else '?'} ({ep.name} = {ep.value})" for ep in eps)


def _load_entry_point(ep: importlib.metadata.EntryPoint, what: str) -> Any:
    try:
        return ep.load()
    except Exception as e:
        raise PluginError(
            f"{what}: the entry point of {_providers([ep])} does not load: {type(e).__name__}: {e}"
        ) from None
