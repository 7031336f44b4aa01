"""Advantage estimators and policy losses: pure functions on per-token tensors.

The learner looks a loss and an estimator up by name (or import path) in `api.LOSSES` and
`api.ADVANTAGES` and knows nothing else about the algorithm; `build_algorithm(cfg)` does the
look-up and the start-up checks. Importing this package registers every built-in function.

    estimators  advantages.py  grpo, dr_grpo, rloo, reinforce_pp, reinforce; min_group_size
    shaping     filters.py     overlong penalty, zero-variance group filter (DAPO)
    losses      ppo.py         ppo_clip, decoupled_ppo, tis, mis
                reinforce.py   aipo
                gspo.py        gspo, decoupled_gspo
                offpolicy.py   m2po, dppo, seq_mask, cispo, vcpo, mu_band (for large lags)
    pieces      importance.py  pi_prox, bounded importance weights (token/sequence/geometric)
                kl.py          KL penalty (k1/k2/k3 values, all with grad KL(pi||ref)), entropy
                aggregation.py token mean / sequence mean / Dr.GRPO constant
                metrics.py     raw metrics by version lag; merge / finalize / reduce

What the learner must know (the rest is in the functions' docstrings):
- Advantages are exact 0 for a group whose rewards all agree (float64, compared, not rounded);
  grpo, dr_grpo and rloo refuse groups of one (`min_group_size(name)` for the config check).
- reinforce_pp and reinforce are batch-wide: give `AdvantageInput.all_reduce_sum` (a SUM
  all-reduce over the data-parallel group) and call the estimator on every rank each step.
- The PPO-family clip is a trust region around pi_prox, the policy at the start of the batch
  (`LossInput.prox_logp`); it is active only when the batch gets several optimizer steps.
- A loss with `ess_scaled_lr` (vcpo) asks for each update's learning rate to be scaled by the
  square root of the update's sequence-weight ESS (`Algorithm.ess_scaled_lr`, `lr_scale_from`).
- The KL penalty has the gradient of KL(pi_theta || ref) whatever `kl_estimator` (which picks
  the value), and is importance-weighted on stale tokens like the policy term.
"""

from slime_async.algos import advantages, gspo, offpolicy, ppo, reinforce  # noqa: F401
from slime_async.algos.advantages import min_group_size
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
    "min_group_size",
    "reduce_metrics",
]
