"""``rollout.sampler``: the lean sampling loop gives transformers ``generate``'s rollouts.

``lean`` must equal ``hf`` (``model.generate``) exactly for a seed: tokens, masks, texts, log-probs,
truncation flags, and the RNG state left behind (the next call's samples depend on it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from oar.models.tiny import build_tiny
from oar.rollout import (
    HFEngine,
    multinomial_rows,
    generate_per_prompt,
    lean_generate,
    lean_unsupported,
    make_engine,
)
from oar.rollout.hf import prompt_heads

#: prompts of different lengths (left padding in a batch)
PROMPTS = ["Compute 1+2.\n", "Compute 47+18-25.\n", "What is 3*4?\n", "x\n"]
GREEDY_PROMPTS = PROMPTS + ["Compute 12-7+30.\n", "9*9\n"]
FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "prompt_index", "truncated")


def _sampling_model():
    """A tiny random model whose eos logit is scaled up, so sampled responses stop at varied lengths."""
    model, tok = build_tiny(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=1)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 8.0  # tied: the input embedding too
    return model, tok


def _greedy_model():
    """A tiny random model with sharpened weights (greedy paths that do not collapse to one character)
    and three more stop tokens, so greedy responses stop at varied lengths."""
    model, tok = build_tiny(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20.0 ** 0.5)
    model.generation_config.eos_token_id = [tok.eos_token_id] + tok.convert_tokens_to_ids(["S", "M", "["])
    return model, tok


def _rollouts(model, tok, sampler, prompts=PROMPTS, **kw):
    engine = HFEngine(model, tok, batch_size=24, sampler=sampler)
    assert engine.sampler == sampler
    ro = engine.generate(prompts, **kw)
    return ro, torch.rand(3)  # the RNG state the call leaves, as a draw


def _assert_same(a, b):
    for k in FIELDS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert a.texts == b.texts


def _no_generate(model):
    """Make ``model.generate`` fail: the lean path must not call it."""

    def boom(*args, **kwargs):
        raise AssertionError("the lean sampler called model.generate")

    model.generate = boom


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.9), (0.6, 0.9)])
def test_lean_sampling_equals_generate(temperature, top_p):
    model, tok = _sampling_model()
    kw = dict(n=8, temperature=temperature, top_p=top_p, max_new_tokens=40, seed=7)
    ref, ref_next = _rollouts(model, tok, "hf", **kw)
    _no_generate(model)
    lean, lean_next = _rollouts(model, tok, "lean", **kw)
    _assert_same(ref, lean)
    assert torch.equal(ref_next, lean_next)  # same RNG stream consumed (32 rows in two calls: 24 + 8)
    # the comparison proves something: left-padded prompts, varied non-empty responses, some stopped
    # at eos and some cut at max_new_tokens, real log-probs
    assert (ref.prompt_mask == 0).any()
    lengths = ref.response_mask.sum(1)
    assert lengths.min() >= 1 and len(set(lengths.tolist())) >= 5
    assert ref.truncated.any() and not ref.truncated.all()
    assert (ref.logprobs[ref.response_mask.bool()] < 0).all()
    assert (ref.logprobs[~ref.response_mask.bool()] == 0).all()


def test_top_p_truncates():
    """top_p 0.9 changes the samples of the same seed (the warper is applied, not skipped)."""
    model, tok = _sampling_model()
    kw = dict(n=8, temperature=1.0, max_new_tokens=40, seed=7)
    full, _ = _rollouts(model, tok, "lean", top_p=1.0, **kw)
    nucleus, _ = _rollouts(model, tok, "lean", top_p=0.9, **kw)
    assert not torch.equal(full.response_ids, nucleus.response_ids)


def test_lean_greedy_equals_generate():
    model, tok = _greedy_model()
    kw = dict(n=8, greedy=True, max_new_tokens=40, seed=0, prompts=GREEDY_PROMPTS)
    ref, ref_next = _rollouts(model, tok, "hf", **kw)
    _no_generate(model)
    lean, lean_next = _rollouts(model, tok, "lean", **kw)
    _assert_same(ref, lean)
    assert torch.equal(ref_next, lean_next)  # greedy draws nothing
    assert len(ref.texts) == len(GREEDY_PROMPTS)  # greedy: one response per prompt
    lengths = ref.response_mask.sum(1)
    assert lengths.min() >= 1 and len(set(lengths.tolist())) >= 3
    assert ref.truncated.any() and not ref.truncated.all()
    assert (ref.logprobs[ref.response_mask.bool()] <= 0).all() and (ref.logprobs < 0).any()


def test_lean_generate_per_prompt_equals_generate():
    """One prompt per call: no padding, so the forwards get no attention mask (as in generate)."""
    model, tok = _sampling_model()
    kw = dict(seeds=[3, 4, 5, 6], pad_id=tok.pad_token_id, n=4, temperature=1.0, top_p=1.0, max_new_tokens=30)
    ref = generate_per_prompt(HFEngine(model, tok, sampler="hf"), PROMPTS, **kw)
    _no_generate(model)
    lean = generate_per_prompt(HFEngine(model, tok, sampler="lean"), PROMPTS, **kw)
    _assert_same(ref, lean)
    assert len(set(ref.response_mask.sum(1).tolist())) >= 3


def test_lean_compact_is_deterministic_and_matches_generate_here():
    """``lean_compact`` drops finished rows; on this CPU model its samples equal generate's and its
    log-probs agree to float rounding (not promised in general: the kernels may depend on batch size)."""
    model, tok = _sampling_model()
    kw = dict(n=8, temperature=0.6, top_p=0.9, max_new_tokens=40, seed=7)
    ref, ref_next = _rollouts(model, tok, "hf", **kw)
    _no_generate(model)
    a, a_next = _rollouts(model, tok, "lean_compact", **kw)
    b, _ = _rollouts(model, tok, "lean_compact", **kw)
    for k in FIELDS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k  # deterministic for a seed
    assert torch.equal(a.response_ids, ref.response_ids) and a.texts == ref.texts
    assert torch.equal(a.response_mask, ref.response_mask) and torch.equal(a.truncated, ref.truncated)
    torch.testing.assert_close(a.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(a_next, ref_next)  # the full batch's random draws, also after compaction


def test_lean_compact_drops_finished_rows():
    """The compacting loop runs the prompt forward once per distinct prompt and later forwards on fewer
    rows (it does something)."""
    model, tok = _sampling_model()
    batch_sizes: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    enc = tok(PROMPTS * 4, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(7)
    tokens, _ = lean_generate(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=40,
                              eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, compact=True)
    assert batch_sizes[0] == 4  # the 4 distinct prompts of the 16 rows
    assert batch_sizes[1] == 16 and min(batch_sizes) < 12
    assert batch_sizes[1:] == sorted(batch_sizes[1:], reverse=True)
    assert tokens.shape[0] == 16


#: Monte-Carlo-like states: two rendered prompts, each followed by response prefixes (one empty)
HEADS = ["Compute 47+18-25.\n", "What is 3*4?\n"]
STATES = [(h, h + tail) for h in HEADS for tail in ["", "4", "47+18=65, ", "47+1", "3*"]]


@pytest.mark.parametrize("greedy", [True, False])
def test_lean_compact_shared_prefix_equals_lean(greedy):
    """``shared_prefix``: each distinct head's forward once, then the tails; the same continuations as
    ``lean`` (one forward of every whole prompt) on this CPU model, log-probs to float rounding."""
    model, tok = _greedy_model() if greedy else _sampling_model()
    heads, prompts = [h for h, _ in STATES], [p for _, p in STATES]
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=30, seed=5, greedy=greedy)
    ref = HFEngine(model, tok, batch_size=64, sampler="lean").generate(prompts, **kw)
    rows: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    got = HFEngine(model, tok, batch_size=64, sampler="lean_compact").generate(prompts, shared_prefix=heads, **kw)
    n = 1 if greedy else 3
    longest = max(len(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts)
    assert rows[0][0] == len(HEADS)  # one forward row per distinct head
    assert rows[1][0] == len(prompts) * n and rows[1][1] < longest - 5  # the tails only
    assert torch.equal(got.response_ids, ref.response_ids) and got.texts == ref.texts
    assert torch.equal(got.response_mask, ref.response_mask)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    assert len(set(ref.texts)) >= 4  # the states continue differently: the tails were seen


def test_prompt_heads_falls_back_to_the_whole_prompt():
    """A prefix whose tokens are not the prompt's leading tokens makes the whole prompt the head."""
    _, tok = _sampling_model()
    prompts = ["Compute 1+2.\n12", "x\ny"]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=True)
    heads = prompt_heads(tok, enc["input_ids"], enc["attention_mask"], ["Compute 1+2.\n", "zz"],
                         add_special_tokens=True)
    n_head = len(tok("Compute 1+2.\n", add_special_tokens=True)["input_ids"])
    assert heads.tolist() == [n_head, int(enc["attention_mask"][1].sum())]


def test_multinomial_rows_is_torch_multinomial():
    """torch draws one sample as argmax(probs / Exp(1) noise): the rows of a full-batch draw."""
    probs = torch.softmax(torch.randn(6, 11, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    rows = torch.tensor([1, 4, 5])
    torch.manual_seed(3)
    full = torch.multinomial(probs, 1).squeeze(1)
    after_full = torch.rand(2)
    torch.manual_seed(3)
    part = multinomial_rows(probs[rows], rows, 6)
    assert torch.equal(part, full[rows])
    assert torch.equal(torch.rand(2), after_full)


def test_lean_falls_back_to_generate_for_other_processors():
    model, tok = _sampling_model()
    assert lean_unsupported(model) == []
    model.generation_config.repetition_penalty = 1.3
    assert lean_unsupported(model) == ["repetition_penalty"]
    with pytest.warns(UserWarning, match="repetition_penalty"):
        engine = HFEngine(model, tok, sampler="lean")
    assert engine.sampler == "hf"


def test_sampler_setting():
    model, tok = _sampling_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HFEngine(model, tok).sampler == "lean"  # the default
        assert make_engine("hf", model, tok, sampler="hf").sampler == "hf"
        assert make_engine("hf", model, tok, sampler="lean_compact").sampler == "lean_compact"
    with pytest.raises(ValueError, match="rollout.sampler"):
        HFEngine(model, tok, sampler="fast")
