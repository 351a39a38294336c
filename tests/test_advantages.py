"""GRPO / Dr. GRPO sequence advantages (docs/methods.md, 1 GRPO and Dr. GRPO) and the grpo/drgrpo estimators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.credit import CreditBatch, get_estimator, list_estimators
from oar.credit.advantages import (
    broadcast_seq,
    drgrpo_estimator,
    grpo_advantages,
    grpo_estimator,
)

EPS = 1e-6


def test_hand_computed_two_groups_interleaved_noncontiguous_ids():
    # group 7: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    # group 3: rewards 2, 5, 8   -> mean 5,   unbiased std sqrt((9 + 0 + 9) / 2) = 3
    rewards = torch.tensor([1.0, 2.0, 0.0, 5.0, 0.0, 8.0, 1.0])
    gids = torch.tensor([7, 3, 7, 3, 7, 3, 7])
    s7 = math.sqrt(1.0 / 3.0)
    expected = torch.tensor(
        [0.5 / (s7 + EPS), -3 / (3 + EPS), -0.5 / (s7 + EPS), 0.0, -0.5 / (s7 + EPS), 3 / (3 + EPS), 0.5 / (s7 + EPS)]
    )
    got = grpo_advantages(rewards, gids)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert got.dtype == torch.float32
    assert got[3].item() == 0.0


def test_dr_grpo_no_std_division():
    rewards = torch.tensor([1.0, 2.0, 0.0, 5.0, 0.0, 8.0, 1.0])
    gids = torch.tensor([7, 3, 7, 3, 7, 3, 7])
    expected = torch.tensor([0.5, -3.0, -0.5, 0.0, -0.5, 3.0, 0.5])
    torch.testing.assert_close(grpo_advantages(rewards, gids, norm_by_std=False), expected)


def test_equal_rewards_give_exact_zeros_even_with_rounding():
    # 0.1 is not representable; a naive mean can differ from 0.1 by an ulp and leak 1e-2 advantages.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], dtype=torch.float32)
    gids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    for norm in (True, False):
        got = grpo_advantages(rewards, gids, norm_by_std=norm)
        assert torch.equal(got, torch.zeros(10))


def test_group_of_one_mean_zero_std_one():
    rewards = torch.tensor([0.7, 1.0, 0.0, -2.0])
    gids = torch.tensor([5, 9, 9, 11])
    got = grpo_advantages(rewards, gids)
    # groups 5 and 11 have one member: A = (r - 0) / (1 + eps)
    assert got[0].item() == pytest.approx(0.7 / (1 + EPS), rel=1e-6)
    assert got[3].item() == pytest.approx(-2.0 / (1 + EPS), rel=1e-6)
    # group 9: mean 0.5, std sqrt(0.5)
    assert got[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS), rel=1e-6)
    dr = grpo_advantages(rewards, gids, norm_by_std=False)
    assert dr[0].item() == pytest.approx(0.7) and dr[3].item() == pytest.approx(-2.0)


def test_eps_changes_denominator():
    rewards = torch.tensor([1.0, 0.0])
    gids = torch.tensor([0, 0])
    # std = sqrt(0.5); eps = 0.5
    got = grpo_advantages(rewards, gids, eps=0.5)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 0.5))


def test_inputs_not_modified_and_dtype_kept():
    rewards = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    gids = torch.tensor([2, 2, 2])
    r0, g0 = rewards.clone(), gids.clone()
    out = grpo_advantages(rewards, gids)
    assert torch.equal(rewards, r0) and torch.equal(gids, g0)
    assert out.dtype == torch.float64


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(3, 1), torch.zeros(3, dtype=torch.long))


def test_empty_batch():
    out = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)


def _loop_reference(rewards: torch.Tensor, gids: torch.Tensor, norm: bool) -> torch.Tensor:
    out = torch.zeros_like(rewards, dtype=torch.float64)
    r = rewards.double()
    for g in gids.unique().tolist():
        sel = gids == g
        vals = r[sel]
        if vals.numel() == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = vals.mean(), torch.std(vals)
        a = vals - mean
        if norm:
            a = a / (std + EPS)
        if vals.numel() > 1 and bool((vals == vals[0]).all()):
            a = torch.zeros_like(a)
        out[sel] = a
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 40), st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.25])), min_size=1, max_size=40),
    st.booleans(),
)
def test_matches_per_group_loop_with_torch_std(pairs, norm):
    gids = torch.tensor([p[0] for p in pairs])
    rewards = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    got = grpo_advantages(rewards, gids, norm_by_std=norm)
    torch.testing.assert_close(got, _loop_reference(rewards, gids, norm), rtol=1e-9, atol=1e-9)
    # group means of the advantages are zero for groups of two or more
    for g in gids.unique().tolist():
        sel = gids == g
        if sel.sum() > 1:
            assert abs(float(got[sel].sum())) < 1e-9


def test_broadcast_seq_exact_zero_outside_mask():
    seq = torch.tensor([2.0, -0.5, 0.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = broadcast_seq(seq, mask)
    expected = torch.tensor([[2.0, 2.0, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError):
        broadcast_seq(seq, mask[:2])


def _batch(mask=None) -> CreditBatch:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    gids = torch.tensor([4, 4, 4, 8, 8])
    mask = mask if mask is not None else torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    ids = torch.randint(0, 50, mask.shape)
    return CreditBatch(response_ids=ids, response_mask=mask, rewards=rewards, group_ids=gids)


def test_registry_returns_estimators():
    assert get_estimator("grpo") is grpo_estimator
    assert get_estimator("drgrpo") is drgrpo_estimator
    assert {"grpo", "drgrpo", "ktae"} <= set(list_estimators())


def test_grpo_estimator_result():
    batch = _batch()
    res = get_estimator("grpo")(batch)
    expected_seq = grpo_advantages(batch.rewards, batch.group_ids)
    torch.testing.assert_close(res.seq_advantages, expected_seq)
    assert torch.equal(res.token_advantages, broadcast_seq(expected_seq, batch.response_mask))
    assert res.weights is None
    # group 8 has equal rewards -> zeros
    assert torch.equal(res.token_advantages[3:], torch.zeros(2, 3))


def test_drgrpo_estimator_default_and_override():
    batch = _batch()
    dr = get_estimator("drgrpo")(batch)
    torch.testing.assert_close(dr.seq_advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0]))
    as_grpo = get_estimator("drgrpo")(batch, norm_by_std=True)
    torch.testing.assert_close(as_grpo.seq_advantages, grpo_advantages(batch.rewards, batch.group_ids))
    g = get_estimator("grpo")(batch, norm_by_std=False, eps=1e-3)
    torch.testing.assert_close(g.seq_advantages, dr.seq_advantages)


def test_unknown_option_raises_naming_it():
    with pytest.raises(TypeError, match="quantil"):
        get_estimator("grpo")(_batch(), quantil=0.3)
    with pytest.raises(TypeError, match="alpha"):
        get_estimator("drgrpo")(_batch(), alpha=1.0)
