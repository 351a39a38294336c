"""Copy-aware credit: ``mc_value`` (Monte-Carlo step values, VinePPO) and OAR-P's tied perturbation,
on hand-built responses where a wrong value is restated in the next step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oar.credit import get_estimator

from helpers import credit_batch as _batch

# one group of "Compute 4+3-2." (= 5): a right response and one whose first result (8) is wrong and
# restated as the next step's operand
RESPONSES = ["4+3=7, so 7-2=5. \\boxed{5}", "4+3=8, 8-2=6. \\boxed{6}"]
REWARDS = [1.0, 0.0]


class PrefixEngine:
    """A stand-in policy: from a prefix that wrote an 8 it ends at the wrong answer 6, otherwise at 5.

    Records every call, so a test can check that all prefixes went out in one batched call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def generate(self, prompts, *, n, temperature, top_p, max_new_tokens, greedy=False, seed=None,
                 shared_prefix=None):
        self.calls.append((list(prompts), n))
        assert shared_prefix is not None and all(p.startswith(h) for p, h in zip(prompts, shared_prefix, strict=True))
        texts, index = [], []
        for i, p in enumerate(prompts):
            head = p.split("\n", 1)[1]  # the response prefix after the prompt "Compute ...\n"
            for _ in range(n):
                texts.append(" \\boxed{6}" if "8" in head else " \\boxed{5}")
                index.append(i)
        return SimpleNamespace(texts=texts, prompt_index=torch.tensor(index),
                               response_mask=torch.ones(len(texts), 3, dtype=torch.long))


def _context(engine, n_rows):
    from oar.credit.mc_value import ContinuationContext
    from oar.reward.score import score_batch

    return ContinuationContext(engine=engine, prompts=["Compute 4+3-2.\n"] * n_rows, golds=["5"] * n_rows,
                               score=lambda texts, golds: score_batch(texts, golds, workers=1), max_new_tokens=40)


def test_step_boundaries_split_results_from_their_copies():
    from oar.credit.mc_value import segment_ids, step_boundaries

    b = _batch(RESPONSES, REWARDS)
    bounds, texts, chars = step_boundaries(b.tokenizer, b.response_ids, b.response_mask)
    # "4+3=|8, |8-2=|6. |\boxed{6}": the wrong 8 (index 4) and its copy (index 7) in different segments;
    # the last boundary is where the answer starts
    assert bounds[1] == [4, 7, 11, 14]
    assert [texts[1][:c] for c in chars[1]] == ["4+3=", "4+3=8, ", "4+3=8, 8-2=", "4+3=8, 8-2=6. "]
    seg = segment_ids(bounds, b.response_mask)
    assert seg[1, :16].tolist() == [0] * 4 + [1] * 3 + [2] * 4 + [3] * 3 + [4] * 2
    assert (seg[b.response_mask == 0] == -1).all()
    # the answer is not a step (reasoning_only) unless asked
    bounds_all, _, _ = step_boundaries(b.tokenizer, b.response_ids, b.response_mask, reasoning_only=False, max_steps=2)
    assert bounds_all[1] == [4, 7]


class _PieceTokenizer:
    """A stand-in for a byte-level BPE tokenizer: token ``i`` decodes to ``pieces[i]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, **_):
        return "".join(self.pieces[i] for i in ids)


def test_step_boundaries_on_bpe_tokens_that_begin_inside_a_match():
    from oar.credit.mc_value import step_boundaries

    # SmolLM2's tokens of "9-8=1, so 1-7=-6. \boxed{-6}": " so" begins at the space of ", " and "=-"
    # at the "=": each opens the next segment, as its first character after the match does
    pieces = ["9", "-", "8", "=", "1", ",", " so", " ", "1", "-", "7", "=-", "6", ".", " \\", "box", "ed", "{",
              "-", "6", "}"]
    ids = torch.arange(len(pieces))[None]
    bounds, texts, chars = step_boundaries(_PieceTokenizer(pieces), ids, torch.ones_like(ids))
    assert texts[0] == "9-8=1, so 1-7=-6. \\boxed{-6}"
    assert bounds[0] == [4, 6, 11, 14]
    assert [texts[0][c:] for c in chars[0]][1:3] == [" so 1-7=-6. \\boxed{-6}", "=-6. \\boxed{-6}"]


def test_mc_value_blames_the_first_mistake_not_its_copy():
    engine = PrefixEngine()
    batch = _batch(RESPONSES, REWARDS)
    batch.continuations = _context(engine, 2)
    res = get_estimator("mc_value")(batch, k=2)
    # every prefix of the batch in one engine call, k continuations each; "4+3=" is shared by both rows:
    # one state, continued once
    assert len(engine.calls) == 1 and engine.calls[0][1] == 2 and len(engine.calls[0][0]) == 7
    adv = res.token_advantages[1]
    std = torch.tensor(REWARDS).std().item()
    # V: group mean 0.5, then 1 ("4+3=" continues right), then 0 after the 8 is written; reward 0
    assert adv[:4].tolist() == pytest.approx([0.5 / std] * 4)
    assert adv[4:7].tolist() == pytest.approx([-1.0 / std] * 3)  # the 8 and its separator
    assert adv[7:].abs().max().item() == pytest.approx(0.0)  # the copy of the 8 and the rest: no blame
    # the correct response: only the first segment moves the value (0.5 -> 1)
    assert res.token_advantages[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert res.stats["mc_prefixes"] == 8 and res.stats["mc_states"] == 7 and res.stats["mc_continuations"] == 14
    # seq_weight adds GRPO's advantage on every token
    both = get_estimator("mc_value")(batch, k=1, seq_weight=1.0)
    m = batch.response_mask.float()
    grpo = get_estimator("grpo")(batch).token_advantages
    assert torch.allclose(both.token_advantages - res.token_advantages, grpo * m, atol=1e-5)


class WrongEngine(PrefixEngine):
    """A policy that ends at the wrong answer 6 from every prefix, the bare prompt included."""

    def generate(self, prompts, **kw):
        ro = super().generate(prompts, **kw)
        ro.texts = [" \\boxed{6}"] * len(ro.texts)
        return ro


def test_root_continuation_values_the_bare_prompt_too():
    """``root: continuation``: V_0 from the policy's continuation of the bare prompt (one state per
    prompt), so a response's deltas sum to r - V_0, and a mistake the policy makes from the start
    is blamed on no step; ``root: group`` (the default) blames the first segment for it."""
    from oar.credit.mc_value import mc_step_credit

    b = _batch(RESPONSES, REWARDS)
    args = (b.tokenizer, b.response_ids, b.response_mask, torch.tensor(REWARDS), torch.zeros(2, dtype=torch.long))
    engine = PrefixEngine()
    delta, values, stats = mc_step_credit(_context(engine, 2), *args, greedy=True, norm_by_std=False, root="continuation")
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == 8  # the 7 states of the batch and the bare prompt
    assert values[:, 0].tolist() == [1.0, 1.0] and stats["mc_states"] == 8
    assert delta[1, 4:7].tolist() == [-1.0] * 3 and delta[1].sum().item() == pytest.approx(-1.0 * 3)
    assert delta[0].abs().max().item() == 0.0  # the right response moves no value: 1 all along
    wrong = WrongEngine()
    d_root, v_root, _ = mc_step_credit(_context(wrong, 2), *args, greedy=True, norm_by_std=False, root="continuation")
    assert v_root[1, :4].tolist() == [0.0] * 4 and d_root[1].abs().max().item() == 0.0
    d_group, _, _ = mc_step_credit(_context(wrong, 2), *args, greedy=True, norm_by_std=False)
    assert d_group[1, :4].tolist() == [-0.5] * 4  # group mean 0.5 -> 0 on the first segment
    with pytest.raises(ValueError, match="root must be one of"):
        mc_step_credit(_context(wrong, 2), *args, root="prompt")


def test_step_deltas_telescope_to_the_grpo_advantage():
    """Per segment, the deltas of a response sum to (r - mean) / std: VinePPO redistributes GRPO's credit."""
    from oar.credit.advantages import grpo_advantages
    from oar.credit.mc_value import group_stats, segment_ids, step_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    bounds = [[2, 5], [3], [], [1, 2, 3], [4], [2]]
    mask = torch.ones(6, 8)
    mean, std = group_stats(rewards, groups)
    values = torch.zeros(6, 6, dtype=torch.float64)
    for i, bs in enumerate(bounds):
        row = [mean[i].item(), *torch.rand(len(bs), generator=g).tolist(), rewards[i].item()]
        values[i, : len(row)] = torch.tensor(row)
    seg = segment_ids(bounds, mask)
    delta = step_advantages(values, seg, mask) / std[:, None]
    per_segment = [sum(delta[i, bs_start].item() for bs_start in [0, *bounds[i]]) for i in range(6)]
    assert per_segment == pytest.approx(grpo_advantages(rewards, groups).tolist(), abs=1e-5)


def test_only_mc_value_is_registered_as_needing_continuations():
    """The trainer builds CreditBatch.continuations only for estimators registered with
    needs_continuations (test_copy_aware_methods_train checks a run of another one builds none)."""
    from oar.credit import estimator_needs_continuations, list_estimators

    assert estimator_needs_continuations("mc_value")
    assert [n for n in list_estimators() if estimator_needs_continuations(n)] == ["mc_value"]


def test_mc_value_errors_name_what_is_missing():
    batch = _batch(RESPONSES, REWARDS)
    with pytest.raises(ValueError, match="continuations"):
        get_estimator("mc_value")(batch)
    batch.continuations = _context(PrefixEngine(), 2)
    with pytest.raises(TypeError, match="unknown option"):
        get_estimator("mc_value")(batch, K=2)
    with pytest.raises(ValueError, match="step_split"):
        get_estimator("mc_value")(batch, step_split="(")


def test_value_ties_and_tied_perturbation():
    from oar.credit.importance import perturbation_importance, value_tie_ids
    from oar.credit.probe import build_probe
    from oar.models.tiny import build_tiny

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    b = _batch(RESPONSES, REWARDS)
    probe = build_probe(b.tokenizer, b.prompt_ids, b.response_ids, prompt_mask=b.prompt_mask,
                        response_mask=b.response_mask)
    ties = value_tie_ids(b.tokenizer, probe, b.response_ids, b.response_mask)
    t_resp = probe.to_response(ties.float(), b.response_ids.shape[1]).long()
    # "4+3=8, 8-2=6": the 8 at 4 and its copy at 7 share an id; 4, 3, 2 and 6 have their own
    row = t_resp[1]
    assert row[4] == row[7] != 0 and len({int(row[i]) for i in (0, 2, 4, 9, 11)}) == 5
    plain = perturbation_importance(model, probe, mode="answer_joint")
    tied = perturbation_importance(model, probe, mode="answer_joint", tie_ids=ties)
    naive = perturbation_importance(model, probe, mode="answer_joint", tie_ids=ties, naive=True)
    assert torch.allclose(tied, naive, atol=1e-5)  # the cached prefix stays valid: ties lie after t
    p_r, t_r = (probe.to_response(x, b.response_ids.shape[1])[1] for x in (plain, tied))
    assert t_r[4] != pytest.approx(p_r[4].item())  # the 8 is masked together with its copy
    assert t_r[7] == pytest.approx(p_r[7].item())  # the copy has no later copy: unchanged
    assert t_r[0] == pytest.approx(p_r[0].item())  # the 4 at 0 is never restated


@pytest.mark.parametrize("method", [{"recipe": "grpo", "credit": "mc_value", "k": 2, "root": "continuation",
                                     "refine": {"mode": "answer_joint"}},
                                    {"recipe": "grpo", "credit": "oar_p", "tie": "values", "mode": "answer_joint"}])
def test_copy_aware_methods_train(small_config, tmp_path, monkeypatch, method):
    """Both run in the training loop (mc_value: continuations sampled and scored every step; OAR-P
    builds none); the credit itself is checked on hand-built responses above."""
    import json

    import oar.trainer.step
    from oar.models.tiny import build_tiny
    from oar.trainer.loop import train

    if method["credit"] != "mc_value":  # not registered with needs_continuations: the trainer builds none
        monkeypatch.setattr(oar.trainer.step, "continuation_context", lambda *a, **k: pytest.fail("continuations built"))

    small_config["methods"]["copy_aware"] = method
    init = tmp_path / "init"
    model, tok = build_tiny(**small_config["model"]["tiny"], seed=0)
    model.save_pretrained(init)
    tok.save_pretrained(init)
    train(small_config, "copy_aware", 0, tmp_path / "run", init=str(init), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time_step" in r]
    assert len(steps) == small_config["train"]["steps"]
    if method["credit"] == "mc_value":
        assert all(r["credit_mc_continuations"] > 0 and r["credit_mc_tokens"] > 0 for r in steps)
        assert all(r["credit_refine_s"] > 0 for r in steps)  # OAR-G's pass ran every step
    else:  # the tied perturbation ran (scores computed for the responses with an answer)
        assert all("credit_importance_s" in r for r in steps)


def test_refine_keeps_the_step_order_and_orders_tokens_inside_a_step():
    """The refined blame (mc_value ties broken by OAR-G) ranks steps as the blame does and, inside a
    step, tokens as OAR-G does, whatever the scales (step values 1 / (k * group size) apart)."""
    from oar.attribution.signals import refine_within_steps

    gen = torch.Generator().manual_seed(0)
    seg = torch.randint(0, 5, (64, 30), generator=gen).sort(dim=1).values
    blame = torch.randint(-8, 9, (64, 5), generator=gen).float().gather(1, seg) / 64  # k 8, group of 8
    g = torch.rand(64, 30, generator=gen) * 10 ** torch.randint(-6, 3, (64, 1), generator=gen).float()
    out = refine_within_steps(blame, g)
    i, j = torch.triu_indices(30, 30, 1)
    bi, bj, oi, oj, gi, gj = blame[:, i], blame[:, j], out[:, i], out[:, j], g[:, i], g[:, j]
    differ = bi != bj
    assert differ.any() and (~differ).any()
    assert torch.equal((oi > oj)[differ], (bi > bj)[differ])
    same = ~differ & (gi != gj)
    assert torch.equal((oi > oj)[same], (gi > gj)[same])
    assert ((out - blame).abs() <= 1e-3 + 1e-6).all()
    with pytest.raises(ValueError, match="refine_weight"):
        refine_within_steps(blame, g, 0.0)


def test_refined_mc_value_signal_breaks_a_steps_ties_by_oar_g():
    """In the attribution benchmark, ``mc_value`` with ``refine`` scores the blamed step's tokens in
    OAR-G's order (one extra OAR-G pass), and a refine that is not OAR-G's options is refused."""
    from oar.attribution.signals import compute_signals
    from oar.attribution.specs import signal_specs
    from oar.models.tiny import build_tiny

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    b = _batch(RESPONSES, REWARDS)
    signals = [{"name": "plain", "kind": "mc_value", "greedy": True},
               {"name": "refined", "kind": "mc_value", "greedy": True, "refine": {"mode": "answer_joint"}},
               {"name": "g", "kind": "oar_g", "mode": "answer_joint"}]
    scores, seconds, info = compute_signals(
        model, b.tokenizer, prompt_ids=b.prompt_ids, prompt_mask=b.prompt_mask, response_ids=b.response_ids,
        response_mask=b.response_mask, rewards=torch.tensor(REWARDS), group_ids=torch.zeros(2, dtype=torch.long),
        rows=torch.tensor([1]), signals=signals, continuations=_context(PrefixEngine(), 2), warmup=False)
    plain, refined, g = scores["plain"][0], scores["refined"][0], scores["g"][0]
    # "4+3=|8, |..." : the segment that wrote the 8 (tokens 4-6) carries the blame, all tied in plain
    assert plain[4] == plain[5] == plain[6] == plain.max() > 0
    blamed = refined[4:7]
    assert torch.equal(blamed.argsort(), g[4:7].argsort()) and len(set(blamed.tolist())) == 3
    assert refined.argmax() in (4, 5, 6) and ((refined - plain).abs() <= 1e-3 + 1e-6).all()
    assert seconds["refined"] > 0 and "refined by OAR-G" in info["notes"]["refined"]
    with pytest.raises(ValueError, match="refine must be a mapping of oar_g options"):
        signal_specs([{"name": "x", "kind": "mc_value", "refine": {"k": 2}}])


def test_refine_spreads_each_steps_credit_by_oar_g_and_keeps_its_sum():
    """``refine`` (training): a step's delta goes to its tokens in proportion to OAR-G's scores
    (floor + (1 - floor) * g / mean g over the step), so every step keeps its total credit."""
    from oar.credit.mc_value import segment_ids, segment_weights, step_boundaries
    from oar.models.tiny import build_tiny

    gen = torch.Generator().manual_seed(0)
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1]])
    s = torch.rand(1, 7, generator=gen)
    w = segment_weights(s, seg, 0.2)
    for k in range(3):
        assert w[seg == k].mean().item() == pytest.approx(1.0)
        assert torch.equal(w[seg == k].argsort(), s[seg == k].argsort())
    assert w[0, 6] == 0.0 and segment_weights(torch.zeros(1, 7), seg)[0, :6].tolist() == [1.0] * 6
    with pytest.raises(ValueError, match="refine_floor"):
        segment_weights(s, seg, 1.5)

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    batch = _batch(RESPONSES, REWARDS, model=model)
    batch.continuations = _context(PrefixEngine(), 2)
    plain = get_estimator("mc_value")(batch, greedy=True)
    refined = get_estimator("mc_value")(batch, greedy=True, refine={"mode": "answer_joint"}, refine_floor=0.1)
    bounds, _, _ = step_boundaries(batch.tokenizer, batch.response_ids, batch.response_mask)
    sid = segment_ids(bounds, batch.response_mask)
    for k in range(int(sid[1].max()) + 1):  # the wrong response: every step's sum is kept
        on = sid[1] == k
        assert refined.token_advantages[1][on].sum().item() == pytest.approx(plain.token_advantages[1][on].sum().item(), abs=1e-5)
    blamed = refined.token_advantages[1, 4:7]  # "8, ": not spread evenly any more
    assert (blamed < 0).all() and blamed.max() - blamed.min() > 1e-3 and refined.stats["refine_s"] > 0
    # OAR-G scores only the responses whose step values move: a second group, all right, whose every
    # continuation is right too, has nothing to spread and is not scored; the first group's credit is as before
    wide = _batch(RESPONSES + [RESPONSES[0]] * 2, REWARDS + [1.0, 1.0], model=model)
    wide.group_ids = torch.tensor([0, 0, 1, 1])
    wide.continuations = _context(PrefixEngine(), 4)
    both = get_estimator("mc_value")(wide, greedy=True, refine={"mode": "answer_joint"}, refine_floor=0.1)
    assert both.stats["refine_fraction"] == 0.5 and (both.token_advantages[2:] == 0).all()
    torch.testing.assert_close(both.token_advantages[:2, :refined.token_advantages.shape[1]], refined.token_advantages,
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="refine must be a mapping of OAR-G options"):
        get_estimator("mc_value")(batch, greedy=True, refine={"beta": 2.0})
