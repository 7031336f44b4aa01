"""Engines that speak SGLang's native HTTP API, and the code that talks to them.

- client.py: `EngineClient` (asyncio, one engine or router), `GenerateOutput`, `EngineError`.
- pool.py: `EnginePool` (least in-flight, fail-over, health probing) for the generators.
- router.py: `Router`, the real sglang-router as a child process.
- weight_push.py: `WeightPusher`, the learner side of the weight update (rank 0).
- weight_sync.py: the weight-update process group recipe shared with the engines.
- server.py, scheduler.py, model_runner.py, sampling.py: the embedded engine
  (`slime-async engine`).

Importing this package imports none of its modules (the client needs no torch).
"""
