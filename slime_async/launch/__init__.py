"""Launching a run: `slime-async run` starts every role on this machine and watches them.

table.py       the launch table: which roles a config needs, their command lines, probes
supervisor.py  child processes by process group: start, readiness, restart, stop
run_dir.py     the run directory's layout
router.py      the one sglang-router command line and its readiness check
progress.py    the terminal progress line (step, ETA, key numbers from metrics/learner.jsonl)
"""
