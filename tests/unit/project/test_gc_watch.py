"""The garbage-collector watch of long-running roles: every collection timed and counted, a long
one logged, and what start-up made frozen out of later collections' sight."""

import gc
import logging
import subprocess
import sys
import textwrap

from slime_async.utils.gc_watch import GcWatch


def test_every_collection_is_counted_by_generation_and_a_long_one_logged(caplog):
    watch = GcWatch("tester", warn_s=1e-9).install()  # every collection counts as long
    try:
        with caplog.at_level(logging.WARNING, logger="slime_async.utils.gc_watch"):
            gc.collect(0)
            gc.collect(2)
        stats = watch.stats()
    finally:
        watch.close()
    assert watch._callback not in gc.callbacks
    assert stats["gc_collections"][0] >= 1 and stats["gc_collections"][2] >= 1
    assert stats["gc_long_collections"] == sum(stats["gc_collections"])
    assert stats["gc_longest_s"] > 0 and sum(stats["gc_seconds"]) >= stats["gc_longest_s"]
    long = [r.getMessage() for r in caplog.records if "garbage collection took" in r.getMessage()]
    assert len(long) == stats["gc_long_collections"]
    assert long[-1].startswith("tester: a generation-2 garbage collection took ")
    assert f"longer than 0.000 s so far: {len(long)}" in long[-1]
    gc.collect()  # after close: no longer counted
    assert watch.stats()["gc_collections"] == stats["gc_collections"]


def test_a_short_collection_is_counted_not_logged(caplog):
    watch = GcWatch("tester", warn_s=60.0).install()
    try:
        with caplog.at_level(logging.WARNING):
            gc.collect(1)
    finally:
        watch.close()
    assert watch.stats()["gc_collections"][1] >= 1 and watch.stats()["gc_long_collections"] == 0
    assert not [r for r in caplog.records if "garbage collection took" in r.getMessage()]


def test_freeze_takes_what_is_alive_out_of_the_collections_sight():
    """In a fresh interpreter (freezing pytest's own heap would keep it for the session): after
    `freeze`, a full collection walks only what came later, and a cycle made before the freeze
    is not collected, as gc.freeze documents; `collect=True` collects first, so no garbage of
    before is kept."""
    code = textwrap.dedent(
        """
        import gc, logging, weakref
        from slime_async.utils.gc_watch import freeze
        logging.basicConfig(level=logging.INFO, format="%(message)s")

        class Node:
            pass

        garbage = Node(); garbage.me = garbage; dead = weakref.ref(garbage); del garbage
        kept = Node(); kept.me = kept; held = weakref.ref(kept)
        frozen = freeze("tester")
        assert dead() is None, "collect=True collects before freezing"
        assert frozen == gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert held() is not None, "a frozen cycle stays (gc.freeze's contract)"
        late = Node(); late.me = late; gone = weakref.ref(late); del late
        gc.collect()
        assert gone() is None, "what came after the freeze is collected"
        n = freeze("again", collect=False)
        assert n >= frozen
        print("ok", frozen, n)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
    assert "tester: " in out.stderr and "objects frozen out of the garbage collector's sight" in (
        out.stderr
    )
