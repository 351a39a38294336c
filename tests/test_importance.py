"""Tests of OAR-P / OAR-G token importance and the oar_p / oar_g estimators (docs/methods.md, 4.2-4.4).

The tiny random model has its matrix weights scaled up (x10) so that its output distributions are
far from uniform and the importance scores are O(0.01-1) rather than O(1e-6): comparisons at
1e-4 are then meaningful.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from oar.credit import CreditBatch, get_estimator
from oar.credit.advantages import grpo_advantages
from oar.credit.importance import MODES, gradient_importance, perturbation_importance
from oar.credit.probe import build_probe
from oar.credit.reshape import bilevel_weights
from oar.models.tiny import build_tiny

CONC = " A:{"
WEIGHT_SCALE = 10.0


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=256, seed=0
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(WEIGHT_SCALE)
    return model, tok


def enc(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def make_batch(tok, prompts: list[str], responses: list[str]):
    pad = tok.pad_token_id
    P = [enc(tok, s) for s in prompts]
    R = [enc(tok, s) for s in responses]
    np_, nr = max(map(len, P)), max(map(len, R))
    p_ids = torch.tensor([[pad] * (np_ - len(p)) + p for p in P])
    p_mask = torch.tensor([[0] * (np_ - len(p)) + [1] * len(p) for p in P])
    r_ids = torch.tensor([r + [pad] * (nr - len(r)) for r in R])
    r_mask = torch.tensor([[1] * len(r) + [0] * (nr - len(r)) for r in R])
    return p_ids, p_mask, r_ids, r_mask


PROMPTS = ["What is 12+7?", "Q: 3*4", "Add 5 and 9, then double.", "x"]
RESPONSES = [
    "12+7 = 19 so \\boxed{19}",
    "3*4=12, \\boxed{12}",
    "5+9=14; 14*2 = 28. The answer: \\boxed{28}",
    "I do not know",  # no answer
]


@pytest.fixture(scope="module")
def probe(tiny):
    _, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, PROMPTS, RESPONSES)
    return build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)


def single_probes(tok):
    out = []
    for p, r in zip(PROMPTS, RESPONSES):
        p_ids, p_mask, r_ids, r_mask = make_batch(tok, [p], [r])
        out.append(build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask))
    return out


def right_aligned(batch_scores: torch.Tensor, row: int, single: torch.Tensor) -> torch.Tensor:
    """The batched scores of ``row`` restricted to the columns of the (shorter) single probe."""
    return batch_scores[row, batch_scores.shape[1] - single.shape[1] :]


# ------------------------------------------------------------------------------------------
# independent reference: plain full forwards, written without the library's helpers
# ------------------------------------------------------------------------------------------


def reference_outcome(model, ids: torch.Tensor, n_answer: int, mode: str):
    """Outcome of one unpadded probe sequence ``ids`` (1-D) whose last ``n_answer`` tokens are the
    answer."""
    L = ids.numel()
    logits = model(input_ids=ids[None], position_ids=torch.arange(L)[None]).logits[0].float()
    return _outcome_of_logits(logits, ids, n_answer, mode)


def _outcome_of_logits(logits: torch.Tensor, ids: torch.Tensor, n_answer: int, mode: str):
    """The outcome of ``mode`` from the ``(L, V)`` logits of the 1-D sequence ``ids``."""
    L = ids.numel()
    pred = torch.arange(L - n_answer - 1, L - 1)  # positions predicting the answer tokens
    if mode == "last":
        return F.log_softmax(logits[L - n_answer - 1], -1)
    if mode == "answer_mean":
        return F.log_softmax(logits[pred].mean(0), -1)
    lp = F.log_softmax(logits[pred], -1)
    return lp[torch.arange(n_answer), ids[pred + 1]].mean()


def reference_oar_p(model, ids: torch.Tensor, reasoning: torch.Tensor, n_answer: int, mode: str, mask_id: int):
    out = torch.zeros(ids.numel())
    with torch.no_grad():
        orig = reference_outcome(model, ids, n_answer, mode)
        for t in reasoning.nonzero().flatten().tolist():
            pert = ids.clone()
            pert[t] = mask_id
            new = reference_outcome(model, pert, n_answer, mode)
            if mode == "answer_joint":
                out[t] = orig - new
            else:
                out[t] = (orig.exp() * (orig - new)).sum()
    return out


# ------------------------------------------------------------------------------------------
# OAR-P
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_oar_p_matches_independent_reference(tiny, mode):
    model, tok = tiny
    for single in single_probes(tok)[:3]:
        got = perturbation_importance(model, single, mode=mode)
        ref = reference_oar_p(
            model,
            single.input_ids[0],
            single.reasoning_mask[0],
            int(single.answer_length[0]),
            mode,
            tok.pad_token_id,
        )
        assert ref.abs().max() > 1e-2  # the comparison is not vacuous
        torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_oar_p_cached_equals_naive(tiny, probe, mode):
    model, _ = tiny
    cached = perturbation_importance(model, probe, mode=mode, chunk_size=7)
    naive = perturbation_importance(model, probe, mode=mode, chunk_size=7, naive=True)
    assert cached.abs().max() > 1e-2
    torch.testing.assert_close(cached, naive, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_oar_p_zero_outside_reasoning_and_rows_without_answer(tiny, probe, mode):
    model, _ = tiny
    s = perturbation_importance(model, probe, mode=mode)
    assert s.shape == probe.input_ids.shape and s.dtype == torch.float32
    assert (s[~probe.reasoning_mask] == 0).all()
    assert (s[~probe.has_answer] == 0).all()
    assert (s[probe.reasoning_mask] != 0).any()
    if mode != "answer_joint":
        assert (s >= -1e-6).all()  # a KL


@pytest.mark.parametrize("naive", [False, True])
def test_oar_p_chunked_equals_unchunked(tiny, probe, naive):
    model, _ = tiny
    big = perturbation_importance(model, probe, mode="answer_mean", chunk_size=10_000, naive=naive)
    for cs in (1, 3, 16) if not naive else (5,):  # naive: one size (many full forwards)
        small = perturbation_importance(model, probe, mode="answer_mean", chunk_size=cs, naive=naive)
        torch.testing.assert_close(small, big, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_oar_p_batched_equals_one_at_a_time(tiny, probe, mode):
    model, tok = tiny
    batched = perturbation_importance(model, probe, mode=mode, chunk_size=16)
    for b, single in enumerate(single_probes(tok)):
        one = perturbation_importance(model, single, mode=mode)
        torch.testing.assert_close(right_aligned(batched, b, one), one[0], atol=1e-5, rtol=1e-5)


def test_oar_p_unreachable_token_has_zero_importance(tiny, probe):
    """Hand-built independence: with the probe's attention_mask 0 at a reasoning position, no
    other position attends to it, so replacing it cannot change the outcome."""
    model, _ = tiny
    cut = probe.to("cpu")
    cut.attention_mask = probe.attention_mask.clone()
    cols = probe.reasoning_mask[0].nonzero().flatten()
    j = int(cols[len(cols) // 2])
    cut.attention_mask[0, j] = 0
    for mode in MODES:
        s = perturbation_importance(model, cut, mode=mode)
        assert abs(float(s[0, j])) < 1e-6
        assert s[0].abs().max() > 1e-2
        naive = perturbation_importance(model, cut, mode=mode, naive=True)
        torch.testing.assert_close(s, naive, atol=1e-4, rtol=1e-4)


def test_oar_p_mask_token_matters_and_mode_restored(tiny, probe):
    model, tok = tiny
    a = perturbation_importance(model, probe, mask_token_id=tok.pad_token_id)
    assert torch.equal(a, perturbation_importance(model, probe))
    b = perturbation_importance(model, probe, mask_token_id=enc(tok, "#")[0])
    assert not torch.allclose(a, b)
    model.train()
    try:
        perturbation_importance(model, probe)
        assert model.training
    finally:
        model.eval()
    assert all(p.grad is None for p in model.parameters())


def test_bad_arguments_raise(tiny, probe):
    model, _ = tiny
    with pytest.raises(ValueError, match="mode"):
        perturbation_importance(model, probe, mode="nope")
    with pytest.raises(ValueError, match="chunk_size"):
        perturbation_importance(model, probe, chunk_size=0)
    with pytest.raises(ValueError, match="mode"):
        gradient_importance(model, probe, mode="nope")
    with pytest.raises(ValueError, match="noise_std"):
        gradient_importance(model, probe, noise_std=-1.0)


# ------------------------------------------------------------------------------------------
# OAR-G
# ------------------------------------------------------------------------------------------


def reference_oar_g_joint(model, ids: torch.Tensor, reasoning: torch.Tensor, n_answer: int) -> torch.Tensor:
    """|sum_h d(-phi)/de_{t,h} e_{t,h}| for one unpadded sequence, noise 0."""
    L = ids.numel()
    e = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
    logits = model(inputs_embeds=e, position_ids=torch.arange(L)[None]).logits[0].float()
    pred = torch.arange(L - n_answer - 1, L - 1)
    phi = F.log_softmax(logits[pred], -1)[torch.arange(n_answer), ids[pred + 1]].mean()
    (g,) = torch.autograd.grad(-phi, e)
    return (g[0] * e[0].detach()).sum(-1).abs() * reasoning


def test_oar_g_joint_noise_free_matches_reference(tiny):
    model, tok = tiny
    for single in single_probes(tok)[:3]:
        got = gradient_importance(model, single, mode="answer_joint", noise_std=0.0)
        ref = reference_oar_g_joint(
            model, single.input_ids[0], single.reasoning_mask[0], int(single.answer_length[0])
        )
        assert ref.max() > 1e-2
        torch.testing.assert_close(got[0], ref, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_oar_g_seeded_deterministic_zero_outside_reasoning(tiny, probe, mode):
    model, _ = tiny
    g1 = gradient_importance(model, probe, mode=mode, generator=torch.Generator().manual_seed(3))
    g2 = gradient_importance(model, probe, mode=mode, generator=torch.Generator().manual_seed(3))
    assert torch.equal(g1, g2)
    assert (g1[~probe.reasoning_mask] == 0).all() and (g1[~probe.has_answer] == 0).all()
    assert (g1[probe.reasoning_mask] > 0).any() and (g1 >= 0).all()
    if mode != "answer_joint":  # the noise matters: another seed gives other scores
        g3 = gradient_importance(model, probe, mode=mode, generator=torch.Generator().manual_seed(4))
        assert not torch.allclose(g1, g3)


@pytest.mark.parametrize("start_training", [False, True])
def test_oar_g_leaves_no_param_grads_and_keeps_mode(tiny, probe, start_training):
    model, _ = tiny
    model.train(start_training)
    try:
        gradient_importance(model, probe, generator=torch.Generator().manual_seed(0))
        assert model.training == start_training
        assert all(p.grad is None for p in model.parameters())
        assert all(p.requires_grad for p in model.parameters())
    finally:
        model.eval()


def test_oar_g_kl_modes_vanish_without_noise(tiny, probe):
    """Without noise the KL's gradient at P_0 is zero (METHODS 4.3, why the noise is there)."""
    model, _ = tiny
    for mode in ("last", "answer_mean"):
        s = gradient_importance(model, probe, mode=mode, noise_std=0.0)
        assert s.abs().max() < 1e-5


def test_oar_g_batched_and_chunked_equal_one_at_a_time(tiny, probe):
    model, tok = tiny
    batched = gradient_importance(model, probe, mode="answer_joint", noise_std=0.0)
    chunked = gradient_importance(model, probe, mode="answer_joint", noise_std=0.0, chunk_size=1)
    torch.testing.assert_close(chunked, batched, atol=1e-5, rtol=1e-4)
    for b, single in enumerate(single_probes(tok)):
        one = gradient_importance(model, single, mode="answer_joint", noise_std=0.0)
        torch.testing.assert_close(right_aligned(batched, b, one), one[0], atol=1e-5, rtol=1e-4)


def test_oar_g_unreachable_token_has_zero_importance(tiny, probe):
    model, _ = tiny
    cut = probe.to("cpu")
    cut.attention_mask = probe.attention_mask.clone()
    cols = probe.reasoning_mask[2].nonzero().flatten()
    j = int(cols[3])
    cut.attention_mask[2, j] = 0
    s = gradient_importance(model, cut, mode="answer_joint", noise_std=0.0)
    assert float(s[2, j]) == 0.0
    assert s[2].max() > 1e-2


# prompts of different lengths (different left padding), reasoning of different lengths, and a
# row without reasoning whose long answer puts the kept logits before another row's reasoning
CACHE_PROMPTS = ["What is 12+7?", "Q", "x", "Compute 2*3 now", "Add 5 and 9, then double it please."]
CACHE_RESPONSES = [
    "12+7 = 19 so \\boxed{19}",
    "3*4=12, \\boxed{12}",
    "\\boxed{123456789012}",  # with chunk_size 2, in the chunk of the next row
    "z\\boxed{6}",
    "5+9=14; 14*2 = 28. The answer: \\boxed{28}",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_oar_g_prefix_cached_equals_naive(tiny, mode, chunk_size):
    """The prefix-KV-cached noisy forward gives the full forward's scores, with the same noise."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, CACHE_PROMPTS, CACHE_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    assert int(probe.reasoning_mask.any(0).long().argmax()) > 0  # the cached path has a prefix
    noise = 0.0 if mode == "answer_joint" else 0.1  # the KL modes need noise to be nonzero
    kw = dict(mode=mode, noise_std=noise, chunk_size=chunk_size)
    cached = gradient_importance(model, probe, generator=torch.Generator().manual_seed(5), **kw)
    naive = gradient_importance(model, probe, generator=torch.Generator().manual_seed(5), naive=True, **kw)
    scale = float(naive.abs().max())
    assert scale > 1e-4  # the comparison is not vacuous
    assert (cached[probe.reasoning_mask] > 0).any() and (cached[~probe.reasoning_mask] == 0).all()
    torch.testing.assert_close(cached, naive, atol=1e-5 * scale, rtol=1e-5)



# groups: the responses of one prompt share its prefix cache although their left padding differs
GROUP_PROMPTS = ["What is 12+7?"] * 3 + ["Add 5 and 9, then double it please."] * 3 + ["x"]
GROUP_RESPONSES = [
    "12+7 = 19 so \\boxed{19}",
    "12+7=20, \\boxed{20}",
    "it is 12 plus 7, which is 19 in all; \\boxed{19}",
    "5+9=14; 14*2 = 28. The answer: \\boxed{28}",
    "28 \\boxed{28}",
    "5+9=14, 14*2=28 so \\boxed{28}",
    "\\boxed{7}",
]


@pytest.mark.parametrize("mode", MODES)
def test_oar_g_prefix_shared_across_a_group_equals_naive(tiny, mode):
    """Rows of one prompt with different left padding gather the prompt's keys from one donor row."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, GROUP_PROMPTS, GROUP_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    pad = probe.input_ids.shape[1] - probe.attention_mask.sum(-1)
    assert len(set(pad[:3].tolist())) == 3  # same prompt, three different paddings
    noise = 0.0 if mode == "answer_joint" else 0.1
    kw = dict(mode=mode, noise_std=noise)
    cached = gradient_importance(model, probe, generator=torch.Generator().manual_seed(3), **kw)
    naive = gradient_importance(model, probe, generator=torch.Generator().manual_seed(3), naive=True, **kw)
    scale = float(naive.abs().max())
    assert scale > 1e-4
    torch.testing.assert_close(cached, naive, atol=1e-5 * scale, rtol=1e-5)

class NoCacheModel(torch.nn.Module):
    """The tiny model without a returned cache (stands in for a model whose cache is not a plain
    DynamicCache)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.inner(**kwargs).logits)


def test_oar_g_without_plain_cache_warns_and_runs_naive(tiny, probe):
    model, _ = tiny
    wrapped = NoCacheModel(model)
    with pytest.warns(UserWarning, match="DynamicCache"):
        got = gradient_importance(wrapped, probe, generator=torch.Generator().manual_seed(1))
    ref = gradient_importance(model, probe, generator=torch.Generator().manual_seed(1), naive=True)
    assert torch.equal(got, ref)


# ------------------------------------------------------------------------------------------
# estimators
# ------------------------------------------------------------------------------------------


def credit_batch(tiny, rewards, group_ids, responses=RESPONSES, prompts=PROMPTS, model=None):
    m, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, prompts, responses)
    return CreditBatch(
        response_ids=r_ids,
        response_mask=r_mask,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids),
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        model=m if model is None else model,
        tokenizer=tok,
    )


@pytest.mark.parametrize("name", ["oar_p", "oar_g"])
def test_estimator_signs_mass_and_no_answer_rows(tiny, name):
    batch = credit_batch(tiny, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    opts = {"conclude": CONC}
    if name == "oar_g":
        opts["seed"] = 0
    res = get_estimator(name)(batch, **opts)
    A = grpo_advantages(batch.rewards, batch.group_ids)
    torch.testing.assert_close(res.seq_advantages, A)
    m = batch.response_mask.bool()
    adv = res.token_advantages
    assert adv.shape == batch.response_ids.shape
    assert (adv[~m] == 0).all()
    for i in range(4):
        assert (torch.sign(adv[i][m[i]]) == torch.sign(A[i])).all()
    probe = build_probe(
        tiny[1], batch.prompt_ids, batch.response_ids, conclude=CONC, prompt_mask=batch.prompt_mask,
        response_mask=batch.response_mask,
    )
    reason = probe.to_response(probe.reasoning_mask.float()).bool()
    w = res.weights
    for i in range(3):  # answered rows: reasoning weights average 1, other response tokens 1
        torch.testing.assert_close(w[i][reason[i]].mean(), torch.tensor(1.0), atol=1e-5, rtol=0)
        assert w[i][reason[i]].std() > 0.05
        assert (w[i][m[i] & ~reason[i]] == 1).all()
        assert (w[i] > 0)[m[i]].all()
    assert (w[3][m[3]] == 1).all()  # no answer: plain GRPO
    assert (w[~m] == 0).all()
    torch.testing.assert_close(adv, A[:, None] * w)
    assert res.stats["probe_fraction"] == pytest.approx(0.75)
    assert res.stats["scored_fraction"] == pytest.approx(0.75)
    assert res.stats["importance_s"] >= 0 and res.stats["probe_s"] >= 0


def test_oar_p_estimator_composes_probe_importance_and_bilevel(tiny):
    model, tok = tiny
    batch = credit_batch(tiny, [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])
    opts = dict(conclude=CONC, quantile=0.5, beta=2.0, floor=0.2, mode="answer_mean", chunk_size=5)
    res = get_estimator("oar_p")(batch, **opts)
    probe = build_probe(
        tok, batch.prompt_ids, batch.response_ids, conclude=CONC, prompt_mask=batch.prompt_mask,
        response_mask=batch.response_mask,
    )
    s = probe.to_response(perturbation_importance(model, probe, mode="answer_mean"))
    reason = probe.to_response(probe.reasoning_mask.float())
    w = bilevel_weights(s, reason, quantile=0.5, beta=2.0, floor=0.2)
    w = torch.where(probe.has_answer[:, None], w, torch.ones_like(w)) * batch.response_mask
    A = grpo_advantages(batch.rewards, batch.group_ids)
    torch.testing.assert_close(res.weights, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.token_advantages, A[:, None] * w, atol=1e-5, rtol=1e-5)


def test_oar_p_answer_joint_uses_influence_size(tiny):
    model, tok = tiny
    batch = credit_batch(tiny, [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0])
    res = get_estimator("oar_p")(batch, conclude=CONC, mode="answer_joint")
    probe = build_probe(
        tok, batch.prompt_ids, batch.response_ids, conclude=CONC, prompt_mask=batch.prompt_mask,
        response_mask=batch.response_mask,
    )
    s = probe.to_response(perturbation_importance(model, probe, mode="answer_joint"))
    reason = probe.to_response(probe.reasoning_mask.float())
    w = bilevel_weights(s.abs(), reason) * batch.response_mask
    torch.testing.assert_close(res.weights[:3], w[:3], atol=1e-5, rtol=1e-5)


class ExplodingModel(torch.nn.Module):
    """A model that fails if it is ever called."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the model must not be called")


@pytest.mark.parametrize("name", ["oar_p", "oar_g"])
def test_zero_advantage_rows_are_not_scored(tiny, name):
    # every group has equal rewards: all A_i == 0, so no importance is computed
    batch = credit_batch(tiny, [1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], model=ExplodingModel())
    res = get_estimator(name)(batch, conclude=CONC)
    assert (res.token_advantages == 0).all()
    m = batch.response_mask.bool()
    assert (res.weights[m] == 1).all()
    assert res.stats["scored_fraction"] == 0.0 and res.stats["probe_fraction"] == pytest.approx(0.75)


def test_partially_zero_advantages_skip_rows(tiny):
    # group 1 (rows 2, 3) has equal rewards -> only rows 0, 1 are scored
    batch = credit_batch(tiny, [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    res = get_estimator("oar_p")(batch, conclude=CONC)
    assert res.stats["scored_fraction"] == pytest.approx(0.5)
    m = batch.response_mask.bool()
    assert (res.weights[2][m[2]] == 1).all() and (res.token_advantages[2:] == 0).all()
    assert res.weights[0][m[0]].std() > 0.05


@pytest.mark.parametrize("name", ["oar_p", "oar_g"])
def test_estimator_option_errors(tiny, name):
    batch = credit_batch(tiny, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    with pytest.raises(TypeError, match="bogus"):
        get_estimator(name)(batch, bogus=1)
    with pytest.raises(ValueError, match="mode"):
        get_estimator(name)(batch, mode="nope")
    batch.model = None
    with pytest.raises(ValueError, match="model"):
        get_estimator(name)(batch)
    if name == "oar_p":
        with pytest.raises(TypeError, match="noise_std"):
            get_estimator(name)(credit_batch(tiny, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0]), noise_std=0.1)


def test_oar_g_estimator_seed_reproducible(tiny):
    batch = credit_batch(tiny, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    a = get_estimator("oar_g")(batch, conclude=CONC, seed=7)
    b = get_estimator("oar_g")(batch, conclude=CONC, seed=7)
    torch.testing.assert_close(a.token_advantages, b.token_advantages, atol=0, rtol=0)


def test_random_batch_cached_equals_naive(tiny):
    """Random reasoning lengths, prompts and answer lengths (different t per chunk)."""
    model, tok = tiny
    rng = random.Random(0)
    chars = "abcdefghij0123456789 +-*="
    prompts, responses = [], []
    for _ in range(6):
        prompts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 9))))
        reason = "".join(rng.choice(chars) for _ in range(rng.randint(0, 14)))
        ans = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
        responses.append(f"{reason}\\boxed{{{ans}}}")
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, prompts, responses)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    for mode in MODES:
        a = perturbation_importance(model, probe, mode=mode, chunk_size=4)
        b = perturbation_importance(model, probe, mode=mode, naive=True, chunk_size=64)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# OAR-G: clean forward only where needed, per-response noise, draws and integrated gradients
# ------------------------------------------------------------------------------------------

from oar.credit.importance import draw_noise, noise_keys  # noqa: E402


def reference_outcome_embeds(model, x: torch.Tensor, ids: torch.Tensor, n_answer: int, mode: str):
    """``reference_outcome`` of one unpadded sequence from its input embeddings ``x`` (L, H)."""
    L = ids.numel()
    logits = model(inputs_embeds=x[None], position_ids=torch.arange(L)[None]).logits[0].float()
    return _outcome_of_logits(logits, ids, n_answer, mode)


def reference_oar_g(model, ids, reasoning, n_answer, mode, *, seed, key, noise_std, draws=1, baseline=None):
    """OAR-G of one unpadded sequence by the formula, with the clean forward in every mode:
    mean over draws of |g . e| (no baseline) or |mean g . (e - b)| (path from ``b``)."""
    emb = model.get_input_embeddings()
    e = emb(ids[None])[0].detach()
    H = e.shape[-1]
    with torch.no_grad():
        out0 = reference_outcome_embeds(model, e, ids, n_answer, mode)
    cols = reasoning.nonzero().flatten()
    noise = draw_noise(seed, key, cols.numel(), H, draws)
    b = None
    if baseline is not None:
        b = emb(torch.tensor([0]))[0].detach() if baseline == "pad" else torch.zeros(H)
    grads = []
    for j in range(draws):
        x = e.clone()
        if b is not None:
            x[cols] = b + (j + 0.5) / draws * (e[cols] - b)
        x[cols] = x[cols] + noise_std * noise[j]
        x.requires_grad_(True)
        out1 = reference_outcome_embeds(model, x, ids, n_answer, mode)
        J = out0 - out1 if mode == "answer_joint" else (out0.exp() * (out0 - out1)).sum()
        grads.append(torch.autograd.grad(J, x)[0])
    g = torch.stack(grads)  # (k, L, H)
    if b is None:
        s = (g * e).sum(-1).abs().mean(0)
    else:
        s = (g.mean(0) * (e - b)).sum(-1).abs()
    return s * reasoning


def count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls, handle


@pytest.mark.parametrize(
    "mode,draws,baseline,noise",
    [
        ("answer_joint", 1, None, 0.1),
        ("answer_mean", 3, None, 0.1),
        ("last", 2, None, 0.1),
        ("answer_mean", 2, "pad", 0.0),
        ("answer_joint", 2, "zero", 0.05),
    ],
)
def test_oar_g_matches_reference_per_response_noise(tiny, mode, draws, baseline, noise):
    """Batched, prefix-cached OAR-G (per-response noise keyed by row) equals the formula run on
    each unpadded sequence with its own noise; answer_joint skips the clean forward (phi_0 is a
    constant of J) and still gives the scores of the reference, which runs it."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, GROUP_PROMPTS, GROUP_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    keys = torch.tensor([11, 12, 13, 21, 22, 23, 31])
    got = gradient_importance(
        model, probe, mode=mode, noise_std=noise, seed=5, row_keys=keys, draws=draws, baseline=baseline
    )
    for b in range(probe.input_ids.shape[0]):
        real = probe.attention_mask[b].bool()
        ref = reference_oar_g(
            model, probe.input_ids[b][real], probe.reasoning_mask[b][real], int(probe.answer_length[b]), mode,
            seed=5, key=int(keys[b]), noise_std=noise, draws=draws, baseline=baseline,
        )
        scale = float(ref.abs().max())
        if probe.reasoning_mask[b].any():
            assert scale > 1e-4
        torch.testing.assert_close(got[b][real], ref, atol=1e-4 * max(scale, 1e-6), rtol=1e-4)


@pytest.mark.parametrize("mode,expected", [("answer_joint", 2), ("answer_mean", 3), ("last", 3)])
def test_oar_g_clean_forward_only_in_kl_modes(tiny, mode, expected):
    """Model calls per chunk: the prompt prefix, the clean forward (KL modes only), the gradient
    forward; draws ride in the gradient forward's batch, not in more calls."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, GROUP_PROMPTS, GROUP_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    calls, handle = count_forwards(model)
    try:
        gradient_importance(model, probe, mode=mode, seed=0)
        assert len(calls) == expected
        calls.clear()
        gradient_importance(model, probe, mode=mode, seed=0, draws=4)
        assert len(calls) == expected
        assert calls[-1]["inputs_embeds"].shape[0] == 4 * int(probe.has_answer.sum())
    finally:
        handle.remove()


@pytest.mark.parametrize("draws,baseline", [(1, None), (3, None), (2, "pad")])
def test_oar_g_scores_do_not_depend_on_chunking(tiny, draws, baseline):
    """Each response's noise comes from its own generator: chunk_size 1, 2 or all, and the
    response alone in its own probe (other padding), give the same scores."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, CACHE_PROMPTS, CACHE_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    kw = dict(mode="answer_mean", noise_std=0.1, seed=9, draws=draws, baseline=baseline)
    full = gradient_importance(model, probe, **kw)
    assert (full[probe.reasoning_mask] > 0).any()
    scale = float(full.abs().max())
    for cs in (1, 2):
        torch.testing.assert_close(gradient_importance(model, probe, chunk_size=cs, **kw), full,
                                   atol=1e-5 * scale, rtol=1e-4)
    b = 4  # the longest prompt: alone, it loses its left padding
    p1, m1, r1, rm1 = make_batch(tok, CACHE_PROMPTS[b : b + 1], CACHE_RESPONSES[b : b + 1])
    one = build_probe(tok, p1, r1, conclude=CONC, prompt_mask=m1, response_mask=rm1)
    alone = gradient_importance(model, one, row_keys=torch.tensor([b]), **kw)
    torch.testing.assert_close(alone[0], right_aligned(full, b, alone), atol=1e-5 * scale, rtol=1e-4)
    other = gradient_importance(model, probe, **{**kw, "seed": 10})
    assert not torch.allclose(other, full)


def test_oar_g_draws_nest_and_path_is_deterministic(tiny, probe):
    model, _ = tiny
    # draw j of k is the j-th block of the response's generator: the first draw does not move
    a = draw_noise(3, 7, 5, 4, 1)
    b = draw_noise(3, 7, 5, 4, 3)
    assert torch.equal(a[0], b[0]) and not torch.equal(b[0], b[1])
    # a path from a baseline needs no noise: without it the scores are deterministic and nonzero
    s1 = gradient_importance(model, probe, mode="answer_mean", noise_std=0.0, baseline="pad", draws=2)
    s2 = gradient_importance(model, probe, mode="answer_mean", noise_std=0.0, baseline="pad", draws=2)
    assert torch.equal(s1, s2) and (s1[probe.reasoning_mask] > 0).any()


def test_noise_keys_rank_within_group():
    k = noise_keys(torch.tensor([4, 4, 7, 4, 7]))
    assert len(set(k.tolist())) == 5
    sub = noise_keys(torch.tensor([4, 7]))  # a row's key depends on its group and rank only
    assert sub[0] == k[0] and sub[1] == k[2]


def test_oar_g_bad_new_arguments_raise(tiny, probe):
    model, _ = tiny
    with pytest.raises(ValueError, match="draws"):
        gradient_importance(model, probe, draws=0)
    with pytest.raises(ValueError, match="baseline"):
        gradient_importance(model, probe, baseline="mean")
    with pytest.raises(ValueError, match="row_keys"):
        gradient_importance(model, probe, row_keys=torch.arange(2))


def test_oar_g_estimator_step_seed_chunking_and_variant(tiny):
    batch = credit_batch(tiny, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    est = get_estimator("oar_g")
    batch.seed, batch.step = 3, 5
    a = est(batch, conclude=CONC, noise_std=0.1)
    b = est(batch, conclude=CONC, noise_std=0.1, chunk_size=1)
    torch.testing.assert_close(a.weights, b.weights, atol=1e-4, rtol=1e-4)  # float rounding only
    batch.step = 6  # another step: other noise
    c = est(batch, conclude=CONC, noise_std=0.1)
    assert not torch.allclose(a.weights, c.weights)
    # the variant's options reach gradient_importance
    d = est(batch, conclude=CONC, mode="answer_joint", draws=2, baseline="pad", noise_std=0.0)
    e = est(batch, conclude=CONC, mode="answer_joint", draws=2, noise_std=0.0)
    assert not torch.allclose(d.weights, e.weights)
    m = batch.response_mask.bool()
    assert (d.weights[3][m[3]] == 1).all() and d.weights[0][m[0]].std() > 0.05


def test_oar_p_runs_no_padding_queries(tiny):
    """OAR-P's perturbed forwards (those with a prefix cache) compute only real tokens: every
    query column's attention mask is 1 (left padding stays in the cached prefix)."""
    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, CACHE_PROMPTS, CACHE_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    calls, handle = count_forwards(model)
    try:
        perturbation_importance(model, probe, mode="last", chunk_size=7)
    finally:
        handle.remove()
    pert = [c for c in calls if c.get("cache", c.get("past_key_values")) is not None]
    assert len(pert) >= 2
    for c in pert:
        q = c["input_ids"].shape[1]
        assert bool(c["attention_mask"][:, -q:].bool().all())



@pytest.mark.parametrize("draws", [1, 2])
def test_oar_g_chunks_by_run_length_give_the_same_scores_with_less_padding(tiny, draws):
    """chunk_tokens groups rows of similar run length: the scores are those of one chunk (each
    response has its own noise), and the chunks compute fewer positions than one left-padded chunk."""
    from oar.credit.importance.common import answered
    from oar.credit.importance.oar_g import _chunks

    model, tok = tiny
    p_ids, p_mask, r_ids, r_mask = make_batch(tok, CACHE_PROMPTS, CACHE_RESPONSES)
    probe = build_probe(tok, p_ids, r_ids, conclude=CONC, prompt_mask=p_mask, response_mask=r_mask)
    kw = dict(mode="answer_joint", noise_std=0.1, seed=9, draws=draws)
    one = gradient_importance(model, probe, **kw)
    assert (one[probe.reasoning_mask] > 0).any()
    rows, sub = answered(probe)
    L = probe.reasoning_mask.shape[1]
    first = probe.reasoning_mask.long().argmax(-1)

    def computed(chunks):  # rows x (L - the chunk's first reasoning column)
        return sum(len(c) * (L - int(first[c].min())) for c in chunks)

    budget = computed([rows]) * draws // 2  # forces at least two chunks
    chunks = _chunks(sub, rows, None, budget, draws)
    assert len(chunks) >= 2 and sorted(torch.cat(chunks).tolist()) == sorted(rows.tolist())
    assert computed(chunks) < computed([rows])
    grouped = gradient_importance(model, probe, chunk_tokens=budget, **kw)
    torch.testing.assert_close(grouped, one, atol=1e-5 * float(one.abs().max()), rtol=1e-4)
