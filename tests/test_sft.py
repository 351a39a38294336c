"""Tests for oar.trainer.sft: batch building, LR schedule, SFT training, greedy accuracy, config entry."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oar.models.loading import load_policy
from oar.models.tiny import build_tiny, build_tiny_tokenizer
from helpers import ROOT, SHARED_DATA, cpu_strategy
from oar.reward.answer import extract_boxed
from oar.trainer.optim import lr_factor
from oar.trainer.sft import IGNORE_INDEX, build_sft_batch, greedy_accuracy, run_sft, sft_step
from oar.trainer.sft_stage import sft_data, sft_from_config

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=128)
OPT = dict(weight_decay=0.0, betas=(0.9, 0.98), grad_clip=1.0)


def _opt() -> dict:
    """:data:`OPT` and the CPU training strategy SFT runs on."""
    return dict(OPT, strategy=cpu_strategy())


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _ids(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# build_sft_batch
# ---------------------------------------------------------------------------------------------


def test_build_sft_batch_layout(tok):
    prompts = ["Compute 1+2.\n", "Compute 10+20+3.\n"]
    responses = ["1+2=3. \\boxed{3}", "10+20=30, 30+3=33. \\boxed{33}"]
    b = build_sft_batch(tok, prompts, responses)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    lens = [len(p) + len(r) + 1 for p, r in zip(prompts, responses)]  # one id per char, + eos
    assert b["input_ids"].shape == (2, max(lens))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        L, P = lens[i], len(p)
        row = b["input_ids"][i].tolist()
        assert row[:L] == _ids(tok, p) + _ids(tok, r) + [eos]
        assert row[L:] == [pad] * (max(lens) - L)  # right padding
        assert b["attention_mask"][i].tolist() == [1] * L + [0] * (max(lens) - L)
        lab = b["labels"][i].tolist()
        assert lab[:P] == [IGNORE_INDEX] * P  # no loss on the prompt
        assert lab[P:L] == _ids(tok, r) + [eos]  # loss on the response and eos
        assert lab[L:] == [IGNORE_INDEX] * (max(lens) - L)
        assert b["position_ids"][i, :L].tolist() == list(range(L))


def test_build_sft_batch_without_eos_and_errors(tok):
    b = build_sft_batch(tok, ["a\n"], ["bc"], add_eos=False)
    assert b["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX] + _ids(tok, "bc")]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_sft_batch(tok, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="record 0: empty response"):
        build_sft_batch(tok, ["a"], [""], add_eos=False)
    with pytest.raises(ValueError, match="record 1: 7 tokens exceed max_length=5"):
        build_sft_batch(tok, ["a", "abc"], ["b", "def"], max_length=5)


def test_build_sft_batch_loss_counts_response_tokens_only(tok):
    """HF's labels= loss on this batch equals a hand-computed mean CE over response tokens."""
    model, _ = build_tiny(**SMALL, seed=0)
    b = build_sft_batch(tok, ["Compute 1+2.\n", "Compute 5-3+1.\n"], ["\\boxed{3}", "5-3=2, 2+1=3. \\boxed{3}"])
    with torch.no_grad():
        out = model(**b)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
        target = b["labels"][:, 1:]
        keep = target != IGNORE_INDEX
        nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected = (nll * keep).sum() / keep.sum()
    assert keep.sum() == len("\\boxed{3}") + 1 + len("5-3=2, 2+1=3. \\boxed{3}") + 1
    torch.testing.assert_close(out.loss, expected)


def test_sft_step_micro_batches_give_the_whole_batch_gradient(tok):
    """Length-sorted micro-batches of 1 or 2 accumulate the same loss and gradient as one padded batch
    (HF's labels= loss), with less padding."""
    model, _ = build_tiny(**SMALL, seed=0)
    prompts = ["Compute 1+2.\n", "Compute 5-3+1.\n", "Compute 2+2.\n"]
    responses = ["\\boxed{3}", "5-3=2, 2+1=3. so the result is \\boxed{3}", "2+2=4. \\boxed{4}"]
    b = build_sft_batch(tok, prompts, responses)
    model.zero_grad()
    whole = model(**b).loss
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for micro in (1, 2, 3):
        model.zero_grad()
        loss, n_tokens = sft_step(model, tok, prompts, responses, micro_batch_size=micro, strategy=cpu_strategy())
        assert n_tokens == int((b["labels"] != IGNORE_INDEX).sum())
        torch.testing.assert_close(loss, whole.detach())
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in want.values())
    # None (the default) is the one pass itself, bit for bit: SFT runs recorded before micro-batches
    # existed keep their weights (a reordered sum differs in the last bits, which 400 steps amplify)
    model.zero_grad()
    loss, n_tokens = sft_step(model, tok, prompts, responses, micro_batch_size=None, strategy=cpu_strategy())
    assert torch.equal(loss, whole.detach()) and n_tokens == int((b["labels"] != IGNORE_INDEX).sum())
    assert all(torch.equal(p.grad, want[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="micro_batch_size"):
        sft_step(model, tok, prompts, responses, micro_batch_size=0, strategy=cpu_strategy())


# ---------------------------------------------------------------------------------------------
# learning-rate schedule
# ---------------------------------------------------------------------------------------------


def test_lr_factor_sft_values():
    f = lambda s: lr_factor(s, warmup_steps=4, floor_step=14, schedule="cosine")  # noqa: E731  (SFT: floor at the last step)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # decay starts at full lr
    assert math.isclose(f(9), 0.5)  # half-way from step 4 to the last step 14: cos(pi/2)
    assert math.isclose(f(14), 0.0, abs_tol=1e-12)  # the last step reaches min_ratio
    vals = [f(s) for s in range(4, 15)]
    assert all(a > b for a, b in zip(vals, vals[1:]))
    assert math.isclose(lr_factor(14, warmup_steps=4, floor_step=14, schedule="cosine", min_ratio=0.1), 0.1)
    assert lr_factor(0, warmup_steps=0, floor_step=0, schedule="cosine") == 1.0


# ---------------------------------------------------------------------------------------------
# greedy_accuracy with a scripted model (exact expected responses)
# ---------------------------------------------------------------------------------------------


class ScriptedModel(torch.nn.Module):
    """Greedy 'model' that answers each prompt with a fixed text, then eos, then padding.

    Implements what :meth:`oar.rollout.HFEngine.generate` uses: ``generation_config``,
    ``parameters()`` and ``generate(..., return_dict_in_generate=True, output_logits=True)``.
    """

    def __init__(self, tok, answers: dict[str, str]):
        super().__init__()
        self.tok = tok
        self.answers = answers
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = SimpleNamespace(eos_token_id=tok.eos_token_id)
        self.prompt_ids = []  # token ids of every prompt seen (padding removed)

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        assert kw["do_sample"] is False and kw["return_dict_in_generate"] and kw["output_logits"]
        rows = []
        for ids, m in zip(input_ids, attention_mask):
            # left padding: real tokens are at the end of the row
            assert m[-1] == 1
            self.prompt_ids.append(ids[m.bool()].tolist())
            prompt = self.tok.decode(ids[m.bool()], skip_special_tokens=True)
            new = _ids(self.tok, self.answers[prompt])[: max_new_tokens - 1] + [self.tok.eos_token_id]
            rows.append(new)
        T = max(len(r) for r in rows)
        new = torch.full((len(rows), T), self.tok.pad_token_id)
        for i, r in enumerate(rows):
            new[i, : len(r)] = torch.tensor(r)
        logits = tuple(torch.zeros(len(rows), len(self.tok)) for _ in range(T))
        return SimpleNamespace(sequences=torch.cat([input_ids, new], dim=1), logits=logits)


def test_greedy_accuracy_scripted(tok):
    records = [
        {"id": "a", "question": "Compute 1+2.", "answer": "3"},
        {"id": "b", "question": "Compute 10+20+3.", "answer": "33"},
        {"id": "c", "question": "Compute 7-9.", "answer": "-2"},
        {"id": "d", "question": "Compute 50+50.", "answer": "100"},
    ]
    texts = ["1+2=3. \\boxed{3}", "10+20=30, 30+3=33. \\boxed{34}", "7-9=-2. \\boxed{-2}", "no box here"]
    model = ScriptedModel(tok, {r["question"] + "\n": t for r, t in zip(records, texts)})
    acc, responses = greedy_accuracy(model, tok, records, template="tiny", max_new_tokens=64, batch_size=3)
    assert responses == texts  # only new tokens, eos/pad stripped, order kept across batches
    assert acc == pytest.approx(2 / 4)
    # prompts are encoded with the tokenizer's special tokens, as in build_sft_batch
    assert model.prompt_ids == [tok(r["question"] + "\n")["input_ids"] for r in records]
    # max_new_tokens is passed through: the scripted model truncates to it
    _, resp2 = greedy_accuracy(model, tok, records[:1], template="tiny", max_new_tokens=14)
    assert resp2 == ["1+2=3. \\boxed"]
    with pytest.raises(ValueError, match="no records"):
        greedy_accuracy(model, tok, [], template="tiny", max_new_tokens=8)
    with pytest.raises(ValueError, match=r"record 1 has no \['id'\]"):
        greedy_accuracy(model, tok, [records[0], {"question": "q", "answer": "1"}], template="tiny", max_new_tokens=8)


# ---------------------------------------------------------------------------------------------
# run_sft
# ---------------------------------------------------------------------------------------------


def _records(n, seed=0):
    from oar.data.synthetic import generate

    return generate("train", n, seed=seed, operands=[2], long_share=0.0, filler_prob=0.0)


def test_run_sft_bad_args(tok):
    model, tok = build_tiny(**SMALL)
    with pytest.raises(ValueError, match="steps"):
        run_sft(model, tok, _records(4), steps=0, batch_size=2, lr=1e-3, warmup_steps=0, seed=0, **_opt())
    with pytest.raises(ValueError, match="no training records"):
        run_sft(model, tok, [], steps=1, batch_size=2, lr=1e-3, warmup_steps=0, seed=0, **_opt())
    with pytest.raises(ValueError, match="'solution'"):
        run_sft(model, tok, [{"question": "x"}], steps=1, batch_size=2, lr=1e-3, warmup_steps=0, seed=0, **_opt())


def test_run_sft_trains_on_the_training_strategy():
    """SFT runs on the training's strategy, as RL's update does: a bfloat16 model is trained on
    float32 master weights with bfloat16 compute (``train.master_dtype``, ``train.compute_dtype``),
    so a step at lr 1e-6 moves every weight (stepped in bfloat16 it would round away); a strategy
    over several processes is refused."""
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    model, tok = build_tiny(**SMALL, seed=0)
    model.to(torch.bfloat16)
    before = {k: v.float().clone() for k, v in model.state_dict().items()}
    strategy = make_strategy(TrainSettings.from_config({"train": {"compute_dtype": "bfloat16"}}), "cpu")
    run_sft(model, tok, _records(8), steps=2, batch_size=4, lr=1e-6, warmup_steps=0, seed=0, progress=False,
            strategy=strategy, **OPT)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    after = model.state_dict()
    changed = sum(int((before[k] != after[k].float()).sum()) for k in before)
    assert changed / sum(v.numel() for v in before.values()) >= 0.99
    with pytest.raises(ValueError, match="sft: runs in one process; this one is rank 1 of 2"):
        run_sft(model, tok, _records(4), steps=1, batch_size=2, lr=1e-3, warmup_steps=0, seed=0,
                strategy=SimpleNamespace(world=2, rank=1), **OPT)


def test_sft_on_fsdp_trains_the_shards_and_saves_the_full_model(tmp_path):
    """SFT on ``train.strategy: fsdp`` (one process, gloo here): the sharded model trains, and
    :func:`save_sft_model` writes its full weights, which load as the plain model with the trained values."""
    from oar.config.settings import TrainSettings
    from oar.trainer.sft import save_sft_model
    from oar.trainer.strategy import make_strategy

    model, tok = build_tiny(**SMALL, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = make_strategy(TrainSettings.from_config({"train": {"strategy": "fsdp"}}), "cpu")
    run_sft(model, tok, _records(8), steps=2, batch_size=4, lr=1e-2, warmup_steps=0, seed=0, progress=False,
            strategy=strategy, **OPT)
    trained = {k: v.clone() for k, v in strategy.full_state(model)}
    save_sft_model(tmp_path / "sft", model, tok, {}, started=0.0, strategy=strategy)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict()
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
    assert all(not torch.equal(saved[k], before[k]) for k in saved if k.endswith("proj.weight"))
    assert json.loads((tmp_path / "sft" / "sft_summary.json").read_text())["seconds"] > 0


def test_run_sft_logging_schedule_and_determinism():
    recs = _records(20)
    logs = []
    m1, tok = build_tiny(**SMALL, seed=0)
    r1 = run_sft(m1, tok, recs, steps=6, batch_size=8, lr=1e-3, warmup_steps=2, seed=3, progress=False,
                 log_fn=lambda s, met: logs.append((s, met)), **_opt())
    assert [s for s, _ in r1["loss_curve"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in logs] == [1, 2, 3, 4, 5, 6]
    lrs = [met["sft/lr"] for _, met in logs]
    expected = [1e-3 * lr_factor(i, warmup_steps=2, floor_step=5, schedule="cosine") for i in range(6)]
    assert lrs == pytest.approx(expected)
    assert all(met["sft/loss"] == loss for (_, met), (_, loss) in zip(logs, r1["loss_curve"]))
    assert r1["final_loss"] == r1["loss_curve"][-1][1]
    assert r1["response_tokens"] > 6 * 8 * 5  # every record has >= 5 response tokens
    assert not m1.training
    # same seeds -> identical run; another batch seed -> a different one
    m2, _ = build_tiny(**SMALL, seed=0)
    r2 = run_sft(m2, tok, recs, steps=6, batch_size=8, lr=1e-3, warmup_steps=2, seed=3, progress=False, **_opt())
    assert r2["loss_curve"] == r1["loss_curve"]
    m3, _ = build_tiny(**SMALL, seed=0)
    r3 = run_sft(m3, tok, recs, steps=6, batch_size=8, lr=1e-3, warmup_steps=2, seed=4, progress=False, **_opt())
    assert r3["loss_curve"] != r1["loss_curve"]


@pytest.mark.slow
def test_run_sft_memorises_few_records():
    """Overfitting 4 solutions end to end: masking, eos and left-padded greedy decoding agree."""
    recs = _records(4, seed=7)
    model, tok = build_tiny(**SMALL, seed=0)
    evals = []
    r = run_sft(model, tok, recs, steps=150, batch_size=4, lr=1e-2, warmup_steps=5, seed=0, progress=False,
                eval_records=recs, eval_every=75, eval_max_new_tokens=40,
                log_fn=lambda s, met: evals.append(s) if "sft/eval_accuracy" in met else None, **_opt())
    assert r["final_loss"] < 0.05 < r["loss_curve"][0][1]
    assert [s for s, _ in r["eval_curve"]] == [75, 150] and evals == [75, 150]
    acc, responses = greedy_accuracy(model, tok, recs, template="tiny", max_new_tokens=40)
    assert responses == [x["solution"] for x in recs]  # stops at eos: nothing after the box
    assert acc == 1.0 and r["eval_curve"][-1][1] == 1.0


# ---------------------------------------------------------------------------------------------
# sft_from_config
# ---------------------------------------------------------------------------------------------


def _small_config():
    return {
        "device": "cpu",
        "model": {"source": "tiny", "gguf_file": None, "trust_remote_code": False, "dtype": "float32",
                  "tiny": SMALL},
        "task": {"kind": "synthetic", "template": "tiny", "train_size": 300, "seed": 11,
                 "synthetic": {"operands": [2], "long_operands": 3, "long_share": 0.1, "ood_operands": 3,
                               "digits": 1, "operators": ["+"], "filler_prob": 0.0}},
        "sft": {"steps": 30, "batch_size": 16, "lr": 3e-3, "weight_decay": 0.01, "betas": [0.9, 0.98],
                "warmup_steps": 3, "grad_clip": 1.0, "eval_size": 6, "max_new_tokens": 24, "seed": 5},
        "reward": {"correct": 1.0, "wrong": 0.0, "timeout_s": 5.0, "workers": 1},
    }


@pytest.mark.slow
def test_sft_from_config_writes_reloadable_checkpoint(tmp_path):
    out = tmp_path / "sft"
    logs = []
    summary = sft_from_config(_small_config(), out, progress=False, log_fn=lambda s, m: logs.append((s, m)))
    curve = [loss for _, loss in summary["sft"]["loss_curve"]]
    assert len(curve) == 30
    assert sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5  # the loss goes down
    assert set(summary["accuracy"]) == {"test", "ood"}
    assert all(0.0 <= a <= 1.0 for a in summary["accuracy"].values())
    assert set(summary["extracted"]) == {"test", "ood"}
    assert (30, {"sft/accuracy_test": summary["accuracy"]["test"],
                 "sft/extracted_test": summary["extracted"]["test"]}) in logs
    assert len(summary["examples"]) == 5 and summary["model"]["parameters"] > 0
    # the folder is complete and nothing temporary is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]
    on_disk = json.loads((out / "sft_summary.json").read_text())
    assert on_disk["accuracy"] == summary["accuracy"]
    assert on_disk["provenance"] == summary["provenance"] and summary["provenance"]["device"] == "cpu"
    assert summary["provenance"]["end_time"] >= summary["provenance"]["start_time"]
    assert on_disk["sft"]["loss_curve"] == [list(x) for x in summary["sft"]["loss_curve"]]
    # reloads with the Auto classes and with load_policy; same weights either way
    m = AutoModelForCausalLM.from_pretrained(out)
    t = AutoTokenizer.from_pretrained(out)
    assert t.padding_side == "left"
    m2, t2 = load_policy(str(out))
    enc = t(["Compute 1+2.\n", "Compute 3+4+5.\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(m(**enc).logits, m2(**enc).logits)
    # the initial weights differ from the trained ones (training happened and was saved)
    fresh, _ = build_tiny(**SMALL, seed=5)
    assert not torch.equal(fresh.model.embed_tokens.weight, m.model.embed_tokens.weight)
    # running again replaces the folder atomically
    sft_from_config(_small_config(), out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]


def test_sft_from_config_rejects_bad_config(tmp_path):
    cfg = _small_config()
    cfg["task"]["kind"] = "other"
    with pytest.raises(ValueError, match="task.kind"):
        sft_from_config(cfg, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def _benchmark_config(tmp_path, name: str, lines: list[str], eval_size: int = 2) -> dict:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = _small_config()
    cfg["task"] = {"kind": "benchmark", "template": "plain", "train_size": 100, "seed": 0,
                   "benchmark": {"name": name, "source": str(src)}}
    cfg["sft"]["eval_size"] = eval_size
    return cfg


def _sft_data(cfg: dict) -> tuple[list[dict], dict[str, list[dict]]]:
    return sft_data(cfg["task"], eval_size=cfg["sft"]["eval_size"])


def test_sft_data_benchmark_holds_out_the_last_records(tmp_path):
    lines = [json.dumps({"question": f"q{i}?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"})
             for i in range(7)]
    train, evals = _sft_data(_benchmark_config(tmp_path, "gsm8k", lines))
    assert [r["question"] for r in train] == ["q0?", "q1?", "q2?", "q3?", "q4?"]
    assert list(evals) == ["heldout"] and [r["answer"] for r in evals["heldout"]] == ["6", "7"]
    # the SFT target: the calculator annotation gone, the answer boxed as the reward reads it
    assert train[2]["solution"] == "2 + 1 = 3\nThe final answer is $\\boxed{3}$."
    assert extract_boxed(train[2]["solution"]) == train[2]["answer"] == "3"
    cfg = _benchmark_config(tmp_path, "gsm8k", lines)
    cfg["task"]["train_size"] = 3
    assert len(_sft_data(cfg)[0]) == 3


def test_sft_data_benchmark_errors(tmp_path):
    # a benchmark without reference solutions cannot be fine-tuned on; the message names it
    cfg = _benchmark_config(tmp_path, "aime24", [json.dumps({"problem": "p", "answer": "1"})] * 4)
    with pytest.raises(ValueError, match=r"'aime24'.*aime24.jsonl.*solution.*sft.enabled"):
        _sft_data(cfg)
    cfg = _benchmark_config(tmp_path, "gsm8k", [json.dumps({"question": "q", "answer": "#### 1"})] * 2)
    with pytest.raises(ValueError, match=r"sft.eval_size=2.*only 2 gsm8k records"):
        _sft_data(cfg)


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "train.jsonl").exists(),
                    reason="../shared/data not present")
def test_gsm8k_train_solutions_all_box_their_gold():
    from oar.data.benchmarks import load_benchmark

    recs = load_benchmark("gsm8k", SHARED_DATA / "gsm8k" / "train.jsonl")
    assert len(recs) == 7473
    assert all(extract_boxed(r["solution"]) == r["answer"] for r in recs)
    assert not any("<<" in r["solution"] or "####" in r["solution"] for r in recs)


def test_sft_cache_copies_a_finished_sft_with_the_same_settings(tmp_path, monkeypatch):
    """sft.cache_dir: the first run trains and fills the cache, a run with the same model, task and sft
    settings copies it (no training: the same weights), other settings train again; the option is in no
    fingerprint (a cell that sets it keeps its finished jobs)."""
    import oar.trainer.sft_stage as sft_mod
    from oar.config.identity import config_sections, fingerprint, sft_cache_key

    trained = []
    real = sft_mod.sft_from_config
    monkeypatch.setattr(sft_mod, "sft_from_config", lambda *a, **k: trained.append(a[1]) or real(*a, **k))
    cfg = _small_config()
    cfg["sft"].update(steps=4, eval_size=2, cache_dir=str(tmp_path / "cache"))
    first = sft_mod.sft_or_cached(cfg, tmp_path / "a" / "sft", progress=False)
    assert trained == [tmp_path / "a" / "sft"] and "cached_from" not in first
    entry = tmp_path / "cache" / sft_cache_key(cfg)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]  # complete, nothing temporary

    second = sft_mod.sft_or_cached(cfg, tmp_path / "b" / "sft", progress=False)
    assert len(trained) == 1 and second["cached_from"] == str(entry)
    assert second["accuracy"] == first["accuracy"]
    assert second["provenance"] == first["provenance"]  # a copy is the model the first run trained
    assert json.loads((tmp_path / "b" / "sft" / "sft_summary.json").read_text())["cached_from"] == str(entry)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "sft")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "sft")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    other = json.loads(json.dumps(cfg))
    other["sft"]["lr"] = 1e-3
    assert sft_cache_key(other) != sft_cache_key(cfg)
    sft_mod.sft_or_cached(other, tmp_path / "c" / "sft", progress=False)
    assert len(trained) == 2

    # where the cache is changes no fingerprint; null (the default) trains without one
    moved = json.loads(json.dumps(cfg))
    moved["sft"]["cache_dir"] = None
    assert sft_cache_key(moved) == sft_cache_key(cfg)
    assert fingerprint(config_sections(moved, "model", "task", "sft")) == fingerprint(
        config_sections(cfg, "model", "task", "sft"))
    sft_mod.sft_or_cached(moved, tmp_path / "d" / "sft", progress=False)
    assert len(trained) == 3 and len(list((tmp_path / "cache").iterdir())) == 2


def test_the_strategy_settings_that_change_sft_join_its_keys_and_no_others():
    """SFT runs on the training's strategy: the ``train`` keys that make it train otherwise (bfloat16
    compute, fsdp, float32 master weights of a model loaded in bfloat16) join its key and its cache
    key. Where it trains as it did before (ddp, float32 compute, the weights in ``model.dtype``) the
    keys are what they were: the model, task and sft sections alone."""
    import copy

    from oar.config.identity import config_sections, fingerprint, sft_cache_key, sft_key, sft_strategy_settings
    from oar.config.load import load_config

    cfg = load_config(ROOT / "config" / "config.yaml")
    sections = config_sections(cfg, "model", "task", "sft")
    assert sft_strategy_settings(cfg) == {}
    assert (sft_key(cfg), sft_cache_key(cfg)) == (fingerprint(sections), fingerprint(sections, cfg["device"]))

    def changed(**keys) -> tuple[dict, str, str]:
        c = copy.deepcopy(cfg)
        for key, value in keys.items():
            section, name = key.split("__")
            c[section][name] = value
        return sft_strategy_settings(c), sft_key(c), sft_cache_key(c)

    for keys, want in [({"train__compute_dtype": "bfloat16"}, {"compute_dtype": "bfloat16"}),
                       ({"train__strategy": "fsdp"}, {"strategy": "fsdp"}),
                       ({"model__dtype": "bfloat16"}, {"master_dtype": "float32"})]:
        settings, key, cache_key = changed(**keys)
        assert settings == want and key != sft_key(cfg) and cache_key != sft_cache_key(cfg), keys
    # bfloat16 weights stepped as they are (master_dtype: model) and a memory-only key: SFT as before
    assert changed(model__dtype="bfloat16", train__master_dtype="model")[0] == {}
    assert changed(train__gradient_checkpointing=True)[1] == sft_key(cfg)
