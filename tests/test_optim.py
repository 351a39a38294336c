"""The shared learning-rate schedule and weight-decay groups (oar.trainer.optim): hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from oar.trainer.optim import decay_groups, lr_factor, make_scheduler


def test_lr_factor_rl_floor_one_past_the_last_step():
    # RL: train.steps = 6, warmup 2, floor at step 6: the last step (5) is still above the floor
    f = lambda s, kind: lr_factor(s, warmup_steps=2, floor_step=6, schedule=kind)  # noqa: E731
    assert [f(s, "linear") for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert [f(s, "constant") for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert f(4, "cosine") == pytest.approx(0.5)  # half-way from step 2 to 6: cos(pi/2)
    assert f(6, "cosine") == pytest.approx(0.0, abs=1e-12) and f(9, "linear") == 0.0  # the floor, then held


def test_lr_factor_min_ratio_and_no_decay_phase():
    assert lr_factor(3, warmup_steps=1, floor_step=5, schedule="linear", min_ratio=0.2) == pytest.approx(0.6)
    assert lr_factor(7, warmup_steps=1, floor_step=5, schedule="linear", min_ratio=0.2) == pytest.approx(0.2)
    assert lr_factor(4, warmup_steps=4, floor_step=4, schedule="cosine") == 1.0  # floor_step <= warmup: no decay


def test_lr_factor_refuses_an_unknown_schedule():
    with pytest.raises(ValueError, match=r"unknown schedule 'step'; valid: constant, linear, cosine"):
        lr_factor(0, warmup_steps=0, floor_step=3, schedule="step")


def test_make_scheduler_follows_lr_factor():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sch = make_scheduler(opt, warmup_steps=1, floor_step=4, schedule="cosine", min_ratio=0.5)
    lrs = []
    for _ in range(5):
        lrs.append(sch.get_last_lr()[0])
        opt.step()
        sch.step()
    expected = [2.0 * lr_factor(s, warmup_steps=1, floor_step=4, schedule="cosine", min_ratio=0.5) for s in range(5)]
    assert lrs == pytest.approx(expected)
    assert lrs[1] == 2.0 and lrs[4] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 3))))


def test_decay_groups_exempt_norms_and_biases_and_count_tied_weights_once():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "norm": torch.nn.LayerNorm(3), "head": head})
    decay, no_decay = decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(5, 3)]
    assert sorted(tuple(p.shape) for p in no_decay["params"]) == [(3,), (3,), (5,)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_rl_optimizer_decays_matrices_only_and_keeps_one_group_without_decay(weight_decay):
    """``train.weight_decay`` > 0: the RL optimizer (``Strategy.prepare``) spares norms and biases, as
    SFT does; 0 (the default): one group of every parameter, as its checkpoints have always held."""
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    strategy = make_strategy(TrainSettings.from_config({"train": {"strategy": "ddp"}}), "cpu")
    _, optimizer = strategy.prepare(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=weight_decay)
    groups = [(g["weight_decay"], sorted(tuple(p.shape) for p in g["params"])) for g in optimizer.param_groups]
    if weight_decay:
        assert groups == [(0.1, [(4, 3)]), (0.0, [(4,), (4,), (4,)])]
    else:
        assert groups == [(0.0, [(4,), (4,), (4,), (4, 3)])]
