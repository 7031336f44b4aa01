"""CurveZMQ keys for tests of cluster configs: what `slime-async keygen DIR > curve.toml` writes."""

from __future__ import annotations

from pathlib import Path

from slime_async.commands.keygen import curve_toml
from slime_async.queue.security import keygen


def write_curve_toml(tmp_path: Path, clients: tuple[str, ...] = ("generator", "learner")) -> Path:
    """Keys under `tmp_path/keys` and the `curve.toml` naming them (the first client's secret);
    written once per `tmp_path`."""
    keys = (tmp_path / "keys").resolve()
    path = tmp_path / "curve.toml"
    if path.exists():
        return path
    keygen(keys, list(clients))
    path.write_text(curve_toml(keys, clients[0]))
    return path
