"""Builders for tests, benchmarks and the examples' toy models; runtime code never imports this.

models.py        tiny HF models of the supported families and a character tokenizer
trajectories.py  synthetic trajectories and groups for the buffer
router.py        the real sglang-router as a child process, for tests
run_config.py    the TOML of a tiny `slime-async run` on CPU, for tests that start whole runs
"""
