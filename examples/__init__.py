"""Example tasks, rollout plugins and rewards (importable as `examples.<name>.<module>`)."""
