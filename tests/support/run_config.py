"""The config of a tiny `slime-async run` on CPU, for tests that start whole runs.

`tiny_run_config(path, model=..., data=..., run_dir=..., learner={"num_steps": 4})` writes a TOML
file: every role on loopback with OS-chosen ports, one strict (SGLang-like) embedded engine on one
thread, a single-turn rollout with a reward that varies between random responses (so every
batch has a gradient), GRPO with decoupled PPO. Each keyword names a section (`run`, `buffer`,
`engine`, `engine.embedded`, `generator`, `generator.sampling`, `learner`, `algo`, `eval`, `run.ray`, ...) whose keys
replace or extend the defaults below; `None` as a value removes the key. Without `run_dir` the
run's directory is left to whoever starts it (`slime-async sweep` names one per point).

The reward is named by import path (`tests.support.run_config:char_sum_reward`): the generator
process imports it from the checkout's root, the working directory the tests start runs in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

VARYING_REWARD = "tests.support.run_config:char_sum_reward"
"""A reward that differs between random responses: groups of equal rewards have no gradient."""


def char_sum_reward(sample, response_text: str, info: dict | None = None) -> float:
    """A reward that differs between random responses (a random model never gets the arithmetic
    right): groups of equal rewards have no gradient, and the learner skips those batches."""
    return (sum(map(ord, response_text)) % 11) / 10.0


def zero_reward(sample, response_text: str, info: dict | None = None) -> float:
    """Every answer scores 0: every group's advantages are 0, no batch has a gradient."""
    return 0.0


def _defaults(model: Path, data: Path, run_dir: Path | None) -> dict[str, dict[str, Any]]:
    where = {"name": run_dir.name, "run_dir": str(run_dir)} if run_dir else {"name": "tiny"}
    return {
        "run": {
            **where,
            "wandb": "disabled",
            "progress": "plain",
            "ready_timeout_s": 240,
        },
        "buffer": {
            "producer_endpoint": "tcp://127.0.0.1:0",
            "consumer_endpoint": "tcp://127.0.0.1:0",
            "max_staleness": 1,
            "wal_dir": "wal",
        },
        "engine": {"port": 0},
        "engine.embedded": {
            "device": "cpu",
            "torch_threads": 1,
            "max_running_requests": 16,
            "strict_sglang": True,  # fail where SGLang fails (flush while running, ...)
        },
        "generator": {
            "dataset": str(data),
            "rollout": "single_turn",
            "reward": VARYING_REWARD,
            "group_size": 4,
            "max_inflight": 16,
        },
        "generator.sampling": {"temperature": 1.0, "max_new_tokens": 12},
        "learner": {
            "model_path": str(model),
            "lr": 1e-4,
            "groups_per_step": 2,
            "num_steps": 4,
            "save_interval": 2,
            "micro_batch_tokens": 2048,
        },
        "push": {"interval": 1},
        "algo": {"advantage": "grpo", "loss": "decoupled_ppo"},
    }


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))  # a TOML basic string is a JSON string for these values
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"config value {v!r}: expected a bool, number, string or list")


def tiny_run_config(
    path: str | Path,
    *,
    model: str | Path,
    data: str | Path,
    run_dir: str | Path | None = None,
    **sections: Mapping[str, Any] | None,
) -> Path:
    """Write the run's TOML to `path` and return it; see the module docstring."""
    config = _defaults(Path(model), Path(data), Path(run_dir) if run_dir else None)
    for name, keys in sections.items():
        section = config.setdefault(name.replace("__", "."), {})
        for key, value in (keys or {}).items():
            if value is None:
                section.pop(key, None)
            else:
                section[key] = value
    lines = []
    for name, keys in config.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_value(value)}" for key, value in keys.items()]
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path


E2E_STEPS = 4
E2E_MAX_STALENESS = 1


def e2e_run_config(root: Path, model: Path, data: Path, mode: str) -> Path:
    """The run of tests/integration/test_e2e.py in `mode` ("async" or "sync"): E2E_STEPS steps at
    buffer.max_staleness = E2E_MAX_STALENESS, its directory `root`/run-<mode>."""
    return tiny_run_config(
        root / f"e2e-{mode}.toml",
        model=model,
        data=data,
        run_dir=root / f"run-{mode}",
        run={"name": "e2e", "mode": mode},
        buffer={"max_staleness": E2E_MAX_STALENESS},
        learner={"num_steps": E2E_STEPS},
    )
