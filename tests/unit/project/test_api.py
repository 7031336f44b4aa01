"""The plug-in API has one stable import path, and the old paths and config values still work."""

from __future__ import annotations

import slime_async.api as api
from slime_async.actors import rewards as old_rewards
from slime_async.actors import rollout as old_rollout
from slime_async.actors.generator import rewards, rollout
from slime_async.config import load_config


def test_api_exports_what_a_plugin_author_uses():
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert api.RolloutContext is rollout.RolloutContext
    assert api.Transcript is rollout.Transcript and api.Sample is rollout.Sample
    assert api.numeric_match is rewards.numeric_match
    assert api.SetupContext.__dataclass_fields__.keys() == {"config", "tokenizer", "run_dir"}
    assert "decoupled_ppo" in api.LOSSES.names() and "grpo" in api.ADVANTAGES.names()


def test_old_import_paths_are_the_same_objects():
    assert old_rollout.RolloutContext is api.RolloutContext
    assert old_rollout.single_turn is api.single_turn
    assert old_rewards.numeric_match is api.numeric_match
    assert old_rewards.REWARDS is api.REWARDS


def test_default_plugins_and_old_config_values_resolve_to_the_same_functions():
    cfg = load_config([], []).generator
    assert api.ROLLOUTS.resolve(cfg.rollout) is api.single_turn
    assert api.REWARDS.resolve(cfg.reward) is api.exact_match
    # A run directory's config.json from before the layout change names the old paths.
    assert api.ROLLOUTS.resolve("slime_async.actors.rollout:single_turn") is api.single_turn
    assert api.REWARDS.resolve("slime_async.actors.rewards:exact_match") is api.exact_match
