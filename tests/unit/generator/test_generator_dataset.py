"""Prompt dataset and cursor: seeded order per epoch, shards, out-of-order completion, restarts."""

import json

import pytest

from slime_async.actors.generator.dataset import (
    Cursor,
    CursorStore,
    DatasetError,
    PromptDataset,
    PromptStream,
)


def write_jsonl(path, n):
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n))
    )
    return path


def test_bad_files_name_file_and_line(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        PromptDataset(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: not valid JSON"):
        PromptDataset(bad)
    bad.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: expected a JSON object"):
        PromptDataset(bad)
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: no 'prompt' field"):
        PromptDataset(bad)
    assert PromptDataset(bad, prompt_key="question").records == [{"question": "a"}]
    bad.write_text("\n")
    with pytest.raises(DatasetError, match="no prompts"):
        PromptDataset(bad)


def test_each_epoch_is_a_seeded_permutation(tmp_path):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", 10))
    s = PromptStream(ds, seed=3)
    epoch0 = [s.at(k).row for k in range(10)]
    epoch1 = [s.at(k).row for k in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert [PromptStream(ds, seed=3).at(k).row for k in range(10)] == epoch0
    assert [PromptStream(ds, seed=4).at(k).row for k in range(10)] != epoch0
    assert s.at(13).epoch == 1 and s.at(13).offset == 3
    assert PromptStream(ds, num_epochs=2).at(19) is not None
    assert PromptStream(ds, num_epochs=2).at(20) is None


def test_shards_partition_each_epoch(tmp_path):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", 10))
    shards = [PromptStream(ds, seed=1, num_shards=3, shard_index=i) for i in range(3)]
    assert [s.per_epoch for s in shards] == [4, 3, 3]
    rows = [s.at(k).row for s in shards for k in range(s.per_epoch)]
    assert sorted(rows) == list(range(10))
    with pytest.raises(DatasetError, match="shard_index 3"):
        PromptStream(ds, num_shards=3, shard_index=3)
    with pytest.raises(DatasetError, match="empty"):
        PromptStream(ds, num_shards=20, shard_index=15)


def test_cursor_watermark_with_out_of_order_completion():
    c = Cursor()
    for k in (2, 0, 4):
        c.mark_done(k)
    assert c.next == 1 and c.ahead == {2, 4}
    pending = c.pending()
    assert [next(pending) for _ in range(4)] == [1, 3, 5, 6]
    c.mark_done(1)
    assert c.next == 3 and c.ahead == {4}
    c.mark_done(0)  # already done: no effect
    assert c.done(2) and not c.done(3) and c.done(4)


def test_cursor_survives_a_restart_and_checks_the_stream(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", 10)
    state = tmp_path / "state" / "gen0.json"
    stream = PromptStream(PromptDataset(data), seed=5)
    store = CursorStore(state, stream)
    c = store.load()
    assert (c.next, c.ahead) == (0, set())
    for k in (0, 1, 3, 12):
        c.mark_done(k)
    store.save(c)
    saved = json.loads(state.read_text())
    assert saved["next"] == 2 and saved["ahead"] == [3, 12]
    assert (saved["epoch"], saved["offset"]) == (0, 2)
    again = CursorStore(state, PromptStream(PromptDataset(data), seed=5)).load()
    assert (again.next, again.ahead) == (2, {3, 12})
    # another seed or another dataset would silently change what item k is: refuse
    with pytest.raises(DatasetError, match=r"seed: 5 -> 6.*delete the file"):
        CursorStore(state, PromptStream(PromptDataset(data), seed=6)).load()
    write_jsonl(data, 11)
    with pytest.raises(DatasetError, match="dataset_digest"):
        CursorStore(state, PromptStream(PromptDataset(data), seed=5)).load()
    state.write_text("{not json")
    with pytest.raises(DatasetError, match="unreadable generator state"):
        store.load()


def test_no_state_path_means_no_persistence(tmp_path):
    store = CursorStore(None, PromptStream(PromptDataset(write_jsonl(tmp_path / "d.jsonl", 3))))
    c = store.load()
    c.mark_done(0)
    store.save(c)
    assert store.load().next == 0
