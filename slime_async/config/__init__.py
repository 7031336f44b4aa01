"""Typed configuration: one pydantic section per role, loaded from TOML files with dotted overrides.

    slime-async run configs/quickstart.toml configs/big.toml learner.lr=1e-5 run.mode=sync

Files (TOML, or a run's resolved config.json) compose left to right, later keys overriding earlier ones; `key=value` arguments come last.
A value is read as TOML (`1e-5`, `true`, `[1, 2]`, `"text"`) and falls back to a plain string.
Unknown keys and wrong types raise `ConfigError` naming the key and the file (or "command line")
that set it. Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from slime_async.config.algo import AlgoConfig
from slime_async.config.base import ConfigError, Section
from slime_async.config.buffer import BufferConfig, CurveConfig, bind_refusal
from slime_async.config.engine import EmbeddedEngineConfig, EngineConfig
from slime_async.config.eval import EvalConfig
from slime_async.config.generator import GeneratorConfig, SamplingConfig
from slime_async.config.learner import LearnerConfig
from slime_async.config.moved import moved_key_errors
from slime_async.config.paths import (
    RunPaths,
    add_import_dirs,
    generate_urls,
    resolve_file_paths,
    run_paths,
    written_path,
)
from slime_async.config.push import PushConfig
from slime_async.config.run import RunConfig

__all__ = [
    "AlgoConfig",
    "BufferConfig",
    "ConfigError",
    "CurveConfig",
    "EmbeddedEngineConfig",
    "EngineConfig",
    "EvalConfig",
    "GeneratorConfig",
    "LearnerConfig",
    "PushConfig",
    "RunConfig",
    "RunPaths",
    "SamplingConfig",
    "Section",
    "SlimeConfig",
    "generate_urls",
    "load_config",
    "run_paths",
    "split_cli_args",
    "written_path",
]

COMMAND_LINE = "command line"


class SlimeConfig(Section):
    run: RunConfig = RunConfig()
    """The whole job on one machine (`slime-async run`)."""
    buffer: BufferConfig = BufferConfig()
    """The trajectory buffer."""
    engine: EngineConfig = EngineConfig()
    """The engines."""
    generator: GeneratorConfig = GeneratorConfig()
    """The generators."""
    learner: LearnerConfig = LearnerConfig()
    """The learner."""
    algo: AlgoConfig = AlgoConfig()
    """Advantages and the policy loss."""
    eval: EvalConfig = EvalConfig()
    """Pinned evaluation on a held-out set, every eval.interval versions."""
    push: PushConfig = PushConfig()
    """The weights from the learner to the engines."""

    @model_validator(mode="after")
    def _derived(self) -> SlimeConfig:
        # The buffer sizes admission by the learner's step until the learner announces it.
        if "groups_per_step" not in self.buffer.model_fields_set:
            self.buffer.groups_per_step = self.learner.groups_per_step
            self.buffer.model_fields_set.discard("groups_per_step")
        # run.seed seeds every role whose own seed is not set (and config.json records each).
        for section in (self.engine, self.generator, self.learner, self.eval):
            if "seed" not in section.model_fields_set:
                section.seed = self.run.seed
                section.model_fields_set.discard("seed")
        # Synchronous RL is the same pipeline with no staleness allowed and a push every step:
        # the buffer then admits one batch per policy version, so generation waits for training.
        if self.run.mode == "sync":
            if self.buffer.max_staleness != 0:
                self.buffer.max_staleness = 0
            if self.push.interval != 1:
                self.push.interval = 1
        _check_across_sections(self)
        return self

    def paths(self) -> RunPaths:
        """The run's written files, absolute, by the one rule of `slime_async/config/paths.py`."""
        return run_paths(self)

    def generate_urls(self) -> list[str]:
        """Where generators send /generate (`slime_async/config/paths.py`)."""
        return generate_urls(self.engine)

    def write_json(self, path: str | Path) -> None:
        """Write the resolved config (every field, defaults included) as JSON."""
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")

    @classmethod
    def read_json(cls, path: str | Path) -> SlimeConfig:
        tree = json.loads(Path(path).read_text())
        moved = moved_key_errors(tree, lambda _key: str(path))
        if moved:
            raise ConfigError("invalid config:\n  " + "\n  ".join(moved))
        return cls.model_validate(tree)


# Smallest group size at which each built-in estimator trains on anything: a group of one has a
# zero (grpo, dr_grpo) or undefined (rloo: leave-one-out of nothing) advantage.
# The built-in estimators' `slime_async.algos.min_group_size`: that module imports torch, which
# config must not (tests/unit/config/test_config.py checks the two agree).
_MIN_GROUP_SIZE = {"grpo": 2, "dr_grpo": 2, "rloo": 2}


def _check_across_sections(cfg: SlimeConfig) -> None:
    """Refuse combinations that hang, or silently train nothing, naming the keys."""
    lag = cfg.push.interval - 1
    if lag > cfg.buffer.max_staleness:
        raise ValueError(
            f"push.interval = {cfg.push.interval} needs buffer.max_staleness >= "
            f"{lag} (got {cfg.buffer.max_staleness}): between pushes the engines' weights lag the "
            f"learner by up to push.interval - 1 = {lag} versions, so the buffer would hold no "
            "batch within the bound and the learner would wait for ever; raise "
            "buffer.max_staleness or lower push.interval"
        )
    need = _MIN_GROUP_SIZE.get(cfg.algo.advantage, 1)
    if cfg.generator.group_size < need:
        raise ValueError(
            f"algo.advantage = {cfg.algo.advantage!r} needs generator.group_size >= {need} "
            f"(got {cfg.generator.group_size}): with one trajectory per prompt its advantages "
            "are zero or undefined, so nothing would be trained; use advantage = 'reinforce' "
            "or 'reinforce_pp' for single samples"
        )
    _check_staleness_research(cfg)
    _check_buffer_bind(cfg)
    _check_initial_weight_version(cfg)
    trajectories = cfg.learner.groups_per_step * cfg.generator.group_size
    if cfg.algo.mini_batches > trajectories:
        raise ValueError(
            f"algo.mini_batches = {cfg.algo.mini_batches} exceeds the trajectories of one step "
            f"(learner.groups_per_step x generator.group_size = {trajectories}): some "
            "mini-batches would always be empty"
        )


def _check_buffer_bind(cfg: SlimeConfig) -> None:
    """The buffer's own bind rule, applied when the config is loaded, so `config`, `run` and
    `slurm` refuse what the buffer would refuse at its start."""
    problem = bind_refusal(cfg.buffer)
    if problem:
        raise ValueError(problem)


def _check_initial_weight_version(cfg: SlimeConfig) -> None:
    """An embedded engine that loads the learner's base model serves version 0's weights: a
    positive label would name them with a version the learner uses for trained weights (an engine
    restarted mid-run would then pass for up to date, and never get the weights again)."""
    label = cfg.engine.embedded.initial_weight_version
    if cfg.engine.kind != "embedded" or not label.isdigit() or int(label) == 0:
        return
    if cfg.engine.model_path not in (None, cfg.learner.model_path):
        return  # an engine of other weights may name them as it likes
    raise ValueError(
        f"engine.embedded.initial_weight_version = {label!r}: the engine starts from the learner's "
        "base model, whose weights are version 0; a positive version would name them like "
        "trained weights. Use 'default' (or '0')"
    )


def _check_staleness_research(cfg: SlimeConfig) -> None:
    """Fixed lag and pinned evaluation: refuse what could not deliver them."""
    k = cfg.buffer.fixed_lag
    if k is not None:
        if cfg.push.interval != 1:
            raise ValueError(
                f"buffer.fixed_lag = {k} needs push.interval = 1 (got "
                f"{cfg.push.interval}): the lag counts pushed versions"
            )
        if cfg.buffer.max_staleness < k:
            why = " (run.mode = 'sync' sets it to 0)" if cfg.run.mode == "sync" else ""
            raise ValueError(
                f"buffer.fixed_lag = {k} needs buffer.max_staleness >= {k} (got "
                f"{cfg.buffer.max_staleness}{why}): every batch is trained {k} versions late"
            )
    if cfg.eval.interval and not cfg.eval.data:
        raise ValueError(
            f"eval.interval = {cfg.eval.interval} needs eval.data (a held-out JSONL file)"
        )
    if cfg.eval.interval and not cfg.eval.greedy and not cfg.eval.samples:
        raise ValueError(
            "eval.interval > 0 with eval.greedy = false and eval.samples = 0 evaluates nothing"
        )


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(dst: dict, src: dict, origin: str, origins: dict, prefix: tuple = ()) -> None:
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, origin, origins, path)
        else:
            dst[key] = value
            origins[path] = origin
            if isinstance(value, dict):
                for sub in _leaf_paths(value, path):
                    origins[sub] = origin


def _leaf_paths(tree: dict, prefix: tuple) -> Iterable[tuple]:
    for key, value in tree.items():
        path = (*prefix, key)
        yield path
        if isinstance(value, dict):
            yield from _leaf_paths(value, path)


def _origin_of(loc: tuple, origins: dict) -> str:
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    return "defaults"


def _known_keys(model: type[Section], loc: tuple) -> list[str]:
    """The field names valid at `loc`'s parent, for 'did you mean' hints."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(cls, type) else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, Section)
        ):
            return []
        cls = field.annotation
    return list(cls.model_fields)


def split_cli_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split positional CLI arguments into TOML files and `key=value` overrides."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    return files, overrides


def load_config(
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    model: type[Section] = SlimeConfig,
) -> Any:
    """Compose TOML `files` (later wins), apply dotted `overrides`, validate into `model`."""
    tree: dict = {}
    origins: dict = {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        if path.suffix == ".json":  # a resolved config.json written by a run
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON: {e}") from None
        else:
            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: not valid TOML: {e}") from None
        _merge(tree, data, str(path), origins)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(
                f"{COMMAND_LINE}: override {item!r} is not of the form section.key=value"
            )
        nested: dict = {}
        cursor = nested
        parts = key.split(".")
        for p in parts[:-1]:
            cursor = cursor.setdefault(p, {})
        cursor[parts[-1]] = _parse_value(raw.strip())
        _merge(tree, nested, COMMAND_LINE, origins)
    if model is SlimeConfig:  # relative paths are relative to the file that sets them
        moved = moved_key_errors(tree, lambda key: _origin_of(key, origins))
        if moved:
            raise ConfigError("invalid config:\n  " + "\n  ".join(moved))
        resolve_file_paths(tree, origins, [Path(f) for f in files])
    try:
        cfg = model.model_validate(tree)
        add_import_dirs(cfg.generator.import_dirs if isinstance(cfg, SlimeConfig) else [])
        return cfg
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(str(p) for p in err["loc"])
            dotted = ".".join(loc)
            where = _origin_of(loc, origins)
            if not loc and err["type"] == "value_error":  # a cross-section check names its keys
                lines.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            if err["type"] == "extra_forbidden":
                hint = difflib.get_close_matches(loc[-1], _known_keys(model, loc), n=1)
                msg = f"unknown key '{dotted}'" + (f" (did you mean '{hint[0]}'?)" if hint else "")
            else:
                msg = f"'{dotted}': {err['msg']} (got {err.get('input')!r})"
            lines.append(f"{where}: {msg}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
