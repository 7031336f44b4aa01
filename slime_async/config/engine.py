"""`[engine]`: engines that speak SGLang's native HTTP API (embedded or external)."""

from typing import Literal

from pydantic import Field

from slime_async.config.base import Section


class EngineConfig(Section):
    kind: Literal["embedded", "external"] = "embedded"
    """`embedded`: `slime-async run` starts our own engines; `external`: use `urls` (e.g. SGLang)."""
    urls: list[str] = []
    """Base URLs of the engines themselves (weights are pushed to each), e.g. http://10.0.0.5:30000."""
    router_url: str | None = None
    """An sglang-router in front of `urls`: generators send /generate there, weights still go to `urls`."""
    num_engines: int = Field(1, ge=1)
    """How many embedded engines `slime-async run` starts; >1 puts sglang-router in front."""
    model_path: str | None = None
    """HF model directory the engine serves at start (None: the learner's initial model)."""
    host: str = "127.0.0.1"
    """Address the embedded engine binds."""
    port: int = Field(30000, ge=0, le=65535)
    """Port of the (first) embedded engine; 0 picks a free one."""
    device: str = "auto"
    """torch device of the embedded engine: auto, cpu, cuda, cuda:1, ..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and KV-cache dtype of the embedded engine."""
    max_running_requests: int = Field(64, ge=1)
    """Most requests decoded together (continuous batching); others wait in the queue."""
    max_context_len: int = Field(2048, ge=2)
    """Longest prompt + output of one request (capped by the model's max positions); sizes the KV cache."""
    cuda_graphs: bool = True
    """Replay the embedded engine's decode step from CUDA graphs (GPU only): far fewer launches."""
    seed: int = 0
    """Seed of the embedded engine's sampler (unset in a full config: run.seed)."""
    torch_threads: int = Field(0, ge=0)
    """CPU threads of the embedded engine's torch (0: torch's default)."""
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    """How long a weight-update group waits for its peers (handshake and each broadcast)."""
    api_key: str | None = None
    """If set, every endpoint needs `Authorization: Bearer <key>`."""
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    """sglang-router load-balancing policy when several engines are used."""
    router_port: int = Field(30100, ge=0, le=65535)
    """Port of the sglang-router that `slime-async run` starts (0 picks a free one)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Client-side timeout of one /generate call."""
    max_retries: int = Field(5, ge=0)
    """Client-side retries of a failed call, with exponential back-off."""
