"""Advantage estimators and policy losses: pure functions on per-token tensors.

The learner looks a loss and an estimator up by name (or import path) in `api.LOSSES` and
`api.ADVANTAGES` and knows nothing else about the algorithm; `build_algorithm(cfg)` does the
look-up and the start-up checks. Importing this package registers every built-in function.

    estimators  advantages.py  grpo, dr_grpo, rloo, reinforce_pp, reinforce
    shaping     filters.py     overlong penalty, zero-variance group filter (DAPO)
    losses      ppo.py         ppo_clip, decoupled_ppo, tis, mis
                reinforce.py   aipo
                gspo.py        gspo
    pieces      importance.py  pi_prox, bounded importance weights (token/sequence/geometric)
                kl.py          k1/k2/k3 KL penalty, entropy bonus
                aggregation.py token mean / sequence mean / Dr.GRPO constant
                metrics.py     raw metrics by version lag; merge / finalize / reduce
"""

from slime_async.algos import advantages, gspo, ppo, reinforce  # noqa: F401  (registration)
from slime_async.algos.api import (
    ADVANTAGES,
    LOSSES,
    AdvantageInput,
    LossInput,
    LossOutput,
)
from slime_async.algos.build import Algorithm, build_algorithm, check_loss_input
from slime_async.algos.metrics import finalize_metrics, merge_metrics, reduce_metrics

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "AdvantageInput",
    "Algorithm",
    "LossInput",
    "LossOutput",
    "build_algorithm",
    "check_loss_input",
    "finalize_metrics",
    "merge_metrics",
    "reduce_metrics",
]
