"""The weight-update group's store port: held from the moment it is chosen, on its own address.

A TCPStore that binds its port itself listens on every address of the machine, so a port that
another process holds on any address (a buffer on 127.0.0.1, say) fails the learner's store on
127.0.0.3 with "address already in use": seen on the simulated three-node Ray cluster, where each
node picks its own ports."""

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from slime_async.actors.engine.weight_sync import init_weight_group, listen_socket
from slime_async.utils import procs


def _held(host: str, port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind((host, port))
    s.listen(1)
    return s


def test_the_store_forms_on_a_port_another_process_holds_on_another_address():
    other = _held("127.0.0.1")  # what another role bound on its own node's address
    port = other.getsockname()[1]
    try:
        listener = listen_socket("127.0.0.3", port)
        group = init_weight_group("127.0.0.3", port, 0, 1, "port_test", listener=listener)
        try:
            # the store listens on 127.0.0.3 alone, and answers there
            client = dist.TCPStore("127.0.0.3", port, is_master=False, timeout=timedelta(10))
            client.set("k", "v")
            assert client.get("k") == b"v"
            assert not procs._bindable("127.0.0.3", port)
        finally:
            group.destroy()
    finally:
        other.close()


def test_a_taken_port_is_refused_naming_the_address():
    other = _held("127.0.0.3")
    try:
        with pytest.raises(OSError, match=r"cannot listen at 127\.0\.0\.3:\d+ for the weight"):
            listen_socket("127.0.0.3", other.getsockname()[1])
    finally:
        other.close()


def test_free_port_skips_a_port_held_on_another_address(monkeypatch):
    other = _held("127.0.0.1")
    taken = other.getsockname()[1]
    offered = iter([taken, taken, 40123])

    class Rng:
        def choice(self, seq):
            return seq[0]

        def randint(self, a, b):
            return next(offered)

    monkeypatch.setattr(procs.random, "SystemRandom", Rng)
    monkeypatch.setattr(procs, "_ephemeral_range", lambda: (1024, 1025))
    monkeypatch.setattr(procs, "_PICKED", set())
    try:
        if not procs._bindable("127.0.0.1", 40123):
            pytest.skip("port 40123 is in use on this machine")
        assert procs.free_port("127.0.0.3") == 40123
    finally:
        other.close()
