"""Credit-concentration metrics (docs/methods.md, 4.5 Credit-concentration metrics)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.credit.metrics import credited_concentration, credited_rows, ess_ratio, top_mass, uniform_top_mass


def test_ess_hand_values():
    w = torch.tensor([[1.0, 3.0, 7.0], [2.0, 2.0, 2.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    got = ess_ratio(w, mask)
    # row 0: (1+3)^2 / (2 * (1+9)) = 0.8; row 1: uniform -> 1; row 2: 25 / (2 * 25) = 0.5; row 3: all zero -> 0
    torch.testing.assert_close(got, torch.tensor([0.8, 1.0, 0.5, 0.0]))


def test_ess_empty_row_is_one():
    got = ess_ratio(torch.rand(2, 4), torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]]))
    assert got[0].item() == 1.0


def test_top_mass_hand_values():
    a = torch.tensor([[1.0, -4.0, 3.0, 2.0, 100.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # row 0 (L=4): k = ceil(0.25 * 4) = 1 -> |-4| / 10 = 0.4; row 1 (L=5): k = ceil(1.25) = 2 -> 0.4
    torch.testing.assert_close(top_mass(a, mask, frac=0.25), torch.tensor([0.4, 0.4]))
    # frac 0.1, L = 4 -> at least one token
    torch.testing.assert_close(top_mass(a, mask, frac=0.1)[0], torch.tensor(0.4))


@pytest.mark.parametrize("length", [10, 20, 30, 50, 100])
def test_top_mass_uniform_is_ten_percent(length):
    a = torch.full((1, length), -0.7)
    assert top_mass(a, torch.ones(1, length)).item() == pytest.approx(0.1)


def test_top_mass_empty_and_zero_rows():
    a = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    mask = torch.tensor([[0, 0], [1, 1]])
    assert torch.equal(top_mass(a, mask), torch.zeros(2))


def test_uniform_top_mass_hand_values():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    # L = 4: k = 1 -> 0.25; L = 5: k = ceil(0.5) = 1 -> 0.2; empty row -> 0
    torch.testing.assert_close(uniform_top_mass(mask), torch.tensor([0.25, 0.2, 0.0], dtype=torch.float64))
    # the uniform row's top_mass is exactly its uniform_top_mass
    a = torch.full((1, 5), 0.3)
    assert top_mass(a, torch.ones(1, 5)).item() == pytest.approx(uniform_top_mass(torch.ones(1, 5)).item())


def test_credited_rows_and_concentration_hand_values():
    # row 0: GRPO-like uniform credit; row 1: concentrated on one token; row 2: a zero-advantage group member;
    # row 3: non-zero only on a padded position, which does not count
    a = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    assert credited_rows(a, mask).tolist() == [True, True, False, False]
    share, top, uniform = credited_concentration(a, mask)
    # credited rows 0 and 1 (L = 4, k = 1): top mass 0.25 and 1.0 -> 0.625; uniform 0.25 each
    assert (share, top, uniform) == pytest.approx((0.5, 0.625, 0.25))
    # sequence-level credit only: top == uniform; no credit at all: zeros
    share, top, uniform = credited_concentration(a[:1], mask[:1])
    assert share == 1.0 and top == pytest.approx(uniform)
    assert credited_concentration(torch.zeros(2, 3), torch.ones(2, 3)) == (0.0, 0.0, 0.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="frac"):
        top_mass(torch.ones(1, 3), torch.ones(1, 3), frac=0.0)
    with pytest.raises(ValueError, match="\\(B, T\\)"):
        ess_ratio(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="\\(B, T\\)"):
        credited_rows(torch.ones(2, 3), torch.ones(3, 3))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 8), st.integers(1, 40), st.floats(0.05, 1.0))
def test_ranges_and_inputs_untouched(seed, b, t, frac):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(b, t, generator=gen) + 0.01
    mask = (torch.rand(b, t, generator=gen) < 0.7).float()
    w0, m0 = w.clone(), mask.clone()
    ess = ess_ratio(w, mask)
    tm = top_mass(w - 0.5, mask, frac=frac)
    assert torch.equal(w, w0) and torch.equal(mask, m0)
    lens = mask.sum(1)
    has = lens > 0
    assert bool((ess[has] <= 1 + 1e-6).all()) and bool((ess[has] >= 1 / lens[has] - 1e-6).all())
    assert bool((tm >= 0).all()) and bool((tm <= 1 + 1e-6).all())
    # scaling weights or advantages does not change either metric
    torch.testing.assert_close(ess_ratio(3 * w, mask), ess)
    torch.testing.assert_close(top_mass(-2 * (w - 0.5), mask, frac=frac), tm)
