"""Learner side of the colocated weight push: tensors handed over by handle, never copied.

An engine that shares the learner's GPU gets each bucket through SGLang's colocated route
`POST /update_weights_from_tensor` instead of a broadcast in the weight-update group:

    POST /update_weights_from_tensor {serialized_named_tensors: [b64, ...] (one per TP rank),
        load_format: null, flush_cache: false, abort_all_requests: false,
        weight_version: <last bucket only>}

Each entry is one pickle of the bucket, `[(hf_name, tensor), ...]`, made as SGLang makes it
(`srt/utils/common.py: MultiprocessingSerializer.serialize(obj, output_str=True)`: torch's
`ForkingPickler` with torch.multiprocessing's reductions, then base64) and read back by
`MultiprocessingSerializer.deserialize` on the engine (`srt/managers/tp_worker.py:
deserialize_own_rank`: rank i reads entry i only). `load_format` null means the engine loads the
names as HF checkpoint names (`srt/model_executor/model_runner_components/weight_updater.py:
update_weights_from_tensor` -> `model.load_weights`), as `/update_weights_from_distributed` does.

What travels for each tensor:
  - CUDA: torch's CUDA IPC handle of the tensor's allocation (`reductions.reduce_tensor`), with
    the storage's device index replaced by the GPU's UUID as SGLang's own sender does
    (`srt/utils/patch_torch.py: _reduce_tensor_modified`; SGLang's receiver maps a UUID back to
    its own index, so CUDA_VISIBLE_DEVICES may differ between the two processes). The engine
    opens the handle and copies into its parameters; the bytes never leave the GPU.
  - CPU: the tensor's storage is moved into shared memory once (in place, as torch's
    `share_memory_()` does: later pushes of the same tensors copy nothing) and sent by file
    name, torch's `file_system` sharing strategy (`reductions.reduce_storage`, that branch), for
    this pickler only: the process-wide strategy is left alone. torch's default strategy on
    Linux (`file_descriptor`) sends a `DupFd`, which the receiver fetches from the sender's
    `multiprocessing.resource_sharer` over a socket authenticated with the sender's
    `multiprocessing` authkey: only the sender's own children (which inherit the key) can open
    it, an unrelated engine process fails with an authentication error. A file name can be
    opened by any process of the same user on the host (`torch_shm_manager` keeps the file).

Each bucket travels flattened (`load_format: "flattened_bucket"`, SGLang's
`srt/weight_sync/tensor_bucket.py`, served by `weight_updater.py:
_update_weights_from_flattened_bucket`): its tensors are copied into one uint8 tensor, and the
pickle holds `{"flattened_tensor": <that tensor>, "metadata": [FlattenedTensorMetadata(name,
shape, dtype, start_idx, end_idx, numel), ...]}`. One handle and one event per bucket instead of
one per tensor: the sender's `_share_cuda_` and the engine's handle opening are the cost of this
path, not the bytes (on an H200, 310 tensors by handle took 31 ms; their raw copy 1.8 ms). Each
tensor starts on a 16-byte boundary (`ALIGN`; the metadata's start/end say where, so the gaps
are SGLang's format too). The metadata's class is SGLang's by name: pickled at protocol 3, where
a class is one `GLOBAL module\nname\n` opcode, written under this module's name and renamed to
SGLang's (`sglang.srt.weight_sync.tensor_bucket`, admitted by its `SafeUnpickler`); SGLang need
not be installed here. An engine that refuses the format (400 naming `flattened_bucket`) gets
the tensors one by one from then on (counted, logged).

The source tensors are kept referenced until the engine answers (the engine copies before it
answers: `embedded/tensor_update.py`); CUDA memory sent by handle is also held by torch's
`CudaIPCSentDataLimbo` until the receiver drops it. Connects to: the engines' HTTP servers (an
`EngineClient`, the pusher's event-loop thread). Memory: one flattened bucket at a time (one
`push.bucket_bytes` on the GPU beside the model).
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from slime_async.actors.engine.client import EngineClient, EngineError, EngineRequestError

log = logging.getLogger(__name__)

ROUTE = "/update_weights_from_tensor"
IPC_OPEN_FAILED = "could not open the shared tensors"
"""The start of the embedded engine's answer when the handles do not open there (another host,
no access to the GPU or to /dev/shm): the pusher falls back to the broadcast for that engine."""
_DEVICE_ARG = 6
"""Index of the storage's device in the arguments of torch's `rebuild_cuda_tensor` (SGLang's
`patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX`)."""


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple[Callable, tuple]:
    """torch's `reduce_storage` under the `file_system` strategy, for this pickler only."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # raises: CUDA storage travels in its tensor
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild drops this reference
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _pickle(obj: Any, protocol: int | None = None) -> bytes:
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, protocol)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
    pickler.dump(obj)
    return buf.getvalue()


def serialize(obj: Any) -> str:
    """`obj` pickled as SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`
    does (torch's reductions, tensors by handle), then base64."""
    return base64.b64encode(_pickle(obj)).decode("ascii")


def request_body(
    named: list[tuple[str, torch.Tensor]] | tuple[torch.Tensor, list[FlattenedTensorMetadata]],
    ranks: int = 1,
    weight_version: str | None = None,
    flush_cache: bool = False,
) -> dict[str, Any]:
    """The body of one `/update_weights_from_tensor` call (SGLang's
    `UpdateWeightsFromTensorReqInput`): one pickle per TP rank, each with its own handles (an
    engine rank must not open another rank's copy: SGLang's `deserialize_own_rank`). `named` is
    a list of (name, tensor) (load_format null) or a flattened bucket, `flatten(...)`'s pair
    (load_format "flattened_bucket"). flush_cache is false as in the distributed update: the
    pusher has flushed after its pause."""
    flat = isinstance(named, tuple)
    entries = [serialize_flat(*named) if flat else serialize(named) for _ in range(ranks)]
    body: dict[str, Any] = {
        "serialized_named_tensors": entries,
        "load_format": FLAT_FORMAT if flat else None,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


FLAT_FORMAT = "flattened_bucket"
SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
ALIGN = 16
"""Byte alignment of each tensor in a flattened bucket (a uint8 slice viewed as bf16/fp32 must
start on the dtype's boundary)."""
_PROTOCOL = 3
"""The highest pickle protocol that writes a class as one GLOBAL opcode (4 and up use
STACK_GLOBAL with framed, length-prefixed strings); SGLang's unpickler reads any protocol."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket: SGLang's `FlattenedTensorMetadata`, field for field
    (sent under SGLang's class name; the embedded engine reads it back as this class)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int
    """Bytes of the tensor (SGLang counts the elements of its uint8 view)."""


_OUR_GLOBAL = f"c{__name__}\nFlattenedTensorMetadata\n".encode()
_SGLANG_GLOBAL = f"c{SGLANG_BUCKET_MODULE}\nFlattenedTensorMetadata\n".encode()


def flatten(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """The bucket copied into one uint8 tensor on its device, each tensor at an `ALIGN`ed offset,
    and where each one is (SGLang's `FlattenedTensorBucket` layout, with alignment gaps)."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(
            f"a bucket's tensors must share one device, got {sorted(map(str, devices))}"
        )
    metas, offset = [], 0
    for name, t in named:
        offset = -(-offset // ALIGN) * ALIGN
        size = t.numel() * t.element_size()
        metas.append(
            FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + size, size)
        )
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8, device=devices.pop())
    views = [view_of(flat, m) for m in metas]
    torch._foreach_copy_(views, [t.detach() for _, t in named])  # grouped copy kernels
    return flat, metas


def view_of(flat: torch.Tensor, m: FlattenedTensorMetadata) -> torch.Tensor:
    """Tensor `m` of a flattened bucket, a view (SGLang's `reconstruct_tensors`)."""
    return flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)


def serialize_flat(flat: torch.Tensor, metas: list[FlattenedTensorMetadata]) -> str:
    """`{"flattened_tensor", "metadata"}` pickled as a sender with SGLang's classes pickles it
    (tensors by handle as `serialize`), then base64."""
    raw = _pickle({"flattened_tensor": flat, "metadata": metas}, _PROTOCOL)
    if metas:
        raw, renamed = raw.replace(_OUR_GLOBAL, _SGLANG_GLOBAL), raw.count(_OUR_GLOBAL)
        if renamed != 1:  # memoized after its first use: exactly one GLOBAL opcode
            raise RuntimeError(f"the metadata class was pickled {renamed} times, not once")
    return base64.b64encode(raw).decode("ascii")


def shareable(t: torch.Tensor) -> torch.Tensor:
    """A tensor that can go by handle: detached (autograd does not cross processes) and
    contiguous (a copy only when it is not)."""
    return t.detach().contiguous()


def _shared(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, shareable(t)) for n, t in named]


def fallback_reason(e: BaseException) -> str | None:
    """Why an engine's refusal means "push to it by broadcast instead", or None when it does not:
    404 (no such route: an engine without the colocated path) or its handles did not open there."""
    if isinstance(e, EngineRequestError) and e.status == 404:
        return f"it has no {ROUTE} (404)"
    if isinstance(e, EngineError) and IPC_OPEN_FAILED in e.message:
        return f"the tensors did not open there ({e.message})"
    return None


@dataclass
class TensorPushStats:
    """Counters of the colocated push since the pusher started."""

    bytes: float = 0.0
    seconds: float = 0.0
    calls: int = 0
    fallbacks: int = 0
    """Engines moved to the broadcast after a refusal (404 or handles that did not open)."""
    flat_refused: int = 0
    """Engines that refused the flattened format (sent tensor by tensor since)."""
    last_gb_per_s: float = 0.0
    why_fallback: dict[str, str] = field(default_factory=dict)


class TensorSender:
    """Sends buckets to colocated engines through `/update_weights_from_tensor`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.stats = TensorPushStats()
        self.one_by_one: dict[str, str] = {}
        """Engines that refused the flattened format, with their answer: sent tensor by tensor."""

    async def send(
        self,
        client: EngineClient,
        named: list[tuple[str, torch.Tensor]],
        ranks: int = 1,
        weight_version: str | None = None,
        flat: tuple[torch.Tensor, list[FlattenedTensorMetadata]] | None = None,
    ) -> dict[str, Any]:
        """One bucket to one engine, flattened (`flat`, `flatten(named)` made once for every
        engine) unless this engine refused that format; the tensors stay referenced here until
        the engine answered (it has copied them by then). Raises EngineError naming the engine."""
        t0 = time.perf_counter()
        use_flat = flat is not None and client.url not in self.one_by_one
        try:
            out = await self._call(
                client, request_body(flat if use_flat else _shared(named), ranks, weight_version)
            )
        except EngineRequestError as e:
            if not use_flat or e.status != 400 or FLAT_FORMAT not in e.message:
                raise
            self.one_by_one[client.url] = e.message
            self.stats.flat_refused += 1
            log.warning(
                "engine %s refused the %s format, it gets the tensors one by one from now on: %s",
                client.url,
                FLAT_FORMAT,
                e.message,
            )
            out = await self._call(client, request_body(_shared(named), ranks, weight_version))
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return out

    async def _call(self, client: EngineClient, body: dict[str, Any]) -> dict[str, Any]:
        out = await client.call("POST", ROUTE, body, timeout_s=self.timeout_s, max_retries=0)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineRequestError(client.url, f"POST {ROUTE}", str(out.get("message")), 400)
        return out or {}

    def count(self, nbytes: float, seconds: float) -> None:
        """One push's colocated bytes and its wall time (for the GB/s of the last push)."""
        self.stats.bytes += nbytes
        if seconds > 0 and nbytes > 0:
            self.stats.last_gb_per_s = nbytes / seconds / 1e9

    def fell_back(self, url: str, why: str) -> None:
        self.stats.fallbacks += 1
        self.stats.why_fallback[url] = why
        log.warning(
            "engine %s: colocated push refused, it gets the broadcast from now on: %s", url, why
        )
