"""KTAE key-token scores and token advantages (docs/methods.md, 3 KTAE)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import fisher_exact

from oar.credit import CreditBatch, get_estimator
from oar.credit.advantages import grpo_advantages
from oar.credit.ktae import (
    fisher_exact_two_sided,
    information_gain_bits,
    key_token_scores,
    ktae_estimator,
    ktae_scores_batch,
    ktae_token_advantages,
)

PAD = 0


def _pad(rows: list[list[int]], width: int, pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _h(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


# ---------------------------------------------------------------- Fisher exact test


def test_fisher_scipy_doc_example():
    # scipy docs: [[6, 2], [1, 4]] -> pmf of tables 2, 6, 7 = 0.10256...
    p = fisher_exact_two_sided(torch.tensor(6), torch.tensor(2), torch.tensor(1), torch.tensor(4))
    assert p.item() == pytest.approx(0.10256410256410257, rel=1e-12)
    assert p.dtype == torch.float64 and p.shape == ()


def test_fisher_hand_tables():
    # [[3, 1], [0, 2]]: R1=4, C1=3, n=6, k in 1..3 with pmf 3/15, 9/15, 3/15 -> p = 6/15
    # [[3, 0], [0, 3]]: pmf 1/20 at k=0 and k=3 -> p = 2/20
    # [[1, 1], [1, 1]]: the observed table is the mode -> p = 1
    # [[0, 0], [2, 3]]: empty row -> p = 1
    a = torch.tensor([3, 3, 1, 0])
    b = torch.tensor([1, 0, 1, 0])
    c = torch.tensor([0, 0, 1, 2])
    d = torch.tensor([2, 3, 1, 3])
    p = fisher_exact_two_sided(a, b, c, d)
    torch.testing.assert_close(p, torch.tensor([0.4, 0.1, 1.0, 1.0], dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_fisher_matches_scipy_on_random_tables():
    gen = np.random.default_rng(0)
    tables = gen.integers(0, 14, size=(400, 4))
    # include small, KTAE-like tables (n <= 16) and lopsided ones
    tables[:100] = gen.integers(0, 5, size=(100, 4))
    tables[100:120, 1] = 0
    t = torch.as_tensor(tables)
    got = fisher_exact_two_sided(t[:, 0], t[:, 1], t[:, 2], t[:, 3]).numpy()
    ref = np.array([fisher_exact([[r[0], r[1]], [r[2], r[3]]], alternative="two-sided").pvalue for r in tables])
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.tuples(*(st.integers(0, 25) for _ in range(4))))
def test_fisher_matches_scipy_property(cells):
    a, b, c, d = cells
    got = fisher_exact_two_sided(torch.tensor(a), torch.tensor(b), torch.tensor(c), torch.tensor(d)).item()
    ref = fisher_exact([[a, b], [c, d]], alternative="two-sided").pvalue
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_fisher_rejects_negative_or_fractional():
    with pytest.raises(ValueError, match="non-negative integers"):
        fisher_exact_two_sided(torch.tensor([-1]), torch.tensor([1]), torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="non-negative integers"):
        fisher_exact_two_sided(torch.tensor([0.5]), torch.tensor([1]), torch.tensor([1]), torch.tensor([1]))


def test_information_gain_hand_values():
    ig = information_gain_bits(
        torch.tensor([2, 1, 3, 2, 0]), torch.tensor([0, 1, 1, 1, 0]), torch.tensor([0, 1, 0, 0, 0]),
        torch.tensor([2, 1, 2, 1, 0]),
    )
    # perfect split: 1 bit; independent: 0; [[3,1],[0,2]]: 1 - 4/6 H(3/4); [[2,1],[0,1]]: H(1/2)-3/4 H(2/3); empty: 0
    expected = torch.tensor(
        [1.0, 0.0, 1.0 - 4 / 6 * _h(0.75), 1.0 - 0.75 * _h(2 / 3), 0.0], dtype=torch.float64
    )
    torch.testing.assert_close(ig, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- key-token scores by hand

V, X, Y, Z, Q = 11, 12, 13, 14, 15


def _hand_group():
    # correct: [v x], [v v x], [v y]; wrong: [v z], [z z], [q z z]  (N_T = N_F = 7)
    rows = [[V, X], [V, V, X], [V, Y], [V, Z], [Z, Z], [Q, Z, Z]]
    ids, mask = _pad(rows, 5)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    return ids, mask, rewards


def _hand_k_v(alpha=1.0, beta=1.0, gamma=1.0, top=1.0) -> float:
    # token v: a = 3, b = 1, c = 0, d = 2; Fisher p = 6/15 (see test_fisher_hand_tables)
    fisher = math.exp(-2 * 0.4)
    ig = 1.0 - 4 / 6 * _h(0.75)
    h = math.asin(math.sqrt(3 / (3 + 1e-10))) - math.asin(math.sqrt(1 / (3 + 1e-10)))
    # BM25: f_T = 4, f_F = 1, N_T = N_F = avg = 7, k1 = 2, b = 0.5 -> norm term = 2
    tf_t = (4 / 7) * 3 / (4 / 7 + 2.0)
    tf_f = (1 / 7) * 3 / (1 / 7 + 2.0)
    assert tf_t == pytest.approx(2 / 3) and tf_f == pytest.approx(0.2)
    x = h + gamma * (tf_t / (tf_f + 1e-5) - tf_f / (tf_t + 1e-5))
    k_raw = (alpha * fisher + beta * ig) * x / (alpha + beta)
    return top * (2.0 / (1.0 + math.exp(-k_raw)) - 1.0)


def test_key_token_score_hand_computed():
    ids, mask, rewards = _hand_group()
    k = key_token_scores(ids, mask, rewards)
    assert k.shape == ids.shape and k.dtype == torch.float32
    expected_v = _hand_k_v()
    assert 0.5 < expected_v < 0.9  # not saturated, so the formula is really exercised
    for i, j in ((0, 0), (1, 0), (1, 1), (2, 0), (3, 0)):
        assert k[i, j].item() == pytest.approx(expected_v, rel=1e-6)
    # x, y only in correct responses -> tf_F = 0 -> K saturates to +top; z, q only in wrong -> -top
    assert k[0, 1].item() == 1.0 and k[2, 1].item() == 1.0
    assert k[3, 1].item() == -1.0 and k[5, 0].item() == -1.0
    # padding is exactly zero
    assert torch.equal(k[mask == 0], torch.zeros(int((mask == 0).sum())))


@pytest.mark.parametrize(
    "opts", [dict(alpha=0.0), dict(beta=0.0), dict(gamma=0.0), dict(gamma=0.5, top=0.3), dict(alpha=2.0, beta=0.5)]
)
def test_key_token_score_options_hand_computed(opts):
    ids, mask, rewards = _hand_group()
    k = key_token_scores(ids, mask, rewards, **opts)
    assert k[0, 0].item() == pytest.approx(_hand_k_v(**opts), rel=1e-6)


def test_only_mask_counts_and_ignore_ids():
    ids, mask, rewards = _hand_group()
    base = key_token_scores(ids, mask, rewards)
    ids2 = ids.clone()
    ids2[4, 2:] = V  # put v into the padding of a wrong response: must not change anything
    k2 = key_token_scores(ids2, mask, rewards)
    assert torch.equal(k2, base)
    k3 = key_token_scores(ids, mask, rewards, ignore_token_ids=[Z, 999])
    assert torch.equal(k3[ids == Z], torch.zeros(int((ids == Z).sum())))
    keep = (ids != Z) & (mask > 0)
    assert torch.equal(k3[keep], base[keep])  # ignored ids still count in N_C, so others are unchanged


def test_degenerate_groups_zero():
    ids, mask, _ = _hand_group()
    for r in (torch.ones(6), torch.zeros(6), -torch.ones(6)):
        assert torch.equal(key_token_scores(ids, mask, r), torch.zeros(ids.shape))


def test_correct_means_positive_reward():
    ids, mask, rewards = _hand_group()
    pm = torch.where(rewards > 0, 1.0, -1.0)  # DAPO-style +1/-1 rewards: same correctness split
    assert torch.equal(key_token_scores(ids, mask, pm), key_token_scores(ids, mask, rewards))


def test_inputs_not_modified_and_bad_inputs():
    ids, mask, rewards = _hand_group()
    copies = [t.clone() for t in (ids, mask, rewards)]
    key_token_scores(ids, mask, rewards)
    for t, c in zip((ids, mask, rewards), copies):
        assert torch.equal(t, c)
    with pytest.raises(ValueError, match="alpha \\+ beta"):
        key_token_scores(ids, mask, rewards, alpha=0.0, beta=0.0)
    with pytest.raises(ValueError, match="top"):
        key_token_scores(ids, mask, rewards, top=-1.0)
    with pytest.raises(ValueError, match="integer"):
        key_token_scores(ids.float(), mask, rewards)
    with pytest.raises(ValueError, match="rewards"):
        key_token_scores(ids, mask, rewards[:3])
    bad = ids.clone()
    bad[0, 0] = -3
    with pytest.raises(ValueError, match=">= 0"):
        key_token_scores(bad, mask, rewards)


# ---------------------------------------------------------------- against a naive reference


def _naive_scores(ids, mask, rewards, alpha=1.0, beta=1.0, gamma=1.0, top=1.0, ignore=()):
    """Dictionary-based reference for one group, with scipy's Fisher test."""
    g, t = ids.shape
    correct = [bool(r > 0) for r in rewards]
    n_t, n_f = sum(correct), g - sum(correct)
    out = torch.zeros(g, t, dtype=torch.float64)
    if n_t == 0 or n_f == 0:
        return out
    toks = [[int(ids[i, j]) for j in range(t) if mask[i, j] > 0] for i in range(g)]
    big_t = sum(len(toks[i]) for i in range(g) if correct[i])
    big_f = sum(len(toks[i]) for i in range(g) if not correct[i])
    avg = (big_t + big_f) / 2
    score = {}
    for v in {x for r in toks for x in r}:
        a = sum(1 for i in range(g) if correct[i] and v in toks[i])
        b = sum(1 for i in range(g) if not correct[i] and v in toks[i])
        c, d = n_t - a, n_f - b
        p = fisher_exact([[a, b], [c, d]]).pvalue
        fisher = 0.0 if abs(p - 1) < 1e-6 else math.exp(-2 * p)
        n = g
        ig = _h(n_t / n) - ((a + b) / n * _h(a / (a + b)) if a + b else 0) - ((c + d) / n * _h(c / (c + d)) if c + d else 0)
        h = math.asin(math.sqrt(a / (a + c + 1e-10))) - math.asin(math.sqrt(b / (b + d + 1e-10)))

        def tf(f, big):
            if big == 0:
                return 0.0
            rel = f / big
            return rel * 3.0 / (rel + 2.0 * (0.5 + 0.5 * big / avg))

        f_t = sum(toks[i].count(v) for i in range(g) if correct[i])
        f_f = sum(toks[i].count(v) for i in range(g) if not correct[i])
        tt, tff = tf(f_t, big_t), tf(f_f, big_f)
        x = h + gamma * (tt / (tff + 1e-5) - tff / (tt + 1e-5))
        k_raw = (alpha * fisher + beta * ig) * x / (alpha + beta)
        score[v] = 0.0 if v in ignore else top * math.tanh(k_raw / 2)
    for i in range(g):
        for j in range(t):
            if mask[i, j] > 0:
                out[i, j] = score[int(ids[i, j])]
    return out


def _random_group(gen: torch.Generator, g: int, t: int, vocab: int):
    ids = torch.randint(0, vocab, (g, t), generator=gen)
    lens = torch.randint(0, t + 1, (g,), generator=gen)
    mask = (torch.arange(t)[None, :] < lens[:, None]).float()
    rewards = torch.randint(0, 2, (g,), generator=gen).float()
    return ids, mask, rewards


@pytest.mark.parametrize("seed", range(6))
def test_matches_naive_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    g = [2, 3, 5, 8, 8, 16][seed]
    ids, mask, rewards = _random_group(gen, g, 12, 9)
    opts = dict(alpha=1.0, beta=1.0, gamma=1.0, top=1.0) if seed % 2 == 0 else dict(alpha=0.7, beta=1.3, gamma=0.2, top=0.5)
    got = key_token_scores(ids, mask, rewards, ignore_token_ids=[3], **opts).double()
    ref = _naive_scores(ids, mask, rewards, ignore=(3,), **opts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10), st.integers(1, 9), st.floats(0.1, 3.0))
def test_scores_bounded_and_padding_zero(seed, g, t, top):
    gen = torch.Generator().manual_seed(seed)
    ids, mask, rewards = _random_group(gen, g, t, 6)
    k = key_token_scores(ids, mask, rewards, top=top)
    assert bool((k.abs() <= top + 1e-6).all())
    assert bool((k[mask == 0] == 0).all())
    if bool((rewards > 0).all()) or bool((rewards <= 0).all()):
        assert bool((k == 0).all())


# ---------------------------------------------------------------- batches of groups


def test_batch_equals_per_group_loop_with_shuffled_ids():
    gen = torch.Generator().manual_seed(1)
    groups = [_random_group(gen, 6, 10, 7) for _ in range(5)]
    groups[2] = (groups[2][0], groups[2][1], torch.ones(6))  # one degenerate group
    ids = torch.cat([g[0] for g in groups])
    mask = torch.cat([g[1] for g in groups])
    rewards = torch.cat([g[2] for g in groups])
    gids = torch.tensor([40, 3, 17, 99, 5]).repeat_interleave(6)
    perm = torch.randperm(30, generator=gen)
    got = ktae_scores_batch(ids[perm], mask[perm], rewards[perm], gids[perm], ignore_token_ids=[1])
    expected = torch.cat([key_token_scores(*g, ignore_token_ids=[1]) for g in groups])[perm]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_token_advantages_are_grpo_plus_k_on_mask():
    gen = torch.Generator().manual_seed(2)
    groups = [_random_group(gen, 4, 8, 5) for _ in range(3)]
    ids = torch.cat([g[0] for g in groups])
    mask = torch.cat([g[1] for g in groups])
    rewards = torch.cat([g[2] for g in groups])
    gids = torch.arange(3).repeat_interleave(4)
    for norm in (True, False):
        adv = ktae_token_advantages(ids, mask, rewards, gids, norm_by_std=norm, top=0.5)
        seq = grpo_advantages(rewards, gids, norm_by_std=norm)
        k = ktae_scores_batch(ids, mask, rewards, gids, top=0.5)
        torch.testing.assert_close(adv, (seq[:, None] + k) * mask)
        assert bool((adv[mask == 0] == 0).all())


def test_empty_mask_and_empty_batch():
    ids = torch.randint(0, 5, (4, 3))
    z = ktae_token_advantages(ids, torch.zeros(4, 3), torch.tensor([1.0, 0, 1, 0]), torch.zeros(4, dtype=torch.long))
    assert torch.equal(z, torch.zeros(4, 3))
    e = ktae_scores_batch(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert e.shape == (0, 3)


# ---------------------------------------------------------------- estimator


def test_estimator_registered_and_uses_tokenizer_eos():
    assert get_estimator("ktae") is ktae_estimator
    ids, mask, rewards = _hand_group()
    batch = CreditBatch(response_ids=ids, response_mask=mask, rewards=rewards, group_ids=torch.zeros(6, dtype=torch.long))
    plain = get_estimator("ktae")(batch)
    seq = grpo_advantages(rewards, batch.group_ids)
    torch.testing.assert_close(plain.seq_advantages, seq)
    torch.testing.assert_close(plain.token_advantages, (seq[:, None] + key_token_scores(ids, mask, rewards)) * mask)
    assert plain.weights is None

    batch.tokenizer = SimpleNamespace(eos_token_id=Z)
    with_eos = get_estimator("ktae")(batch)
    z = ids == Z
    torch.testing.assert_close(with_eos.token_advantages[z], seq[:, None].expand_as(ids)[z])
    # explicit option overrides the tokenizer default
    none_ignored = get_estimator("ktae")(batch, ignore_token_ids=())
    torch.testing.assert_close(none_ignored.token_advantages, plain.token_advantages)
    dr = get_estimator("ktae")(batch, norm_by_std=False, top=0.5, gamma=0.0)
    torch.testing.assert_close(dr.seq_advantages, grpo_advantages(rewards, batch.group_ids, norm_by_std=False))


def test_estimator_unknown_option():
    ids, mask, rewards = _hand_group()
    batch = CreditBatch(response_ids=ids, response_mask=mask, rewards=rewards, group_ids=torch.zeros(6, dtype=torch.long))
    with pytest.raises(TypeError, match="quantile"):
        get_estimator("ktae")(batch, quantile=0.25)
