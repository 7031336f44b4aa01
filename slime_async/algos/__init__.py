"""Advantage estimators and policy losses: pure functions on per-token tensors.

The learner looks a loss and an estimator up by name (or import path) in `api.LOSSES` and
`api.ADVANTAGES` and knows nothing else about the algorithm.
"""
