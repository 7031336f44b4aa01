"""build_algorithm: names and import paths resolve; a broken user function fails at start-up."""

import textwrap

import pytest
import torch

from slime_async.algos import (
    ADVANTAGES,
    LOSSES,
    AdvantageInput,
    LossInput,
    build_algorithm,
    check_loss_input,
    reduce_metrics,
)
from slime_async.config import AlgoConfig, load_config
from slime_async.utils.plugins import PluginError

USER_MODULE = textwrap.dedent(
    """
    import torch
    from slime_async.algos import LossOutput

    def my_loss(inp, cfg):
        m = inp.loss_mask
        loss = -(torch.where(m > 0, inp.advantages * inp.logp, 0.0)).sum() / inp.token_denominator
        return LossOutput(loss=loss, metrics={"my_tokens|cnt": float(m.sum())})

    def my_advantage(inp, cfg, state):
        state["calls"] = state.get("calls", 0) + 1
        return inp.rewards - 1.0

    def too_few_params(inp):
        raise AssertionError("never called")

    def advantage_without_state(inp, cfg):
        raise AssertionError("never called")

    async def async_loss(inp, cfg):
        raise AssertionError("never called")

    def crashing_loss(inp, cfg):
        raise KeyError("no such tensor")

    def vector_loss(inp, cfg):
        return LossOutput(loss=inp.logp.sum(-1))

    def scalar_advantage(inp, cfg, state):
        return inp.rewards.sum()

    def nan_advantage(inp, cfg, state):
        return inp.rewards / 0.0 * 0.0
    """
)


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_algos"


def test_every_builtin_resolves_and_documents_its_formula():
    assert set(LOSSES.names()) == {
        "ppo_clip",
        "decoupled_ppo",
        "tis",
        "mis",
        "aipo",
        "gspo",
        "decoupled_gspo",
        "m2po",
        "dppo",
        "seq_mask",
        "cispo",
        "vcpo",
        "mu_band",
    }
    assert set(ADVANTAGES.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce"}
    for registry in (LOSSES, ADVANTAGES):
        for name in registry.names():
            fn = registry.resolve(name)
            assert fn.__doc__ and ("=" in fn.__doc__), name
    for loss in LOSSES.names():
        for adv in ADVANTAGES.names():
            build_algorithm(AlgoConfig(loss=loss, advantage=adv, kl_coef=0.1, entropy_coef=0.1))


def test_user_functions_by_import_path(user_module):
    cfg = load_config(
        [], [f"algo.loss={user_module}:my_loss", f"algo.advantage={user_module}:my_advantage"]
    )
    algo = build_algorithm(cfg.algo)
    assert algo.state == {}  # the dry run worked on a copy
    adv = algo.advantages(AdvantageInput(torch.tensor([[1.0, 3.0]]), torch.tensor([[2, 2]])))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.0]]))
    assert algo.state == {"calls": 1}
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = algo.loss(
        LossInput(
            logp=logp,
            behavior_logp=logp.detach(),
            advantages=torch.tensor([[1.0, 2.0]]),
            loss_mask=torch.ones(1, 2),
            versions=torch.zeros(1, 2, dtype=torch.int32),
            current_version=0,
            token_denominator=2.0,
            seq_denominator=1.0,
        )
    )
    assert out.loss.item() == pytest.approx((1 + 4) / 2)
    assert reduce_metrics([out.metrics, out.metrics]) == {"my_tokens": 4.0}


@pytest.mark.parametrize(
    ("field", "name", "message"),
    [
        ("loss", "too_few_params", "does not accept"),
        ("advantage", "advantage_without_state", "does not accept"),
        ("loss", "async_loss", "plain (not async)"),
        ("loss", "crashing_loss", "failed on a 2x3 test batch"),
        ("loss", "vector_loss", "must be a scalar"),
        ("advantage", "scalar_advantage", "expected a tensor"),
        ("advantage", "nan_advantage", "non-finite"),
        ("loss", "missing_function", "has no attribute"),
    ],
)
def test_broken_user_function_fails_at_startup_naming_it(user_module, field, name, message):
    with pytest.raises(PluginError) as e:
        build_algorithm(AlgoConfig(**{field: f"{user_module}:{name}"}))
    assert f"{user_module}:{name}" in str(e.value) and message in str(e.value)


def test_unknown_name_and_module():
    with pytest.raises(PluginError, match=r"unknown loss 'ppo'.*decoupled_ppo"):
        build_algorithm(AlgoConfig(loss="ppo"))
    with pytest.raises(
        PluginError,
        match=r"algo.advantage = 'no_such_pkg.mod:fn': no module named 'no_such_pkg'; searched ",
    ):
        build_algorithm(AlgoConfig(advantage="no_such_pkg.mod:fn"))


def test_required_inputs_and_shape_checks():
    algo = build_algorithm(AlgoConfig(kl_coef=0.1))
    assert algo.needs_ref_logp and not algo.needs_entropy
    inp = LossInput(
        logp=torch.zeros(2, 3, requires_grad=True),
        behavior_logp=torch.zeros(2, 3),
        advantages=torch.zeros(2, 1),
        loss_mask=torch.ones(2, 3),
        versions=torch.zeros(2, 3, dtype=torch.int32),
        current_version=0,
        token_denominator=6.0,
        seq_denominator=2.0,
    )
    with pytest.raises(ValueError, match=r"LossInput.advantages has shape \(2, 1\)"):
        algo.loss(inp)
    inp.advantages = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logp is None"):
        algo.loss(inp)
    inp.token_denominator = 0.0
    with pytest.raises(ValueError, match="token_denominator"):
        check_loss_input(inp)
