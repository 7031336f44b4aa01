"""The Ray actor of one process of a run: it runs the role's command line on its node.

Each actor lives in one placement-group bundle (its node, its GPUs: Ray sets
CUDA_VISIBLE_DEVICES) and runs one role (or one learner rank) as a `procs.Child`: its own process
group, output to `<run_dir>/logs/<log>.log` on the node, SIGKILL from the kernel if the actor dies
(PR_SET_PDEATHSIG, so `ray.kill` of the actor ends its role too). It binds nothing itself; it
answers the driver's calls: its node's address and free ports there, start/poll/stop, and, on a
node that does not share the head's run directory, the new bytes of the role's log, metrics and
ready file (`gather`), which the driver writes into the head's run directory.

Memory: one child and one read offset per gathered file.

Ray is not imported here at module level (the class is wrapped by `ray.remote` in the driver), so
the module stays importable without the extra.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from slime_async.utils.procs import Child, free_port

MARKER = ".head_node"
"""File in the head's run directory: an actor that sees it (same token) shares the file system."""


class RoleProcess:
    """One role's process on one node (a Ray actor: `ray.remote(RoleProcess)`)."""

    def __init__(self, name: str, run_dir: str, token: str, config_json: str, driver_python: str):
        self.name = name
        self.run_dir = Path(run_dir)
        self.driver_python = driver_python
        marker = self.run_dir / MARKER
        self.shared = marker.is_file() and marker.read_text().strip() == token
        if not self.shared:  # this node's own copy of the run directory, at the same path
            for sub in ("logs", "metrics", "ready"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            cfg = self.run_dir / "config.json"
            if not cfg.is_file() or cfg.read_text() != config_json:
                cfg.write_text(config_json)
        self.child: Child | None = None
        self.log_name = name
        self.gather_names: list[str] = []
        self._offsets: dict[str, int] = {}

    def node(self) -> dict:
        """This node: the address other nodes reach it at, its host name, the actor's pid."""
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "shared": self.shared,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def free_ports(self, host: str, n: int) -> list[int]:
        """`n` distinct TCP ports free now on `host` (this node's address)."""
        ports: list[int] = []
        while len(ports) < n:
            p = free_port(host)
            if p not in ports:
                ports.append(p)
        return ports

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        log_name: str,
        gather: list[str],
        cwd: str | None = None,
    ) -> dict:
        """Run `argv` (this node's interpreter for the driver's) as the role's child process, in
        the driver's working directory when this node has it (plug-ins are imported from it)."""
        if self.child is not None and self.child.alive():
            raise RuntimeError(f"{self.name}: already running (pid {self.child.pid})")
        if argv and argv[0] == self.driver_python:
            argv = [sys.executable, *argv[1:]]
        ready = env.get("SLIME_ASYNC_READY_FILE")
        if ready:
            Path(ready).unlink(missing_ok=True)  # this node's copy; the driver removed its own
        self.log_name = log_name
        self.gather_names = gather
        log = self.run_dir / "logs" / f"{log_name}.log"
        workdir = cwd if cwd is not None and Path(cwd).is_dir() else None
        self.child = Child(
            self.name, argv, log_path=log, env=env, cwd=workdir, die_with_parent=True
        )
        return {"pid": self.child.pid, "started_at": self.child.started_at}

    def poll(self) -> int | None:
        return None if self.child is None else self.child.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the role's process group, SIGKILL after `grace_s`; its exit code."""
        return None if self.child is None else self.child.stop(grace_s)

    def tail(self, n: int) -> str:
        return "" if self.child is None else self.child.tail(n)

    def gather(self) -> dict[str, tuple[int, bytes]]:
        """New bytes of this role's files since the last call: {relative path: (offset, bytes)}
        (offset 0 with the whole content for files rewritten in place). Nothing when the file
        system is shared with the head."""
        if self.shared:
            return {}
        out: dict[str, tuple[int, bytes]] = {}
        rels = [f"logs/{self.log_name}.log", *self.gather_names]
        for rel in rels:
            path = self.run_dir / rel
            if not path.is_file():
                continue
            data = path.read_bytes()
            if rel.endswith((".log", ".jsonl")):  # append-only
                start = self._offsets.get(rel, 0)
                if len(data) > start:
                    out[rel] = (start, data[start:])
                    self._offsets[rel] = len(data)
            elif self._offsets.get(rel) != hash(data):
                out[rel] = (0, data)
                self._offsets[rel] = hash(data)
        return out


def write_gathered(run_dir: Path, gathered: dict[str, tuple[int, bytes]]) -> None:
    """Write what `RoleProcess.gather` returned into the head's run directory."""
    for rel, (offset, data) in gathered.items():
        path = run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith((".log", ".jsonl")):
            with open(path, "r+b" if path.exists() else "wb") as f:
                f.seek(offset)
                f.write(data)
                f.truncate()
        else:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
