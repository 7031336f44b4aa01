"""Moved and removed keys beyond load_config (tests/unit/config/test_config.py has the files,
overrides and config.json): the table's old keys are gone from the schema, a sweep's --grid and
--exclude refuse them, and external engines refuse every [engine.embedded] key."""

from typing import Any

import pytest

from slime_async.config import EmbeddedEngineConfig, EngineConfig, Section, SlimeConfig
from slime_async.config.moved import MOVED, REMOVED, moved_key
from slime_async.launch.sweep import parse_exclude, parse_grid

OLD_KEYS = sorted([*MOVED, *REMOVED])


def _field(model: type[Section], key: str) -> Any:
    """The field at the dotted `key` of `model`, None where there is none."""
    *sections, name = key.split(".")
    for part in sections:
        field = model.model_fields.get(part)
        if field is None or not issubclass(field.annotation, Section):
            return None
        model = field.annotation
    return model.model_fields.get(name)


@pytest.mark.parametrize("old", OLD_KEYS)
def test_an_old_key_is_no_field_and_a_sweep_refuses_it(old):
    assert _field(SlimeConfig, old) is None
    why = moved_key(old)
    assert why is not None
    with pytest.raises(ValueError, match="--grid") as e:
        parse_grid([f"{old}=1,2"])
    assert why in str(e.value)
    # An --exclude pair naming an old key would match no point, excluding nothing.
    with pytest.raises(ValueError) as e:
        parse_exclude([f"buffer.fixed_lag=0 {old}=1"])
    assert why in str(e.value)


def test_current_keys_pass_the_sweep():
    assert parse_grid(["push.interval=1,2", "eval.interval=5"]) == [
        ("push.interval", ["1", "2"]),
        ("eval.interval", ["5"]),
    ]
    assert moved_key("engine.embedded.device") is None


NOT_DEFAULT = {
    "device": "cpu",
    "dtype": "bfloat16",
    "max_running_requests": 8,
    "max_context_len": 512,
    "cuda_graphs": False,
    "torch_threads": 1,
    "strict_sglang": True,
    "initial_weight_version": "v0",
    "mem_fraction": 0.5,
    "gpu_reserve_gib": 4.0,
    "block_size": 32,
    "kv_cache_tokens": 4096,
    "max_prefill_tokens": 1024,
    "prefix_sharing": False,
    "prefill_attention": "gathered",
    "decode_attention": "gathered",
    "decode_shared_prefix": "off",
    "compile": False,
    "overlap_schedule": False,
    "gc_warning_s": 0.2,
    "health_delay_s": 0.5,
    "health_timeout_s": 5.0,
}
"""A value other than the default for every `[engine.embedded]` key."""


def test_not_default_covers_every_embedded_key():
    assert set(NOT_DEFAULT) == set(EmbeddedEngineConfig.model_fields)


@pytest.mark.parametrize("key", sorted(NOT_DEFAULT))
def test_external_engines_refuse_every_embedded_key(key):
    external = {"kind": "external", "urls": ["http://127.0.0.1:1"]}
    assert EngineConfig(**external).embedded == EmbeddedEngineConfig()
    with pytest.raises(ValueError, match=rf"engine\.embedded\.{key}: only the embedded engine"):
        EngineConfig(**external, embedded={key: NOT_DEFAULT[key]})
    assert getattr(EngineConfig(embedded={key: NOT_DEFAULT[key]}).embedded, key) == NOT_DEFAULT[key]
