"""The driver of a Ray run: placement, one actor per process, the launch table, supervision.

    code = run_on_ray(cfg, run_dir, resume=False, progress=progress)

Order: join the cluster (`run.ray.address`, $RAY_ADDRESS or "auto"); check the placement against
the nodes (PlacementError names what is missing, before anything starts); reserve one placement
group (bounded wait); start one `RoleProcess` actor per bundle, named `<run>/<process>` in
`run.ray.namespace`; ask each for its node's address and free ports there; plan the local
launcher's table with those addresses (`RoleAddresses`); run the same `Supervisor` (readiness
probes, restarts by `run.restart_failed`, the progress line and metrics, Ctrl-C) with
`RayChild`ren instead of local processes.

A role restarted by the supervisor runs again in its actor; an actor that died (killed, its node's
raylet gone) is replaced by a new one in the same bundle, so the role comes back on the same node
at the same address. At the end, whatever happened (completion, failure, SIGINT/SIGTERM, an
exception), every role is stopped, every actor killed and the placement group removed; if the
driver itself dies, Ray ends its actors (and with them their roles) and its placement group.

Logs and metrics: an actor on a node that shares the head's run directory writes there directly;
elsewhere it keeps a copy of the run directory at the same path and the driver copies the role's
log, metrics, ready file (and the buffer's final accounting) into the head's every
`run.ray.sync_interval_s`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from slime_async.config import ConfigError, SlimeConfig
from slime_async.launch.progress import ProgressDisplay
from slime_async.launch.ray import import_ray
from slime_async.launch.ray.actor import MARKER, RoleProcess, write_gathered
from slime_async.launch.ray.placement import Slot, bundle_of, check_fits, reserve, slots_of
from slime_async.launch.run_dir import RunDir
from slime_async.launch.supervisor import RoleSpec, Supervisor
from slime_async.launch.table import RoleAddresses, plan_roles
from slime_async.metrics.trackers import JobTracker

PLACEMENT_JSON = "placement.json"
"""In the run directory: each process's node (address, Ray node id, host name, GPUs, bundle)."""
CALL_TIMEOUT_S = 60.0
"""Longest wait for one call to an actor (start, poll, stop add their own grace)."""


class RayChild:
    """A role running in one actor (or one per learner rank): the supervisor's child interface."""

    def __init__(
        self, name: str, actors: list[Any], run_dir: RunDir, sync_interval_s: float, ray: Any
    ):
        self.name = name
        self.actors = actors
        self.run_dir = run_dir
        self.log_path = run_dir.log(name)
        self.sync_interval_s = sync_interval_s
        self._ray = ray
        self._last_sync = 0.0
        self._code: int | None = None
        self.dead: set[int] = set()  # indices of actors that died
        self.pid = 0
        self.started_at = time.time()

    def start(self, argv: list[str], env: dict[str, str], rank_envs: list[dict[str, str]]) -> None:
        calls = []
        for i, actor in enumerate(self.actors):
            log = self.name if i == 0 else f"{self.name}.rank{i}"
            gather = (
                [f"metrics/{self.name}.jsonl", f"ready/{self.name}"]
                + (["buffer_final.json"] if self.name == "buffer" else [])
                if i == 0
                else []
            )
            full_env = {**env, **(rank_envs[i] if rank_envs else {})}
            calls.append(actor.start.remote(argv, full_env, log, gather, str(Path.cwd())))
        started = self._ray.get(calls, timeout=CALL_TIMEOUT_S)
        self.pid = started[0]["pid"]
        self.started_at = started[0]["started_at"]

    def poll(self) -> int | None:
        """None while every process runs; else the first failure's code (a dead actor: -9), or 0
        once all exited 0 (as torchrun reports its ranks)."""
        if self._code is not None:
            return self._code
        self.sync()
        codes: list[int | None] = []
        for i, actor in enumerate(self.actors):
            try:
                codes.append(self._ray.get(actor.poll.remote(), timeout=CALL_TIMEOUT_S))
            except self._ray.exceptions.RayActorError:
                self.dead.add(i)
                codes.append(-signal.SIGKILL)
            except self._ray.exceptions.GetTimeoutError:
                codes.append(None)  # no answer yet: Ray reports a dead node as RayActorError
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            self._code = failed[0]
        elif all(c == 0 for c in codes):
            self._code = 0
        return self._code

    def alive(self) -> bool:
        return self.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop every process of the role (SIGTERM, SIGKILL after `timeout`), then copy what
        it wrote last."""
        calls = {i: a.stop.remote(timeout) for i, a in enumerate(self.actors) if i not in self.dead}
        codes: dict[int, int | None] = {}
        for i, ref in calls.items():
            try:
                codes[i] = self._ray.get(ref, timeout=timeout + CALL_TIMEOUT_S)
            except self._ray.exceptions.RayActorError:
                self.dead.add(i)
        self.sync(force=True)
        if self._code is None:
            known = [c for c in codes.values() if c is not None]
            self._code = next((c for c in known if c != 0), known[0] if known else -signal.SIGKILL)
        return self._code

    def tail(self, n: int = 40) -> str:
        self.sync(force=True)
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def sync(self, force: bool = False) -> None:
        """Copy the role's new log and metrics bytes from a node without the head's files."""
        now = time.monotonic()
        if not force and now - self._last_sync < self.sync_interval_s:
            return
        self._last_sync = now
        for i, actor in enumerate(self.actors):
            if i in self.dead:
                continue
            try:
                write_gathered(
                    self.run_dir.path, self._ray.get(actor.gather.remote(), timeout=CALL_TIMEOUT_S)
                )
            except self._ray.exceptions.RayActorError:
                self.dead.add(i)


class RayRun:
    """The placement group and the actors of one run; `close()` releases them all."""

    def __init__(self, ray: Any, cfg: SlimeConfig, run_dir: RunDir):
        self.ray = ray
        self.cfg = cfg
        self.run_dir = run_dir
        self.rc = cfg.run.ray
        self.slots = slots_of(cfg)
        self.bundles = [bundle_of(s, self.rc) for s in self.slots]
        self.prefix = run_dir.path.name
        self.token = secrets.token_hex(8)
        self.pg: Any = None
        self.actors: dict[Slot, Any] = {}
        self.nodes: dict[Slot, dict] = {}

    # ----- placement and actors --------------------------------------------------------------

    def place(self) -> None:
        ray = self.ray
        check_fits(self.slots, self.bundles, ray.nodes(), ray.available_resources())
        self.pg = reserve(ray, self.bundles, self.rc, name=f"{self.prefix}")
        (self.run_dir.path / MARKER).write_text(self.token + "\n")
        for i in range(len(self.slots)):
            self._new_actor(i)
        slots = list(self.actors)
        refs = [self.actors[s].node.remote() for s in slots]
        try:
            infos = ray.get(refs, timeout=self.cfg.run.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the run's {len(refs)} Ray actors did not all start within "
                f"run.ready_timeout_s = {self.cfg.run.ready_timeout_s:g}s (waited for each to "
                "report its node)"
            ) from None
        self.nodes = dict(zip(slots, infos, strict=True))
        placement = {
            s.name: {**self.nodes[s], "bundle": self.bundles[i]} for i, s in enumerate(self.slots)
        }
        (self.run_dir.path / PLACEMENT_JSON).write_text(json.dumps(placement, indent=2) + "\n")

    def _new_actor(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot, bundle = self.slots[index], self.bundles[index]
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = (
            self.ray.remote(RoleProcess)
            .options(
                name=f"{self.prefix}/{slot.name}",
                namespace=self.rc.namespace,
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources=custom,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=index
                ),
            )
            .remote(
                slot.name,
                str(self.run_dir.path),
                self.token,
                self.run_dir.config_json.read_text(),
                sys.executable,
            )
        )
        self.actors[slot] = actor
        return actor

    def addresses(self) -> RoleAddresses:
        """Each role's node address and ports found free there (a port set in the config is
        kept: engines `engine.port + i`, the router `engine.router_port`)."""
        ray, eng = self.ray, self.cfg.engine
        by_role = {s.name: s for s in self.slots}

        def ports(name: str, n: int) -> tuple[str, list[int]]:
            slot = by_role[name]
            ip = self.nodes[slot]["ip"]
            return ip, ray.get(self.actors[slot].free_ports.remote(ip, n), timeout=CALL_TIMEOUT_S)

        bhost, bports = ports("buffer", 2)
        fixed = [
            self._fixed_port(e)
            for e in (self.cfg.buffer.producer_endpoint, self.cfg.buffer.consumer_endpoint)
        ]
        bports = [f or p for f, p in zip(fixed, bports, strict=True)]
        engines = []
        if eng.kind == "embedded":
            for i in range(eng.num_engines):
                host, (p,) = ports(f"engine{i}", 1)
                engines.append((host, eng.port + i if eng.port else p))
        router = None
        if "router" in by_role:
            host, (p, prom) = ports("router", 2)
            router = (host, eng.router_port or p, prom)
        lhost, (lport,) = ports("learner.rank0", 1)
        return RoleAddresses(
            buffer_host=bhost,
            buffer_ports=(bports[0], bports[1]),
            engines=engines,
            router=router,
            learner_master=(lhost, lport),
        )

    @staticmethod
    def _fixed_port(endpoint: str) -> int:
        from urllib.parse import urlparse

        parsed = urlparse(endpoint)
        if parsed.scheme != "tcp":
            raise ConfigError(
                f"buffer endpoint {endpoint!r}: run.launcher = 'ray' needs tcp:// endpoints "
                "(other nodes connect to the buffer); the host is the buffer's node"
            )
        return parsed.port or 0

    def spawn(self, spec: RoleSpec, argv: list[str], env: dict[str, str], log: Path) -> RayChild:
        """The supervisor's `spawn`: the role in its actor(s); a dead actor is replaced first."""
        indices = [i for i, s in enumerate(self.slots) if s.role == spec.name]
        if not indices:
            raise ConfigError(f"{spec.name}: the launch table has a role with no placement")
        actors = []
        for i in indices:
            actor = self.actors[self.slots[i]]
            try:
                self.ray.get(actor.poll.remote(), timeout=CALL_TIMEOUT_S)
            except self.ray.exceptions.RayActorError:
                actor = self._new_actor(i)  # same bundle: same node, same addresses
            actors.append(actor)
        child = RayChild(spec.name, actors, self.run_dir, self.rc.sync_interval_s, self.ray)
        child.start(argv, env, spec.rank_envs)
        return child

    def placement_lines(self) -> list[str]:
        """Where each process runs, for the supervisor's log."""
        out = []
        for slot in self.slots:
            node = self.nodes.get(slot, {})
            gpus = node.get("cuda_visible_devices")
            out.append(
                f"{slot.name} on {node.get('ip')} ({node.get('hostname')}, Ray node "
                f"{str(node.get('node_id'))[:12]})"
                + (f", CUDA_VISIBLE_DEVICES={gpus}" if gpus else "")
            )
        return out

    def close(self) -> None:
        """Kill every actor (their roles die with them) and remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        with contextlib.suppress(OSError):
            (self.run_dir.path / MARKER).unlink()


def run_on_ray(
    cfg: SlimeConfig,
    run_dir: RunDir,
    *,
    resume: bool,
    progress: ProgressDisplay | None,
    tracker: JobTracker | None = None,
) -> int:
    """`slime-async run` with `run.launcher = "ray"`; the exit code of `Supervisor.run`.

    `tracker` forwards the metrics files synced into the head's run directory."""
    import os

    ray = import_ray()
    address = cfg.run.ray.address or os.environ.get("RAY_ADDRESS") or "auto"
    print(f"[slime-async] joining the Ray cluster at {address}", flush=True)
    ray.init(address=address, namespace=cfg.run.ray.namespace, log_to_driver=False)
    run = RayRun(ray, cfg, run_dir)
    try:
        run.place()
        where = run.addresses()
        stages = plan_roles(cfg, run_dir, where)
        planned = {s.name for stage in stages for s in stage}
        placed = {s.role for s in run.slots}
        if planned != placed:  # slots_of and plan_roles must agree on the roles
            raise ConfigError(f"placement {sorted(placed)} != launch table {sorted(planned)}")
        supervisor = Supervisor(
            run_dir,
            stages,
            resume=resume,
            restart_failed=cfg.run.restart_failed,
            ready_timeout_s=cfg.run.ready_timeout_s,
            stop_grace_s=cfg.run.stop_grace_s,
            poll_interval_s=cfg.run.poll_interval_s,
            progress=progress,
            spawn=run.spawn,
            liveness=cfg.engine.liveness,
            api_key=cfg.engine.api_key,
            tracker=tracker,
        )
        for line in run.placement_lines():
            supervisor.event(f"placed {line}")
        return supervisor.run()
    finally:
        run.close()
        ray.shutdown()
