"""Where a run's files are and where its requests go: decided here, once, for every role.

The rule for relative paths: **a relative path is relative to the config file that sets it.**
- Paths a run **reads** (`generator.dataset`, `generator.tokenizer_path`, `engine.model_path`,
  `learner.model_path`, `learner.load`) and `run.runs_dir` resolve from the directory of the TOML
  file that sets them (`resolve_file_paths`, when the config is loaded); set on the command line
  (or left at a default), from the working directory. The run's `config.json` holds them absolute.
- Paths a run **writes** inside itself (`buffer.wal_dir`, `generator.state_path`, `learner.save`)
  name places in the run directory `run.run_dir` (`slime-async run` always sets it), else under
  the working directory. Left unset, the generator's cursor is `<run_dir>/state/<producer_id>.json`
  and the learner's checkpoints `<run_dir>/checkpoints`; the write-ahead log stays off.
- Plug-in modules (`generator.rollout = "my_agent:rollout"`, rewards, `run.prepare`, losses) are
  imported from the working directory, from the directories a config file names in
  `generator.import_dirs` (relative to that file: the shipped configs name the checkout, where
  `examples/` is) and from the directories of the config files themselves (appended here; the
  list is kept in config.json for every role).

Defaults that depend on another key (the cursor on `producer_id`) are computed when asked, not
written into the run's config.json, so a role's own overrides still apply to them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_async.config.base import ConfigError
from slime_async.config.engine import EngineConfig

if TYPE_CHECKING:  # the config package's __init__ imports this module
    from slime_async.config import SlimeConfig


READ_PATHS = (
    ("generator", "dataset"),
    ("generator", "tokenizer_path"),
    ("engine", "model_path"),
    ("learner", "model_path"),
    ("learner", "load"),
    ("run", "runs_dir"),
    ("eval", "data"),
)
"""Keys whose relative values resolve from the directory of the config file that sets them."""


def missing_inputs(cfg: SlimeConfig) -> list[str]:
    """`section.key: path` for every file or directory this machine's roles would read that
    does not exist (an external engine's model is read by the engine, elsewhere)."""
    missing = []
    for section, key in READ_PATHS:
        if (section, key) == ("run", "runs_dir"):
            continue  # written, created on demand
        if (section, key) == ("engine", "model_path") and cfg.engine.kind == "external":
            continue
        value = getattr(getattr(cfg, section), key)
        if value is not None and not Path(value).expanduser().exists():
            missing.append(f"{section}.{key}: {value} does not exist")
    return missing


CHECKPOINTS_DIR = "checkpoints"
"""The learner's checkpoints inside the run directory, unless `learner.save` says otherwise."""


@dataclass(frozen=True)
class RunPaths:
    """The files of one role's run, every path absolute or None."""

    run_dir: Path | None
    """The run directory (`run.run_dir`), None outside a supervised run."""
    wal_dir: Path | None
    """The buffer's write-ahead log (None: off)."""
    generator_state: Path | None
    """This generator's dataset cursor (None: not kept, only without a run directory)."""
    checkpoints: Path | None
    """The learner's checkpoint directory (None: no checkpoints)."""


def written_path(run_dir: str | Path | None, path: str | Path) -> Path:
    """A path the run writes: absolute as given, else under `run_dir` (or the working dir)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return (Path(run_dir) / p if run_dir else p).absolute()


def run_paths(cfg: SlimeConfig) -> RunPaths:
    """Every written path of `cfg`, by the rule in the module docstring."""
    run_dir = Path(cfg.run.run_dir).absolute() if cfg.run.run_dir else None

    def under(path: str | None, default: str | None) -> Path | None:
        if path is not None:
            return written_path(run_dir, path)
        return run_dir / default if run_dir is not None and default is not None else None

    return RunPaths(
        run_dir=run_dir,
        wal_dir=under(cfg.buffer.wal_dir, None),
        generator_state=under(cfg.generator.state_path, f"state/{cfg.generator.producer_id}.json"),
        checkpoints=under(cfg.learner.save, CHECKPOINTS_DIR),
    )


def generate_urls(engine: EngineConfig) -> list[str]:
    """Where generators send /generate: `router_url`, else `urls`, else the embedded engine (or
    the router `slime-async run` starts in front of several) at `host:port`. Weights never go
    this way: the learner pushes them to each of `urls`."""
    if engine.router_url:
        return [engine.router_url]
    if engine.urls:
        return list(engine.urls)
    port = engine.router_port if engine.num_engines > 1 else engine.port
    if engine.kind == "external" or port == 0:
        raise ConfigError("engine.urls: the generator needs the engines' URLs (none configured)")
    return [f"http://{engine.host}:{port}"]


def resolve_file_paths(tree: dict[str, Any], origins: dict[tuple, str], files: list[Path]) -> None:
    """Make the `READ_PATHS` set by a TOML file absolute from that file's directory; record the
    TOML files' directories in `generator.import_dirs`. Changes `tree` (the raw, merged config).

    `origins` maps a key path to the file (or "command line") that set it last. Values from a
    `.json` file (a run's resolved config.json) are kept: they were resolved when it was written.
    """
    toml_files = [str(Path(f)) for f in files if Path(f).suffix != ".json"]  # in given order
    for key in READ_PATHS:
        section = tree.get(key[0])
        value = section.get(key[1]) if isinstance(section, dict) else None
        if not isinstance(value, str) or origins.get(key) not in toml_files:
            continue
        origin = origins[key]
        p = Path(value).expanduser()
        if not p.is_absolute():
            section[key[1]] = str((Path(origin).parent / p).resolve())
    gen = tree.get("generator")
    given = gen.get("import_dirs") if isinstance(gen, dict) else None
    origin = origins.get(("generator", "import_dirs"))
    if isinstance(given, list) and origin in toml_files:
        base = Path(origin).parent
        gen["import_dirs"] = [
            str((base / Path(d).expanduser()).resolve()) if isinstance(d, str) else d for d in given
        ]
    dirs = [str(Path(f).parent.resolve()) for f in toml_files]
    if dirs:
        gen = tree.setdefault("generator", {})
        if isinstance(gen, dict):
            known = list(gen.get("import_dirs") or [])
            gen["import_dirs"] = known + [d for d in dict.fromkeys(dirs) if d not in known]


def add_import_dirs(dirs: list[str]) -> None:
    """Put the config files' directories on the import path (after what is there already)."""
    for d in dirs:
        if d not in sys.path:
            sys.path.append(d)
