"""The embedded engine: SGLang's native HTTP API served by our own continuous-batching engine.

    server.py        the aiohttp app: SGLang's endpoints, their field names and failure behaviour
    scheduler.py     continuous batching: admission, decode steps, aborts, pause/continue
    model_runner.py  the HF model's forward passes over a preallocated KV cache (CUDA graphs on GPU)
    sampling.py      temperature / top-k / top-p sampling and the log-probs returned with tokens

Started by `slime-async engine` (`slime_async/commands/engine.py`), which serves `server.py`.
"""
