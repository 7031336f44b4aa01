"""Let megatron-core run on a CPU-only torch. Applied only when CUDA is absent.

megatron-core assumes CUDA in a few places even with every fusion off. The fixes, measured on
megatron-core 0.16.1 (Python 3.11) and needed the same way on 0.19.x (Python 3.12):

1. `torch.cuda.current_device()` is used as a device for the attention buffers and RoPE's
   inv_freq: it must return the CPU device.
2. `attention_mask=None` makes GPTModel build a causal mask on "cuda": callers pass an explicit
   `[1, 1, s, s]` bool mask (True = masked); `causal_mask()` builds it.
3. The RNG tracker: `model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`, dropout 0.
   `seed_model_parallel()` does this on any device.
4. `torch.cuda.synchronize()` must be a no-op for `dist_checkpointing.save`.
5. `psutil` must be installed or `dist_checkpointing.save` hangs (a declared dependency of ours).
   The writer's results queue would be a spawned Manager (and the calling script would need a
   `__main__` guard): `write_results_in_process()` gives it a thread queue instead (any device).
6. megatron-core >= 0.17 imports triton unconditionally from a MoE module: a stub module stands
   in where triton is absent (no triton kernel runs on the CPU path).
7. The MoE all-to-all token dispatcher (expert parallelism) creates a `torch.cuda.Stream` and
   moves its split sizes to the host on it (`torch.cuda.stream(...)`, `current_stream()`,
   `record_event().synchronize()`): on the CPU these are no-op stand-ins (every op is
   synchronous there). Its split sizes become host numpy arrays only when they were on a
   CUDA device: on the CPU they would stay tensors, which `all_to_all_single` refuses, so
   `patch_moe()` converts CPU tensors too, and installs these stand-ins (only for MoE models;
   `torch.cuda.Stream` itself is left alone: later imports annotate with it). gloo's
   all_to_all does the rest.
8. megatron-core 0.16.1's MoE router names `te_general_gemm` without defining it when
   Transformer Engine is absent (a NameError on the first forward, CPU or GPU; 0.19 defines it
   as None): `patch_moe()` defines it, on any device.
9. Importing megatron-core's GPT stack took 5.4-6.5 s of CPU a process on a 2-core CPU machine,
   most of it in two things the CPU path never uses: its `jit_fuser` is `torch.compile`, applied at import to its
   fused activations (off on the CPU), which loads torch's compiler; and its inference context
   imports wandb when installed (we log from the supervisor, never through megatron). `apply()`
   imports the GPT stack with `torch.compile` standing as the identity and wandb hidden, then
   puts both back (1.8-2.0 s of CPU there): the fusions stay plain functions (the same math,
   run eagerly) and wandb imports normally afterwards.

Megatron's DDP and DistributedOptimizer allocate on "cuda" and check `torch.cuda.FloatTensor`
type strings, so on CPU the learner uses torch's AdamW with a data-parallel gradient all-reduce.

Call `apply()` before importing megatron.core; it is idempotent and a no-op when CUDA exists.
That holds for any `megatron.core` import, not only the GPT model's: the package's `__init__`
already loads `megatron.core.transformer.moe` (measured on 0.16.1), the modules of (6). So the
modules that use megatron-core import it inside their functions, which run after `apply()`,
never at their top.
"""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import sys
import types
from importlib.metadata import version

import torch

_applied = False


def cpu_mode() -> bool:
    """True when megatron-core must run on the CPU (no usable CUDA device)."""
    return not torch.cuda.is_available()


class _Anything:
    """Stands for any triton attribute: callable, decorator, subscriptable, attribute-rich."""

    def __init__(self, name: str = "triton"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator: @triton.jit
        return self

    def __getattr__(self, item: str) -> _Anything:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __getitem__(self, item) -> _Anything:
        return self

    def __repr__(self) -> str:
        return f"<triton stub {self._name}>"


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _CpuStream:
    """Stands for a CUDA stream on the CPU, where every op is synchronous (7)."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = _CpuStream()


_STUB_SUBMODULES = ("language", "runtime", "testing", "language.extra", "runtime.jit")


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


def _megatron_needs_triton_stub() -> bool:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    major, minor = (int(x) for x in version("megatron-core").split(".")[:2])
    return (major, minor) >= (0, 17)


def _import_megatron_with_triton_stub() -> None:
    """Import megatron's GPT stack with a triton stub in place, then take the stub away again.

    Only the modules imported meanwhile hold the stub; torch's own triton probe (inductor)
    must keep seeing no triton afterwards, or it tries to use it.
    """
    names = ["triton"] + [f"triton.{s}" for s in _STUB_SUBMODULES]
    root = _StubModule("triton")
    root.__path__ = []  # a package, so `import triton.language` resolves below
    root.__version__ = "0.0.0-slime-async-stub"
    sys.modules["triton"] = root
    for sub in _STUB_SUBMODULES:
        mod = _StubModule(f"triton.{sub}")
        mod.__path__ = []
        sys.modules[f"triton.{sub}"] = mod
        parent, _, leaf = f"triton.{sub}".rpartition(".")
        setattr(sys.modules[parent], leaf, mod)
    try:
        import megatron.core.models.gpt  # noqa: F401
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _not_compiled(model=None, **kwargs):
    """`torch.compile`'s signature, compiling nothing: `f(fn)` and `f(**kw)(fn)` return `fn`."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def _lean_megatron_import():
    """(9) `torch.compile` as the identity and wandb hidden, for the length of an import."""
    compile_ = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = _not_compiled
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError: megatron's try/except
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


def apply() -> bool:
    """Patch torch so megatron-core runs on the CPU; returns True if patches are active."""
    global _applied
    if not cpu_mode():
        return False
    if _applied:
        return True
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # (1)
    torch.cuda.synchronize = lambda device=None: None  # (4)
    with _lean_megatron_import():  # (9)
        if _megatron_needs_triton_stub():
            _import_megatron_with_triton_stub()  # (6)
        else:
            import megatron.core.models.gpt  # noqa: F401
    _applied = True
    return True


def patch_moe() -> None:
    """What megatron's MoE layers need without Transformer Engine, on CPU and GPU alike (8)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for name in ("te_general_gemm", "fused_topk_with_score_function"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    if not cpu_mode() or getattr(token_dispatcher, "_slime_async_cpu", False):
        return
    # (7) The dispatcher's side stream, set before any dispatcher makes one: torch.cuda.Stream
    # itself stays (replacing the class breaks annotations such as `torch.cuda.Stream | None`
    # in modules imported later, transformers' among them).
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if dispatcher.cuda_dtoh_stream is None:
        dispatcher.cuda_dtoh_stream = _CpuStream()
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # (7)
    token_dispatcher._slime_async_cpu = True


def write_results_in_process() -> None:
    """(5) Hand the torch_dist writer a thread queue for its write results, before a save.

    megatron-core's writer returns each save's results through a module-level queue that it
    creates on first use as a `multiprocessing` Manager queue started with "spawn": a fresh
    interpreter that imports torch (about 4 s of CPU once per learner process, measured on a
    2-core CPU machine). Our saves are synchronous (`dist_checkpointing.save` runs the writer in
    this process, which also reads the results back), so the put and the get are in one process
    and a thread queue is all it needs. Read on megatron-core 0.16.1 and 0.19.2
    (`filesystem_async._results_queue`); another layout is left alone."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def device() -> torch.device:
    """The device megatron modules live on in this process."""
    if cpu_mode():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[1, 1, s, s]` bool mask, True above the diagonal (masked), as GPTModel expects (2)."""
    return torch.triu(
        torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1
    ).view(1, 1, seq_len, seq_len)


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's RNG tracker; works on CPU and GPU (3)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    kwargs = {"inference_rng_tracker": True} if cpu_mode() else {}
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **kwargs)


LIBRARY_WARNINGS = (
    # megatron-core at import, where Transformer Engine / Apex are absent: the local
    # implementations are what this project uses on purpose.
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    # torch.distributed.checkpoint, called by megatron-core's dist_checkpointing.load.
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""Warnings megatron-core and torch print from inside their own code, which a user of this
project cannot act on (nothing in the config changes them)."""


def quiet_library_warnings() -> None:
    """Hide `LIBRARY_WARNINGS` in this process (commands that print to a terminal call it)."""
    import warnings

    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
