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
    UNLABELED,
    auroc,
    average_ranks,
    compute_signals,
    fidelity_table,
    label_responses,
    parse_response,
    spearman,
    token_char_spans,
    token_labels,
)
from oar.data.synthetic import DEFAULT_FILLERS, generate

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
    from oar.models import build_tiny_tokenizer

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


def test_compute_signals_shapes_masks_and_ktae_abs():
    """On a random tiny model: every signal is (n, T), zero outside the probe's reasoning for OAR,
    ktae == |ktae_signed|, and the random baseline is reproducible."""
    from oar.models import build_tiny

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
    scores, seconds, info = compute_signals(model, tok, **kw)
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
    again, _, _ = compute_signals(model, tok, signals=("random", "oar_g"), **kw)
    assert torch.equal(again["random"], scores["random"])
    assert torch.allclose(again["oar_g"], scores["oar_g"])
    with pytest.raises(ValueError, match="unknown signals"):
        compute_signals(model, tok, signals=("oar_x",), **kw)


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------

E2E_TASK = {"operands": [2, 3], "digits": 1, "operators": ["+", "-"], "filler_prob": 0.5}
E2E_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}


@pytest.mark.slow
def test_attribution_from_config_end_to_end(tmp_path):
    """A tiny model fine-tuned for 80 steps on 1-digit problems writes parseable responses part of
    the time; the benchmark runs on them and writes the table, the per-response rows, the plot."""
    import pandas as pd

    from oar.attribution import attribution_from_config
    from oar.config import load_config
    from oar.models import build_tiny
    from oar.sft import run_sft

    model, tok = build_tiny(**E2E_MODEL, seed=0)
    recs = generate("train", 400, seed=0, **E2E_TASK)
    run_sft(model, tok, recs, steps=80, batch_size=16, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98),
            warmup_steps=5, grad_clip=1.0, seed=0, progress=False)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    cfg = load_config(
        ROOT / "config" / "config.yaml",
        {
            "task": {"synthetic": E2E_TASK},
            "rollout": {"n": 6, "temperature": 0.7, "max_new_tokens": 40},
            "attribution": {"n_responses": 24, "seed": 0},
            "reward": {"workers": 1},
        },
    )
    out = tmp_path / "attribution"
    fid = attribution_from_config(cfg, model_dir, out, repeats=1)

    on_disk = pd.read_csv(out / "fidelity.csv")
    assert list(on_disk.columns) == list(FIDELITY_COLUMNS)
    assert on_disk["signal"].tolist() == ["oar_p", "oar_p_answer_mean", "oar_g", "ktae", "ktae_signed", "random"]
    pd.testing.assert_frame_equal(on_disk, fid, check_dtype=False)
    assert (out / "fidelity.png").stat().st_size > 1000
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left

    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_sampled"] == 24 and summary["n_prompts"] == 4
    assert summary["n_evaluated"] + summary["n_skipped_no_answer"] + summary["n_skipped_unparsed"] == 24
    n = summary["n_evaluated"]
    assert n >= 1, "the fine-tuned model produced no parseable response"
    assert (fid["n_responses"] == n).all()
    assert (fid["n_pivotal"] >= n).all()  # every parsed response has at least one step
    assert fid.set_index("signal").loc["oar_p", "spearman_vs_oar_p"] == pytest.approx(1.0)
    ok = fid["auroc_pooled"].dropna()
    assert ((ok >= 0) & (ok <= 1)).all()
    assert (fid["seconds_per_response"] > 0).all()

    per = pd.read_csv(out / "per_response.csv", keep_default_na=False, na_values=[""])
    assert len(per) == n
    # the labels counted per response are the parse of its text (one token per character)
    for _, r in per.iterrows():
        p = parse_response(r["text"], fillers=DEFAULT_FILLERS)
        assert p is not None
        assert r["n_pivotal"] == sum(e - s for s, e in p.pivotal_spans)
        assert r["n_filler"] == sum(e - s for s, e in p.filler_spans)
        assert r["n_reasoning"] == p.reasoning_end
