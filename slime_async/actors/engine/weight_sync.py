"""The weight-update process group shared by the learner (rank 0) and the engines.

Both sides build it with the same recipe as SGLang (otherwise the handshake hangs): rank 0 hosts a
TCPStore at master_address:master_port, every rank wraps it in `PrefixStore(group_name, store)`
and passes that to torch's process-group constructor under the name `group_name`; gloo on CPU,
NCCL on GPU. No default process group is needed, so a learner that already runs under torchrun
keeps its own world untouched. Engine ranks are `rank_offset + tp_rank`.

The engine receives every tensor of an update by `broadcast(src=0)` in the order of `names`.

Stopping a broadcast (`WeightGroup.abort`): a gloo send waits for its peer's receive, and neither
the process group's `abort()` nor `shutdown()` ends a pending one (measured with torch 2.13); so
the learner notes the TCP connections its gloo backend opened while the group formed and shuts
them down, which fails its own pending collective and every peer's at once ("Connection closed by
peer"). NCCL's `abort()` aborts its communicators.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
)

log = logging.getLogger(__name__)


@dataclass
class WeightGroup:
    """One member's handle on a weight-update group."""

    pg: dist.ProcessGroup
    name: str
    rank: int
    world_size: int
    backend: str
    device: torch.device
    links: dict[int, str] = field(default_factory=dict)
    """fd -> socket inode of the TCP connections the gloo backend opened (`abort`)."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 in place (rank 0 sends, the others receive)."""
        dist.broadcast(tensor, src=0, group=self.pg)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start the broadcast of `tensor` from rank 0; the caller polls `is_completed()`."""
        work = dist.broadcast(tensor, src=0, group=self.pg, async_op=True)
        assert work is not None
        return work

    def abort(self) -> int:
        """Fail every pending collective of this group here and on its peers now: gloo's TCP
        connections are shut down (those noted when the group formed and still open under the
        same inode), NCCL's communicators aborted. Returns the connections shut down."""
        if self.backend == "nccl":
            try:
                self.pg.abort()
            except Exception as e:  # an NCCL build without abort: the group times out instead
                log.warning("weight-update group %s: NCCL abort failed: %s", self.name, e)
            return 0
        shut = 0
        for fd, inode in self.links.items():
            if _socket_inode(fd) != inode:  # closed (and the fd maybe reused) meanwhile
                continue
            shut += _on_socket(fd, lambda s: s.shutdown(socket.SHUT_RDWR)) is not None
        log.warning(
            "weight-update group %s: shut down %d of its %d connections here (pending "
            "collectives fail now, here and on the peers)",
            self.name,
            shut,
            len(self.links),
        )
        return shut

    def destroy(self) -> None:
        """Forget the group here. Its connections close only when the backend object is freed
        (neither `abort()` nor `shutdown()` closes gloo's, measured with torch 2.13): the caller
        drops every reference (`WeightPusher._destroy`), and a peer still waiting in one of its
        collectives then fails at once instead of waiting out its timeout."""
        dist.destroy_process_group(self.pg)


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
    keep_ports: Iterable[int] = (),
    listener: socket.socket | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks are in.
    `keep_ports`: ports of connections this process opens meanwhile that are not the group's
    (the engines' HTTP ports, on the learner), never shut down by `WeightGroup.abort`.
    `listener` (rank 0): a socket already listening at master_address:master_port
    (`listen_socket`); the store takes it over. Without one the store binds the port itself,
    on every address of the machine, so another process can have taken it meanwhile."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-update backend must be gloo or nccl, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a weight-update group named {group_name!r} already exists here")
    timeout = timedelta(seconds=timeout_s)
    t0 = time.monotonic()
    log.info(
        "weight-update group %s: rank %d/%d joining the store at %s:%d",
        group_name,
        rank,
        world_size,
        master_address,
        master_port,
    )
    fd = listener.detach() if listener is not None and rank == 0 else None
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=fd,
    )
    log.info(
        "weight-update group %s: rank %d/%d store up after %.2fs",
        group_name,
        rank,
        world_size,
        time.monotonic() - t0,
    )
    store = PrefixStore(group_name, store)
    before = _sockets()
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    keep = {int(master_port), *keep_ports}
    links = _links(before, keep) if backend == "gloo" else {}
    log.info(
        "weight-update group %s: rank %d/%d joined after %.2fs",
        group_name,
        rank,
        world_size,
        time.monotonic() - t0,
    )
    # Group-local ranks are the global ranks of this private group (used by broadcast's src).
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(pg, group_name, rank, world_size, backend, torch.device(device), links)


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening at host:port (port 0: one the kernel picks), for rank 0's store.

    Held from the moment its port is chosen until the store takes it over, so no other process
    can take the port in between; and it listens on `host` alone, where a store binding the
    port itself would listen on every address (and fail when any process holds the port on any
    of them). Raises OSError naming the address when the port is taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen(socket.SOMAXCONN)
    except OSError as e:
        s.close()
        raise OSError(
            e.errno, f"cannot listen at {host}:{port} for the weight-update group: {e}"
        ) from e
    return s


def _socket_inode(fd: int) -> str | None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("socket:") else None


def _sockets() -> dict[int, str]:
    """fd -> "socket:[inode]" of this process's open sockets (Linux /proc; empty elsewhere)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return {}
    return {fd: inode for fd in fds if (inode := _socket_inode(fd)) is not None}


def _links(before: dict[int, str], keep: set[int]) -> dict[int, str]:
    """The connected TCP sockets opened since `before` but those with a local or peer port in
    `keep` (the group store's, and the engines' HTTP ports: the caller's event loop may open a
    connection to an engine meanwhile, and reuse it later)."""
    out = {}
    for fd, inode in _sockets().items():
        if before.get(fd) == inode:
            continue
        ports = _on_socket(fd, _tcp_ports)
        if ports and not keep.intersection(ports):
            out[fd] = inode
    return out


def _tcp_ports(s: socket.socket) -> tuple[int, ...]:
    """(local, peer) port of a connected TCP socket, () for any other (a listener: OSError)."""
    if s.type != socket.SOCK_STREAM:
        return ()
    return s.getsockname()[1], s.getpeername()[1]


def _on_socket(fd: int, fn: Callable[[socket.socket], Any]) -> Any:
    """`fn` of a duplicate of the socket at `fd` (True when `fn` returns None); None when the fd
    is not a socket any more or `fn` raises OSError."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        out = fn(s)
        return True if out is None else out
    except OSError:
        return None
    finally:
        s.close()


def receive_tensors(
    group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one update: receive each tensor by broadcast(src=0), in `names` order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    # Check every entry before the first broadcast, so a bad request fails without a half-read.
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        specs.append((name, torch_dtype, [int(s) for s in shape]))
    # gloo receives into host memory; an engine on a GPU then copies each tensor over (the
    # push to an engine that shares the learner's GPU, where NCCL cannot run: `choose_backend`).
    on = group.device if group.backend == "nccl" else torch.device("cpu")
    out = []
    for name, torch_dtype, shape in specs:
        t = torch.empty(shape, dtype=torch_dtype, device=on)
        group.broadcast(t)
        out.append((name, t if on == group.device else t.to(group.device)))
    return out


def gpu_uuid(device: torch.device | None = None) -> str | None:
    """The UUID of `device` (default: this process's current GPU); None off the GPU."""
    if device is not None and device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return str(torch.cuda.get_device_properties(index).uuid)


def choose_backend(learner_gpu: str | None, engines: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The weight push's backend for `push.backend = "auto"`, and why.

    NCCL when the learner and every engine hold GPUs of their own. gloo when the learner is on
    the CPU, when an engine says (SGLang's `device` server arg) it is not on a GPU, or when an
    engine reports the learner's own GPU (`gpu_uuid`, the embedded engine's /server_info field):
    NCCL refuses two ranks on one device ("invalid usage"). An engine that reports no device is
    taken to be SGLang on GPUs of its own (SGLang's default device is cuda). An engine on the
    learner's GPU gets the push by handle instead (`colocated_engines`) unless it refused that
    path; then it is one of `engines` here."""
    if learner_gpu is None:
        return "gloo", "the learner is not on a GPU"
    for url, info in engines.items():
        device = str(info.get("device") or "cuda")
        if not device.startswith("cuda"):
            return "gloo", f"engine {url} is on {device}"
        if info.get("gpu_uuid") == learner_gpu:
            return "gloo", f"engine {url} shares the learner's GPU ({learner_gpu})"
    return "nccl", "every engine is on a GPU of its own"


def routable_address() -> str:
    """This node's address as other nodes reach it: the source address of the default route
    (a UDP socket is connected, nothing is sent), else the host name's address; loopback only
    when nothing else exists (then a warning: engines on other nodes cannot reach it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet leaves: connect() only picks a route
            addr = s.getsockname()[0]
        if addr and not addr.startswith("127."):
            return addr
    except OSError:
        pass
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    log.warning("no routable address found: the weight group uses 127.0.0.1 (single node only)")
    return "127.0.0.1"


def colocated_engines(
    learner_gpu: str | None, engines: dict[str, dict[str, Any]]
) -> dict[str, str]:
    """url -> why, for each engine on the learner's own GPU (its /server_info `gpu_uuid`): with
    `push.backend = "auto"` they get the weights by CUDA IPC handle
    (`/update_weights_from_tensor`, `tensor_push.py`), never through the group."""
    if learner_gpu is None:
        return {}
    return {
        url: f"it shares the learner's GPU ({learner_gpu}): tensors by CUDA IPC handle"
        for url, info in engines.items()
        if info.get("gpu_uuid") == learner_gpu
    }
