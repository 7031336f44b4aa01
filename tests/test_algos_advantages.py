"""Advantage estimators, reward shaping and the group filter, against hand-computed values."""

import math

import pytest
import torch

from slime_async.algos import ADVANTAGES, AdvantageInput, build_algorithm
from slime_async.algos.filters import keep_groups, overlong_penalty
from slime_async.config import AlgoConfig

# Group 0 has signal, group 1 has none (all equal).
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
LENGTHS = torch.full((2, 4), 5)


def estimate(name, rewards=REWARDS, state=None, **cfg):
    fn = ADVANTAGES.resolve(name)
    inp = AdvantageInput(rewards=rewards, response_lengths=torch.full(rewards.shape, 5))
    return fn(inp, AlgoConfig(**cfg), {} if state is None else state)


def test_grpo_normalises_by_group_std():
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 1/sqrt(3); A = +-0.5 * sqrt(3) = +-0.8660.
    a = estimate("grpo", advantage_eps=1e-12)
    expect = [[0.8660254, -0.8660254, -0.8660254, 0.8660254], [0.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(a, torch.tensor(expect), atol=1e-6, rtol=0)


def test_grpo_without_std_is_dr_grpo():
    expect = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(estimate("grpo", advantage_std_norm=False), expect)
    torch.testing.assert_close(estimate("dr_grpo"), expect)


def test_rloo_uses_leave_one_out_mean():
    # 1 - (0 + 0 + 1) / 3 = 2/3 ; 0 - (1 + 0 + 1) / 3 = -2/3.
    a = estimate("rloo")
    expect = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(a, expect)
    with pytest.raises(ValueError, match="at least 2"):
        estimate("rloo", rewards=torch.ones(3, 1))


def test_reinforce_pp_normalises_over_the_batch():
    # All 8 rewards: mean 1.25, sample variance 5.5 / 7.
    a = estimate("reinforce_pp", advantage_eps=1e-12)
    std = math.sqrt(5.5 / 7)
    torch.testing.assert_close(a, (REWARDS - 1.25) / std)
    assert abs(a[0, 0].item() - (-0.28204)) < 1e-4


def test_reinforce_running_baseline_persists_in_state():
    state = {}
    a1 = estimate("reinforce", state=state, baseline_decay=0.9)
    torch.testing.assert_close(a1, REWARDS - 1.25)  # first baseline: the batch mean
    assert state["baseline"] == pytest.approx(1.25)
    a2 = estimate("reinforce", rewards=torch.zeros(1, 2), state=state, baseline_decay=0.9)
    torch.testing.assert_close(a2, torch.full((1, 2), -1.25))
    assert state["baseline"] == pytest.approx(0.9 * 1.25)
    assert isinstance(state["baseline"], float)  # checkpointable as plain data


def test_overlong_penalty_ramps_over_the_buffer():
    cfg = AlgoConfig(overlong_max_len=10, overlong_buffer_len=4, overlong_penalty_factor=0.5)
    lengths = torch.tensor([[5, 6, 8, 10, 11]])
    # start = 6: (6 - 8) / 4 = -0.5, (6 - 10) / 4 = -1, beyond 10: -1; times 0.5.
    expect = torch.tensor([[0.0, 0.0, -0.25, -0.5, -0.5]])
    torch.testing.assert_close(overlong_penalty(lengths, cfg), expect)
    assert overlong_penalty(lengths, AlgoConfig()).abs().sum() == 0


def test_zero_variance_filter_keeps_groups_with_signal():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    lengths = torch.tensor([[3, 3], [3, 3], [3, 9]])
    on = AlgoConfig(filter_zero_variance=True)
    assert keep_groups(rewards, lengths, on).tolist() == [1]
    assert keep_groups(rewards, lengths, AlgoConfig()).tolist() == [0, 1, 2]
    # The overlong penalty separates the samples of group 2: it now carries a signal.
    shaped = AlgoConfig(filter_zero_variance=True, overlong_max_len=8, overlong_buffer_len=2)
    assert keep_groups(rewards, lengths, shaped).tolist() == [1, 2]


def test_algorithm_shapes_rewards_before_the_estimator():
    algo = build_algorithm(AlgoConfig(advantage="dr_grpo", overlong_max_len=4))
    rewards = torch.tensor([[1.0, 1.0]])
    lengths = torch.tensor([[3, 9]])  # the second is overlong: reward 1 - 1 = 0
    adv = algo.advantages(AdvantageInput(rewards, lengths))
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5]]))


def test_algorithm_state_round_trips():
    algo = build_algorithm(AlgoConfig(advantage="reinforce"))
    algo.advantages(AdvantageInput(REWARDS, LENGTHS))
    saved = algo.state_dict()
    fresh = build_algorithm(AlgoConfig(advantage="reinforce"))
    fresh.load_state_dict(saved)
    torch.testing.assert_close(
        fresh.advantages(AdvantageInput(REWARDS, LENGTHS)),
        algo.advantages(AdvantageInput(REWARDS, LENGTHS)),
    )


def test_advantage_input_shapes_are_checked():
    algo = build_algorithm(AlgoConfig())
    with pytest.raises(ValueError, match=r"must both be \[G, n\]"):
        algo.advantages(AdvantageInput(torch.ones(4), torch.ones(4)))
