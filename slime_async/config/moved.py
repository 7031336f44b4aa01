"""Keys that moved to another section or were removed: one table, checked before validation.

An old key in a TOML file, a command-line override, a sweep's `--grid` or `--exclude`, or a run's
`config.json` is refused with the key it became, instead of pydantic's bare "unknown key":

    configs/mine.toml: 'learner.push_interval' is now 'push.interval'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_EMBEDDED = (
    "device",
    "dtype",
    "max_running_requests",
    "max_context_len",
    "cuda_graphs",
    "torch_threads",
    "strict_sglang",
    "initial_weight_version",
    "mem_fraction",
    "block_size",
    "kv_cache_tokens",
    "max_prefill_tokens",
    "prefix_sharing",
    "decode_attention",
    "compile",
    "overlap_schedule",
)

MOVED: dict[str, str] = {
    "learner.push_interval": "push.interval",
    "learner.push_bucket_bytes": "push.bucket_bytes",
    "learner.weight_master_addr": "push.master_addr",
    "engine.push_backend": "push.backend",
    "engine.push_pause_mode": "push.pause_mode",
    "engine.flush_timeout_s": "push.flush_timeout_s",
    "engine.push_timeout_s": "push.timeout_s",
    "engine.resync_wait_s": "push.resync_wait_s",
    "engine.weight_sync_timeout_s": "push.group_timeout_s",
    "learner.eval_interval": "eval.interval",
    **{f"engine.{k}": f"engine.embedded.{k}" for k in _EMBEDDED},
}
"""Old dotted key -> the key that holds the same setting now."""

REMOVED: dict[str, str] = {
    "buffer.curve.client_public_key": (
        "a client needs only its secret key file, buffer.curve.client_secret_key (the public key "
        "is derived from it)"
    ),
}
"""Old dotted key -> why it went and what to set instead."""


def moved_key(key: str) -> str | None:
    """Why the dotted `key` is refused (the key it became, or why it went); None if it is current."""
    if key in MOVED:
        return f"'{key}' is now '{MOVED[key]}'"
    if key in REMOVED:
        return f"'{key}' was removed: {REMOVED[key]}"
    return None


def moved_key_errors(
    tree: dict[str, Any], origin_of: Callable[[tuple[str, ...]], str]
) -> list[str]:
    """One message per old key present in `tree` (a config's nested dict), with where it was set."""
    errors = []
    for old in (*MOVED, *REMOVED):
        path = tuple(old.split("."))
        if _has(tree, path):
            errors.append(f"{origin_of(path)}: {moved_key(old)}")
    return errors


def _has(tree: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
