"""Decode attention over shared prompt blocks (`shared_prefix`): which rows share, the kernel
against the reference, and the setting's refusals."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from slime_async.actors.engine.embedded import attention, shared_prefix
from slime_async.config.engine import EmbeddedEngineConfig

BS = 16


def _tables(rows: list[list[int]], width: int = 6) -> np.ndarray:
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def test_groups_are_rows_with_equal_leading_blocks_cut_at_group_max():
    # 0, 2, 3, 5 share blocks 7 8 9; 4 parts after 7; 1 is alone; 6 and 7 share 20
    bt = _tables(
        [[7, 8, 9, 10], [3, 4], [7, 8, 9, 11, 12], [7, 8, 9, 13], [7, 14, 15], [7, 8, 9, 16],
         [20, 21], [20, 21, 22]]
    )  # fmt: skip
    lens = np.array([60, 20, 70, 49, 40, 64, 20, 33])
    g = shared_prefix.find_groups(bt, lens, BS, group_max=4)
    assert g.rows.tolist() == [[0, 2, 3, 5], [7, 6, -1, -1]]
    # row 6's newest key is in its second block: only the first is wholly before it
    assert g.tokens.tolist() == [48, 16]
    assert g.start.tolist() == [48, 0, 48, 48, 0, 48, 16, 16]
    # Eight rows of one prompt at group_max 3: groups of 3, 3 and 2
    bt = _tables([[5, 6, 7, r] for r in range(8)])
    g = shared_prefix.find_groups(bt, np.full(8, 4 * BS), BS, group_max=3)
    assert g.rows.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, -1]]
    assert g.tokens.tolist() == [48, 48, 48] and g.start.tolist() == [48] * 8


def test_no_groups_without_a_whole_shared_block_before_every_newest_key():
    bt = _tables([[5, 6], [5, 7], [9]])
    # rows 0 and 1 share block 5, but row 1's newest key is in it: nothing to share
    g = shared_prefix.find_groups(bt, np.array([30, BS, 3]), BS)
    assert g.rows.shape == (0, shared_prefix.GROUP_MAX) and g.start.tolist() == [0, 0, 0]
    g = shared_prefix.find_groups(bt[:1], np.array([30]), BS)  # one row
    assert len(g.tokens) == 0
    # a group left with one row after the cut shares with nobody: left out
    bt = _tables([[5, 6, r] for r in range(3)])
    g = shared_prefix.find_groups(bt, np.full(3, 40), BS, group_max=2)
    assert g.rows.tolist() == [[0, 1]] and g.start.tolist() == [32, 32, 0]


def test_group_size_keeps_one_tile_of_query_heads():
    assert shared_prefix.group_size(16, 8) == 8  # Qwen3-0.6B: 8 rows x 2 heads
    assert shared_prefix.group_size(32, 8) == 8
    assert shared_prefix.group_size(64, 4) == 4
    assert shared_prefix.group_size(64, 1) == 2


def test_the_setting_is_refused_where_it_would_do_nothing():
    with pytest.raises(ValidationError, match="prefix_sharing off none are shared"):
        EmbeddedEngineConfig(decode_shared_prefix="on", prefix_sharing=False)
    with pytest.raises(ValidationError, match="needs the triton decode kernel"):
        EmbeddedEngineConfig(decode_shared_prefix="on", decode_attention="gathered")
    assert EmbeddedEngineConfig(prefix_sharing=False).decode_shared_prefix == "auto"


def test_a_cpu_runner_reads_auto_as_off_and_refuses_on(tmp_path):
    from slime_async.actors.engine.embedded.model_runner import ModelRunner
    from slime_async.models.toy import make_tiny_model

    d = make_tiny_model(tmp_path / "qwen3", family="qwen3", seed=5)
    runner = ModelRunner(d, max_slots=2, max_context_len=32)
    assert runner.decode_shared_prefix == "off"
    bt = torch.tensor([[1, 2], [1, 3]], dtype=torch.int32)
    assert runner.groups(bt, torch.tensor([20, 20])) is None
    with pytest.raises(ValueError, match="needs the triton decode kernel on a CUDA device"):
        ModelRunner(d, max_slots=2, max_context_len=32, decode_shared_prefix="on")


@pytest.mark.skipif(
    attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)
@pytest.mark.parametrize("splits", [1, 3])
def test_shared_keys_read_once_give_the_reference_attention(splits, monkeypatch):
    """Rows in groups (one parting early, a group cut short, an empty padding group) and rows
    alone, their keys split or not: the prefix kernel's softmax merged with each row's own
    keys equals attention over all of them (fp32, CPU interpreter)."""
    g = torch.Generator().manual_seed(5)
    hkv, h, d = 2, 4, 32
    kc = torch.randn(40, BS, hkv, d, generator=g)
    vc = torch.randn(40, BS, hkv, d, generator=g)
    tables = [[7, 8, 9, 10], [3, 4], [7, 8, 9, 11, 12], [7, 8, 9, 13], [7, 14, 15], [7, 8, 9, 16],
              [20, 21], [20, 21, 22]]  # fmt: skip
    bt_np = _tables(tables)
    lens_np = np.array([60, 20, 70, 49, 40, 64, 20, 33], dtype=np.int32)
    found = shared_prefix.find_groups(bt_np, lens_np, BS, group_max=4)
    pad = np.full((2, 4), -1, dtype=np.int32)
    shared = shared_prefix.SharedPrefix(
        torch.from_numpy(np.vstack([found.rows, pad])),
        torch.from_numpy(np.r_[found.tokens, 0, 0].astype(np.int32)),
        torch.from_numpy(found.start),
    )
    bt, lens = torch.from_numpy(bt_np), torch.from_numpy(lens_np)
    q = torch.randn(len(tables), h, d, generator=g)
    monkeypatch.setattr(attention, "decode_splits", lambda *a: splits)
    prefix = shared_prefix.prefix_partials(q, kc, vc, bt, shared, d**-0.5)
    got = attention.paged_decode(q, kc, vc, bt, lens, d**-0.5, prefix=prefix)
    ref = attention.decode_reference(q, kc, vc, bt, lens, d**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # the plain kernel on the same rows, for the merge's sake: the same
    torch.testing.assert_close(attention.paged_decode(q, kc, vc, bt, lens, d**-0.5), ref)


@pytest.mark.skipif(
    attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton and TRITON_INTERPRET=1 (the CPU interpreter) set before it is imported",
)
def test_the_start_up_check_passes_the_kernels_and_names_a_failure(monkeypatch):
    from types import SimpleNamespace

    from slime_async.actors.engine.embedded.model_runner import ModelRunner

    shape = SimpleNamespace(
        device=torch.device("cpu"), block_size=BS, num_kv_heads=2, head_dim=32, num_heads=4,
        dtype=torch.float32, group_max=8,
    )  # fmt: skip
    shape._check_decode = lambda *a, **k: ModelRunner._check_decode(shape, *a, **k)
    assert ModelRunner._check_shared(shape) is None
    monkeypatch.setattr(attention, "paged_decode", lambda *a, **k: torch.zeros(4, 4, 32))  # wrong
    assert ModelRunner._check_shared(shape).startswith("relative error")
