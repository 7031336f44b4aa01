"""The buffer of the queue tests: a config on free loopback ports with a write-ahead log, and the
real buffer process (`slime-async buffer`) started on a config and waited for."""

from __future__ import annotations

from pathlib import Path

from slime_async.config import BufferConfig
from slime_async.queue.client import ping
from slime_async.utils.procs import Child, free_port, python_module, wait_until
from tests.support.forked import fork_server, role_env


def wal_buffer_config(wal_dir: Path, **overrides) -> BufferConfig:
    """Loopback endpoints on free ports, the log in `wal_dir`, short client timeouts."""
    return BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        wal_dir=str(wal_dir),
        **{"request_timeout_s": 1.0, "give_up_s": 30.0, **overrides},
    )


def start_buffer(cfg: BufferConfig, log: Path) -> Child:
    """`slime-async buffer` with every key of `cfg` as an override; returns once it answers."""
    overrides = [
        f"buffer.{k}={v}" if not isinstance(v, str) else f'buffer.{k}="{v}"'
        for k, v in cfg.model_dump(exclude={"curve"}).items()
        if v is not None
    ]
    child = Child(
        "buffer",
        python_module("slime_async", "buffer", *overrides),
        log_path=log,
        env=role_env(),
        fork_server=fork_server(),
    )
    wait_until(lambda: ping(cfg.consumer_endpoint, cfg) is not None, 60, "the buffer", child=child)
    return child
