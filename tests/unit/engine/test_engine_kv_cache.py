"""The paged KV cache's block pool: reference counts, the prefix index, eviction; its config keys."""

import pytest
from pydantic import ValidationError

from slime_async.actors.engine.embedded.kv_cache import SCRATCH_BLOCK, BlockPool, OutOfBlocks
from slime_async.config import EmbeddedEngineConfig, EngineConfig


def test_blocks_are_counted_and_the_scratch_block_is_never_handed_out():
    pool = BlockPool(num_blocks=5, block_size=4)
    got = pool.allocate(4)
    assert SCRATCH_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks, match="asked for 1 KV blocks, 0 available"):
        pool.allocate(1)
    pool.share(got[:2])  # a second holder of two blocks
    pool.release(got)
    assert pool.available == 2  # the shared two are still held
    pool.release(got[:2])
    assert pool.available == 4 and pool.in_use() == 0


def test_prefix_index_matches_whole_blocks_of_the_same_prefix_only():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    keys = pool.keys(prompt)
    assert len(keys) == 2
    blocks = pool.allocate(3)
    pool.register(keys, blocks)
    assert pool.match(pool.keys([*prompt, 99])) == blocks[:2]
    assert pool.match(pool.keys([0, 1, 2, 3, 7, 7, 7, 7])) == blocks[:1]  # same first block only
    assert pool.match(pool.keys([9, 1, 2, 3, 4, 5, 6, 7])) == []  # a key names the whole prefix


def test_idle_cached_blocks_are_reused_then_evicted_least_recent_first():
    pool = BlockPool(num_blocks=4, block_size=2)  # three usable blocks
    a, b = pool.allocate(2)
    pool.register(pool.keys([1, 2, 3, 4]), [a, b])
    pool.release([a, b])  # idle in the index: still matchable, and counted as available
    assert pool.available == 3 and pool.match(pool.keys([1, 2, 3, 4])) == [a, b]
    pool.share([a])  # a new request takes the first cached block
    assert pool.available == 2
    pool.allocate(2)  # the free block, then b evicted
    assert pool.evictions == 1 and pool.match(pool.keys([1, 2, 3, 4])) == [a]
    pool.release([a])
    assert pool.clear_index() == 1 and pool.match(pool.keys([1, 2])) == []


def test_cache_keys_refuse_impossible_combinations():
    with pytest.raises(ValidationError, match="block_size must be a power of two"):
        EmbeddedEngineConfig(block_size=24)
    with pytest.raises(
        ValidationError, match=r"decode_attention = 'triton' needs engine\.embedded\.block_size"
    ):
        EmbeddedEngineConfig(block_size=8, decode_attention="triton")
    with pytest.raises(ValidationError):
        EmbeddedEngineConfig(mem_fraction=1.5)
    with pytest.raises(
        ValidationError, match=r"kv_cache_tokens and engine\.embedded\.mem_fraction"
    ):
        EmbeddedEngineConfig(kv_cache_tokens=4096, mem_fraction=0.5)
    with pytest.raises(
        ValidationError, match=r"engine\.embedded\.prefix_sharing: only the embedded engine"
    ):
        EngineConfig(
            kind="external", urls=["http://127.0.0.1:1"], embedded={"prefix_sharing": False}
        )
    assert EmbeddedEngineConfig(block_size=8).decode_attention == "auto"


def test_prefix_keys_of_another_namespace_never_match():
    """SGLang's (extra_key, cache_salt) namespaces: the same tokens under another key share
    nothing; under the same key they share; None and (None, None) are the plain index."""
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(10))
    blocks = pool.allocate(2)
    pool.register(pool.keys(prompt, ("weights-1", None)), blocks)
    assert pool.match(pool.keys(prompt, ("weights-1", None))) == blocks
    assert pool.match(pool.keys(prompt, ("weights-2", None))) == []
    assert pool.match(pool.keys(prompt)) == []
    assert pool.match(pool.keys(prompt, ("weights-1", "salt"))) == []
    assert pool.match(pool.keys(prompt, (None, "weights-1"))) == []
    assert pool.keys(prompt, (None, None)) == pool.keys(prompt)
