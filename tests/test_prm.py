"""A process reward model as the first-mistake signal on any task (oar.credit.prm): the steps of a response,
TRL's PRMTrainer input layout by hand, a token-classification PRM read at the separators, and the credit
it gives (a PRM that doubts a step puts the importance on that step's tokens)."""

from __future__ import annotations

import pytest
import torch

from oar.credit import get_estimator

from helpers import credit_batch

BENCH = {"kind": "benchmark"}
RESPONSES = ["First 2+3 = 5.\nThen 5*2 = 10.\n\\boxed{10}", "First 2+3 = 6.\nThen 6*2 = 12.\n\\boxed{12}"]
REWARDS = [1.0, 0.0]


def test_line_steps_hand_case():
    from oar.credit.prm import line_steps

    text = "a=1\n\n b=2 \nx<eos>"
    steps = line_steps(text, end_markers=["<eos>"])
    assert steps.step_spans == [[0, 3], [6, 9], [11, 12]] and steps.reasoning_end == 12
    assert [text[a:b] for a, b in steps.step_spans] == ["a=1", "b=2", "x"]
    assert steps.result_spans == steps.step_spans
    assert line_steps("  \n \n") is None
    assert line_steps("a;b", separator=";").step_spans == [[0, 1], [2, 3]]


def test_prm_inputs_are_trls_layout():
    """[bos] prompt (step separator)*: the label of step k at the last token of its separator, as TRL's
    PRMTrainer.tokenize_row places it (trl/experimental/prm/prm_trainer.py, separator after every step)."""
    from oar.credit.prm import prm_inputs
    from oar.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids, at = prm_inputs(tok, "Q", ["1+1=2", "2+2=5"])
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>Q1+1=2\n2+2=5\n"
    assert at == [7, 13] and [tok.decode([ids[k]]) for k in at] == ["\n", "\n"]
    ids, at = prm_inputs(tok, "Q", ["a", "b"], separator=" ки\n")
    assert tok.decode(ids[at[0] - 3: at[0] + 1]) == " ки\n".replace("к", "<unk>").replace("и", "<unk>")


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory):
    """A random two-label token-classification model with the tiny tokenizer, saved as a PRM would be."""
    from transformers import AutoModelForTokenClassification

    from oar.models.tiny import build_tiny

    lm, tok = build_tiny(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=128,
                         seed=0)
    cfg = lm.config
    cfg.num_labels = 2
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(cfg)
    folder = tmp_path_factory.mktemp("prm")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_prm_reads_one_probability_per_step(prm_folder):
    from oar.credit.prm import load_prm, prm_error_probs

    model, tok = load_prm(str(prm_folder))
    probs = prm_error_probs(model, tok, ["Q", "Q2"], [["a=1", "b=2", "c"], ["x"]], chunk=1)
    assert [len(p) for p in probs] == [3, 1]
    assert all(0.0 < p < 1.0 for row in probs for p in row)
    # batched and one at a time agree (right padding does not move a position)
    both = prm_error_probs(model, tok, ["Q", "Q2"], [["a=1", "b=2", "c"], ["x"]], chunk=2)
    assert [p for row in both for p in row] == pytest.approx([p for row in probs for p in row], abs=1e-5)


def test_step_prm_credit_lands_on_the_doubted_step(prm_folder, monkeypatch):
    """The PRM doubts the wrong response's first step (set by hand): pinpoint puts the Bi-Level
    importance on that line's tokens (they get more than the response's mean weight, the other
    lines less); suffix spares nothing before it (the first step) and weighs the rest; the right
    response keeps GRPO's credit. A PRM that doubts nothing gives GRPO's credit."""
    from oar.credit import prm as P

    seen = {}

    def doubt_first_of_wrong(model, tok, prompts, steps, separator="\n", chunk=16):
        seen["steps"] = steps
        return [[0.9 if "6" in s[0] else 0.1] + [0.2] * (len(s) - 1) for s in steps]

    monkeypatch.setattr(P, "prm_error_probs", doubt_first_of_wrong)
    batch = credit_batch(RESPONSES, REWARDS, task=BENCH)
    out = get_estimator("step_prm")(batch, prm=str(prm_folder))
    assert seen["steps"][1] == ["First 2+3 = 6.", "Then 6*2 = 12.", "\\boxed{12}"]
    mask = batch.response_mask[1].bool()
    w = out.weights[1]
    first = len("First 2+3 = 6.")
    assert float(w[:first].min()) > float(w[mask].mean()) > float(w[first + 1: int(mask.sum()) - 1].max())  # not the eos
    assert torch.allclose(out.weights[0][batch.response_mask[0].bool()], torch.ones(int(batch.response_mask[0].sum())))
    assert out.stats["located_fraction"] == 0.5 and out.stats["prm_s"] > 0
    grpo = get_estimator("grpo")(credit_batch(RESPONSES, REWARDS, task=BENCH))
    suffix = get_estimator("step_prm")(credit_batch(RESPONSES, REWARDS, task=BENCH), prm=str(prm_folder), shape="suffix")
    assert torch.allclose(suffix.token_advantages, grpo.token_advantages)  # the mistake is the first step
    monkeypatch.setattr(P, "prm_error_probs", lambda m, t, prompts, steps, *a, **k: [[0.1] * len(s) for s in steps])
    none = get_estimator("step_prm")(credit_batch(RESPONSES, REWARDS, task=BENCH), prm=str(prm_folder))
    assert torch.allclose(none.token_advantages, grpo.token_advantages)


def test_step_prm_runs_a_real_prm_forward(prm_folder):
    out = get_estimator("step_prm")(credit_batch(RESPONSES, REWARDS, task=BENCH), prm=str(prm_folder), threshold=0.01)
    assert out.stats["located_fraction"] == 1.0  # every response has a step above a 1% doubt
    assert out.token_advantages.shape == credit_batch(RESPONSES, REWARDS, task=BENCH).response_ids.shape


def test_step_prm_refuses_what_it_cannot_read(tmp_path):
    from oar.models.tiny import build_tiny

    lm, tok = build_tiny(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=128)
    lm.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    with pytest.raises(FileNotFoundError, match=r"is a LlamaForCausalLM checkpoint, not a token-classification PRM"):
        get_estimator("step_prm")(credit_batch(RESPONSES, REWARDS, task=BENCH), prm=str(tmp_path / "lm"))
    with pytest.raises(ValueError, match="set the option prm"):
        get_estimator("step_prm")(credit_batch(RESPONSES, REWARDS, task=BENCH))
