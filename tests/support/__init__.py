"""Helpers the tests share, imported as `tests.support.<module>` (tests/README.md).

repo.py            the checkout's root; PYTHONPATH for children that import `tests.*`
cpu_only.py        the CPU tiers hide the GPUs; fake GPU ids for a simulated Ray cluster
run_config.py      the TOML of a tiny `slime-async run` on CPU, and its default reward
staleness_runs.py  one small real sweep, made once per session
learner_worker.py  the learner's torchrun worker, test-only loss and estimator, batches
engine_util.py     embedded engines as child processes, HF greedy references, runner drivers
router.py          the real sglang-router as a child process
buffer_process.py  the buffer's test config and `slime-async buffer` as a child process
launch_plan.py     the launch table planned on free ports, each role's config
standins.py        stand-in roles and a supervisor driver for the supervisor's tests
scripted.py        what a scripted engine answers
"""
