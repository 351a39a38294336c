"""Controls of token credit (oar.credit.controls): where each oracle puts its importance on hand-built
responses, and what the nulls do to OAR-G's scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oar.credit import CreditBatch, estimator_needs_model, get_estimator

from helpers import credit_batch

ROOT = Path(__file__).resolve().parents[1]
TASK = {"kind": "synthetic", "synthetic": {"fillers": ["so", "ok", "well"]}}
# one group of the question 4+3-2 = 5; the tiny tokenizer has one token per character
RESPONSES = [
    "4+3=7, so 7-2=5. \\boxed{5}",  # 0 correct
    "4+3=8, 8-2=6. \\boxed{6}",  # 1 first step wrong (8), restated as the next step's operand
    "4+3=7, ok 7-2=4. \\boxed{4}",  # 2 last step wrong (4)
    "4+3=7 well",  # 3 off the grammar, no answer
]
REWARDS = [1.0, 0.0, 0.0, 0.0]


def _batch(responses=RESPONSES, rewards=REWARDS, prompts=None, task=TASK, model=None) -> CreditBatch:
    return credit_batch(responses, rewards, prompts=prompts, task=task, model=model)


def _top(row: torch.Tensor) -> list[int]:
    """Positions holding the row's largest value."""
    return (row == row.max()).nonzero().flatten().tolist()


def test_oracle_labels_hand_case():
    from oar.credit.controls import oracle_labels

    lab = oracle_labels(_batch(), fillers=TASK["synthetic"]["fillers"])
    assert lab.parsed.tolist() == [True, True, True, False]
    assert lab.located.tolist() == [False, True, True, False]
    # row 1: "4+3=8, 8-2=6. \boxed{6}": the first mistake is the 8 at index 4, not its copy at index 7
    assert lab.first_mistake[1].nonzero().flatten().tolist() == [4]
    # row 2: "4+3=7, ok 7-2=4. \boxed{4}": the mistake is in the last step, the 4 at index 14
    assert lab.first_mistake[2].nonzero().flatten().tolist() == [14]
    assert lab.first_mistake[0].sum() == 0 and lab.first_mistake[3].sum() == 0
    # every step's result, never the operands that restate them
    assert lab.results[0].nonzero().flatten().tolist() == [4, 14]
    assert lab.results[1].nonzero().flatten().tolist() == [4, 11]
    # progress: -1 on the whole first step whose result departs from the reference (7, then 5)
    assert lab.progress[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert lab.progress[2].nonzero().flatten().tolist() == [10, 11, 12, 13, 14]
    assert set(lab.progress[1].unique().tolist()) == {0.0, -1.0}
    assert lab.progress[0].abs().sum() == 0
    # reasoning: every token before "\boxed{"
    assert lab.reasoning[1].nonzero().flatten().tolist() == list(range(len("4+3=8, 8-2=6. ")))


@pytest.mark.parametrize("synthetic, parsed", [
    ({"fillers": ["so", "ok", "well"]}, [True, True, True, False]),
    ({}, [True, True, True, False]),  # no key: the generator's default words, which hold "so" and "ok"
    ({"fillers": [], "filler_prob": 0.0}, [False, True, False, False]),  # none: a filler is off the grammar
])
def test_oracle_reads_the_fillers_the_task_generates(synthetic, parsed):
    """The oracle parses with the words ``generate`` writes for the same section (oar.data.synthetic
    .task_fillers), the attribution benchmark's words: an empty list means no fillers, not the defaults."""
    from oar.credit.controls import oracle_labels
    from oar.data.synthetic import DEFAULT_FILLERS, task_fillers

    assert task_fillers({}) == list(DEFAULT_FILLERS) and task_fillers(None) == list(DEFAULT_FILLERS)
    assert task_fillers({"fillers": []}) == []
    batch = _batch(task={"kind": "synthetic", "synthetic": synthetic})
    assert oracle_labels(batch, fillers=task_fillers(synthetic)).parsed.tolist() == parsed
    out = get_estimator("oracle_first_mistake")(batch, quantile=0.25, beta=1.0, floor=0.1)
    # located: the parsed wrong responses of the 4 (rows 1 and 2 are wrong; row 2 carries the filler "ok")
    assert out.stats["located_fraction"] == pytest.approx(sum(parsed[1:3]) / 4)


def test_oracle_first_mistake_weights_the_mistake_not_its_copy():
    est = get_estimator("oracle_first_mistake")
    batch = _batch()
    out = est(batch, quantile=0.25, beta=1.0, floor=0.1)
    A = out.seq_advantages
    assert A[0] > 0 and bool((A[1:] < 0).all())
    w = out.weights
    reasoning = len("4+3=8, 8-2=6. ")
    # the mistake's token carries the largest weight of its response; the copy gets the floor
    assert _top(w[1]) == [4]
    assert w[1, 7] < 1.0 and w[1, 4] > 1.0
    assert _top(w[2]) == [14]
    # mass preserved over the reasoning tokens of a reshaped response
    assert float(w[1, :reasoning].mean()) == pytest.approx(1.0, abs=1e-5)
    # the correct response and the unparsed one keep GRPO's uniform credit
    m = batch.response_mask.float()
    assert torch.equal(w[0], m[0]) and torch.equal(w[3], m[3])
    assert torch.allclose(out.token_advantages, A[:, None] * w)
    assert out.stats["located_fraction"] == pytest.approx(0.5)
    # a right answer reached through two mistakes that cancel (8 for 7, then 8-2=5): located, but
    # never boosted with its positive advantage
    lucky = _batch(responses=["4+3=8, 8-2=5. \\boxed{5}", RESPONSES[1]], rewards=[1.0, 0.0])
    out = est(lucky)
    assert out.seq_advantages[0] > 0 and torch.equal(out.weights[0], lucky.response_mask[0].float())
    assert _top(out.weights[1]) == [4]


def test_oracle_decisive_weights_every_result_and_no_operand():
    out = get_estimator("oracle_decisive")(_batch())
    w = out.weights
    assert _top(w[0]) == [4, 14]  # 7 and 5, not the 7 restated at index 10
    assert _top(w[1]) == [4, 11]
    assert w[0, 10] < w[0, 4]
    assert torch.equal(w[3], _batch().response_mask[3].float())


def test_oracle_progress_pav_form():
    batch = _batch()
    out = get_estimator("oracle_progress")(batch, alpha=0.5)
    A, adv, m = out.seq_advantages, out.token_advantages, batch.response_mask.float()
    expect = A[:, None] * m
    expect[1, 0:5] -= 0.5
    expect[2, 10:15] -= 0.5
    assert torch.allclose(adv, expect)
    # an all-wrong group (A = 0) still gets the progress term, as PAV's process advantage
    wrong = _batch(responses=RESPONSES[1:3], rewards=[0.0, 0.0])
    adv0 = get_estimator("oracle_progress")(wrong, alpha=1.0).token_advantages
    assert adv0[0, 0:5].tolist() == [-1.0] * 5 and float(adv0[0, 5:].abs().sum()) == 0.0


@pytest.mark.parametrize("name", ["oracle_first_mistake", "oracle_decisive", "oracle_progress"])
def test_oracles_refuse_other_tasks(name):
    from oar.credit.controls import SyntheticTaskRequired

    with pytest.raises(SyntheticTaskRequired, match="synthetic"):
        get_estimator(name)(_batch(prompts=["What is 4+3-2?\n"] * 4))
    with pytest.raises(SyntheticTaskRequired, match="benchmark"):
        get_estimator(name)(_batch(task={"kind": "benchmark"}))


def test_config_refuses_oracle_on_benchmark_task():
    from oar.config.load import load_config
    from oar.config.methods import resolve_method
    from oar.config.source import ConfigError

    cfg = load_config(ROOT / "config" / "config.yaml")
    cfg["methods"]["oracle"] = {"recipe": "grpo", "credit": "oracle_first_mistake"}
    assert resolve_method(cfg, "oracle").estimator == "oracle_first_mistake"
    cfg["task"]["kind"] = "benchmark"
    with pytest.raises(ConfigError, match=r"methods\.oracle\.credit.*benchmark"):
        resolve_method(cfg, "oracle")
    # the nulls run on any task, with OAR-G's options
    cfg["methods"]["nul"] = {"recipe": "grpo", "credit": "shuffled", "mode": "answer_joint", "noise_std": 0.001}
    assert resolve_method(cfg, "nul").credit_options["mode"] == "answer_joint"


def test_nulls_permute_and_invert_oar_g_scores():
    from oar.credit.nulls import invert_scores, shuffle_scores
    from oar.models.tiny import build_tiny

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          max_position_embeddings=128, seed=0)
    batch = _batch(model=model)
    opts = dict(mode="answer_joint", noise_std=1e-3, conclude="\\boxed{")
    assert estimator_needs_model("shuffled") and estimator_needs_model("inverted")
    assert not estimator_needs_model("oracle_first_mistake")
    ref = get_estimator("oar_g")(batch, **opts)
    shuf = get_estimator("shuffled")(batch, **opts)
    inv = get_estimator("inverted")(batch, **opts)
    reasoning = [len(r[: r.index("\\boxed{")]) if "\\boxed{" in r else 0 for r in RESPONSES]
    moved = 0
    for b, n in enumerate(reasoning[:3]):
        w_ref, w_shuf, w_inv = ref.weights[b, :n], shuf.weights[b, :n], inv.weights[b, :n]
        # the same weights in another order (Bi-Level reshaping is per row and order-free)
        assert torch.allclose(w_ref.sort().values, w_shuf.sort().values, atol=1e-6)
        moved += int(not torch.allclose(w_ref, w_shuf))
        # OAR-G's most important token is the inverted control's least important one
        assert int(w_inv.argmin()) == int(w_ref.argmax())
        assert float(w_inv.mean()) == pytest.approx(1.0, abs=1e-5)
    assert moved >= 2
    # the pure functions on a hand case
    s = torch.tensor([[1.0, 2.0, 5.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert invert_scores(s, mask).tolist() == [[5.0, 4.0, 1.0, 9.0]]
    p = shuffle_scores(s, mask, torch.Generator().manual_seed(0))
    assert sorted(p[0, :3].tolist()) == [1.0, 2.0, 5.0] and p[0, 3] == 9.0


# ------------------------------------------- what about the oracle pays: degraded oracles, the suffix control
def test_labels_name_every_steps_result_and_the_mistakes_step():
    from oar.credit.controls import oracle_labels

    lab = oracle_labels(_batch(), fillers=TASK["synthetic"]["fillers"])
    # row 1: step 1's result at 4 (the mistake), step 2's at 11; row 2: the mistake is its second step
    assert lab.result_step[1].nonzero().flatten().tolist() == [4, 11]
    assert lab.result_step[1, 4] == 1 and lab.result_step[1, 11] == 2
    assert lab.mistake_step.tolist() == [-1, 0, 1, -1]


@pytest.mark.parametrize("accuracy, moved", [(1.0, [False, False, False, False]), (0.0, [False, True, True, False])])
def test_relocate_mistakes_moves_the_importance_to_another_step_of_the_same_response(accuracy, moved):
    from oar.credit.controls import oracle_labels, relocate_mistakes

    lab = oracle_labels(_batch(), fillers=TASK["synthetic"]["fillers"])
    target, did = relocate_mistakes(lab, lab.located, accuracy, torch.Generator().manual_seed(0))
    assert did.tolist() == moved
    if accuracy == 0.0:  # the other step of each two-step response: row 1's second result, row 2's first
        assert target[1].nonzero().flatten().tolist() == [11] and target[2].nonzero().flatten().tolist() == [4]
    else:
        assert torch.equal(target, lab.first_mistake)


def test_relocate_mistakes_keeps_the_rate_and_leaves_one_step_responses():
    from oar.credit.controls import OracleLabels, relocate_mistakes

    B, T = 4000, 6
    result_step = torch.tensor([[1, 0, 2, 0, 3, 0]] * (B - 1) + [[1, 0, 0, 0, 0, 0]])
    first = (result_step == 2).float()
    first[-1] = (result_step[-1] == 1).float()
    mistake = torch.full((B,), 1)
    mistake[-1] = 0
    lab = OracleLabels(first_mistake=first, results=(result_step > 0).float(), progress=torch.zeros(B, T),
                       reasoning=torch.ones(B, T), parsed=torch.ones(B, dtype=torch.bool),
                       located=torch.ones(B, dtype=torch.bool), result_step=result_step, mistake_step=mistake)
    target, moved = relocate_mistakes(lab, lab.located, 0.75, torch.Generator().manual_seed(1))
    assert 0.22 < float(moved[:-1].float().mean()) < 0.28 and not moved[-1]
    on = target[:-1].argmax(-1)[moved[:-1]]
    assert set(on.tolist()) == {0, 4}  # steps 1 and 3, never the mistake's step 2
    assert 0.45 < float((on == 0).float().mean()) < 0.55  # drawn uniformly


def test_degraded_oracle_is_the_oracle_at_localisation_1_and_seeded():
    b = _batch()
    b.seed, b.step = 3, 5
    full = get_estimator("oracle_first_mistake")(b)
    same = get_estimator("oracle_first_mistake")(b, localisation=1.0)
    assert torch.equal(full.token_advantages, same.token_advantages) and "relocated_fraction" not in same.stats
    blind = get_estimator("oracle_first_mistake")(b, localisation=0.0)
    again = get_estimator("oracle_first_mistake")(b, localisation=0.0)
    assert torch.equal(blind.token_advantages, again.token_advantages)  # seeded by the run seed and the step
    assert blind.stats["relocated_fraction"] == 0.5  # rows 1 and 2 of 4
    assert _top(blind.weights[1]) == [11] and _top(full.weights[1]) == [4]
    # the mass of each row's advantage is kept either way
    m = b.response_mask.float()
    assert torch.allclose((blind.token_advantages * m).sum(-1), (full.token_advantages * m).sum(-1), atol=1e-5)


def test_oracle_suffix_spares_the_correct_prefix_and_spreads_the_penalty_from_the_mistake_on():
    b = _batch()
    res = get_estimator("oracle_suffix")(b)
    A = res.seq_advantages
    m = b.response_mask.float()
    L = m.sum(-1)
    # row 1: the mistake's result at 4: tokens 0-3 spared, 4.. carry A_1 x L / (L - 4)
    assert res.token_advantages[1, :4].abs().sum() == 0
    assert torch.allclose(res.token_advantages[1, 4:int(L[1])], A[1] * L[1] / (L[1] - 4))
    # row 2: the mistake in the last step (its result at 14)
    assert res.token_advantages[2, :14].abs().sum() == 0
    # the penalty's total is kept; the correct row and the unparsed one keep GRPO's uniform credit
    assert torch.allclose((res.token_advantages * m).sum(-1), A * L, atol=1e-5)
    for r in (0, 3):
        assert torch.allclose(res.token_advantages[r, :int(L[r])], A[r].expand(int(L[r])))
    assert res.stats["scored_fraction"] == 0.5 and 0 < res.stats["spared_fraction"] < 1
    plain = get_estimator("oracle_suffix")(b, preserve_mass=False)
    assert torch.allclose(plain.token_advantages[1, 4:int(L[1])], A[1].expand(int(L[1]) - 4))
    with pytest.raises(TypeError, match="unknown option.*beta"):
        get_estimator("oracle_suffix")(b, beta=2.0)
