"""`slime-async keygen DIR`: write CurveZMQ key pairs for the buffer and its clients."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write CurveZMQ key pairs (server + clients) for a buffer reached across nodes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the keys into (created; never overwritten)")
    p.add_argument(
        "--clients",
        nargs="+",
        default=["client"],
        metavar="NAME",
        help="one key pair per client name (default: one shared 'client' pair)",
    )


def main(args: argparse.Namespace) -> int:
    import sys

    from slime_async.queue.security import SecurityError, keygen

    try:
        written = keygen(args.dir, args.clients)
    except SecurityError as e:
        print(f"slime-async keygen: error: {e}", file=sys.stderr)
        return 2
    d = Path(args.dir).resolve()
    first = args.clients[0]
    # The TOML goes to stdout alone, so `slime-async keygen DIR > curve.toml` is a config file.
    print(f"wrote {len(written)} key pairs under {d}; config on stdout", file=sys.stderr)
    print(curve_toml(d, first), end="")
    return 0


def curve_toml(directory: Path, client: str) -> str:
    """The `[buffer.curve]` section naming the keys `keygen` wrote under `directory`."""
    return (
        "[buffer.curve]\n"
        f'server_secret_key = "{directory}/server.key_secret"\n'
        f'server_public_key = "{directory}/server.key"\n'
        f'client_secret_key = "{directory}/{client}.key_secret"\n'
        f'authorized_clients_dir = "{directory}/authorized_clients"\n'
    )
