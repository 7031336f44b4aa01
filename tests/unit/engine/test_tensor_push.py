"""The colocated push's pieces without an engine: which engines get tensors by handle (server_info
dicts), the serialisation (torch's reductions, file_system shared memory for CPU tensors, base64)
read back by the engine's unpickler, the engine's field checks, and which refusals mean "fall
back to the broadcast". The real processes are in tests/integration/test_engine_tensor_push.py."""

import base64
import pickle

import pytest
import torch

from slime_async.actors.engine import weight_push
from slime_async.actors.engine.client import EngineError, EngineRequestError
from slime_async.actors.engine.embedded.tensor_update import (
    BadTensors,
    decode,
    open_tensors,
)
from slime_async.actors.engine.tensor_push import (
    IPC_OPEN_FAILED,
    ROUTE,
    TensorSender,
    fallback_reason,
    request_body,
    serialize,
)
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.actors.engine.weight_sync import choose_backend, colocated_engines
from slime_async.actors.learner.process import push_backend
from tests.support.engine_util import push_config

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
SAME = {"device": "cuda:0", "gpu_uuid": GPU_A}
OWN = {"device": "cuda:0", "gpu_uuid": GPU_B}
SGLANG = {}  # a real SGLang server reports neither: taken to be on GPUs of its own


def test_auto_pushes_by_handle_only_to_an_engine_on_the_learners_gpu():
    infos = {"http://a": SAME, "http://b": OWN, "http://c": SGLANG}
    assert list(colocated_engines(GPU_A, infos)) == ["http://a"]
    assert "shares the learner's GPU" in colocated_engines(GPU_A, infos)["http://a"]
    # the others form the group: NCCL, every one of them on a GPU of its own
    rest = {u: i for u, i in infos.items() if u != "http://a"}
    assert choose_backend(GPU_A, rest)[0] == "nccl"
    assert colocated_engines(None, infos) == {}  # a learner off the GPU shares nothing
    assert colocated_engines(GPU_B, {"http://a": SAME}) == {}
    # an engine on the learner's GPU that refused the handles is back in the group: gloo
    assert choose_backend(GPU_A, infos)[0] == "gloo"


def test_the_pusher_splits_a_mixed_pool_and_keeps_a_fallen_back_engine_in_the_group(
    monkeypatch,
):
    monkeypatch.setattr(weight_push, "gpu_uuid", lambda: GPU_A)
    p = WeightPusher(["http://a", "http://b"], push_config(backend="auto"))
    try:
        p.infos = {"http://a": SAME, "http://b": OWN}
        assert p._split_ipc(["http://a", "http://b"]) == ["http://b"]
        assert list(p.ipc) == ["http://a"]
        p.sender.fell_back("http://a", "it has no route (404)")
        assert p._split_ipc(["http://a", "http://b"]) == ["http://a", "http://b"]
        assert p.ipc == {} and p.sender.stats.fallbacks == 1
    finally:
        p.close()
    gloo = WeightPusher(["http://a"], push_config(backend="gloo"))
    try:
        gloo.infos = {"http://a": SAME}
        assert gloo._split_ipc(["http://a"]) == ["http://a"] and gloo.ipc == {}
    finally:
        gloo.close()


def test_push_backend_ipc_stays_ipc_on_a_learner_without_a_gpu():
    assert push_backend("ipc", learner_on_gpu=False) == "ipc"
    assert push_backend("auto", learner_on_gpu=False) == "gloo"


def test_cpu_tensors_travel_by_shared_memory_file_name_and_read_back():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    strategy = torch.multiprocessing.get_sharing_strategy()
    body = request_body([("w", t), ("v", t[1])], ranks=2, weight_version=7)
    assert torch.multiprocessing.get_sharing_strategy() == strategy  # process-wide: untouched
    assert set(body) == {
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
    }
    assert body["weight_version"] == "7" and body["load_format"] is None
    assert body["flush_cache"] is False and len(body["serialized_named_tensors"]) == 2
    raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
    assert b"rebuild_storage_filename" in raw and b"DupFd" not in raw
    assert t.is_shared()  # moved to shared memory in place: later pushes copy nothing
    got = open_tensors(raw, "serialized_named_tensors[0]")
    assert [n for n, _ in got] == ["w", "v"]
    assert torch.equal(got[0][1], t) and torch.equal(got[1][1], t[1])


def test_the_engine_reads_only_what_torchs_reductions_need():
    with pytest.raises(BadTensors, match="not admitted"):
        open_tensors(pickle.dumps([("x", print)]), "serialized_named_tensors[0]")
    with pytest.raises(BadTensors, match=r"list of \(name, tensor\) pairs"):
        open_tensors(base64.b64decode(serialize({"w": torch.zeros(1)})), "f")
    with pytest.raises(BadTensors, match=r"serialized_named_tensors\[1\] is not valid base64"):
        decode("a!b", "serialized_named_tensors[1]")
    with pytest.raises(BadTensors, match="must be a base64 string"):
        decode(3, "serialized_named_tensors[0]")


def test_only_a_missing_route_or_unopened_handles_mean_fall_back():
    call = f"POST {ROUTE}"
    assert "404" in fallback_reason(EngineRequestError("u", call, "HTTP 404: Not Found", 404))
    opened = EngineRequestError("u", call, f"HTTP 400: {IPC_OPEN_FAILED} of x: boom", 400)
    assert IPC_OPEN_FAILED in fallback_reason(opened)
    assert (
        fallback_reason(EngineRequestError("u", call, "HTTP 400: unknown parameter", 400)) is None
    )
    assert fallback_reason(EngineError("u", call, "HTTP 500: boom", 500)) is None
    s = TensorSender(timeout_s=1)
    s.count(2e9, 0.5)
    assert s.stats.bytes == 2e9 and s.stats.last_gb_per_s == pytest.approx(4.0)


def test_a_cuda_handle_on_an_engine_without_cuda_is_a_handle_that_did_not_open():
    """What an engine off the GPU (or on another host) meets: the sender's cue to fall back."""

    class CudaTensor:
        def __reduce__(self):
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = (torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage, torch.float32)
            return rebuild_cuda_tensor, (*args, "GPU-none", b"h", 8, 0, False, b"r", 0, b"e", True)

    with pytest.raises(BadTensors, match=IPC_OPEN_FAILED):
        open_tensors(pickle.dumps([("w", CudaTensor())]), "serialized_named_tensors[0]")
