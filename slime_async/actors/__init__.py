"""The roles: generator and rollout plugins, engines and their clients, learner, supervisor."""
