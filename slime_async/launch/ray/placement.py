"""Placement of a Ray run: one bundle per process, rules from `[run.ray]`, checked before start.

    slots = slots_of(cfg)                      # [Slot("buffer", "cpu"), Slot("engine0", ...), ...]
    bundles = [bundle_of(s, cfg.run.ray) for s in slots]
    check_fits(slots, bundles, ray.nodes())    # PlacementError naming what is missing
    pg = reserve(bundles, ...)                 # one placement group, a bounded wait

A rule is a custom resource the nodes meant for a kind of role declare (`ray start
--resources='{"engine": 8}'`); each bundle of that kind asks for a sliver of it (`RULE_SHARE`), so
it can only land on such a node. "head" is Ray's own marker of the head node. The check runs on
the nodes' totals (a first-fit of every bundle, then the free resources of the whole cluster), so a
placement that can never be satisfied fails at once with the missing resources named; one that
waits for resources other jobs hold fails after `run.ray.placement_timeout_s`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from slime_async.config import ConfigError, SlimeConfig
from slime_async.config.run import RayConfig

RULE_SHARE = 0.001
"""How much of a rule's custom resource one bundle takes (any node that has the resource fits
a thousand bundles of it)."""
HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node alone."""

Kind = Literal["cpu", "engine", "learner"]


class PlacementError(ConfigError):
    """The placement the config asks for cannot be satisfied on this cluster."""


@dataclass(frozen=True)
class Slot:
    """One process of the run: a role, or one rank of the learner."""

    role: str
    kind: Kind
    rank: int = 0

    @property
    def name(self) -> str:
        return self.role if self.kind != "learner" else f"{self.role}.rank{self.rank}"


def slots_of(cfg: SlimeConfig) -> list[Slot]:
    """The processes `plan_roles` starts for `cfg` (the same rules), in start order."""
    slots = [Slot("buffer", "cpu")]
    if cfg.engine.kind == "embedded":
        slots += [Slot(f"engine{i}", "engine") for i in range(cfg.engine.num_engines)]
        if cfg.engine.num_engines > 1:
            slots.append(Slot("router", "cpu"))
    slots += [Slot(f"generator{i}", "cpu") for i in range(cfg.run.num_generators)]
    slots += [Slot("learner", "learner", r) for r in range(cfg.run.learner_procs)]
    return slots


def rule_of(kind: Kind, rc: RayConfig) -> str | None:
    """The custom resource a node needs for roles of `kind` (None: any node)."""
    rule = {"cpu": rc.cpu_nodes, "engine": rc.engine_nodes, "learner": rc.learner_nodes}[kind]
    return HEAD_RESOURCE if rule == "head" else rule


def bundle_of(slot: Slot, rc: RayConfig) -> dict[str, float]:
    """The resources of one slot's bundle (and of the actor that runs in it)."""
    gpus = {"cpu": 0, "engine": rc.gpus_per_engine, "learner": rc.gpus_per_learner_rank}
    bundle: dict[str, float] = {"CPU": rc.cpus_per_role}
    if gpus[slot.kind]:
        bundle["GPU"] = float(gpus[slot.kind])
    rule = rule_of(slot.kind, rc)
    if rule is not None:
        bundle[rule] = RULE_SHARE
    return bundle


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _label(rule: str | None) -> str:
    if rule is None:
        return "any node"
    return "the head node" if rule == HEAD_RESOURCE else f"nodes with resource '{rule}'"


def check_fits(
    slots: list[Slot],
    bundles: list[dict[str, float]],
    nodes: list[dict[str, Any]],
    available: dict[str, float] | None = None,
) -> None:
    """Raise PlacementError naming the missing resources unless every bundle fits on the nodes
    (`ray.nodes()`: their totals) and, when given, in the cluster's free resources."""
    alive = [dict(n.get("Resources", {})) for n in nodes if n.get("Alive", True)]
    missing: list[str] = []
    # 1. Per kind of role: what its rule's nodes hold against what its bundles ask.
    by_rule: dict[tuple[str | None, str], list[int]] = defaultdict(list)
    for i, slot in enumerate(slots):
        rule = next((k for k in bundles[i] if k not in ("CPU", "GPU")), None)
        by_rule[(rule, slot.kind)].append(i)
    for (rule, kind), idx in by_rule.items():
        eligible = [n for n in alive if rule is None or n.get(rule, 0) > 0]
        names = ", ".join(slots[i].name for i in idx)
        if not eligible:
            hint = (
                "the cluster has no head node?"
                if rule == HEAD_RESOURCE
                else f"start those nodes with `ray start ... --resources='{{\"{rule}\": 1}}'`"
            )
            missing.append(f"{kind} roles ({names}) need {_label(rule)}: there is none ({hint})")
            continue
        for res in ("GPU", "CPU"):
            need = sum(bundles[i].get(res, 0.0) for i in idx)
            have = sum(n.get(res, 0.0) for n in eligible)
            if need > have:
                missing.append(
                    f"{kind} roles ({names}) need {res} {need:g} on {_label(rule)}, which have "
                    f"{res} {have:g} in all: missing {res} {need - have:g}"
                )
    # 2. All bundles together, first fit on the nodes' totals (biggest bundles first).
    if not missing:
        free = [dict(n) for n in alive]
        order = sorted(range(len(bundles)), key=lambda i: -bundles[i].get("GPU", 0.0))
        for i in order:
            b = bundles[i]
            node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in b.items())), None)
            if node is None:
                missing.append(
                    f"{slots[i].name} needs {_fmt(b)} on one node and no node has that left "
                    "once the other roles are placed"
                )
                break
            for k, v in b.items():
                node[k] -= v
    # 3. What other jobs hold now.
    if not missing and available is not None:
        total: dict[str, float] = defaultdict(float)
        for b in bundles:
            for k, v in b.items():
                total[k] += v
        for res in ("GPU", "CPU"):
            if total.get(res, 0.0) > available.get(res, 0.0) + 1e-9:
                missing.append(
                    f"the run needs {res} {total[res]:g} and the cluster has {available.get(res, 0.0):g} "
                    f"free now: missing {res} {total[res] - available.get(res, 0.0):g}"
                )
    if missing:
        raise PlacementError(
            "run.ray placement cannot be satisfied on this Ray cluster:\n  "
            + "\n  ".join(missing)
            + f"\n  (nodes: {'; '.join(_fmt(_shown(n)) for n in alive) or 'none'})"
        )


def _shown(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources without Ray's bookkeeping entries (memory, node:<ip>, ...)."""
    hidden = ("memory", "object_store_memory")
    return {
        k: v
        for k, v in resources.items()
        if k not in hidden and (not k.startswith("node:") or k == HEAD_RESOURCE)
    }


def reserve(ray: Any, bundles: list[dict[str, float]], rc: RayConfig, name: str) -> Any:
    """One placement group of `bundles`, ready; on timeout it is removed and PlacementError
    names what it waited for."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=rc.strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=rc.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"run.ray placement group {name!r} ({len(bundles)} bundles) was not ready after "
            f"run.ray.placement_timeout_s = {rc.placement_timeout_s:g}s: the resources exist but "
            f"are held by other work; free now: {_fmt(_shown(ray.available_resources()))}"
        ) from None
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg
