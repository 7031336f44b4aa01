"""The integration tier runs on the CPU: no test here sees a GPU (tests/support/cpu_only.py)."""

from tests.support.cpu_only import hide_gpus

hide_gpus()
