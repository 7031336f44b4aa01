"""CurveZMQ keys and the loopback rule of the buffer's endpoints.

Without keys the buffer binds loopback (or ipc://) only, unless `allow_non_loopback` is set:
ZeroMQ without CURVE has no authentication, so anyone who reaches the port could feed
trajectories. With keys, only clients whose public key is in `authorized_clients_dir` complete
the handshake; others get no answer at all (ZeroMQ drops them during the handshake).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth

from slime_async.config.buffer import BufferConfig, CurveConfig, bind_refusal
from slime_async.config.buffer import is_loopback as is_loopback  # the rule lives with the config


class SecurityError(ValueError):
    """An endpoint or key configuration that would expose the buffer."""


def curve_enabled(curve: CurveConfig) -> bool:
    return bool(curve.server_secret_key)


def check_bind(cfg: BufferConfig) -> None:
    """Refuse a non-loopback bind without CURVE keys unless explicitly allowed."""
    problem = bind_refusal(cfg)
    if problem:
        raise SecurityError(problem)


def _load(path: str, want_secret: bool) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise SecurityError(f"CURVE key file {path} not found")
    public, secret = zmq.auth.load_certificate(path)
    if want_secret and not secret:
        raise SecurityError(f"{path} holds no secret key (use the *.key_secret file)")
    return public, secret


def setup_server(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Make `sock` a CURVE server (call before bind)."""
    public, secret = _load(curve.server_secret_key or "", want_secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def start_authenticator(ctx: zmq.Context, curve: CurveConfig):
    """A ZAP handler thread accepting only the public keys in `authorized_clients_dir`."""
    from zmq.auth.thread import ThreadAuthenticator

    if not curve.authorized_clients_dir or not Path(curve.authorized_clients_dir).is_dir():
        raise SecurityError(
            "buffer.curve.authorized_clients_dir must name a directory of client public keys"
        )
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=curve.authorized_clients_dir)
    return auth


def setup_client(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Give a client socket its key pair and the server's public key (no-op without CURVE)."""
    if not curve.server_public_key:
        return
    if not curve.client_secret_key:
        raise SecurityError("buffer.curve.client_secret_key is needed to talk to a CURVE buffer")
    server_public, _ = _load(curve.server_public_key, want_secret=False)
    public, secret = _load(curve.client_secret_key, want_secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def keygen(directory: str | Path, clients: list[str]) -> dict[str, Path]:
    """Write a server key pair and one pair per client; authorize the clients' public keys.

    Layout: DIR/server.key (public), DIR/server.key_secret, DIR/<client>.key(_secret),
    DIR/authorized_clients/<client>.key. Existing files are never overwritten.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    authorized = d / "authorized_clients"
    authorized.mkdir(exist_ok=True)
    written: dict[str, Path] = {}
    for name in ["server", *clients]:
        public = d / f"{name}.key"
        if public.exists() or (d / f"{name}.key_secret").exists():
            raise SecurityError(f"{public} already exists; remove it or pick another directory")
        pub, sec = zmq.auth.create_certificates(d, name)
        Path(sec).chmod(0o600)
        written[name] = Path(pub)
        if name != "server":
            shutil.copy(pub, authorized / f"{name}.key")
    return written
