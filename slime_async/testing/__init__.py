"""Builders that the benchmarks and the tests share; runtime code never imports this.

trajectories.py  synthetic trajectories and groups for the buffer

The toy models and the character tokenizer are runtime code (`slime_async.models.toy`): the
quickstart and the examples use them too. Helpers only the tests use live in `tests/support/`.
"""
