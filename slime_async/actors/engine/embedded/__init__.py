"""The embedded engine: SGLang's native HTTP API served by our own continuous-batching engine.

    server.py        the aiohttp app: SGLang's endpoints, their field names and failure behaviour
    scheduler.py     continuous batching: admission, decode steps, aborts, pause/continue
    model_runner.py  the HF model's forward passes (packed prefill, decode) over the paged KV cache
    layers.py        the fused decoder layer (packed matmuls, compiled on GPU) of the dense families
    kv_cache.py      KV blocks, reference counts and the prefix index of shared prompts
    attention.py     attention over the blocks: the Triton paged decode kernel, gathered SDPA
    cuda_graphs.py   the decode step captured per batch-size bucket
    sampling.py      temperature / top-k / top-p sampling and the log-probs returned with tokens

A family's own layer math over the HF modules is in its folder of `slime_async.models`.
Started by `slime-async engine` (`slime_async/commands/engine.py`), which serves `server.py`.
"""
