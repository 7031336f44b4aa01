"""min_new_tokens on the learner's side: the first tokens of each turn are scored with the stop
ids left out of the softmax, as the engine sampled them, in the forward and the backward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_async.actors.learner.batch import TrainGroup, rows_from_groups
from slime_async.actors.learner.logprobs import chunked_logprobs
from slime_async.actors.learner.stop_ban import StopBan, model_eos_ids, stop_ban
from slime_async.config import AlgoConfig
from slime_async.queue.schema import Trajectory
from tests.support.learner_worker import learner_cfg, make_sharp_model
from tests.support.learner_worker import learner_factory as learner_factory

STOP = (3, 7)


def _reference(hidden, weight, labels, temp, banned):
    z = (hidden @ weight.t()) / temp[:, None]
    z = z.masked_fill(
        banned[:, None] & torch.isin(torch.arange(z.shape[1]), torch.tensor(STOP)), -torch.inf
    )
    lp = z.log_softmax(-1)
    ent = -(lp.exp() * lp.masked_fill(lp == -torch.inf, 0.0)).sum(-1)
    return lp.gather(-1, labels[:, None])[:, 0], ent


@pytest.mark.parametrize("chunk", [2, 64])
def test_banned_rows_get_the_softmax_without_the_stop_ids_and_its_gradient(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v = 9, 6, 12
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.tensor([0, 1, 2, 4, 5, 6, 8, 3, 7])  # the last two are stop ids, not banned
    temp = torch.full((n,), 0.8, dtype=torch.float64)
    banned = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    lp, ent = chunked_logprobs(
        hidden, weight, labels, temp, True, chunk, banned=banned, stop_ids=torch.tensor(STOP)
    )
    ref_lp, ref_ent = _reference(hidden, weight, labels, temp, banned)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    plain, _ = chunked_logprobs(hidden, weight, labels, temp, True, chunk)
    assert float((lp - plain)[banned].min()) > 1e-5  # renormalised: higher than over all ids
    assert torch.equal(lp[~banned], plain[~banned])
    # gradients of a mix of log-probs and entropies, against autograd on the reference
    w_lp, w_ent = (
        torch.linspace(-1, 1, n, dtype=torch.float64),
        torch.linspace(1, 2, n, dtype=torch.float64),
    )
    gh, gw = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), (hidden, weight))
    assert torch.allclose(gh.double(), rh, atol=1e-5) and torch.allclose(gw.double(), rw, atol=1e-5)


def test_the_ban_covers_the_first_tokens_of_every_model_turn():
    ban = StopBan(2, STOP)
    mask = np.array([1, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=np.uint8)
    assert ban.banned(mask).tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0, 1]
    assert not StopBan(0, STOP).active and StopBan(0, STOP).banned(mask).sum() == 0


def _traj(response, loss_mask=None, logprobs=None):
    r = len(response)
    return Trajectory(
        id="t0",
        group_id="g0",
        group_size=1,
        prompt_ids=np.array([2, 10, 11], dtype=np.int32),
        response_ids=np.array(response, dtype=np.int32),
        logprobs=np.asarray(logprobs if logprobs is not None else [-1.0] * r, dtype=np.float32),
        loss_mask=np.asarray(loss_mask if loss_mask is not None else [1] * r, dtype=np.uint8),
        versions=np.zeros(r, dtype=np.int32),
        reward=1.0,
    )


def test_a_stop_id_where_the_engine_banned_it_is_refused_naming_the_trajectory():
    group = TrainGroup((_traj([12, 3, 14]),))
    with pytest.raises(ValueError, match=r"trajectory 't0': response token 1 is stop id 3"):
        rows_from_groups([group], 100, ban=StopBan(2, STOP))
    rows = rows_from_groups([TrainGroup((_traj([12, 13, 3]),))], 100, ban=StopBan(2, STOP))
    assert rows[0].per_token["stop_banned"].tolist() == [1.0, 1.0, 0.0]


def test_stop_ids_are_the_models_eos_and_the_configured_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": [5, 9]}')
    assert model_eos_ids(tmp_path) == (5, 9)
    assert stop_ban(3, [9, 12], str(tmp_path)) == StopBan(3, (5, 9, 12))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3")


def test_the_learner_scores_banned_tokens_as_the_engine_sampled_them(model_dir, learner_factory):
    """mu from the engine's rule (the stop ids banned on the first 3 tokens): with the ban the
    learner's log-probs equal mu, so pi_prox / mu = 1; without it every early token is off."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model_eos_ids(model_dir)
    stops = tuple(sorted(set(eos) | {7}))
    prompt = [2, 10, 11]
    response = [12, 13, 14, 15, 16]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    banned = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)
    z = logits.clone()
    z[banned[:, None] & torch.isin(torch.arange(z.shape[1]), torch.tensor(stops))] = -torch.inf
    mu = z.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    traj = _traj(response, logprobs=mu.numpy())
    traj.prompt_ids = np.array(prompt, dtype=np.int32)
    ban = StopBan(3, stops)
    learner = learner_factory(
        learner_cfg(str(model_dir), micro_batch_tokens=4096), AlgoConfig(), stop_ban=ban
    )
    (row,) = rows_from_groups([TrainGroup((traj,))], learner.arch.vocab_size, 1.0, ban)
    (lp,) = learner.microbatches.rows_logprobs(learner.model, [row])
    assert np.allclose(lp, mu.numpy(), atol=1e-5)
    (unbanned,) = rows_from_groups([TrainGroup((traj,))], learner.arch.vocab_size, 1.0)
    (lp0,) = learner.microbatches.rows_logprobs(learner.model, [unbanned])
    assert float(np.abs(lp0[:3] - mu.numpy()[:3]).min()) > 1e-4 and np.allclose(lp0[3:], lp[3:])
    m = learner.train_step([TrainGroup((traj, _with(traj, 0.0)))])
    assert m["is_weight_max"] == pytest.approx(1.0, abs=1e-4)  # pi_prox / mu = 1 everywhere


def _with(t, reward):
    import dataclasses

    return dataclasses.replace(t, id="t1", reward=reward)
