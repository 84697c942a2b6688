"""The shared optimizer and schedule factory (llmlab.train.optim), used by both trainers and the lab's trials."""

import math

import pytest
import torch

from llmlab.train.optim import OPTIMIZERS, SCHEDULES, build_optimizer, build_schedule, lr_multiplier, mean_lr_share


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_decays_matrices_only_and_steps(name):
    model = tiny_model()
    hidden = {id(p): (0, 1) for p in model.parameters() if p.ndim == 2} if OPTIMIZERS[name].hidden_matrices else None
    optimizer = build_optimizer(name, model.parameters(), lr=1e-2, weight_decay=0.1, matrices=hidden)
    decayed = [g for g in optimizer.param_groups if g["weight_decay"] > 0]
    assert [p.ndim for g in decayed for p in g["params"]] == [2, 2]
    assert all(p.ndim == 1 for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"])
    divisor = OPTIMIZERS[name].lr_divisor
    expected_lr, expected_wd = 1e-2 / divisor, 0.1 * divisor
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
    assert decayed[0]["weight_decay"] == pytest.approx(expected_wd)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_schedules_warm_up_then_decay_to_the_floor():
    for name in SCHEDULES:
        values = [lr_multiplier(s, name, 10, 100, 0.1) for s in range(101)]
        assert values[0] == 0 and values[5] == pytest.approx(0.5) and values[10] == pytest.approx(1.0)
        assert min(values[10:]) >= 0.1 - 1e-12
        assert values[100] == pytest.approx(1.0 if name == "constant" else 0.1)
        assert all(a >= b - 1e-12 for a, b in zip(values[10:], values[11:]))  # never rises after warmup
    assert lr_multiplier(55, "cosine", 10, 100) == pytest.approx(0.5)
    assert lr_multiplier(55, "polynomial", 10, 100) == pytest.approx(0.25)  # power 2 at half way
    assert mean_lr_share("linear") == pytest.approx(0.5, abs=1e-3) and mean_lr_share("polynomial") == pytest.approx(
        1 / 3, abs=2e-3
    )


def test_cosine_equals_transformers_cosine_with_min_lr():
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    model = tiny_model()
    ours = build_schedule(build_optimizer("adamw", model.parameters(), 1e-3, 0.0), "cosine", 7, 50, 0.05)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(
        build_optimizer("adamw", model.parameters(), 1e-3, 0.0), 7, 50, min_lr_rate=0.05
    )
    for step in range(50):
        assert ours.lr_lambdas[0](step) == pytest.approx(theirs.lr_lambdas[0](step), abs=1e-15)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer("sgd", tiny_model().parameters(), 1e-3, 0.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule(build_optimizer("adamw", tiny_model().parameters(), 1e-3, 0.0), "step", 0, 10)
    assert math.isclose(lr_multiplier(0, "constant", 0, 10), 1.0)
