"""PPO-clip policy loss, aggregation modes and k3 KL (docs/methods.md, 1 GRPO and Dr. GRPO, 2 DAPO)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.trainer.loss import AGG_MODES, aggregate, k3_kl, policy_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 4) / (2 * 3)),
    ],
)
def test_aggregate_hand(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_sum_norm_max_len_override():
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(7 / 20)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(LOSS, MASK, "token-mean", max_len=10)


def test_aggregate_unknown_mode_names_it_and_valid_ones():
    with pytest.raises(ValueError) as err:
        aggregate(LOSS, MASK, "seq-mean")
    msg = str(err.value)
    assert "'seq-mean'" in msg and all(m in msg for m in AGG_MODES)


def test_aggregate_empty_rows_and_nan_padding():
    loss = torch.tensor([[1.0, float("nan")], [float("inf"), 7.0], [3.0, 5.0]])
    mask = torch.tensor([[1, 0], [0, 0], [1, 1]])
    # the empty row is skipped by the seq-mean modes; padding never leaks NaN/inf
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(9 / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((1 + 8) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(9 / 6)
    for mode in AGG_MODES:
        assert aggregate(loss, torch.zeros(3, 2), mode).item() == 0.0


def test_aggregate_gradient_token_mean_vs_seq_mean():
    x = LOSS.clone().requires_grad_(True)
    aggregate(x, MASK, "seq-mean-token-mean").backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]))


def _hand_tokens():
    # one row of 6 tokens: (A, ratio)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 2.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.1, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    old = torch.zeros(1, 6)
    return adv, ratio.log(), old, mask


def test_policy_loss_hand_no_dual_clip():
    adv, logp, old, mask = _hand_tokens()
    # per token max(-A r, -A clip(r)): -1.2 (clipped high), -0.5, 0.8 (clipped low), 5.0, 1.1
    loss, stats = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 5.0 + 1.1) / 5)
    assert stats["clipfrac"] == pytest.approx(2 / 5)
    assert stats["clipfrac_high"] == pytest.approx(1 / 5)
    assert stats["clipfrac_low"] == pytest.approx(1 / 5)
    assert "dualclip_frac" not in stats
    r = torch.tensor([1.5, 0.5, 0.5, 5.0, 1.1])
    assert stats["approx_kl"] == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-6)
    assert stats["ppo_kl"] == pytest.approx(float((-r.log()).mean()), rel=1e-6)
    assert stats["ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-6)


def test_policy_loss_hand_dual_clip_and_clip_higher():
    adv, logp, old, mask = _hand_tokens()
    # dual clip c = 3 caps token 4 (A=-1, r=5): min(5, 3) = 3
    loss, stats = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 1.1) / 5)
    assert stats["dualclip_frac"] == pytest.approx(1 / 5)
    # clip-higher eps_high = 0.6: token 1 (r=1.5) is no longer clipped
    loss2, stats2 = policy_loss(logp, old, adv, mask, eps_high=0.6)
    assert loss2.item() == pytest.approx((-1.5 - 0.5 + 0.8 + 5.0 + 1.1) / 5)
    assert stats2["clipfrac_high"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=0.9)


def test_policy_loss_gradients():
    adv, logp, old, mask = _hand_tokens()
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask, clip_ratio_c=3.0)
    loss.backward()
    # d/dlogp of -A r = -A r; clipped and dual-clipped tokens (and padding) have zero gradient
    expected = torch.tensor([[0.0, -0.5, 0.0, 0.0, 1.1, 0.0]]) / 5
    torch.testing.assert_close(x.grad, expected)


def test_policy_loss_on_policy_is_minus_mean_advantage():
    adv = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logp = torch.randn(2, 3)
    for mode in AGG_MODES:
        loss, stats = policy_loss(logp, logp.clone(), adv, mask, agg=mode)
        assert loss.item() == pytest.approx(aggregate(-adv, mask, mode).item())
        assert stats["clipfrac"] == 0.0 and stats["approx_kl"] == 0.0


def test_policy_loss_shapes_checked():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3))


def test_k3_hand_and_clamps():
    logp = torch.tensor([0.0, math.log(2.0), 0.0, 0.0, -50.0])
    ref = torch.tensor([math.log(2.0), 0.0, 0.0, 100.0, 0.0])
    got = k3_kl(logp, ref)
    # d = ref - logp: ln2 -> 2 - ln2 - 1; -ln2 -> 1/2 + ln2 - 1; 0 -> 0; 100 -> clamp to 20 -> huge -> 10;
    # 50 -> clamp 20 -> 10
    expected = torch.tensor([1 - math.log(2), math.log(2) - 0.5, 0.0, 10.0, 10.0])
    torch.testing.assert_close(got, expected)
    got2 = k3_kl(logp, ref, log_ratio_clamp=1.0, kl_clamp=100.0)
    assert got2[3].item() == pytest.approx(math.e - 2.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=20), st.integers(0, 1000))
def test_k3_non_negative(vals, seed):
    logp = torch.tensor(vals)
    ref = logp + torch.randn(len(vals), generator=torch.Generator().manual_seed(seed)) * 5
    assert bool((k3_kl(logp, ref) >= 0).all())


def test_k3_non_negative_for_tiny_log_ratios():
    d = torch.logspace(-12, -1, 200)
    logp = torch.zeros(400)
    ref = torch.cat([d, -d])
    assert bool((k3_kl(logp, ref) >= 0).all())


def test_policy_loss_inputs_not_modified():
    adv, logp, old, mask = _hand_tokens()
    copies = [t.clone() for t in (adv, logp, old, mask)]
    policy_loss(logp, old, adv, mask, clip_ratio_c=3.0, agg="seq-mean-token-mean")
    for t, c in zip((adv, logp, old, mask), copies):
        assert torch.equal(t, c)
