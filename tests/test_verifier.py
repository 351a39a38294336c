"""The step verifier (oar.credit.verifier): its training targets by hand, a short fine-tuning that moves
the weights and separates right from wrong results, the estimator built on it (a verifier that locates
every mistake gives the oracle's credit), and how the workflow and the run identity see it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oar.credit import get_estimator

from helpers import credit_batch

TASK = {"kind": "synthetic", "synthetic": {"fillers": ["so", "ok", "well"]}}
# one group of 4+3-2 = 5 (the tiny tokenizer has one token per character): right, first step wrong,
# last step wrong, off the grammar
RESPONSES = ["4+3=7, so 7-2=5. \\boxed{5}", "4+3=8, 8-2=6. \\boxed{6}", "4+3=7, ok 7-2=4. \\boxed{4}", "4+3=7 well"]
REWARDS = [1.0, 0.0, 0.0, 0.0]


def _tiny_tokenizer():
    from oar.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_result_targets_are_the_right_steps_results_only():
    """Two steps, the second a demonstration slip: only the first step's result is a target."""
    from oar.trainer.verifier import result_targets

    tok = _tiny_tokenizer()
    rec = {"solution": "4+3=7, so 7-2=4. \\boxed{4}", "result_spans": [[4, 5], [14, 15]], "demo_errors": [1]}
    ids, mask, labels = result_targets([rec], ["Q"], tok)
    p_len = len(tok("Q", add_special_tokens=True)["input_ids"])
    targets = (labels[0] != -100).nonzero().flatten().tolist()
    assert targets == [p_len + 4]
    assert labels[0, p_len + 4] == ids[0, p_len + 4] == tok.convert_tokens_to_ids("7")
    assert mask[0].sum() == ids.shape[1]
    # without the slip, both results are targets
    ids, _, labels = result_targets([dict(rec, demo_errors=[])], ["Q"], tok)
    assert (labels[0] != -100).nonzero().flatten().tolist() == [p_len + 4, p_len + 14]


def test_first_wrong_step():
    from oar.credit.verifier import first_wrong_step

    assert first_wrong_step([0.1, 0.6, 0.9], 0.5) == 1
    assert first_wrong_step([0.1, 0.2], 0.5) == -1
    assert first_wrong_step([], 0.5) == -1
    assert first_wrong_step([0.5], 0.5) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A verifier fine-tuned for a few steps from a tiny model on demonstrations with slips."""
    from oar.trainer.verifier import VerifierSettings, save_verifier, train_verifier
    from oar.data.synthetic import generate
    from oar.models.tiny import build_tiny

    torch.manual_seed(0)
    records = generate("train", 240, seed=0, demo_error_rate=0.3, fillers=["so", "ok", "well"])
    prompts = [r["question"] + "\n" for r in records]
    start, tok = build_tiny(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=128)
    before = {k: v.clone() for k, v in start.state_dict().items()}
    settings = VerifierSettings(steps=40, batch_size=16, lr=3e-3, weight_decay=0.0, warmup_steps=2, seed=0,
                                demonstrations=200, eval_size=40)
    model, summary = train_verifier(settings, records, prompts, tok, start)
    folder = tmp_path_factory.mktemp("verifier") / "model"
    save_verifier(model, tok, folder, summary)
    return {"model": model, "tok": tok, "summary": summary, "folder": folder, "start": start, "before": before,
            "records": records, "prompts": prompts}


def test_train_verifier_moves_a_copy_and_measures_itself(trained):
    s, model, start = trained["summary"], trained["model"], trained["start"]
    # the start model is left as it was; the verifier's weights moved
    assert all(torch.equal(v, trained["before"][k]) for k, v in start.state_dict().items())
    moved = sum(float((v.float() - trained["before"][k].float()).abs().sum()) for k, v in model.state_dict().items())
    assert moved > 0
    assert s["train_records"] == 200 and s["eval_steps"] > 40
    assert 0.0 < s["wrong_share"] < 1.0
    assert 0.0 <= s["eval_accuracy"] <= 1.0 and s["final_loss_mean50"] > 0
    assert (trained["folder"] / "verifier_summary.json").is_file()
    assert (trained["folder"] / "config.json").is_file()


def test_step_error_probs_one_per_step(trained):
    from oar.credit.verifier import step_error_probs

    recs = trained["records"][:6]
    probs = step_error_probs(trained["model"], trained["tok"], trained["prompts"][:6], [r["solution"] for r in recs],
                             [r["result_spans"] for r in recs], chunk=4)  # two chunks
    assert [len(p) for p in probs] == [len(r["result_spans"]) for r in recs]
    assert all(0.0 <= p <= 1.0 for row in probs for p in row)
    # a response without steps has no probabilities
    assert step_error_probs(trained["model"], trained["tok"], ["Q"], ["x"], [[]]) == [[]]


@pytest.mark.parametrize("shape, oracle", [("pinpoint", "oracle_first_mistake"), ("suffix", "oracle_suffix")])
def test_a_verifier_that_finds_every_mistake_gives_the_oracles_credit(trained, monkeypatch, shape, oracle):
    """With the verifier's probabilities replaced by the truth (1 on each wrong result, from the
    task's own check), step_verifier's credit is the oracle's, token for token; with none located
    it is GRPO's."""
    from oar.credit import verifier as V

    def truth(model, tok, prompts, responses, spans, chunk=256):
        # the responses' steps checked by hand: row 1 step 0 wrong, row 2 step 1 wrong
        wrong = {RESPONSES[1]: 0, RESPONSES[2]: 1}
        first = [next((k for t, k in wrong.items() if r.startswith(t)), None) for r in responses]
        assert first.count(None) == 2  # the right row and the unparsed one
        return [[1.0 if f == k else 0.0 for k in range(len(s))] for f, s in zip(first, spans)]

    monkeypatch.setattr(V, "step_error_probs", truth)
    batch = credit_batch(RESPONSES, REWARDS, task=TASK)
    got = get_estimator("step_verifier")(batch, verifier=str(trained["folder"]), shape=shape)
    want = get_estimator(oracle)(credit_batch(RESPONSES, REWARDS, task=TASK))
    assert torch.allclose(got.token_advantages, want.token_advantages, atol=1e-6)
    assert got.stats["located_fraction"] == want.stats["located_fraction"] == 0.5
    # both wrong rows' mistakes found, the right row left alone
    assert {k: got.stats[k] for k in got.stats if k.startswith("verifier_") and k != "verifier_s"} == {
        "verifier_wrong_rows": 2.0, "verifier_hits": 2.0, "verifier_others": 0.0, "verifier_right_rows": 1.0,
        "verifier_false_alarms": 0.0}
    # credit is per token, not one value per response (row 1 wrong at its first step)
    row = got.token_advantages[1][batch.response_mask[1].bool()]
    assert row.unique().numel() > 1

    monkeypatch.setattr(V, "step_error_probs", lambda *a, **k: [[0.0] * len(s) for s in a[4]])
    none = get_estimator("step_verifier")(credit_batch(RESPONSES, REWARDS, task=TASK), verifier=str(trained["folder"]),
                                          shape=shape)
    grpo = get_estimator("grpo")(credit_batch(RESPONSES, REWARDS, task=TASK))
    assert torch.allclose(none.token_advantages, grpo.token_advantages, atol=1e-6)
    assert none.stats["verifier_hits"] == 0.0 and none.stats["verifier_wrong_rows"] == 2.0

    # a verifier that blames every step: row 1's first step is its mistake (a hit), row 2's first
    # step is right (another step), and the right row is a false alarm
    monkeypatch.setattr(V, "step_error_probs", lambda *a, **k: [[1.0] * len(s) for s in a[4]])
    every = get_estimator("step_verifier")(credit_batch(RESPONSES, REWARDS, task=TASK), verifier=str(trained["folder"]),
                                           shape=shape)
    assert (every.stats["verifier_hits"], every.stats["verifier_others"], every.stats["verifier_false_alarms"]) == (1, 1, 1)


def test_the_trained_verifier_runs_as_the_estimator(trained):
    out = get_estimator("step_verifier")(credit_batch(RESPONSES, REWARDS, task=TASK), verifier=str(trained["folder"]))
    assert out.token_advantages.shape == credit_batch(RESPONSES, REWARDS, task=TASK).response_ids.shape
    assert out.stats["verifier_s"] > 0


@pytest.mark.parametrize("options, match", [
    ({}, "names the verifier a config's workflow trains"),
    ({"verifier": "/nonexistent/verifier"}, "does not load as a causal language model"),
    ({"verifier": "x", "shape": "round"}, "shape 'round'"),
])
def test_estimator_refuses_what_it_cannot_read(options, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        get_estimator("step_verifier")(credit_batch(RESPONSES, REWARDS, task=TASK), **options)


def _config(tmp_path, **verifier):
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods

    cfg = load_config("config/ranking_decisive.yaml", overrides={"results_dir": str(tmp_path), "verifier": verifier,
                                                                  "only_methods": ["grpo", "step_verifier_pinpoint",
                                                                                   "step_verifier_suffix"]})
    return cfg, resolve_methods(cfg)


def test_the_verifier_joins_the_identity_of_its_runs_only(tmp_path):
    """A verifier setting changed: the step_verifier runs' keys change (they retrain), GRPO's does not;
    the view gets a verifier entry keyed by the verifier's settings."""
    from oar.config.identity import run_identity, run_key, uses_trained_verifier, verifier_key
    from oar.pipeline.store import store_entries

    a, ma = _config(tmp_path)
    b, mb = _config(tmp_path, steps=301)
    assert uses_trained_verifier(ma["step_verifier_suffix"]) and not uses_trained_verifier(ma["grpo"])
    assert verifier_key(a, sft=False) != verifier_key(b, sft=False)
    assert run_key(a, ma["step_verifier_suffix"], sft=False) != run_key(b, mb["step_verifier_suffix"], sft=False)
    assert run_key(a, ma["grpo"], sft=False) == run_key(b, mb["grpo"], sft=False)
    assert run_identity(a, ma["grpo"], 0, "m") == run_identity(b, mb["grpo"], 0, "m")
    assert run_identity(a, ma["step_verifier_suffix"], 0, "m") != run_identity(b, mb["step_verifier_suffix"], 0, "m")
    views = {e.view: e.target for e in store_entries(a, ma, sft=False)}
    assert views["verifier"] == f"verifier/{verifier_key(a, sft=False)}"
    # GRPO alone, and no attribution signal reading the verifier: no verifier entry
    no_attribution = {**a, "attribution": {**a["attribution"], "enabled": False}}
    assert "verifier" not in {e.view for e in store_entries(no_attribution, {"grpo": ma["grpo"]}, sft=False)}
    assert "verifier" in {e.view for e in store_entries(a, {"grpo": ma["grpo"]}, sft=False)}  # its step_verifier signal


def test_the_trainer_locates_the_trained_verifier(tmp_path, trained):
    """``verifier: trained`` becomes <results_dir>/<name>/verifier/model; before it is trained, one line
    says how to train it."""
    import shutil

    from oar.config.tree import ResultsTree
    from oar.trainer.setup import estimator_options

    cfg, methods = _config(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"verifier_summary.json is missing; train it first"):
        estimator_options(cfg, methods["step_verifier_pinpoint"])
    folder = Path(ResultsTree.of(cfg).verifier_model)
    assert folder == tmp_path / "ranking_decisive" / "verifier" / "model"
    shutil.copytree(trained["folder"], folder)
    assert estimator_options(cfg, methods["step_verifier_pinpoint"])["verifier"] == str(folder)
    assert "verifier" not in estimator_options(cfg, methods["grpo"])


def test_oar_train_before_the_verifier_is_trained_is_one_line(tmp_path, capsys):
    from helpers import ROOT, one_error_line, run_cli

    out = tmp_path / "run"
    rc, _, err = run_cli(["train", "--config", str(ROOT / "config" / "smoke.yaml"), "--method", "step_verifier",
                          "--seed", "0", "--output", str(out), "--no-progress",
                          "--set", f"results_dir={tmp_path}", "tracking.enabled=false"], capsys)
    assert rc == 2
    line = one_error_line(err, "train")
    assert line.startswith("oar train: error: methods.step_verifier: credit step_verifier reads the verifier this config "
                           f"trains, and {tmp_path}/smoke/verifier/model/verifier_summary.json is missing; train it first")
    assert not out.exists()  # nothing of the run was made
