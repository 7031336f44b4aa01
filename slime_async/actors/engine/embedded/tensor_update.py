"""The embedded engine's `POST /update_weights_from_tensor`: weights handed over by handle.

The colocated path of SGLang 0.5.23 (`srt/entrypoints/http_server.py: update_weights_from_tensor`),
what a learner on the same GPU (or, on the CPU, the same host) sends instead of a broadcast
(`slime_async/actors/engine/tensor_push.py`). The body is SGLang's
`UpdateWeightsFromTensorReqInput` (`srt/managers/io_struct.py`):

    serialized_named_tensors  list, one base64 pickle per TP rank (this engine has one: entry 0,
                              as `srt/managers/tp_worker.py: deserialize_own_rank` reads its own)
    load_format               null or "direct" (HF names, loaded as the distributed update loads
                              them), or "flattened_bucket" (SGLang's `FlattenedTensorBucket`:
                              the entry is `{"flattened_tensor": uint8 tensor, "metadata":
                              [FlattenedTensorMetadata, ...]}`, each tensor a view of the flat
                              one; `weight_updater.py: _update_weights_from_flattened_bucket`);
                              custom loaders are refused (400)
    flush_cache               default true (SGLang's); abort_all_requests default false
    weight_version            applied only when the update succeeded
    selector                  "all" or "target" ("draft": this engine has no draft model, 400)
    torch_empty_cache         accepted, changes nothing here

Each entry is read as `srt/utils/common.py: MultiprocessingSerializer.deserialize` reads it
(strict base64, then an unpickler that admits only the globals torch's reductions need, as
SGLang's `SafeUnpickler` admits only listed ones; the list here is this engine's own and smaller).
A CUDA storage's device may be a GPU UUID (`srt/utils/patch_torch.py`), mapped to this process's
device index. The result must be a list of (name, tensor) pairs; every name, shape and dtype is
checked against the model before any copy (`ModelRunner.load_weights` checks names and shapes),
so a bad request changes nothing. The copy into the parameters runs on the scheduler thread and
is complete (the stream synchronised) before the answer, so the sender may free or overwrite its
tensors as soon as it has the answer; the opened handles are dropped before answering.

Answers as SGLang: 200 `{success: true, message}`, 400 `{success: false, message}` naming the
field or tensor; a malformed body or bad base64 is 400 `{"error": {"message"}}` (SGLang turns
validation errors into 400). Handles that do not open here answer 400 with a message starting
`tensor_push.IPC_OPEN_FAILED`, the sender's cue to fall back to the broadcast. The weight-update
session rule (SGLang 0.5.23: the call must run between /begin_weight_update and
/end_weight_update), the version and the flush after the update are the distributed update's
(`weights.WeightRoutes`), which wires this route in.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing.reductions as reductions
from aiohttp import web

from slime_async.actors.engine.embedded.http import read_body
from slime_async.actors.engine.tensor_push import (
    FLAT_FORMAT,
    IPC_OPEN_FAILED,
    ROUTE,
    SGLANG_BUCKET_MODULE,
    FlattenedTensorMetadata,
    view_of,
)

if TYPE_CHECKING:
    from slime_async.actors.engine.embedded.server import EmbeddedEngine
    from slime_async.actors.engine.embedded.weights import WeightRoutes

log = logging.getLogger(__name__)

CALL = ROUTE.removeprefix("/")
LOAD_FORMATS = (None, "direct", FLAT_FORMAT)
"""Each loads HF checkpoint names here (this engine's parameters carry the HF names)."""


def _device_index(device: int | str) -> int:
    """A storage's device as sent: this process's index, or a GPU UUID (SGLang's patched
    reduction) mapped to the index of the visible GPU with that UUID."""
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == str(device):
            return i
    raise ValueError(f"no visible GPU has UUID {device}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    args = (*args[:6], _device_index(args[6]), *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    """Admits the containers, dtypes and rebuild functions of torch's reductions, nothing else."""

    _ALLOWED = {
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch", "UntypedStorage"),
        ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) == (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata  # SGLang's dataclass, field for field
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not admitted")


class BadTensors(ValueError):
    """The request's tensors are unusable; the message names the field or the tensor."""


def decode(entry: object, field: str) -> bytes:
    """Strict base64 of one entry (SGLang's `Base64Bytes`: `b64decode(validate=True)`)."""
    if not isinstance(entry, str):
        raise BadTensors(f"{field} must be a base64 string, got {type(entry).__name__}")
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadTensors(f"{field} is not valid base64 ({e})") from None


def open_tensors(
    raw: bytes, field: str, load_format: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Unpickle one entry (opening its handles) into (name, tensor) pairs; a flattened bucket's
    tensors are views of its flat tensor."""
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        raise BadTensors(f"{field}: not a pickle of named tensors ({e})") from None
    except Exception as e:  # a handle that does not open (no CUDA here, no such file, ...)
        raise BadTensors(f"{IPC_OPEN_FAILED} of {field}: {type(e).__name__}: {e}") from None
    if load_format == FLAT_FORMAT:
        return _unflatten(obj, field)
    if not isinstance(obj, list | tuple) or not all(
        isinstance(p, list | tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise BadTensors(f"{field} must hold a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


def _unflatten(obj: object, field: str) -> list[tuple[str, torch.Tensor]]:
    """A flattened bucket's (name, view) pairs, each entry of its metadata checked against the
    flat tensor first (types, bounds, size and alignment): a bad one names itself."""
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise BadTensors(
            f"{field} with load_format {FLAT_FORMAT!r} must hold a dict of flattened_tensor and "
            "metadata"
        )
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise BadTensors(f"{field}: flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metas, list | tuple) or not metas:
        raise BadTensors(f"{field}: metadata must be a non-empty list")
    out = []
    for i, m in enumerate(metas):
        where = f"{field}: metadata[{i}]"
        if not isinstance(m, FlattenedTensorMetadata):
            raise BadTensors(f"{where} is not a FlattenedTensorMetadata")
        name, shape = getattr(m, "name", None), getattr(m, "shape", None)
        dtype = getattr(m, "dtype", None)
        ints = [getattr(m, k, None) for k in ("start_idx", "end_idx", "numel")]
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise BadTensors(f"{where}: name must be a string and dtype a torch dtype")
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadTensors(f"{where} ({name!r}): shape {shape!r} is not a tuple of sizes")
        if not all(isinstance(v, int) for v in ints):
            raise BadTensors(f"{where} ({name!r}): start_idx, end_idx and numel must be integers")
        start, end, size = ints
        want = torch.Size(shape).numel() * dtype.itemsize
        if not 0 <= start <= end <= flat.numel() or end - start != want or size != want:
            raise BadTensors(
                f"{where} ({name!r}): bytes [{start}, {end}) of {flat.numel()} do not hold a "
                f"{dtype} tensor of shape {tuple(shape)} ({want} bytes, numel {size})"
            )
        if start % dtype.itemsize:
            raise BadTensors(f"{where} ({name!r}): byte offset {start} is not aligned to {dtype}")
        out.append((name, view_of(flat, m)))
    return out


class TensorUpdate:
    """The route's handler, bound to one engine's weight routes (their session, version and
    flush rules: `WeightRoutes._outside_session`, `WeightRoutes._update`)."""

    def __init__(self, engine: EmbeddedEngine, weights: WeightRoutes):
        self.engine = engine
        self.weights = weights
        self.updates = 0
        self.refused = 0
        """Calls answered 400 (each logged with its reason)."""

    async def handle(self, request: web.Request) -> web.Response:
        eng = self.engine
        body = await read_body(request)
        try:
            raw, load_format, flush, abort_all, _version = self._parse(body)
        except BadTensors as e:
            return self._refuse(e, error=True)
        if abort_all:
            # tokenizer_control_mixin.py: update_weights_from_tensor aborts every request first,
            # before the scheduler looks at the session (as the distributed update).
            await self.weights._abort_all()
        refusal = self.weights._outside_session(CALL)
        if refusal is not None:
            self.refused += 1
            log.warning("%s refused: %s", ROUTE, refusal.text)
            return refusal

        def update() -> None:
            t0 = time.perf_counter()
            tensors = open_tensors(raw, "serialized_named_tensors[0]", load_format)
            t1 = time.perf_counter()
            try:
                self._check(tensors)
                eng.runner.load_weights(tensors)
                t2 = time.perf_counter()
                if eng.device.type == "cuda":  # the copy is done before the sender hears of it
                    torch.cuda.current_stream(eng.device).synchronize()
                t3 = time.perf_counter()
                log.info(
                    "%s: %d tensors, %.1f MB: opened in %.1f ms, copies queued in %.1f ms, "
                    "done %.1f ms later",
                    ROUTE,
                    len(tensors),
                    sum(t.numel() * t.element_size() for _, t in tensors) / 1e6,
                    (t1 - t0) * 1e3,
                    (t2 - t1) * 1e3,
                    (t3 - t2) * 1e3,
                )
            finally:
                del tensors  # the handles close here, not when the scheduler next collects

        resp = await self.weights._update(
            update, body, flush, CALL, "updated the weights from shared tensors."
        )
        if resp.status == 200:
            self.updates += 1
        else:
            self.refused += 1
            log.warning("%s refused: %s", ROUTE, resp.text)
        return resp

    def _parse(self, body: dict[str, Any]):
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise BadTensors(
                "serialized_named_tensors must be a non-empty list (one entry per TP rank)"
            )
        raws = [decode(e, f"serialized_named_tensors[{i}]") for i, e in enumerate(entries)]
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise BadTensors(
                f"load_format {load_format!r} is not served by the embedded engine "
                f"(null, 'direct' or {FLAT_FORMAT!r}: HF names)"
            )
        selector = body.get("selector", "all")
        if selector not in ("all", "target"):
            raise BadTensors(f"selector {selector!r}: this engine has no draft model")
        version = body.get("weight_version")
        return (
            raws[0],
            load_format,
            bool(body.get("flush_cache", True)),  # SGLang's default
            bool(body.get("abort_all_requests", False)),
            None if version is None else str(version),
        )

    def _check(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """dtypes here (each is cast to its parameter's dtype, so any floating type will do);
        names and shapes in `load_weights`, before its first copy."""
        for name, t in tensors:
            if not t.dtype.is_floating_point:
                raise ValueError(f"parameter {name!r}: dtype {t.dtype} is not a floating type")

    def _refuse(self, why: BaseException | str, error: bool = False) -> web.Response:
        """400 as SGLang answers it: a malformed request `{"error": {"message"}}` (its
        validation errors), a refused update `{success: false, message}` (as the server's)."""
        self.refused += 1
        log.warning("%s refused: %s", ROUTE, why)
        if error:
            return web.json_response({"error": {"message": str(why)}}, status=400)
        return web.json_response(
            {"success": False, "message": str(why), "num_paused_requests": 0}, status=400
        )
