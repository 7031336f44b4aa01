"""The run supervisor: starts the roles of a run as child processes, watches them, stops them all.

    stages = [[buffer, engine0, engine1], [router], [generator0, learner]]   # RoleSpec each
    code = Supervisor(run_dir, stages, restart_failed=1).run()

Process model. Each role is a `procs.Child` in its own session (process group), output appended to
`<run_dir>/logs/<role>.log`. Binds nothing itself; it connects only to what the readiness probes
of the roles check (HTTP GETs, TCP connects, a buffer stats call, ready files).

Fork server (`preload`, `run.fork_server`; `slime_async/utils/forkserver.py`): on a machine with
no visible GPU, a process started first imports torch, transformers and megatron-core once, and
every `python -m` role is forked from it into its own session, as it would have started; the
event line of each start says "fork", or "exec" and why not. It is recorded among the children
and dies with the supervisor like them; its roles die with it.

Start-up, stage by stage: every role of a stage is started, then the supervisor waits on each
one's readiness probe (never a sleep) before the next stage starts. A role that exits or misses
`ready_timeout_s` during start-up stops the run.

Supervision: every `poll_interval_s` each child is polled. When the role marked "ends_run" (the
learner) exits 0 the run is complete. A role that dies (non-zero, killed, or exit 0 where that
is not expected) is reported with name, pid, exit code and the last lines of its log, then
restarted with `resume=True` up to `restart_failed` times (per role), or the run stops.

Liveness (`liveness`, `slime_async/launch/liveness.py`): the roles with a `liveness_url` (the
engines) are probed while they run; an engine hung for `engine.liveness.restart_after_s`, or one
whose restart another role asked for (the learner's push: an engine stuck in its update), is
stopped and restarted the same way, with its reason in the report and the count.

Stopping (run end, failure, SIGINT/SIGTERM/SIGHUP): children are stopped in reverse start order, each
process group with SIGTERM and, after `stop_grace_s`, SIGKILL; nothing of a child's group
survives (a role must not move its own processes into a new session).

One owner per run directory: `run()` holds an flock on `<run_dir>/supervisor.lock` (RunDirBusy
for a second supervisor) and records its live children in `children.json`. If the supervisor
dies without stopping them (SIGKILL, OOM), they die with it: each role gets SIGKILL from the
kernel (PR_SET_PDEATHSIG), and a watchdog process, which waits on a pipe only the supervisor
holds, stops what the roles started in their process groups (torchrun workers, engine helpers),
unless a new owner already holds the lock. `run --resume` stops whatever is still left.

Elsewhere than this machine: `spawn` replaces the local child process by another kind of child
with the same few methods (`poll`, `alive`, `stop`, `tail`, `pid`, `log_path`): the Ray launcher
(`slime_async/launch/ray/`) passes one that runs the role in a Ray actor on its node. Those
children are not this machine's processes, so no watchdog or children.json is kept for them;
Ray ends a dead driver's actors, and each actor's role dies with its actor.

Metrics: every poll also hands the roles' new metrics records to the job's tracker (one wandb run,
one TensorBoard directory: `slime_async/metrics/trackers.py`), which `run()` closes at the end.

Memory: one Child per role and the unread tail of the metrics files it displays; nothing grows
with the length of the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

from slime_async.config.engine import LivenessConfig
from slime_async.launch.liveness import RoleLiveness
from slime_async.launch.progress import ProgressDisplay
from slime_async.launch.run_dir import READY_ENV, RunDir
from slime_async.metrics import MetricsLogger, MetricsTail
from slime_async.metrics import names as m
from slime_async.metrics.trackers import JobTracker
from slime_async.utils.forkserver import ForkServer
from slime_async.utils.procs import (
    WATCHDOG_CLEAN_STOP,
    Child,
    kill_groups,
    python_module,
    start_time,
    wait_until,
)

FORK_SERVER = "fork-server"
"""The fork server's name in the run's logs and in its record of children."""
WATCHDOG_GRACE_S = 3.0
"""How long the watchdog gives leftovers between SIGTERM and SIGKILL."""


@dataclass
class RoleSpec:
    """One row of the launch table: how to start a role and how to tell it is ready."""

    name: str
    """Unique role name: log file, ready file and messages use it (e.g. "engine1")."""
    argv: Callable[[bool], list[str]]
    """Command line of the role; the argument is True when it must resume its earlier state."""
    ready: Callable[[Path], bool]
    """Readiness probe, called with the role's ready-file path; True once the role serves."""
    ready_what: str = "ready"
    """What the probe checks, for messages ("GET http://127.0.0.1:30000/health")."""
    on_exit_0: Literal["ends_run", "expected", "failure"] = "failure"
    """Exit code 0 means: the run is complete / the role is done (keep going) / a failure."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the child."""
    liveness_url: str | None = None
    """An engine's base URL: probed while the role runs, restarted when hung (see Supervisor)."""
    rank_envs: list[dict[str, str]] = field(default_factory=list)
    """A torch.distributed role started one process per rank (the Ray launcher): each rank's
    extra environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). Empty: one process (torchrun, if
    any, is in `argv`)."""


def ready_file_exists(path: Path) -> bool:
    """The probe of roles without a port: the role wrote its ready file (`announce_ready`)."""
    return path.exists()


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP reached the supervisor (BaseException: probes' `except Exception` let it through)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Starts `stages` of roles in order, supervises them, stops them all at the end."""

    def __init__(
        self,
        run_dir: RunDir,
        stages: Sequence[Sequence[RoleSpec]],
        *,
        resume: bool = False,
        restart_failed: int = 0,
        ready_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
        poll_interval_s: float = 0.2,
        progress: ProgressDisplay | None = None,
        step_role: str = "learner",
        err: TextIO | None = None,
        spawn: Callable[[RoleSpec, list[str], dict[str, str], Path], Child] | None = None,
        liveness: LivenessConfig | None = None,
        api_key: str | None = None,
        tracker: JobTracker | None = None,
        preload: Sequence[str] | None = None,
    ):
        self.run_dir = run_dir
        self.stages = [list(s) for s in stages]
        self.specs = {spec.name: spec for stage in self.stages for spec in stage}
        if len(self.specs) != sum(len(s) for s in self.stages):
            raise ValueError("role names in the launch table must be unique")
        self.resume = resume
        self.restarts_left = dict.fromkeys(self.specs, restart_failed)
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.step_role = step_role
        self.err = err or sys.stderr
        self.spawn = spawn
        """Starts a role elsewhere: (spec, argv, env, log path) -> a child; None: here."""
        self.tracker = tracker
        """Forwards every role's metrics records to wandb / TensorBoard; closed by `run()`."""
        self.children: dict[str, Child] = {}  # insertion order = start order
        self.failure: str | None = None  # the report of the failure that stopped the run
        self._signal: int | None = None
        self._tails: dict[str, MetricsTail] = {}
        self.run_dir.logs_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir.log("supervisor"), "a", encoding="utf-8")  # noqa: SIM115
        self.failures = 0
        self.restarts: dict[str, int] = {}  # per role, since this supervisor started
        self.liveness_restarts = {"hung": 0, "requested": 0}
        """Restarts of engines that were hung, and that another role asked for."""
        self._liveness_args = (liveness, api_key)
        self.liveness: RoleLiveness | None = None
        """Probes the engine roles while they run (built by `run`)."""
        self.preload = list(preload) if preload is not None and spawn is None else None
        """What the fork server imports (None: every role starts as a fresh interpreter)."""
        self.fork_server: ForkServer | None = None
        """Forks the roles from a process that imported `preload` once (started by `run`)."""
        self._fork_server_record: tuple[int, float] | None = None
        """The fork server's (pid, start time), recorded with the children."""
        self._fork_server_noted = False

    # ----- the whole run ---------------------------------------------------------------------

    def run(self) -> int:
        """Start, supervise, stop. 0: the run completed; 1: a role failed; 128+N: signal N."""
        try:
            self.run_dir.lock()  # RunDirBusy: another supervisor owns the directory
        except BaseException:
            self._log.close()
            raise
        self._start_watchdog()
        handlers = self._install_signal_handlers()
        try:
            self._start_fork_server()
            self._start_liveness()
            self.start()
            return self.supervise()
        except Interrupted as e:
            self.event(f"received {e}; stopping every role")
            return 128 + e.signum
        except RoleFailed:
            return 1
        finally:
            if self.liveness is not None:
                self.liveness.close()
            self.stop_all()
            self._stop_fork_server()
            self._stop_watchdog()
            self.run_dir.unlock()
            for sig, old in handlers.items():
                signal.signal(sig, old)
            self._poll_metrics()
            if self.tracker is not None:
                self.tracker.close()
            if self.progress is not None:
                self.progress.close()
            self._log.close()

    def start(self) -> None:
        """Start every stage and wait until all its roles are ready; raises RoleFailed."""
        for stage in self.stages:
            for spec in stage:
                self._spawn(spec, self.resume)
            for spec in stage:
                self._wait_ready(spec)

    def supervise(self) -> int:
        """Poll the children until the run completes (0) or a role fails for good (RoleFailed)."""
        while True:
            self._check_signal()
            for name, child in list(self.children.items()):
                code = child.poll()
                if code is None:
                    continue
                spec = self.specs[name]
                if code == 0 and spec.on_exit_0 == "ends_run":
                    self.event(f"{name} (pid {child.pid}) finished; the run is complete")
                    return 0
                if code == 0 and spec.on_exit_0 == "expected":
                    self.event(f"{name} (pid {child.pid}) finished its work")
                    child.stop(self.stop_grace_s)  # anything it left in its group goes too
                    del self.children[name]
                    self._record_children()
                    continue
                self._handle_failure(spec, child, code)
            if not self.children:
                self.event("every role has finished")
                return 0
            self._check_liveness()
            self._poll_metrics()
            time.sleep(self.poll_interval_s)

    def stop_all(self) -> None:
        """Stop every child, last started first (SIGTERM, then SIGKILL after the grace period)."""
        for name in reversed(list(self.children)):
            child = self.children.pop(name)
            was_alive = child.alive()
            code = child.stop(self.stop_grace_s)
            self._record_children()
            if was_alive:
                self.event(f"stopped {name} (pid {child.pid}): {describe_exit(code)}")

    # ----- pieces ------------------------------------------------------------------------------

    def event(self, text: str) -> None:
        """One line for logs/supervisor.log and the terminal."""
        self._log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self._log.flush()
        if self.progress is not None and self.progress.mode != "off":
            self.progress.message(text)
        elif self.progress is None:
            print(f"[slime-async] {text}", file=self.err, flush=True)

    def _spawn(self, spec: RoleSpec, resume: bool) -> Child:
        ready = self.run_dir.ready_file(spec.name)
        ready.unlink(missing_ok=True)  # a file left by an earlier process must not count
        argv = spec.argv(resume)
        env = {**spec.env, READY_ENV: str(ready)}
        if self.spawn is not None:
            child = self.spawn(spec, argv, env, self.run_dir.log(spec.name))
        else:
            child = Child(
                spec.name,
                argv,
                log_path=self.run_dir.log(spec.name),
                env=env,
                die_with_parent=True,
                fork_server=self.fork_server,
            )
            self._note_fork_server(child)
        self.children[spec.name] = child
        self._record_children()
        self._log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} argv {spec.name}: {argv}\n")
        how = "" if self.fork_server is None else f", {child.started_by}"
        self.event(f"started {spec.name} (pid {child.pid}{how}, log {self.run_dir.log(spec.name)})")
        return child

    def _wait_ready(self, spec: RoleSpec) -> None:
        child = self.children[spec.name]
        ready_path = self.run_dir.ready_file(spec.name)
        t0 = time.monotonic()
        try:
            wait_until(
                lambda: self._check_signal() or spec.ready(ready_path),
                timeout=self.ready_timeout_s,
                what=f"{spec.name} to be ready ({spec.ready_what})",
                interval=min(self.poll_interval_s, 0.1),
                child=child,
            )
        except (RuntimeError, TimeoutError) as e:
            # A quick role may announce readiness and exit between two polls: that is a start.
            if not (isinstance(e, RuntimeError) and self._probe(spec, ready_path)):
                self._fail(f"{spec.name} did not start: {e}")
        self.event(f"{spec.name} is ready ({spec.ready_what}, {time.monotonic() - t0:.1f}s)")
        if self.liveness is not None:
            self.liveness.watch_role(spec.name)

    @staticmethod
    def _probe(spec: RoleSpec, ready_path: Path) -> bool:
        try:
            return bool(spec.ready(ready_path))
        except Exception:
            return False

    def _start_liveness(self) -> None:
        liveness, api_key = self._liveness_args
        urls = {s.name: s.liveness_url for s in self.specs.values() if s.liveness_url}
        if urls and liveness is not None:
            self.liveness = RoleLiveness(urls, liveness, api_key, self.run_dir.path)

    def _check_liveness(self) -> None:
        """Log the engines' state changes; restart the ones due (hung, or asked for)."""
        if self.liveness is None:
            return
        for line in self.liveness.events():
            self.event(line)
        for name, why, cause in self.liveness.due(self.children):
            child = self.children.get(name)
            if child is None:
                continue
            self.liveness.unwatch_role(name)
            self.event(f"stopping {name} (pid {child.pid}) to restart it: {why}")
            # A hung process cannot exit gracefully (a stopped one does not even run its
            # handler): SIGTERM, then SIGKILL after a second.
            code = child.stop(1.0)
            self._handle_failure(self.specs[name], child, -9 if code is None else code, why, cause)

    def _handle_failure(
        self,
        spec: RoleSpec,
        child: Child,
        code: int,
        why: str | None = None,
        cause: str | None = None,
    ) -> None:
        tail = child.tail(20)
        what = why or f"{spec.name} (pid {child.pid}) {describe_exit(code)}"
        report = f"{what}; last lines of {child.log_path}:\n{tail}"
        if self.liveness is not None:
            self.liveness.unwatch_role(spec.name)
        child.stop(self.stop_grace_s)  # its process group may still hold processes it started
        del self.children[spec.name]
        self._record_children()
        restart = self.restarts_left[spec.name] > 0
        if cause in self.liveness_restarts and restart:
            self.liveness_restarts[cause] += 1
        self._count_failure(spec.name, code, restart)
        if not restart:
            self._fail(report + "\nno restarts left for it; stopping the run")
        self.restarts_left[spec.name] -= 1
        self._report(report)
        self.event(
            f"restarting {spec.name} ({self.restarts_left[spec.name]} restarts left after this one)"
        )
        # Re-insert at its start position so the reverse-order stop still stops it in place.
        order = list(self.specs)
        self._spawn(spec, resume=True)
        self.children = {n: self.children[n] for n in order if n in self.children}
        self._wait_ready(spec)

    def _count_failure(self, role: str, code: int, restart: bool) -> None:
        """One record in metrics/supervisor.jsonl per failure: the totals and this role's."""
        self.failures += 1
        if restart:
            self.restarts[role] = self.restarts.get(role, 0) + 1
        record = {
            m.SUP_FAILURES: self.failures,
            m.SUP_RESTARTS: sum(self.restarts.values()),
            m.SUP_HUNG_RESTARTS: self.liveness_restarts["hung"],
            m.SUP_REQUESTED_RESTARTS: self.liveness_restarts["requested"],
            **{m.SUP_ROLE_RESTARTS + name: n for name, n in self.restarts.items()},
            m.SUP_ROLE_EXIT + role: code,
        }
        with MetricsLogger(self.run_dir.path, "supervisor") as log:
            log.log(self.failures, record)

    def _fail(self, report: str) -> None:
        self.failure = report
        self._report(report)
        raise RoleFailed(report)

    def _report(self, text: str) -> None:
        self._log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self._log.flush()
        if self.progress is not None:
            self.progress.close()  # a rich bar would overdraw the report
        print(f"[slime-async] {text}", file=self.err, flush=True)

    def _poll_metrics(self) -> None:
        if self.tracker is not None:
            self.tracker.poll()
        if self.progress is None or self.progress.mode == "off":
            return
        for path in sorted(self.run_dir.metrics_dir.glob("*.jsonl")):
            tail = self._tails.setdefault(path.stem, MetricsTail(path))
            for rec in tail.read_new():
                numbers = {k: v for k, v in rec.items() if k not in ("step", "time")}
                if path.stem == self.step_role and isinstance(rec.get("step"), int):
                    self.progress.update(rec["step"], numbers)
                else:
                    self.progress.numbers.update(
                        {k: v for k, v in numbers.items() if v is not None}
                    )

    # ----- one owner -----------------------------------------------------------------------------

    def _record_children(self) -> None:
        if self.spawn is not None:
            return  # not this machine's processes: nothing a local successor could stop
        children = {n: (c.pid, c.started_at) for n, c in self.children.items()}
        if self._fork_server_record is not None:
            children[FORK_SERVER] = self._fork_server_record
        self.run_dir.write_children(children)

    # ----- the fork server ---------------------------------------------------------------------

    def _start_fork_server(self) -> None:
        """Start the fork server, if this run uses one; it imports while the roles' turn comes."""
        if self.preload is None:
            return
        self.fork_server = ForkServer(
            self.preload,
            log_path=self.run_dir.log(FORK_SERVER),
            ready_timeout_s=self.ready_timeout_s,
            packages=("slime_async",),  # not the router's program, nor a user's own
        ).start()
        self._fork_server_record = (self.fork_server.pid, start_time(self.fork_server.pid))
        self._record_children()
        self.event(
            f"started the fork server (pid {self.fork_server.pid}, log "
            f"{self.run_dir.log(FORK_SERVER)}): the roles are forked from it once it has "
            "imported torch, transformers and megatron-core"
        )

    def _note_fork_server(self, child: Child) -> None:
        """Log the server's imports once, and why it could not start a role (each time)."""
        server = self.fork_server
        if server is None:
            return
        if server.ready is not None and not self._fork_server_noted:
            self._fork_server_noted = True
            failed = "; ".join(f"{k}: {v}" for k, v in server.ready["failed"].items())
            self.event(
                f"fork server ready: {len(server.ready['imported'])} imports in "
                f"{server.ready['cpu_s']:.1f} s of CPU" + (f"; left out {failed}" if failed else "")
            )
        if child.started_by != "fork":
            self.event(f"{child.name} was not forked: started {child.started_by}")

    def _stop_fork_server(self) -> None:
        if self.fork_server is None:
            return
        code = self.fork_server.close()
        self._fork_server_record = None
        self._record_children()
        if code not in (0, None):
            self.event(f"the fork server exited with code {code}")

    def _start_watchdog(self) -> None:
        """A process that outlives us only to stop our children's groups if we die first."""
        self._watchdog = None
        if self.spawn is not None:
            return
        read, self._watch_pipe = os.pipe()
        self._watchdog = subprocess.Popen(
            python_module(
                "slime_async.utils.procs",
                str(read),
                str(self.run_dir.lock_file),
                str(self.run_dir.children_json),
                str(WATCHDOG_GRACE_S),
            ),
            pass_fds=(read,),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        os.close(read)

    def _stop_watchdog(self) -> None:
        if self._watchdog is None:
            return
        with contextlib.suppress(OSError):  # a clean stop: it exits without waiting for our lock
            os.write(self._watch_pipe, WATCHDOG_CLEAN_STOP)
        os.close(self._watch_pipe)  # EOF: it finds no children recorded (or our lock) and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._watchdog.wait(10)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; the caller handles signals

        def on_signal(signum: int, frame: object) -> None:
            # Only a flag: raising here could strike between Popen and recording the child.
            self._signal = signum

        # SIGHUP too: children live in their own sessions, so a closed terminal reaches only us.
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        return {sig: signal.signal(sig, on_signal) for sig in signals}

    def _check_signal(self) -> bool:
        if self._signal is not None:
            raise Interrupted(self._signal)
        return False


class RoleFailed(Exception):
    """A role failed for good; the run stops (the report is in `Supervisor.failure`)."""


def cleanup_leftovers(run_dir: RunDir, grace_s: float) -> list[int]:
    """Stop the children a dead owner recorded (the caller holds the lock); return their pids."""
    left = run_dir.read_children()
    pids = kill_groups({pid: started for pid, started in left.values()}, grace_s)
    run_dir.write_children({})
    return pids
