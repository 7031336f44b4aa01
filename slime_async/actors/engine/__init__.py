"""Engines that speak SGLang's native HTTP API, and the code that talks to them.

    client.py       `EngineClient` (asyncio, one engine or one router), `GenerateOutput`, errors
    pool.py         `EnginePool`: least in flight, fail-over, health probing (the generators)
    health.py       the liveness probe (/ready, else /health) and `EngineWatch`, for every role
    push_watch.py   the push's hung and stuck engines, restart requests, the stall watchdog
    weight_push.py  `WeightPusher`: the learner's side of a weight update (learner rank 0)
    weight_sync.py  the weight-update process-group recipe both sides share
    embedded/       the embedded engine (`slime-async engine`): HTTP server, scheduler, model
                    runner, sampling

Importing this package imports none of its modules (the client needs no torch).
"""
