"""Attribution-fidelity benchmark: rank statistics, the ground-truth parser, labels, metrics, and
a small end-to-end run on a briefly fine-tuned tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

from oar.attribution import (
    FIDELITY_COLUMNS,
    FILLER,
    PIVOTAL,
    STABILITY_COLUMNS,
    UNLABELED,
    auroc,
    average_ranks,
    check_steps,
    compute_signals,
    cost_table,
    counterfactual_edit,
    draw_counterfactual,
    fidelity_table,
    label_responses,
    localisation_columns,
    localisation_table,
    mistake_spans,
    parse_response,
    question_terms,
    signal_specs,
    spearman,
    stability_table,
    token_char_spans,
    token_labels,
    topk_hit,
)
from oar.data.synthetic import DEFAULT_FILLERS, format_solution, generate, solve_steps

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# rank statistics
# ---------------------------------------------------------------------------------------------


def test_average_ranks_ties():
    assert average_ranks([3.0, 1.0, 3.0, 2.0, 3.0]).tolist() == [4.0, 1.0, 4.0, 2.0, 4.0]
    assert average_ranks([]).tolist() == []
    with pytest.raises(ValueError, match="finite"):
        average_ranks([1.0, float("nan")])


def test_auroc_hand_values():
    # perfect separation, reversed, and all tied
    assert auroc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert auroc([5, 5, 5, 5], [1, 0, 1, 0]) == 0.5
    # positives {3, 1}, negatives {2, 0}: pairs (3>2, 3>0, 1<2, 1>0) -> 3/4
    assert auroc([3, 1, 2, 0], [1, 1, 0, 0]) == 0.75
    # ties across classes count 1/2: positives {2, 1}, negatives {2, 0}:
    # (2=2 -> 1/2, 2>0 -> 1, 1<2 -> 0, 1>0 -> 1) = 2.5 / 4
    assert auroc([2, 1, 2, 0], [True, True, False, False]) == 0.625
    # one positive among three negatives, tied with one of them: (1 + 1/2 + 0) / 3
    assert auroc([1.0, 0.0, 1.0, 2.0], [1, 0, 0, 0]) == pytest.approx(0.5)
    assert math.isnan(auroc([1, 2], [1, 1])) and math.isnan(auroc([1, 2], [0, 0])) and math.isnan(auroc([], []))
    with pytest.raises(ValueError, match="shape"):
        auroc([1, 2, 3], [1, 0])


def test_auroc_matches_pairwise_count_and_mann_whitney():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 40))
        s = rng.integers(0, 4, n).astype(float)  # many ties
        y = rng.random(n) < 0.4
        if y.all() or not y.any():
            continue
        pos, neg = s[y], s[~y]
        pairs = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
        assert auroc(s, y) == pytest.approx(pairs, abs=1e-12)
        u = scipy.stats.mannwhitneyu(pos, neg).statistic
        assert auroc(s, y) == pytest.approx(u / (len(pos) * len(neg)), abs=1e-12)


def test_spearman_matches_scipy_and_degenerate_cases():
    rng = np.random.default_rng(1)
    for _ in range(10):
        x = rng.integers(0, 5, 30).astype(float)
        y = x + rng.normal(size=30) * 2
        assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1.0], [2.0]))


def test_random_scores_auroc_near_half_on_large_case():
    g = torch.Generator().manual_seed(0)
    n = 40000
    labels = torch.rand(n, generator=g) < 0.3
    scores = torch.rand(n, generator=g)
    # standard error of the AUROC under the null with 12k/28k items is ~0.003
    assert abs(auroc(scores.numpy(), labels.numpy()) - 0.5) < 0.02


# ---------------------------------------------------------------------------------------------
# ground truth
# ---------------------------------------------------------------------------------------------


def test_parse_hand_written_response():
    text = "12-47=-35, so -35+20=-15. well \\boxed{-15}"
    p = parse_response(text, fillers=DEFAULT_FILLERS)
    assert p is not None
    assert [text[s:e] for s, e in p.pivotal_spans] == ["35", "15"]
    assert p.pivotal_spans == [[7, 9], [22, 24]]
    assert [text[s:e] for s, e in p.filler_spans] == ["so", "well"]
    assert p.filler_spans == [[11, 13], [26, 30]]
    assert p.steps == [(12, "-", 47, -35), (-35, "+", 20, -15)]
    assert p.reasoning_end == text.index("\\boxed{") and p.answer == "-15"
    # wrong arithmetic still parses: the written results are what the answer depends on
    q = parse_response("3+4=8. \\boxed{8}", fillers=DEFAULT_FILLERS)
    assert q is not None and q.pivotal_spans == [[4, 5]] and q.filler_spans == [] and q.steps == [(3, "+", 4, 8)]
    # text after the closing brace (an eos piece) is ignored
    assert parse_response("3+4=7. \\boxed{7}</s>", fillers=DEFAULT_FILLERS) is not None


@pytest.mark.parametrize(
    "text",
    [
        "3+4=7 \\boxed{7}",  # no ". " before the box
        "3+4=7. \\boxed{",  # truncated answer
        "3+4=7. \\boxed{}",  # empty answer
        "3+4=7.",  # no answer at all
        "3+4=7, 7+1=8, \\boxed{8}",  # ", " where ". " belongs
        "3+4=7, maybe 7+1=8. \\boxed{8}",  # unknown filler word
        "so 3+4=7. \\boxed{7}",  # filler before the first step
        "3+4=7.  \\boxed{7}",  # stray space
        "3+=7. \\boxed{7}",  # malformed step
    ],
)
def test_parse_rejects_off_grammar(text):
    assert parse_response(text, fillers=DEFAULT_FILLERS) is None


def test_parse_recovers_generator_spans():
    """On reference solutions (negatives, '*', fillers in every gap) the parse equals the record."""
    n_fill = 0
    for split in ("train", "test", "ood"):
        recs = generate(split, 300, seed=5, operators=["+", "-", "*"], filler_prob=0.5)
        for r in recs:
            p = parse_response(r["solution"], fillers=DEFAULT_FILLERS)
            assert p is not None, r["solution"]
            assert p.pivotal_spans == r["result_spans"], r["solution"]
            assert p.filler_spans == r["filler_spans"], r["solution"]
            assert p.answer == r["answer"]
            n_fill += len(p.filler_spans)
    assert n_fill > 100
    custom = generate("test", 50, seed=1, fillers=["hmm", "h"], filler_prob=1.0)
    for r in custom:
        p = parse_response(r["solution"], fillers=["hmm", "h"])
        assert p is not None and p.filler_spans == r["filler_spans"]
    # several words per gap (task.synthetic.filler_words, the regime map's length knob): one span per gap
    for r in generate("test", 50, seed=1, filler_prob=1.0, filler_words=5):
        p = parse_response(r["solution"], fillers=DEFAULT_FILLERS)
        assert p is not None and p.filler_spans == r["filler_spans"] and p.pivotal_spans == r["result_spans"]
        assert all(len(r["solution"][a:b].split(" ")) == 5 for a, b in p.filler_spans)
        assert [len(f.split(" ")) for f in p.gap_fillers] == [5] * len(p.steps)
    # one word per gap draws exactly what the generator drew before filler_words existed (digest of 9d421aa's records)
    import hashlib
    import json

    recs = generate("train", 50, seed=3, filler_prob=0.5, demo_error_rate=0.3)
    assert hashlib.sha256(json.dumps(recs, sort_keys=True).encode()).hexdigest()[:16] == "189ca0afc869459b"


def test_token_labels_from_char_spans_multi_char_tokens():
    # text "ab12 so" as tokens "ab" "12" " s" "o": token 2 straddles a space and the filler
    starts, ends = np.array([0, 2, 4, 6]), np.array([2, 4, 6, 7])
    lab = token_labels(starts, ends, [[2, 4]], [[5, 7]], 7)
    assert lab.tolist() == [UNLABELED, PIVOTAL, FILLER, FILLER]
    # a token covering both kinds is left out
    lab = token_labels(np.array([0]), np.array([7]), [[2, 4]], [[5, 7]], 7)
    assert lab.tolist() == [UNLABELED]
    # an empty token (zero characters) is never labeled
    lab = token_labels(np.array([2, 2]), np.array([2, 4]), [[2, 4]], [], 7)
    assert lab.tolist() == [UNLABELED, PIVOTAL]


class _WordTok:
    """A toy tokenizer whose tokens are multi-character strings (ids index ``vocab``)."""

    def __init__(self, vocab):
        self.vocab = list(vocab)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.vocab[i] for i in ids)


class _SpaceTok(_WordTok):
    """Single-token decodes drop a leading space (like SentencePiece), full decodes keep it."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        text = super().decode(ids)
        return text.lstrip(" ") if len(ids) == 1 else text


@pytest.mark.parametrize("cls", [_WordTok, _SpaceTok])
def test_token_char_spans_general_tokenizers(cls):
    vocab = ["47", "+", "18", "=", "65", ",", " so", " 65", "-", "25", "40", ".", " \\boxed{", "}"]
    tok = cls(vocab)
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 10, 11, 12, 10, 13]
    text, starts, ends = token_char_spans(tok, ids)
    assert text == "47+18=65, so 65-25=40. \\boxed{40}"
    assert [text[s:e] for s, e in zip(starts, ends)] == [vocab[i] for i in ids]
    p = parse_response(text, fillers=DEFAULT_FILLERS)
    lab = token_labels(starts, ends, p.pivotal_spans, p.filler_spans, len(text))
    assert np.nonzero(lab == PIVOTAL)[0].tolist() == [4, 11]  # "65" after "=" and "40"
    assert np.nonzero(lab == FILLER)[0].tolist() == [6]  # " so" (the space is not a filler char)


def test_label_responses_tiny_tokenizer_and_status():
    from oar.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    texts = ["47+18=65, so 65-25=40. \\boxed{40}", "47+18=65. \\boxed{", "4+5=9 ok \\boxed{9}"]
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    T = max(len(e) for e in enc) + 2
    ids = torch.full((3, T), tok.pad_token_id)
    mask = torch.zeros((3, T), dtype=torch.long)
    for b, e in enumerate(enc):
        ids[b, : len(e)] = torch.tensor(e)
        mask[b, : len(e)] = 1
    before = ids.clone()
    labels, status = label_responses(tok, ids, mask, fillers=DEFAULT_FILLERS)
    assert torch.equal(ids, before)
    assert status == ["ok", "no_answer", "unparsed"]
    assert labels.shape == (3, T)
    # one token per character: the pivotal tokens are the result digits, the filler tokens "so"
    assert (labels[0] == PIVOTAL).nonzero().flatten().tolist() == [6, 7, 19, 20]
    assert (labels[0] == FILLER).nonzero().flatten().tolist() == [10, 11]
    assert bool((labels[1:] == UNLABELED).all())


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def test_fidelity_table_hand_case():
    # two responses, T = 5; labels: -1 unlabeled, 1 pivotal, 0 filler
    labels = torch.tensor([[1, 0, 1, -1, 0], [1, 1, -1, -1, -1]])
    reason = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    good = torch.tensor([[0.9, 0.1, 0.8, 0.5, 0.2], [0.7, 0.6, 0.1, 0.0, 0.0]])
    flat = torch.ones(2, 5)
    fid, per = fidelity_table(
        {"oar_p": good, "flat": flat}, labels, reason, seconds_per_response={"oar_p": 0.5}
    )
    assert list(fid.columns) == list(FIDELITY_COLUMNS)
    row = fid.set_index("signal")
    assert row.loc["oar_p", "auroc_pooled"] == 1.0
    assert row.loc["flat", "auroc_pooled"] == 0.5
    # only the first response has both classes
    assert row.loc["oar_p", "auroc_mean_per_response"] == 1.0
    assert row.loc["oar_p", "n_responses_both_classes"] == 1
    assert row.loc["oar_p", "n_pivotal"] == 4 and row.loc["oar_p", "n_filler"] == 2
    assert row.loc["oar_p", "n_responses"] == 2
    assert row.loc["oar_p", "seconds_per_response"] == 0.5 and math.isnan(row.loc["flat", "seconds_per_response"])
    assert row.loc["oar_p", "spearman_vs_oar_p"] == pytest.approx(1.0)
    # a constant signal has no rank correlation
    assert math.isnan(row.loc["flat", "spearman_vs_oar_p"]) and row.loc["flat", "n_responses_spearman"] == 0
    assert per["n_pivotal"].tolist() == [2, 2] and per["n_filler"].tolist() == [2, 0]
    assert per["n_reasoning"].tolist() == [5, 3]
    assert per["auroc_oar_p"].iloc[0] == 1.0 and math.isnan(per["auroc_oar_p"].iloc[1])


def test_fidelity_table_pooled_differs_from_per_response_mean():
    labels = torch.tensor([[1, 0], [1, 0]])
    reason = torch.ones(2, 2, dtype=torch.bool)
    # each response ranks its pivotal token first, but on different scales
    s = torch.tensor([[10.0, 9.0], [2.0, 1.0]])
    fid, _ = fidelity_table({"x": s}, labels, reason)
    r = fid.iloc[0]
    assert r["auroc_mean_per_response"] == 1.0
    assert r["auroc_pooled"] == 0.75  # (10>9, 10>1, 2<9, 2>1)
    assert math.isnan(r["spearman_vs_oar_p"])  # no reference signal given


def test_fidelity_table_rejects_labels_outside_reasoning():
    labels = torch.tensor([[1, 0]])
    with pytest.raises(ValueError, match="reasoning"):
        fidelity_table({"x": torch.ones(1, 2)}, labels, torch.tensor([[True, False]]))


def _tiny_signal_batch():
    """A random tiny model and a batch of 4 responses in 2 groups, rows 0-2 to score."""
    from oar.models.tiny import build_tiny

    model, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                            max_position_embeddings=128, seed=0)
    prompts = ["Compute 1+2.\n", "Compute 3+4.\n"]
    resp = ["1+2=3, so 3+1=4. \\boxed{4}", "1+2=4. \\boxed{4}", "3+4=7. \\boxed{7}", "3+4=8 ok"]
    pid = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rid = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in resp]
    P, T = max(map(len, pid)), max(map(len, rid))
    group = torch.tensor([0, 0, 1, 1])
    p_ids = torch.full((4, P), tok.pad_token_id)
    p_mask = torch.zeros((4, P), dtype=torch.long)
    r_ids = torch.full((4, T), tok.pad_token_id)
    r_mask = torch.zeros((4, T), dtype=torch.long)
    for b in range(4):
        p = pid[int(group[b])]
        p_ids[b, P - len(p):] = torch.tensor(p)
        p_mask[b, P - len(p):] = 1
        r_ids[b, : len(rid[b])] = torch.tensor(rid[b])
        r_mask[b, : len(rid[b])] = 1
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    rows = torch.tensor([0, 1, 2])
    kw = dict(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids, response_mask=r_mask,
              rewards=rewards, group_ids=group, rows=rows, warmup=False)
    return model, tok, resp, kw


#: The benchmark's historical signal set, spelled as config dicts.
SIX_SIGNALS = [
    {"name": "oar_p", "kind": "oar_p", "mode": "last"},
    {"name": "oar_p_answer_mean", "kind": "oar_p", "mode": "answer_mean"},
    {"name": "oar_g", "kind": "oar_g", "mode": "answer_mean"},
    {"name": "ktae", "kind": "ktae"},
    {"name": "ktae_signed", "kind": "ktae", "signed": True},
    {"name": "random", "kind": "random"},
]


def test_compute_signals_shapes_masks_and_ktae_abs():
    """On a random tiny model: every signal is (n, T), zero outside the probe's reasoning for OAR,
    ktae == |ktae_signed|, and the random baseline is reproducible."""
    model, tok, resp, kw = _tiny_signal_batch()
    rows, T = kw["rows"], kw["response_ids"].shape[1]
    scores, seconds, info = compute_signals(model, tok, signals=SIX_SIGNALS, **kw)
    assert set(scores) == set(seconds) == {"oar_p", "oar_p_answer_mean", "oar_g", "ktae", "ktae_signed", "random"}
    reason = info["reasoning_mask"]
    assert reason.shape == (3, T) and bool(info["has_answer"].all())
    # reasoning = tokens before "\boxed{" of each response
    for i, b in enumerate(rows.tolist()):
        assert int(reason[i].sum()) == resp[b].index("\\boxed{")
    for name, s in scores.items():
        assert s.shape == (3, T), name
        assert torch.isfinite(s).all(), name
    for name in ("oar_p", "oar_p_answer_mean", "oar_g"):
        assert bool((scores[name][~reason] == 0).all()), name
        assert bool((scores[name][reason] >= 0).all()), name
        assert float(scores[name][reason].abs().sum()) > 0, name
    assert torch.equal(scores["ktae"], scores["ktae_signed"].abs())
    assert float(scores["ktae"].sum()) > 0  # both groups are mixed
    assert info["n_scored"]["ktae"] == 4 and info["n_scored"]["oar_p"] == 3
    again, _, _ = compute_signals(model, tok, signals=[SIX_SIGNALS[5], SIX_SIGNALS[2]], **kw)
    assert torch.equal(again["random"], scores["random"])
    assert torch.allclose(again["oar_g"], scores["oar_g"])
    with pytest.raises(ValueError, match="unknown signal 'oar_x'"):
        compute_signals(model, tok, signals=("oar_x",), **kw)



def test_compute_signals_config_specs_seeds_and_baselines():
    """Signals given as config dicts: OAR-G variants follow their seed (answer_joint without noise
    does not), draws and integrated-gradient variants run, OAR-P answer_joint is |phi diff|,
    uniform is the response mask."""
    model, tok, resp, kw = _tiny_signal_batch()
    specs = [
        {"name": "g", "kind": "oar_g", "mode": "answer_mean", "noise_std": 1e-3},
        {"name": "g_k3", "kind": "oar_g", "mode": "answer_joint", "noise_std": 1e-2, "draws": 3},
        {"name": "g_n0", "kind": "oar_g", "mode": "answer_joint", "noise_std": 0.0},
        {"name": "g_ig", "kind": "oar_g", "mode": "answer_joint", "noise_std": 0.0, "baseline": "pad", "draws": 2},
        {"name": "p_joint", "kind": "oar_p", "mode": "answer_joint"},
        {"name": "flat", "kind": "uniform"},
    ]
    a, sec, info = compute_signals(model, tok, signals=specs, seed=0, **kw)
    b, _, _ = compute_signals(model, tok, signals=specs, seed=1, **kw)
    reason = info["reasoning_mask"]
    assert list(a) == [s["name"] for s in specs] and set(sec) == set(a)
    for name in ("g", "g_k3", "g_n0", "g_ig", "p_joint"):
        assert bool((a[name][~reason] == 0).all()) and bool((a[name][reason] >= 0).all()), name
        assert float(a[name][reason].sum()) > 0, name
    assert not torch.allclose(a["g"], b["g"]) and not torch.allclose(a["g_k3"], b["g_k3"])
    assert torch.allclose(a["g_n0"], b["g_n0"]) and torch.allclose(a["g_ig"], b["g_ig"])
    assert torch.equal(a["flat"], kw["response_mask"][kw["rows"]].float())
    assert info["notes"]["g_k3"] == "mode=answer_joint, noise_std=0.01, draws=3"


def test_oracle_and_step_verifier_signals(tmp_path, monkeypatch):
    """``oracle``: 1 on the first mistake's result tokens (row 1's "4" of 1+2=4), 0 on a right response;
    ``step_verifier``: each step's result tokens carry the verifier's probability that the step is
    wrong, the located first mistake's raised by 1 (the probabilities set by hand)."""
    from oar.credit import verifier as V
    from oar.models.tiny import build_tiny

    model, tok, resp, kw = _tiny_signal_batch()
    folder = tmp_path / "verifier"
    v_model, v_tok = build_tiny(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                max_position_embeddings=128, seed=1)
    v_model.save_pretrained(folder)
    v_tok.save_pretrained(folder)
    hand = {resp[0]: [0.2, 0.1], resp[1]: [0.9], resp[2]: [0.3]}
    monkeypatch.setattr(V, "step_error_probs", lambda m, t, prompts, responses, spans, chunk=256:
                        [next(v for r, v in hand.items() if text.startswith(r)) for text in responses])
    task = {"kind": "synthetic", "synthetic": {"fillers": ["so", "ok"]}}
    specs = [{"name": "oracle", "kind": "oracle"}, {"name": "oracle_p50", "kind": "oracle", "localisation": 0.5},
             {"name": "verifier", "kind": "step_verifier", "verifier": str(folder)}]
    scores, _, info = compute_signals(model, tok, signals=specs, task=task, **kw)
    T = kw["response_ids"].shape[1]
    at = lambda *pos: torch.zeros(T).index_fill_(0, torch.tensor(pos, dtype=torch.long), 1.0)  # noqa: E731
    assert torch.equal(scores["oracle"][1], at(4)) and scores["oracle"][[0, 2]].sum() == 0
    # row 1 has one step: nowhere else to move its importance
    assert torch.equal(scores["oracle_p50"][1], at(4))
    assert torch.allclose(scores["verifier"][1], 1.9 * at(4))
    assert torch.allclose(scores["verifier"][0], 0.2 * at(4) + 0.1 * at(14))  # "1+2=3, so 3+1=4": results 3 and 4
    assert torch.allclose(scores["verifier"][2], 0.3 * at(4))
    from oar.attribution.specs import SignalSpec

    assert SignalSpec("oracle_p50", "oracle", {"localisation": 0.5}).stochastic
    assert not SignalSpec("oracle", "oracle", {}).stochastic
    with pytest.raises(ValueError, match="names the verifier a config's workflow trains"):
        compute_signals(model, tok, signals=[{"name": "v", "kind": "step_verifier"}], task=task, **kw)


def test_signal_specs_validation():
    specs = signal_specs([{"name": "oar_p", "kind": "oar_p"}, {"name": "x", "kind": "oar_g", "draws": 2}])
    assert [(s.name, s.kind) for s in specs] == [("oar_p", "oar_p"), ("x", "oar_g")]
    assert specs[1].stochastic and not specs[0].stochastic
    with pytest.raises(ValueError, match="unknown kind"):
        signal_specs([{"name": "x", "kind": "oar_q"}])
    with pytest.raises(ValueError, match="unknown options"):
        signal_specs([{"name": "x", "kind": "oar_p", "noise_std": 0.1}])
    with pytest.raises(ValueError, match="duplicate"):
        signal_specs([{"name": "random", "kind": "random"}, {"name": "random", "kind": "uniform"}])
    with pytest.raises(ValueError, match="draws"):
        signal_specs([{"name": "x", "kind": "oar_g", "draws": 0}])
    with pytest.raises(ValueError, match="tie must be one of"):
        signal_specs([{"name": "x", "kind": "oar_p", "tie": "all"}])
    # the benchmark sets OAR-G's seed (its own, + 1 for stability) and runs a signal's rows in one call
    for key in ("seed", "chunk_tokens"):
        with pytest.raises(ValueError, match="unknown options"):
            signal_specs([{"name": "x", "kind": "oar_g", key: 1}])
    with pytest.raises(ValueError, match="unknown options"):
        signal_specs([{"name": "x", "kind": "mc_value", "seq_weight": 1.0}])


@pytest.mark.parametrize("name, spelling", [
    ("oar_p", "{name: oar_p, kind: oar_p, mode: last}"),
    ("oar_p_answer_mean", "{name: oar_p_answer_mean, kind: oar_p, mode: answer_mean}"),
    ("oar_g", "{name: oar_g, kind: oar_g, mode: answer_mean}"),
    ("ktae", "{name: ktae, kind: ktae}"),
    ("ktae_signed", "{name: ktae_signed, kind: ktae, signed: true}"),
    ("random", "{name: random, kind: random}"),
    ("uniform", "{name: uniform, kind: uniform}"),
])
def test_a_bare_signal_name_is_refused_with_its_new_spelling(name, spelling):
    """Signals are dicts {name, kind, **options}; a bare name the benchmark once read names its dict,
    and that dict is a valid signal."""
    import re

    import yaml

    with pytest.raises(ValueError, match=re.escape(f"write {spelling}")):
        signal_specs([name])
    (spec,) = signal_specs([yaml.safe_load(spelling)])
    assert (spec.name, spec.kind) == (name, yaml.safe_load(spelling)["kind"])


def test_signal_options_are_the_credit_layers_options_types():
    """A signal kind's options are its options type's fields (less those the benchmark sets itself)
    with the type's defaults, and the schema's attribution.signals items list exactly their union."""
    from dataclasses import fields

    from oar.attribution.specs import SIGNAL_KINDS
    from oar.config.validate import schema
    from oar.credit.importance import OarGOptions, OarPOptions, option_defaults
    from oar.credit.mc_value import McValueOptions

    assert SIGNAL_KINDS["oar_p"].options is OarPOptions and SIGNAL_KINDS["oar_g"].options is OarGOptions
    assert SIGNAL_KINDS["mc_value"].options is McValueOptions
    for kind in SIGNAL_KINDS.values():
        o, extra = kind.parse({})
        assert {f.name: getattr(o, f.name) for f in fields(o)} == option_defaults(kind.options)
        assert {f.name: getattr(extra, f.name) for f in fields(extra)} == option_defaults(kind.extra)
    item = schema()["properties"]["attribution"]["properties"]["signals"]["items"]
    union = set().union(*(k.names for k in SIGNAL_KINDS.values()))
    assert set(item["properties"]) - {"name", "kind"} == union
    assert item["properties"]["kind"]["enum"] == list(SIGNAL_KINDS)
    assert set(item["properties"]["refine"]["properties"]) == set(SIGNAL_KINDS["oar_g"].names)


# ---------------------------------------------------------------------------------------------
# error localisation: the mistake locator and the counterfactual editor
# ---------------------------------------------------------------------------------------------

Q = "Compute 47+18-25."  # 47+18=65, 65-25=40


def _check(text, question=Q):
    p = parse_response(text, fillers=DEFAULT_FILLERS)
    assert p is not None, text
    return p, check_steps(p.steps, *question_terms(question), p.answer)


@pytest.mark.parametrize(
    "text, status, step, propagated",
    [
        ("47+18=65, 65-25=40. \\boxed{40}", "consistent", None, False),
        ("47+18=66, 66-25=41. \\boxed{41}", "mistake", 0, True),  # wrong first step, carried on
        ("47+18=65, 65-25=41. \\boxed{41}", "mistake", 1, True),  # wrong later step
        ("47+18=66, then 66-25=41. well \\boxed{41}", "mistake", 0, True),  # filler words
        ("47+19=66, 66-25=41. \\boxed{41}", "inconsistent_operands", None, False),  # miscopied operand
        ("47+18=65, 64-25=39. \\boxed{39}", "inconsistent_operands", None, False),  # miscopied result
        ("47-18=29, 29-25=4. \\boxed{4}", "inconsistent_operands", None, False),  # wrong operator
        ("47+18=66, 65-25=40. \\boxed{40}", "mistake", 0, False),  # mistake, then a copy error
        ("47+18=66, 66-25=40. \\boxed{40}", "mistake", 0, False),  # a second mistake
        ("47+18=66, 66-25=41. \\boxed{40}", "mistake", 0, False),  # box is not the last result
        ("47+18=66. \\boxed{66}", "mistake", 0, False),  # too few steps
        ("47+18=65. \\boxed{65}", "incomplete", None, False),
        ("47+18=65, 65-25=40, 40+1=41. \\boxed{41}", "extra_steps", None, False),
        ("47+18=65, 65-25=40. \\boxed{41}", "box_mismatch", None, False),
    ],
)
def test_check_steps_hand_cases(text, status, step, propagated):
    _, c = _check(text)
    assert (c.status, c.mistake_step, c.propagated) == (status, step, propagated)
    assert c.locatable == (status == "mistake")


def test_check_steps_reduction_order_and_signs():
    q = "Compute 2+3*4."  # * first: 3*4=12, 2+12=14
    assert _check("3*4=12, 2+12=14. \\boxed{14}", q)[1].status == "consistent"
    assert _check("2+3=5, 5*4=20. \\boxed{20}", q)[1].status == "inconsistent_operands"
    c = _check("3*4=13, 2+13=15. \\boxed{15}", q)[1]
    assert (c.status, c.mistake_step, c.propagated) == ("mistake", 0, True)
    assert c.expected == ((3, "*", 4), (2, "+", 13))  # a later step takes the written value
    q = "Compute 12-47+20."
    assert _check("12-47=-35, -35+20=-15. \\boxed{-15}", q)[1].status == "consistent"
    c = _check("12-47=35, 35+20=55. \\boxed{55}", q)[1]  # a dropped sign is a mistake
    assert (c.status, c.mistake_step, c.propagated) == ("mistake", 0, True)


def test_mistake_spans_label_the_result_and_the_other_steps():
    from oar.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = "12-47=35, so 35+20=55. ok \\boxed{55}"
    p, c = _check(text, "Compute 12-47+20.")
    pos, neg = mistake_spans(p, c.mistake_step)
    assert [text[s:e] for s, e in pos] == ["35"] and [text[s:e] for s, e in neg] == ["35+20=55"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    dec, starts, ends = token_char_spans(tok, ids)
    lab = token_labels(starts, ends, pos, neg, len(dec))
    assert np.nonzero(lab == 1)[0].tolist() == [6, 7]
    assert np.nonzero(lab == 0)[0].tolist() == list(range(13, 21))  # fillers, separators, box: -1
    # a negative result's sign is part of it
    p, c = _check("12-47=-36, -36+20=-16. \\boxed{-16}", "Compute 12-47+20.")
    assert mistake_spans(p, 0)[0] == [[6, 9]]
    with pytest.raises(ValueError, match="outside"):
        mistake_spans(p, 2)


def test_counterfactual_edit_hand_cases():
    cf = counterfactual_edit([47, 18, 25], ["+", "-"], ["so", None], 0, 66)
    assert cf.text == "47+18=66, so 66-25=41. \\boxed{41}" and cf.answer == "41"
    assert (cf.step, cf.original_result, cf.new_result) == (0, 65, 66)
    cf = counterfactual_edit([47, 18, 25], ["+", "-"], [None, "ok"], 1, 38)
    assert cf.text == "47+18=65, 65-25=38. ok \\boxed{38}"
    cf = counterfactual_edit([2, 3, 4], ["+", "*"], [None, None], 0, 13)
    assert cf.text == "3*4=13, 2+13=15. \\boxed{15}"
    with pytest.raises(ValueError, match="right result"):
        counterfactual_edit([2, 3], ["+"], [None], 0, 5)


def test_draw_counterfactual_edits_exactly_one_result():
    """On reference solutions (with '*', negatives, fillers): the edit parses, its box is the
    re-derived value and differs from the gold, the mistake is located at the edited step and
    carried on, exactly one step breaks a op b, the text before the edited result is unchanged."""
    import random

    rng = random.Random(0)
    recs = generate("test", 200, seed=3, operands=[2, 3, 4], operators=["+", "-", "*"], filler_prob=0.5)
    steps_seen = set()
    for r in recs:
        p = parse_response(r["solution"], fillers=DEFAULT_FILLERS)
        nums, ops = question_terms(r["question"])
        cf = draw_counterfactual(nums, ops, p.gap_fillers, r["answer"], rng, max_delta=5)
        q = parse_response(cf.text, fillers=DEFAULT_FILLERS)
        assert q is not None, cf.text
        assert q.answer == cf.answer == str(q.steps[-1][3]) != r["answer"]
        c = check_steps(q.steps, nums, ops, q.answer)
        assert (c.status, c.mistake_step, c.propagated) == ("mistake", cf.step, True), cf.text
        wrong = [i for i, (a, op, b, res) in enumerate(q.steps) if res != {"+": a + b, "-": a - b, "*": a * b}[op]]
        assert wrong == [cf.step]
        assert 1 <= abs(cf.new_result - cf.original_result) <= 5
        assert (cf.new_result >= 0) == (cf.original_result >= 0)
        assert q.gap_fillers == p.gap_fillers
        start = p.result_spans[cf.step][0]
        assert cf.text[:start] == r["solution"][:start]
        # the unedited steps render back to the original solution
        assert format_solution(solve_steps(nums, ops), p.gap_fillers)[0] == r["solution"]
        steps_seen.add(cf.step)
    assert steps_seen == {0, 1, 2}
    # editing 2*3 in 2*3*0 leaves the answer at 0: only the last step can be edited
    for _ in range(20):
        cf = draw_counterfactual([2, 3, 0], ["*", "*"], [None, None], "0", rng, max_delta=3)
        assert cf.step == 1 and cf.answer != "0"


# ---------------------------------------------------------------------------------------------
# error-localisation and stability metrics
# ---------------------------------------------------------------------------------------------


def test_topk_hit_hand_values():
    assert topk_hit([0.9, 0.5, 0.1], [False, True, False], 1) == 0.0
    assert topk_hit([0.9, 0.5, 0.1], [False, True, False], 2) == 1.0
    assert topk_hit([0.9, 0.5, 0.1], [False, True, False], 10) == 1.0
    # all tied: the chance level 1 - C(n - P, k) / C(n, k)
    assert topk_hit([1, 1, 1, 1], [True, False, False, False], 1) == pytest.approx(0.25)
    assert topk_hit([1, 1, 1, 1], [True, False, False, False], 2) == pytest.approx(0.5)
    # one above, three tied for the last slot, one of them positive
    assert topk_hit([2, 1, 1, 1], [False, True, False, False], 2) == pytest.approx(1 / 3)
    assert math.isnan(topk_hit([1, 2], [False, False], 1))
    with pytest.raises(ValueError, match="k must be"):
        topk_hit([1.0], [True], 0)


def test_localisation_table_hand_case():
    # r0 sampled, r1 counterfactual, r2 sampled (another scale); T = 6
    labels = torch.tensor([[0, 0, 1, 1, -1, -1], [1, 0, 0, -1, -1, -1], [1, 0, -1, -1, -1, -1]])
    reason = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    a = torch.tensor([[0.1, 0.2, 0.9, 0.3, 0.8, 5.0], [0.2, 0.5, 0.1, 0.7, 9.0, 9.0], [0.05, 0.01, 0.0, 0, 0, 0]])
    kinds = ["sampled", "counterfactual", "sampled"]
    table, per = localisation_table({"a": a, "flat": torch.ones(3, 6)}, labels, reason, kinds, top_k=(1, 3))
    assert list(table.columns) == list(localisation_columns((1, 3)))
    t = table.set_index(["signal", "kind"])
    r = t.loc[("a", "sampled")]
    assert (r["n_responses"], r["top1"], r["top3"], r["auroc_mean"]) == (2, 1.0, 1.0, 1.0)
    # pooled over r0 and r2: positives {.9, .3, .05} vs negatives {.1, .2, .01}: 7 of 9 pairs
    assert r["auroc_pooled"] == pytest.approx(7 / 9)
    assert (r["n_positive"], r["n_negative"], r["n_auroc"]) == (3, 3, 2)
    r = t.loc[("a", "counterfactual")]
    assert (r["top1"], r["top3"], r["auroc_mean"]) == (0.0, 1.0, 0.5)  # 0.7 is an unlabeled token
    # a constant score gets the chance level: r0 2 of 5 candidates, r2 1 of 3, r1 1 of 4
    assert t.loc[("flat", "sampled"), "top1"] == pytest.approx((2 / 5 + 1 / 3) / 2)
    assert t.loc[("flat", "sampled"), "top3"] == pytest.approx((1 - 1 / 10 + 1) / 2)
    assert t.loc[("flat", "counterfactual"), "top3"] == pytest.approx(3 / 4)
    assert t.loc[("flat", "counterfactual"), "auroc_mean"] == 0.5
    assert per["top1_a"].tolist() == [1.0, 0.0, 1.0] and per["n_positive"].tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="outside the reasoning"):
        localisation_table({"a": a}, labels, torch.zeros(3, 6, dtype=torch.bool), kinds)


def test_stability_table_hand_case():
    a = torch.tensor([[1.0, 2, 3, 0], [3, 2, 1, 0], [1, 1, 1, 0]])
    b = torch.tensor([[1.0, 3, 2, 9], [1, 2, 3, 9], [1, 2, 3, 9]])
    reason = torch.tensor([[1, 1, 1, 0]] * 3, dtype=torch.bool)
    table, per = stability_table({"x": (a, b, "noise seed")}, reason, ["sampled", "sampled", "counterfactual"])
    assert list(table.columns) == list(STABILITY_COLUMNS)
    assert per["spearman_x"].iloc[0] == pytest.approx(0.5) and per["spearman_x"].iloc[1] == pytest.approx(-1.0)
    assert math.isnan(per["spearman_x"].iloc[2])  # a constant score has no rank correlation
    t = table.set_index("kind")
    assert t.loc["sampled", "n"] == 2 and t.loc["sampled", "median"] == pytest.approx(-0.25)
    assert t.loc["sampled", "q25"] == pytest.approx(-0.625) and t.loc["sampled", "iqr"] == pytest.approx(0.75)
    assert t.loc["counterfactual", "n"] == 0 and math.isnan(t.loc["counterfactual", "median"])
    assert t.loc["all", "n"] == 2 and (table["comparison"] == "noise seed").all()


def test_cost_table_ratio():
    c = cost_table({"g": 2.0, "p": 3.0, "k": 1.0}, {"g": 4, "p": 4, "k": 10}, reference="g", notes={"k": "n"})
    t = c.set_index("signal")
    assert t.loc["g", "seconds_per_response"] == 0.5 and t.loc["g", "ratio_to_reference"] == 1.0
    assert t.loc["p", "ratio_to_reference"] == pytest.approx(1.5)
    assert t.loc["k", "seconds_per_response"] == pytest.approx(0.1) and t.loc["k", "note"] == "n"
    assert cost_table({"p": 1.0}, {"p": 1}, reference="g")["ratio_to_reference"].isna().all()


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------

E2E_TASK = {"operands": [2, 3], "digits": 1, "operators": ["+", "-"], "filler_prob": 0.5}
E2E_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}
E2E_SFT_STEPS = 1000


@pytest.mark.slow
@pytest.mark.e2e
def test_attribution_from_config_end_to_end(tmp_path, capfd):
    """A tiny model fine-tuned briefly on 1-digit problems makes arithmetic mistakes and solves
    some problems: the benchmark finds both kinds of responses, scores them with a signal of every kind
    and writes the tables (one row per signal and kind, n > 0), the per-response rows and the figures;
    its progress bars count the mistakes collected and the signals scored."""
    import json

    import pandas as pd

    from oar.attribution import attribution_from_config, format_tables
    from oar.config.load import load_config
    from oar.models.tiny import build_tiny
    from helpers import cpu_strategy
    from oar.trainer.sft import run_sft

    model, tok = build_tiny(**E2E_MODEL, seed=0)
    recs = generate("train", 400, seed=0, **E2E_TASK)
    run_sft(model, tok, recs, strategy=cpu_strategy(), steps=E2E_SFT_STEPS, batch_size=16, lr=1e-2, weight_decay=0.0,
            betas=(0.9, 0.98), warmup_steps=5, grad_clip=1.0, seed=0, progress=False)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    cfg = load_config(
        ROOT / "config" / "config.yaml",
        {
            "task": {"synthetic": E2E_TASK},
            "rollout": {"n": 6, "temperature": 0.7, "max_new_tokens": 40},
            # min_steps 1: this model rarely solves 3-operand problems in consistent steps
            "attribution": {"n_sampled": 4, "n_counterfactual": 4, "max_prompts": 60, "prompts_per_round": 12,
                            "min_steps": 1},
            "reward": {"workers": 1},
        },
    )
    # one signal of each kind, plus the zero-noise OAR-G (stability) and the tied OAR-P; the smoke DAG
    # (tests/test_workflow.py) runs every signal of the default config
    keep = ("oar_p", "oar_p_tied", "oar_g", "oar_g_joint_n0", "mc_value", "ktae", "random", "uniform")
    cfg["attribution"]["signals"] = [s for s in cfg["attribution"]["signals"] if s["name"] in keep]
    assert len(cfg["attribution"]["signals"]) == len(keep)
    out = tmp_path / "attribution"
    res = attribution_from_config(cfg, model_dir, out)
    names = [s["name"] for s in cfg["attribution"]["signals"]]
    err = capfd.readouterr().err
    assert "attribution: mistakes: 100%" in err and "8/8" in err
    assert "attribution: signals: 100%" in err and f"{len(names)}/{len(names)}" in err

    loc = pd.read_csv(out / "localisation.csv")
    assert list(loc.columns) == list(localisation_columns((1, 3)))
    assert list(zip(loc["signal"], loc["kind"])) == [(s, k) for s in names for k in ("sampled", "counterfactual")]
    assert (loc["n_responses"] == 4).all() and (loc["n_positive"] > 0).all()
    for col in ("top1", "top3"):
        assert loc[col].between(0, 1).all(), col
    assert loc["auroc_mean"].dropna().between(0, 1).all()
    assert (loc["top3"] >= loc["top1"]).all()
    stab = pd.read_csv(out / "stability.csv")
    stochastic = [s["name"] for s in cfg["attribution"]["signals"]
                  if s["kind"] in ("oar_g", "random", "ktae")]
    assert set(stab["signal"]) == set(stochastic)
    assert set(stab["kind"]) == {"sampled", "counterfactual", "all"}
    n0 = stab[(stab["signal"] == "oar_g_joint_n0") & (stab["kind"] == "all")]
    assert n0["median"].item() == pytest.approx(1.0)  # no noise: the same scores twice
    cost = pd.read_csv(out / "cost.csv", keep_default_na=False, na_values=[""])
    assert cost["signal"].tolist() == names and (cost["seconds_per_response"] > 0).all()
    assert cost.set_index("signal").loc["oar_g", "ratio_to_reference"] == 1.0
    fid = pd.read_csv(out / "fidelity.csv")
    assert list(fid.columns) == list(FIDELITY_COLUMNS) and (fid["n_responses"] == 8).all()
    per = pd.read_csv(out / "per_response.csv", keep_default_na=False)  # "" stays "" (original_text)
    assert per["kind"].tolist() == ["sampled"] * 4 + ["counterfactual"] * 4
    assert (per["reward"] <= 0).all()  # every scored response is wrong, the edits included
    for _, r in per.iterrows():
        p = parse_response(r["text"], fillers=DEFAULT_FILLERS)
        c = check_steps(p.steps, *question_terms(r["question"]), p.answer)
        assert (c.status, c.mistake_step, c.propagated) == ("mistake", r["mistake_step"], True)
        assert (r["original_text"] != "") == (r["kind"] == "counterfactual")
    for name in ("localisation.png", "fidelity.png", "cost_curve.png"):
        assert (out / name).stat().st_size > 1000
    md = (out / "attribution.md").read_text()
    assert "## Error localisation" in md and "## Stability" in md and "## Cost" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_sampled"] == 4 and summary["n_counterfactual"] == 4
    assert {"git_commit", "cpu_capability", "start_time", "end_time"} <= set(summary["provenance"])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left
    text = format_tables(res)
    assert "Error localisation (sampled: n = 4, counterfactual: n = 4)" in text and "Stability" in text


def test_localisation_by_position_splits_last_and_earlier_mistakes():
    import pandas as pd

    from oar.attribution.metrics import localisation_by_position

    per = pd.DataFrame({"kind": ["sampled"] * 4 + ["counterfactual"] * 2,
                        "mistake_step": [1, 1, 0, -1, 0, 2], "n_steps": [2, 2, 2, 2, 3, 3],
                        "top3_a": [1.0, 0.0, 0.5, 1.0, 0.25, 1.0], "top3_b": [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]})
    tab = localisation_by_position(per, ["a", "b"], top_k=(3,))
    got = {(r.kind, r.position): (r.n_responses, r.top3_a, r.top3_b) for r in tab.itertuples()}
    # the response without a located mistake (-1) is left out
    assert got == {("sampled", "last"): (2, 0.5, 0.0), ("sampled", "earlier"): (1, 0.5, 1.0),
                   ("counterfactual", "earlier"): (1, 0.25, 1.0), ("counterfactual", "last"): (1, 1.0, 0.0)}
