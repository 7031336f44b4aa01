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


# ------------------------------------------------- exact zeros, group sizes, across DP ranks

GROUP_BASELINES = ["grpo", "dr_grpo", "rloo"]


@pytest.mark.parametrize("name", [*GROUP_BASELINES, "reinforce_pp"])
@pytest.mark.parametrize("value", [-0.3, 0.1, 1.0 / 3.0, 7.7])
def test_equal_rewards_give_exact_zero_advantages(name, value):
    # Eight equal rewards that are not exact in binary: the float32 mean is off by an ulp, and
    # (r - mean) / (0 + eps) used to be about +-0.03 (a gradient from a group with no signal).
    rewards = torch.full((3, 8), value, dtype=torch.float32)
    rewards[1] = torch.tensor([1.0, 0.0] * 4)  # a group with signal stays non-zero
    a = estimate(name, rewards=rewards)
    assert a.dtype == torch.float32
    if name == "reinforce_pp":  # batch-wide: only an all-equal batch is zero
        assert (estimate(name, rewards=torch.full((3, 8), value)) == 0).all()
        return
    assert (a[0] == 0).all() and (a[2] == 0).all(), a
    assert (a[1] != 0).all()


def test_old_float32_grpo_gave_equal_rewards_a_gradient():
    # The yardstick of the test above: the old formula on the same group is far from 0.
    r = torch.full((1, 8), -0.3, dtype=torch.float32)
    old = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
    assert old.abs().max() > 1e-3


@pytest.mark.parametrize("name", GROUP_BASELINES)
def test_group_baselines_refuse_groups_of_one(name):
    with pytest.raises(ValueError, match=r"at least 2 samples.*generator.group_size"):
        estimate(name, rewards=torch.ones(3, 1))


def test_min_group_size_for_the_config_check(tmp_path, monkeypatch):
    from slime_async.algos import min_group_size

    assert {n: min_group_size(n) for n in ADVANTAGES.names()} == {
        "grpo": 2,
        "dr_grpo": 2,
        "rloo": 2,
        "reinforce_pp": 1,
        "reinforce": 1,
    }
    (tmp_path / "my_adv.py").write_text(
        "def pairwise(inp, cfg, state):\n    return inp.rewards\n"
        "pairwise.min_group_size = 4\n"
        "def plain(inp, cfg, state):\n    return inp.rewards\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert min_group_size("my_adv:pairwise") == 4 and min_group_size("my_adv:plain") == 1
    # reinforce_pp and reinforce are fine with groups of one.
    assert estimate("reinforce_pp", rewards=torch.tensor([[1.0], [0.0]])).abs().sum() > 0
    assert estimate("reinforce", rewards=torch.tensor([[1.0], [0.0]])).abs().sum() > 0


# Each rank's part of one batch; the parts are locally constant but differ across ranks in the
# second case, which a per-rank equality check would wrongly zero.
RANK_PARTS = {
    "mixed": [[[1.0, 0.0, 0.5, 0.25]], [[2.0, 3.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]],
    "locally_constant": [[[1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]],
    "all_equal": [[[-0.3, -0.3]], [[-0.3, -0.3], [-0.3, -0.3]]],
}


def _rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:

        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t

        results = {}
        for case, parts in RANK_PARTS.items():
            rewards = torch.tensor(parts[rank])
            inp = AdvantageInput(rewards, torch.full(rewards.shape, 5), None, all_reduce_sum)
            cfg = AlgoConfig(advantage_eps=1e-12, baseline_decay=0.5)
            state: dict = {}
            results[case] = {
                "reinforce_pp": ADVANTAGES.resolve("reinforce_pp")(inp, cfg, state),
                "reinforce_1": ADVANTAGES.resolve("reinforce")(inp, cfg, state),
                "reinforce_2": ADVANTAGES.resolve("reinforce")(inp, cfg, state),
                "baseline": state["baseline"],
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_batch_wide_estimators_span_data_parallel_ranks(tmp_path):
    """Two gloo ranks, each with its part: reinforce_pp normalises over the union and every
    rank ends with the same reinforce baseline, the one a single rank with the whole batch gets."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    world = 2
    procs = [
        ctx.Process(target=_rank_worker, args=(r, world, str(tmp_path / "init"), str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"rank process {p.pid} exit code {p.exitcode} (timeout 120 s)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for case, parts in RANK_PARTS.items():
        flat = torch.tensor([x for part in parts for row in part for x in row])
        whole = flat.reshape(1, -1)
        cfg = dict(advantage_eps=1e-12, baseline_decay=0.5)
        expect_pp = estimate("reinforce_pp", rewards=whole, **cfg).reshape(-1)
        state: dict = {}
        expect_r1 = estimate("reinforce", rewards=whole, state=state, **cfg).reshape(-1)
        estimate("reinforce", rewards=whole, state=state, **cfg)
        pp = torch.cat([got[r][case]["reinforce_pp"].reshape(-1) for r in range(world)])
        r1 = torch.cat([got[r][case]["reinforce_1"].reshape(-1) for r in range(world)])
        torch.testing.assert_close(pp, expect_pp)
        torch.testing.assert_close(r1, expect_r1)
        assert got[0][case]["baseline"] == got[1][case]["baseline"] == state["baseline"], case
        if case == "all_equal":
            assert (pp == 0).all()
        else:
            assert (pp != 0).any()
    # The global mean, not a per-rank one: rank 0's first advantage is 1 - mean of all 12.
    mixed = [x for part in RANK_PARTS["mixed"] for row in part for x in row]
    mixed_mean = sum(mixed) / len(mixed)
    assert len(mixed) == 12 and mixed_mean != pytest.approx(1.75 / 4)  # != rank 0's own mean
    assert got[0]["mixed"]["reinforce_1"][0, 0].item() == pytest.approx(1.0 - mixed_mean)
