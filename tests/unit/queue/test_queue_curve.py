"""CurveZMQ: `slime-async keygen` keys let authorized clients in and keep others out; without
keys the buffer refuses to bind beyond loopback."""

import asyncio
import re
import subprocess
import sys

import pytest
import zmq.auth

from slime_async.config import BufferConfig, CurveConfig, load_config
from slime_async.queue.client import BufferUnavailable, ConsumerClient, ProducerClient, ping
from slime_async.queue.security import SecurityError, check_bind, is_loopback
from slime_async.queue.server import Buffer
from slime_async.testing.trajectories import synthetic_group
from slime_async.utils.procs import free_port


@pytest.fixture()
def keys(tmp_path):
    d = tmp_path / "keys"
    out = subprocess.run(
        [sys.executable, "-m", "slime_async", "keygen", str(d), "--clients", "gen", "learner"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "server_secret_key" in out
    assert sorted(p.name for p in (d / "authorized_clients").iterdir()) == [
        "gen.key",
        "learner.key",
    ]
    again = subprocess.run(
        [sys.executable, "-m", "slime_async", "keygen", str(d)], capture_output=True, text=True
    )
    assert again.returncode == 2 and "already exists" in again.stderr  # never overwrites
    toml = tmp_path / "curve.toml"
    toml.write_text(out)  # stdout is a config file as is
    assert load_config([toml]).buffer.curve.client_secret_key == str(d / "gen.key_secret")
    return d


def _cfg(keys, client: str | None, **curve) -> BufferConfig:
    return BufferConfig(
        producer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        consumer_endpoint=f"tcp://127.0.0.1:{free_port()}",
        request_timeout_s=0.5,
        give_up_s=1.5,
        curve=CurveConfig(
            server_secret_key=str(keys / "server.key_secret"),
            server_public_key=str(keys / "server.key"),
            client_secret_key=str(keys / f"{client}.key_secret") if client else None,
            authorized_clients_dir=str(keys / "authorized_clients"),
            **curve,
        ),
    )


def test_authorized_clients_are_served_others_refused(keys, tmp_path):
    cfg = _cfg(keys, "gen")
    with Buffer(cfg) as buf:

        async def produce():
            async with ProducerClient(cfg, "gen") as p:
                return await p.put_group(synthetic_group("g", 2))

        assert asyncio.run(produce()) == "ok"
        learner = cfg.model_copy(update={"curve": _cfg(keys, "learner").curve})
        with ConsumerClient(learner, "learner") as c:
            assert len(c.get_batch(num_groups=1, timeout_s=1).groups[0]) == 2

        # A key pair the buffer never authorized: the handshake fails, no answer ever comes.
        stranger_dir = tmp_path / "stranger"
        stranger_dir.mkdir()
        zmq.auth.create_certificates(stranger_dir, "x")
        stranger = cfg.model_copy(
            update={
                "curve": cfg.curve.model_copy(
                    update={"client_secret_key": str(stranger_dir / "x.key_secret")}
                )
            }
        )
        assert ping(cfg.consumer_endpoint, stranger, timeout_s=0.5) is None
        with ConsumerClient(stranger, "learner") as c, pytest.raises(BufferUnavailable):
            c.get_batch(num_groups=1)
        # No keys at all: a plain client cannot talk to a CURVE server either.
        plain = cfg.model_copy(update={"curve": CurveConfig()})
        assert ping(cfg.producer_endpoint, plain, timeout_s=0.5) is None
        assert ping(cfg.producer_endpoint, cfg, timeout_s=2) is not None
        assert buf.stats()["counts"]["trajectories_in"] == 2


def test_non_loopback_bind_needs_keys_or_an_explicit_opt_in(keys):
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://localhost:1")
    assert is_loopback("tcp://[::1]:5555") and is_loopback("ipc:///tmp/buf.sock")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://10.1.2.3:5555") and not is_loopback("tcp://eth0:5555")
    wide = BufferConfig(consumer_endpoint="tcp://0.0.0.0:5556")
    with pytest.raises(
        SecurityError, match=re.escape("consumer_endpoint='tcp://0.0.0.0:5556' is not a loopback")
    ):
        check_bind(wide)
    check_bind(wide.model_copy(update={"allow_non_loopback": True}))
    check_bind(wide.model_copy(update={"curve": _cfg(keys, None).curve}))
    r = subprocess.run(
        [sys.executable, "-m", "slime_async", "buffer", "buffer.producer_endpoint=tcp://0.0.0.0:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not a loopback address" in r.stdout + r.stderr
