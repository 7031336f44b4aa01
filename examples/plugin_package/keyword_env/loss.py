"""`keyword_pg`: the plain policy gradient, -A * log pi over the step's model tokens (no ratio,
no clip; on-policy runs only, e.g. run.mode = "sync")."""

from __future__ import annotations


def policy_gradient(inp, cfg):
    from slime_async.api import LossOutput

    per_token = -(inp.advantages * inp.logp) * inp.loss_mask  # [B, T]
    return LossOutput(loss=per_token.sum() / inp.token_denominator)
