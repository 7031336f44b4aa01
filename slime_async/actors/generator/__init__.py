"""The generator role: prompts -> groups of rollouts (asyncio plugins) -> rewards -> the buffer.

    process.py   the `slime-async generator` process: engines, tokenizer, buffer client, signals
    loop.py      `Generator`: keeps admitted groups in flight, scores them, pushes them whole
    dataset.py   the JSONL prompts, the shuffled/sharded stream and its durable cursor
    rollout.py   what a rollout plugin gets: `RolloutContext`, `Sample`, `Transcript`, `Generation`
    rewards.py   the shipped reward functions and the reward contract checks
    lifecycle.py the `generator.lifecycle` plug-in: set up once per generator, torn down at its end

Plug-in authors import from `slime_async.api`, not from here.
"""
