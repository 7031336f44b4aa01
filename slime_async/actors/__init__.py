"""The roles that do the work, one package each.

    generator/  prompts -> rollout plugins -> rewards -> the buffer   (`slime-async generator`)
    engine/     SGLang-protocol clients, the weight push, and the embedded engine (`slime-async engine`)
    learner/    batches from the buffer -> Megatron-core step -> weights to the engines (`slime-async learner`)

Importing this package imports none of them.
"""
