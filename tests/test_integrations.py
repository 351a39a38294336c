"""oar estimators inside verl and TRL (:mod:`oar.integrations`).

- verl (not installable next to oar's transformers: verl 0.9.x pins transformers<5.11, verl 0.8.0
  downgrades numpy): the adapter takes exactly the keywords verl's trainer passes a registered
  estimator (copied below from verl's source), GRPO through it equals oar's and verl's own GRPO,
  KTAE and the first-mistake oracle with the token ids give non-uniform token credit and fail with
  one line without them, registration is idempotent against a stub of verl's registry (its code
  copied verbatim), and estimators that need the policy are refused with one line;
- TRL (skipped when trl does not import): a two-step ``OarGRPOTrainer`` run on the tiny model, whose
  loss receives ``(batch, time)`` advantages that differ across the tokens of a row, with groups laid
  out as TRL samples them, and whose weights move.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from collections import defaultdict
from enum import Enum
from typing import Any

import numpy as np
import pytest
import torch

from helpers import ROOT

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import broadcast_seq, grpo_advantages

#: What verl's ``compute_advantage`` passes an estimator found in its registry (every name but the
#: hard-wired "gae" and "grpo"): verl/trainer/ppo/ray_trainer.py lines 194-202 of volcengine/verl at
#: b178a3cd56f58b2d502255daba591e92833930a7 (version 0.8.0.dev), ``adv_kwargs`` and the call at line 216,
#: ``advantages, returns = adv_estimator_fn(**adv_kwargs)``; the PyPI wheel of verl 0.9.1 passes the same
#: to a custom name (its ray_trainer.py lines 251-259, call at 279). Always passed:
VERL_ALWAYS = frozenset({"token_level_rewards", "response_mask", "config"})
#: Passed when present: ``index`` (``data.non_tensor_batch["uid"]``, lines 199-200) and
#: ``reward_baselines`` (``data.batch["reward_baselines"]``, lines 201-202, ReMax's). Lines 204-213 add
#: ``sum_pi_squared`` and ``rollout_is_weights`` for the optimal-token-baseline names only.
VERL_OPTIONAL = frozenset({"index", "reward_baselines"})
#: Parameters the adapter's function names (the rest reach it through ``**kwargs``).
ADAPTER_NAMED = frozenset({"token_level_rewards", "response_mask", "index", "config"})


def _verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl's ``compute_grpo_outcome_advantage`` (verl/trainer/ppo/core_algos.py lines 303-330 at the
    commit above), its loop copied: the reference the adapter's GRPO must equal."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        scores[i] = centred / (id2std[index[i]] + epsilon) if norm_adv_by_std_in_grpo else centred
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def _verl_stub(monkeypatch) -> types.ModuleType:
    """``verl.trainer.ppo.core_algos`` with its registry (core_algos.py lines 112-133 at the commit
    above, verbatim but for the docstring) in ``sys.modules``."""
    core_algos = types.ModuleType("verl.trainer.ppo.core_algos")
    ADV_ESTIMATOR_REGISTRY: dict[str, Any] = {}

    def register_adv_est(name_or_enum):
        def decorator(fn):
            name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
            if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name] != fn:
                raise ValueError(
                    f"Adv estimator {name} has already been registered: {ADV_ESTIMATOR_REGISTRY[name]} vs {fn}"
                )
            ADV_ESTIMATOR_REGISTRY[name] = fn
            return fn

        return decorator

    core_algos.ADV_ESTIMATOR_REGISTRY = ADV_ESTIMATOR_REGISTRY
    core_algos.register_adv_est = register_adv_est
    names = ["verl", "verl.trainer", "verl.trainer.ppo"]
    for parent, child in zip(names, names[1:] + ["verl.trainer.ppo.core_algos"]):
        monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent) or types.ModuleType(parent))
    ppo = sys.modules["verl.trainer.ppo"]
    monkeypatch.setattr(ppo, "core_algos", core_algos, raising=False)
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core_algos)
    return core_algos


def _verl_batch() -> dict[str, Any]:
    """Eight responses of two prompts, rows interleaved as after verl's ``_balance_batch``: the
    score at each response's last token, uid strings as verl sets them."""
    lengths = torch.tensor([5, 3, 6, 6, 2, 4, 6, 5])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    token_level_rewards = torch.zeros(8, 6)
    token_level_rewards[torch.arange(8), lengths - 1] = rewards
    index = np.array(["u-b", "u-a", "u-b", "u-a", "u-a", "u-b", "u-b", "u-a"], dtype=object)
    return {"token_level_rewards": token_level_rewards, "response_mask": mask, "index": index,
            "rewards": rewards, "group_ids": torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])}


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def _non_uniform_rows(adv: torch.Tensor, mask: torch.Tensor) -> int:
    """How many rows hold different advantages on their masked tokens."""
    m = mask.bool()
    return sum(int(adv[b][m[b]].unique().numel() > 1) for b in range(adv.shape[0]))


# --- verl -----------------------------------------------------------------------------------------


def test_verl_adapter_takes_the_keywords_verl_passes():
    from oar.integrations.verl import verl_advantage_fn

    fn = verl_advantage_fn("grpo")
    params = inspect.signature(fn).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert named == ADAPTER_NAMED
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items() if n in named)
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert VERL_ALWAYS <= named and not {n for n in named if params[n].default is inspect.Parameter.empty} - VERL_ALWAYS
    b = _verl_batch()
    full = {"token_level_rewards": b["token_level_rewards"], "response_mask": b["response_mask"], "config": None,
            "index": b["index"], "reward_baselines": torch.zeros(8)}
    assert set(full) == VERL_ALWAYS | VERL_OPTIONAL
    adv, returns = fn(**full)
    assert adv.shape == returns.shape == b["response_mask"].shape
    with pytest.raises(ValueError) as err:
        fn(**{k: full[k] for k in VERL_ALWAYS})
    assert "index" in _one_line(err) and "uid" in _one_line(err)


def test_verl_grpo_equals_oar_and_verl_grpo():
    from oar.integrations.verl import verl_advantage_fn

    b = _verl_batch()
    for norm in (True, False):
        adv, returns = verl_advantage_fn("grpo")(token_level_rewards=b["token_level_rewards"].clone(),
                                                 response_mask=b["response_mask"], index=b["index"],
                                                 config={"norm_adv_by_std_in_grpo": norm})
        ours = broadcast_seq(grpo_advantages(b["rewards"], b["group_ids"], norm_by_std=norm), b["response_mask"])
        theirs, _ = _verl_grpo(b["token_level_rewards"].clone(), b["response_mask"], b["index"],
                               norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(adv, ours, rtol=0, atol=0)
        torch.testing.assert_close(adv, theirs, rtol=1e-6, atol=1e-6)
        assert torch.equal(adv, returns)
    drgrpo, _ = verl_advantage_fn("drgrpo", norm_by_std=False)(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=b["index"],
        config={"norm_adv_by_std_in_grpo": True})
    torch.testing.assert_close(drgrpo, broadcast_seq(grpo_advantages(b["rewards"], b["group_ids"], norm_by_std=False),
                                                     b["response_mask"]))


def test_verl_ktae_needs_the_response_ids_and_gives_token_credit():
    from oar.integrations.verl import RESPONSES_KEY, verl_advantage_fn

    b = _verl_batch()
    fn = verl_advantage_fn("ktae")
    call = {"token_level_rewards": b["token_level_rewards"], "response_mask": b["response_mask"],
            "index": b["index"], "config": None}
    with pytest.raises(ValueError) as err:
        fn(**call)
    assert RESPONSES_KEY in _one_line(err) and "'ktae'" in _one_line(err)
    responses = torch.randint(4, 14, (8, 6), generator=torch.Generator().manual_seed(0))
    adv, _ = fn(**call, **{RESPONSES_KEY: responses})
    assert adv.shape == (8, 6)
    assert torch.all(adv[b["response_mask"] == 0] == 0)
    assert _non_uniform_rows(adv, b["response_mask"]) > 0


def test_verl_oracle_reads_prompts_and_responses():
    """The first-mistake oracle through the adapter, given what verl's batch holds (``prompts``,
    ``responses``, ``attention_mask``) and the tokenizer: the wrong responses' credit is not uniform."""
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate
    from oar.integrations.verl import verl_advantage_fn
    from oar.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    right, wrong = generate("train", 1, seed=0)[0], generate("train", 1, seed=0, demo_error_rate=1.0)[0]
    assert right["question"] == wrong["question"] and wrong["demo_errors"]
    texts = [right["solution"], wrong["solution"], right["solution"], wrong["solution"]]
    prompts = tok([render_prompt("tiny", right["question"])] * 4, return_tensors="pt")
    responses = tok(texts, return_tensors="pt", padding=True, padding_side="right")
    T = responses["input_ids"].shape[1]
    mask = responses["attention_mask"].float()
    lengths = mask.sum(1).long()
    token_level_rewards = torch.zeros(4, T)
    token_level_rewards[torch.arange(4), lengths - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv, _ = verl_advantage_fn("oracle_first_mistake", tokenizer=tok)(
        token_level_rewards=token_level_rewards, response_mask=mask, index=np.array(["q"] * 4, dtype=object),
        config=None, responses=responses["input_ids"], prompts=prompts["input_ids"],
        attention_mask=torch.cat([prompts["attention_mask"], responses["attention_mask"]], dim=1))
    assert _non_uniform_rows(adv[[1, 3]], mask[[1, 3]]) == 2
    assert (adv[[1, 3]][mask[[1, 3]].bool()] < 0).all()
    assert _non_uniform_rows(adv[[0, 2]], mask[[0, 2]]) == 0


@pytest.mark.parametrize("estimator", ["oar_p", "oar_g", "shuffled", "inverted", "mc_value"])
def test_verl_refuses_estimators_that_need_the_policy(estimator):
    from oar.integrations.verl import verl_advantage_fn

    with pytest.raises(ValueError) as err:
        verl_advantage_fn(estimator)
    assert repr(estimator) in _one_line(err) and "verl" in _one_line(err)


def test_register_with_verl_is_idempotent(monkeypatch):
    from oar.integrations.verl import register_with_verl

    core_algos = _verl_stub(monkeypatch)
    first = register_with_verl("oar_ktae", "ktae", alpha=2.0)
    assert core_algos.ADV_ESTIMATOR_REGISTRY["oar_ktae"] is first
    assert register_with_verl("oar_ktae", "ktae", alpha=2.0) is first
    with pytest.raises(ValueError) as err:
        register_with_verl("oar_ktae", "ktae", alpha=3.0)
    assert "'oar_ktae'" in _one_line(err) and "another name" in _one_line(err)
    core_algos.register_adv_est("remax")(lambda **kw: None)
    with pytest.raises(ValueError) as err:
        register_with_verl("remax", "grpo")
    assert "not oar" in _one_line(err)
    for name in ("grpo", "gae"):
        with pytest.raises(ValueError) as err:
            register_with_verl(name, "grpo")
        assert "hard-wired" in _one_line(err)
    with pytest.raises(ValueError) as err:
        register_with_verl("oar_g", "oar_g")
    assert "needs_model" in _one_line(err)
    assert "oar_g" not in core_algos.ADV_ESTIMATOR_REGISTRY


def test_register_with_real_verl():
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    from verl.trainer.ppo import core_algos

    from oar.integrations.verl import register_with_verl

    fn = register_with_verl("oar_test_drgrpo", "drgrpo", norm_by_std=False)
    assert core_algos.get_adv_estimator_fn("oar_test_drgrpo") is fn


def test_the_adapters_import_neither_verl_nor_trl():
    code = ("import sys, oar.integrations.verl, oar.integrations.trl; "
            "print(sorted(m for m in ('verl', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert out.stdout.strip() == "[]"


# --- TRL ------------------------------------------------------------------------------------------

#: The calls of :func:`late_credit` in the TRL run: (group ids, rewards, token advantages).
LATE_CALLS: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


@register_estimator("test_integrations_late_credit")
def late_credit(batch: CreditBatch, *, norm_by_std: bool = True, late: float = 3.0) -> CreditResult:
    """A user-style model-free estimator: GRPO's advantage, later tokens weighted up to ``late`` times
    more (docs/adding-a-method.md's example); records each call in :data:`LATE_CALLS`."""
    a = grpo_advantages(batch.rewards, batch.group_ids, norm_by_std=norm_by_std)
    mask = batch.response_mask.float()
    pos = (mask.cumsum(1) - 1).clamp(min=0) / (mask.sum(1, keepdim=True) - 1).clamp(min=1)
    w = (1 + (late - 1) * pos) * mask
    w = w * mask.sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1e-8)
    adv = broadcast_seq(a, batch.response_mask) * w
    LATE_CALLS.append((batch.group_ids.clone(), batch.rewards.clone(), adv.clone()))
    return CreditResult(token_advantages=adv, seq_advantages=a, weights=w)


def _digit_share(completions: list[str], **_: Any) -> list[float]:
    """Reward: the share of digits in the completion. An untrained tiny model never answers right
    (oar.reward.score.score_batch would give every completion 0), this gives a group mixed rewards."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def test_trl_settings_and_groups():
    from oar.integrations.trl import check_trl_settings, trl_group_ids

    check_trl_settings("group", "sum_then_normalize")
    for bad in (("batch", "sum_then_normalize"), ("group", "normalize_then_sum")):
        with pytest.raises(ValueError) as err:
            check_trl_settings(*bad)
        assert "OarGRPOTrainer" in _one_line(err)
    unscorable = torch.tensor([False, True, False, False])
    assert trl_group_ids(8, slice(4, 8), 2, unscorable).tolist() == [2, 9, 3, 3]
    with pytest.raises(ValueError) as err:
        trl_group_ids(12, slice(6, 12), 4, torch.zeros(6, dtype=torch.bool))
    assert "num_generations=4" in _one_line(err)


def test_trl_refuses_estimators_that_need_the_policy():
    pytest.importorskip("trl")
    from oar.integrations.trl import oar_grpo_trainer_class

    with pytest.raises(ValueError) as err:
        oar_grpo_trainer_class()(model="unused", oar_estimator="oar_p")
    assert "'oar_p'" in _one_line(err) and "TRL" in _one_line(err)


@pytest.mark.slow
def test_trl_two_steps_feed_token_advantages_to_the_loss(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate
    from oar.integrations.trl import OarGRPOTrainer
    from oar.models.tiny import build_tiny

    model, tok = build_tiny(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    records = generate("train", 4, seed=0)
    dataset = Dataset.from_list([{"prompt": render_prompt("tiny", r["question"])} for r in records])
    G, B = 4, 8
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=B, num_generations=G,
                      max_completion_length=12, max_steps=2, learning_rate=1e-3, bf16=False, use_cpu=True,
                      report_to=[], save_strategy="no", logging_steps=1, seed=0)
    trainer = OarGRPOTrainer(model=str(tmp_path / "tiny"), reward_funcs=_digit_share, args=args,
                             train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(tmp_path / "tiny"),
                             oar_estimator="test_integrations_late_credit", oar_options={"late": 3.0})
    seen: list[dict[str, torch.Tensor]] = []
    compute_loss = trainer._compute_loss

    def recording(model, inputs):
        seen.append({k: inputs[k].detach().clone() for k in ("advantages", "completion_mask")})
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    LATE_CALLS.clear()
    trainer.train()

    assert len(seen) == 2 and len(LATE_CALLS) == 2
    for step, (group_ids, rewards, adv) in zip(seen, LATE_CALLS):
        assert group_ids.tolist() == [i // G for i in range(B)]
        assert rewards.unique().numel() > 1
        got = step["advantages"]
        assert got.dim() == 2 and got.shape == step["completion_mask"].shape
        assert _non_uniform_rows(got, step["completion_mask"]) > 0
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, adv.tolist()))  # TRL shuffles rows
    moved = max((v.detach() - before[k]).abs().max().item() for k, v in trainer.model.named_parameters())
    assert moved > 0
