"""`slime-async buffer`: run the trajectory buffer process until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse

from slime_async.commands import add_config_arguments, config_from_args

HELP = "run the trajectory buffer (ZeroMQ endpoints from [buffer]; write-ahead log if wal_dir)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def main(args: argparse.Namespace) -> int:
    import json
    import logging
    import signal
    from pathlib import Path

    from slime_async.queue.damage import WalDamaged
    from slime_async.queue.security import SecurityError
    from slime_async.queue.server import Buffer
    from slime_async.queue.wal import WalFormatError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s buffer %(levelname)s %(message)s")
    cfg = config_from_args(args)
    wal_dir = cfg.paths().wal_dir
    try:
        buf = Buffer(cfg.buffer, wal_dir=wal_dir)
    except (SecurityError, WalDamaged, WalFormatError) as e:
        logging.error("%s", e)
        print(f"slime-async buffer: error: {e}")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: buf.stop())
    signal.signal(signal.SIGINT, lambda *_: buf.stop())
    s = buf.stats()
    logging.info(
        "ready: producers -> %s, consumers -> %s, %d groups recovered, wal=%s",
        buf.producer_endpoint,
        buf.consumer_endpoint,
        s["groups_pending"] + s["groups_ready"] + s["batches_delivered_uncommitted"],
        wal_dir,
    )
    buf.serve_forever()
    if cfg.run.run_dir:
        # The run's final accounting: the supervisor stops the buffer after the generators and
        # the learner, so nothing can still arrive (this replaces the learner's earlier copy).
        final = Path(cfg.run.run_dir) / "buffer_final.json"
        final.write_text(json.dumps(buf.stats(), indent=2) + "\n")
        logging.info("final accounting in %s", final)
    logging.info("stopped")
    return 0
