"""The colocated push's pieces without an engine: which engines get tensors by handle (server_info
dicts), the serialisation (torch's reductions, file_system shared memory for CPU tensors, base64)
read back by the engine's unpickler, the engine's field checks, and which refusals mean "fall
back to the broadcast". The real processes are in tests/integration/test_engine_tensor_push.py."""

import ast
import asyncio
import base64
import dataclasses
import io
import pickle
import pickletools
import types

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
    ALIGN,
    FLAT_FORMAT,
    IPC_OPEN_FAILED,
    ROUTE,
    SGLANG_BUCKET_MODULE,
    FlattenedTensorMetadata,
    TensorSender,
    fallback_reason,
    flatten,
    request_body,
    serialize,
    serialize_flat,
)
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.actors.engine.weight_sync import choose_backend, colocated_engines
from slime_async.actors.learner.process import push_backend
from tests.support import sglang_wheel as sw
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


# ---- flattened buckets (load_format "flattened_bucket") ------------------------------------------

BUCKET = [
    ("odd_bf16", torch.arange(3, dtype=torch.bfloat16)),  # 6 bytes: the next starts aligned
    ("matrix", torch.randn(2, 3)),
    ("transposed", torch.randn(4, 5).t()),  # not contiguous: copied in as its values
    ("scalar", torch.tensor(2.5)),
    ("empty", torch.zeros(0, 4)),
]


def _globals(raw: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle asks its unpickler for (GLOBAL opcodes, protocol <= 3)."""
    found = set()
    for op, arg, _ in pickletools.genops(raw):
        assert op.name not in ("STACK_GLOBAL", "INST", "OBJ"), op.name  # all of them visible
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    return found


def test_a_flattened_bucket_is_one_aligned_tensor_and_reads_back():
    flat, metas = flatten(BUCKET)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert [m.name for m in metas] == [n for n, _ in BUCKET]
    assert all(m.start_idx % ALIGN == 0 for m in metas)
    assert [m.numel for m in metas] == [t.numel() * t.element_size() for _, t in BUCKET]
    body = request_body((flat, metas), ranks=2, weight_version=4)
    assert body["load_format"] == FLAT_FORMAT and len(body["serialized_named_tensors"]) == 2
    raw = decode(body["serialized_named_tensors"][1], "serialized_named_tensors[1]")
    assert (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata") in _globals(raw)
    got = open_tensors(raw, "serialized_named_tensors[1]", FLAT_FORMAT)
    assert [n for n, _ in got] == [n for n, _ in BUCKET]
    for (_, want), (_, t) in zip(BUCKET, got, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    with pytest.raises(ValueError, match="empty bucket"):
        flatten([])


def test_sglangs_own_code_reads_our_flattened_bucket():
    """The wheel as the oracle: every global of the pickle is one SGLang's SafeUnpickler admits
    (its ALLOWED_GLOBALS, read from srt/utils/common.py), its weight updater takes the format
    (weight_updater.py reads `flattened_tensor` and `metadata`), and the wheel's own
    tensor_bucket.py, run here, rebuilds the tensors from the pickle."""
    api = sw.api_or_skip()
    allowed = _sglang_allowed_globals(api.files.read("srt/utils/common.py"))
    updater = api.files.read("srt/model_executor/model_runner_components/weight_updater.py")
    assert f'load_format == "{FLAT_FORMAT}"' in updater
    assert '["flattened_tensor"]' in updater and '["metadata"]' in updater
    flat, metas = flatten(BUCKET)
    raw = base64.b64decode(serialize_flat(flat, metas), validate=True)
    refused = _globals(raw) - allowed
    assert not refused, f"SGLang's SafeUnpickler would refuse {refused}"

    module = types.ModuleType(SGLANG_BUCKET_MODULE)
    exec(
        compile(api.files.read("srt/weight_sync/tensor_bucket.py"), "tensor_bucket.py", "exec"),
        module.__dict__,
    )
    fields = [f.name for f in dataclasses.fields(module.FlattenedTensorMetadata)]
    assert fields == [f.name for f in dataclasses.fields(FlattenedTensorMetadata)]

    class AsSGLang(pickle.Unpickler):
        """SafeUnpickler's rule (admitted globals only), the bucket's class from the wheel."""

        def find_class(self, mod, name):
            assert (mod, name) in allowed, (mod, name)
            if mod == SGLANG_BUCKET_MODULE:
                return getattr(module, name)
            return super().find_class(mod, name)

    obj = AsSGLang(io.BytesIO(raw)).load()
    assert all(type(m) is module.FlattenedTensorMetadata for m in obj["metadata"])
    bucket = module.FlattenedTensorBucket(
        flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
    )
    rebuilt = bucket.reconstruct_tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in BUCKET]
    for (_, want), (_, t) in zip(BUCKET, rebuilt, strict=True):
        assert t.dtype == want.dtype and torch.equal(t, want)


def _sglang_allowed_globals(source: str) -> set[tuple[str, str]]:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for item in node.body:
                if isinstance(item, ast.Assign) and item.targets[0].id == "ALLOWED_GLOBALS":
                    return set(ast.literal_eval(item.value))
    raise AssertionError("srt/utils/common.py: no SafeUnpickler.ALLOWED_GLOBALS")


def _flat_payload(mutate) -> bytes:
    flat, metas = flatten(BUCKET[:2])
    obj = {"flattened_tensor": flat, "metadata": metas}
    mutate(obj, metas)
    return base64.b64decode(serialize_flat(obj["flattened_tensor"], obj["metadata"]))


@pytest.mark.parametrize(
    "mutate, says",
    [
        (lambda o, m: setattr(m[1], "end_idx", m[1].end_idx + 4), "do not hold"),
        (lambda o, m: setattr(m[1], "start_idx", m[1].start_idx + 2), "do not hold"),
        (lambda o, m: (setattr(m[1], "start_idx", 2), setattr(m[1], "end_idx", 26)), "aligned"),
        (lambda o, m: setattr(m[0], "shape", torch.Size([4])), "do not hold"),
        (lambda o, m: setattr(m[0], "shape", "3"), "not a tuple of sizes"),
        (lambda o, m: setattr(m[0], "name", 3), "name must be a string"),
        (lambda o, m: setattr(m[1], "numel", None), "must be integers"),
        (lambda o, m: o.update(flattened_tensor=o["flattened_tensor"].view(torch.int16)), "uint8"),
        (lambda o, m: m.clear(), "non-empty list"),
    ],
    ids=[
        "past-end",
        "size",
        "misaligned",
        "shape",
        "shape-type",
        "name",
        "numel",
        "dtype",
        "empty",
    ],
)
def test_a_bad_flattened_bucket_is_refused_naming_the_entry(mutate, says):
    with pytest.raises(BadTensors, match=says):
        open_tensors(_flat_payload(mutate), "serialized_named_tensors[0]", FLAT_FORMAT)


def test_an_engine_that_refuses_the_flattened_format_gets_tensors_one_by_one():
    class Refuses:
        url = "http://old"

        def __init__(self):
            self.formats = []

        async def call(self, method, path, body, **kw):
            self.formats.append(body["load_format"])
            if body["load_format"] == FLAT_FORMAT:
                raise EngineRequestError(
                    self.url, f"POST {path}", "HTTP 400: Unknown load_format=flattened_bucket", 400
                )
            return {"success": True}

    s, c = TensorSender(timeout_s=1), Refuses()
    named = BUCKET[:2]
    asyncio.run(s.send(c, named, flat=flatten(named)))
    asyncio.run(s.send(c, named, flat=flatten(named)))
    assert c.formats == [FLAT_FORMAT, None, None]  # refused once, then one by one
    assert s.stats.flat_refused == 1 and "flattened_bucket" in s.one_by_one[c.url]

    class Fails(Refuses):
        async def call(self, method, path, body, **kw):
            raise EngineRequestError(self.url, f"POST {path}", "HTTP 400: unknown parameter", 400)

    with pytest.raises(EngineRequestError, match="unknown parameter"):  # not the format: raised
        asyncio.run(s.send(Fails(), named, flat=flatten(named)))
