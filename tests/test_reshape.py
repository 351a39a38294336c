"""Bi-Level reshaping weights (docs/methods.md, 4.4 Bi-Level reshaping)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.credit.reshape import bilevel_weights, masked_row_quantile


def test_hand_computed_row():
    # l = log1p(s) = [0, 1, 2, 3] -> n = [0, 1/3, 2/3, 1]; tau = quantile 0.25 at rank 0.75 = 0.25
    s = torch.tensor([[0.0, math.e - 1, math.e**2 - 1, math.e**3 - 1, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    tau = 0.25
    raw = [
        max(0.0 / (tau + 1e-8), 0.1),
        1 + (1 / 3 - tau) / (1 - tau + 1e-8),
        1 + (2 / 3 - tau) / (1 - tau + 1e-8),
        1 + (1 - tau) / (1 - tau + 1e-8),
    ]
    total = sum(raw)
    expected = torch.tensor([[r * 4 / total for r in raw] + [1.0]], dtype=torch.float64)
    got = bilevel_weights(s, mask)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    assert got[0, 4].item() == 1.0
    nomass = bilevel_weights(s, mask, preserve_mass=False)
    torch.testing.assert_close(nomass[0, :4], torch.tensor(raw, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_hand_computed_suppress_interpolation_and_beta():
    # l = [0, 2, 4, 8] / 8 -> n = [0, .25, .5, 1]; q = 0.5: rank 1.5 -> tau = 0.375
    l = torch.tensor([0.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    s = torch.expm1(l)[None]
    mask = torch.ones(1, 4)
    tau = 0.375
    raw = [0.1, 0.25 / (tau + 1e-8), 1 + 2.0 * (0.5 - tau) / (1 - tau + 1e-8), 1 + 2.0 * (1 - tau) / (1 - tau + 1e-8)]
    got = bilevel_weights(s, mask, quantile=0.5, beta=2.0, preserve_mass=False)
    torch.testing.assert_close(got[0], torch.tensor(raw, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    got_floor = bilevel_weights(s, mask, quantile=0.5, beta=2.0, floor=0.5, preserve_mass=False)
    assert got_floor[0, 0].item() == 0.5 and got_floor[0, 1].item() == pytest.approx(0.25 / 0.375)


def test_constant_scores_give_ones():
    s = torch.full((2, 6), 3.0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert torch.equal(bilevel_weights(s, mask), torch.ones(2, 6))
    assert torch.equal(bilevel_weights(s, mask, preserve_mass=False), torch.ones(2, 6))


def test_empty_rows_all_ones_and_outside_mask_exactly_one():
    s = torch.rand(3, 7) * 4
    s[1, 3:] = float("nan")  # garbage outside the mask is ignored
    mask = torch.zeros(3, 7)
    mask[1, :3] = 1
    mask[2, 2:6] = 1
    s0, m0 = s.clone(), mask.clone()
    w = bilevel_weights(s, mask)
    assert torch.equal(w[0], torch.ones(7))
    assert bool((w[mask == 0] == 1.0).all())
    assert torch.equal(s.isnan(), s0.isnan()) and torch.equal(s.nan_to_num(), s0.nan_to_num())
    assert torch.equal(mask, m0)
    assert torch.isfinite(w).all()


def test_bad_inputs():
    s = torch.rand(2, 4)
    m = torch.ones(2, 4)
    with pytest.raises(ValueError, match="quantile"):
        bilevel_weights(s, m, quantile=1.5)
    with pytest.raises(ValueError, match="\\(B, T\\)"):
        bilevel_weights(s, m[:, :3])
    bad = s.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        bilevel_weights(bad, m)
    with pytest.raises(ValueError, match="floor"):
        bilevel_weights(s, m, floor=-0.1)


def _random_rows(seed: int, b: int, t: int):
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(b, t, generator=gen).pow(3) * 10
    lens = torch.randint(0, t + 1, (b,), generator=gen)
    start = torch.randint(0, 3, (b,), generator=gen)
    pos = torch.arange(t)[None]
    mask = ((pos >= start[:, None]) & (pos < (start + lens)[:, None])).float()
    return s, mask


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_quantile_matches_torch_quantile_per_row(q):
    s, mask = _random_rows(0, 64, 40)
    m = mask.bool()
    got = masked_row_quantile(s, m, q)
    for i in range(s.shape[0]):
        if m[i].any():
            assert got[i].item() == torch.quantile(s[i][m[i]], q).item()
        else:
            assert math.isnan(got[i].item())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_quantile_with_ties_matches_torch_quantile(seed, q):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 4, (16, 25), generator=gen).float()  # many ties
    lens = torch.randint(0, 26, (16,), generator=gen)
    m = torch.rand(16, 25, generator=gen).argsort(dim=1) < lens[:, None]  # scattered masks
    got = masked_row_quantile(v, m, q)
    for i in range(16):
        if m[i].any():
            assert got[i].item() == torch.quantile(v[i][m[i]], q).item()
        else:
            assert math.isnan(got[i].item())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 12), st.integers(1, 30), st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_invariants(seed, b, t, q, beta):
    s, mask = _random_rows(seed, b, t)
    w = bilevel_weights(s, mask, quantile=q, beta=beta)
    m = mask.bool()
    assert bool((w > 0).all())
    assert bool((w[~m] == 1.0).all())
    lens = m.sum(1)
    means = (w * mask).sum(1) / lens.clamp(min=1)
    torch.testing.assert_close(means[lens > 0], torch.ones(int((lens > 0).sum())), rtol=1e-5, atol=1e-5)
    raw = bilevel_weights(s, mask, quantile=q, beta=beta, preserve_mass=False)
    assert bool((raw[m] >= 0.1 - 1e-7).all()) and bool((raw[m] <= 1 + beta + 1e-6).all())
    # A_i * w keeps the sign of A_i
    adv = torch.randn(b)
    tok = adv[:, None] * w * mask
    assert bool(((torch.sign(tok) == torch.sign(adv)[:, None]) | ~m).all())


def test_monotone_in_score_within_row():
    s, mask = _random_rows(3, 8, 30)
    w = bilevel_weights(s, mask)
    for i in range(8):
        m = mask[i].bool()
        order = torch.argsort(s[i][m])
        ws = w[i][m][order]
        assert bool((ws[1:] >= ws[:-1] - 1e-6).all())
