"""The training run's typed settings (oar.config.settings): one field per schema key, built from the
validated config with the schema's defaults, frozen; the trainer's phases read no config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from oar.config.load import load_config
from oar.config.settings import (EvalSettings, FSDPSettings, HeldoutSettings, PreemptionSettings,
                                 RewardSettings, RolloutSettings, SFTSettings, TrainSettings, TransferSettings)
from oar.config.validate import schema

ROOT = Path(__file__).resolve().parents[1]


def _keys(*path: str) -> set[str]:
    node = schema()
    for key in path:
        node = node["properties"][key]
    return set(node["properties"])


@pytest.mark.parametrize("cls, path", [
    (TrainSettings, ("train",)), (RolloutSettings, ("rollout",)), (RewardSettings, ("reward",)),
    (HeldoutSettings, ("train", "heldout")), (FSDPSettings, ("train", "fsdp")),
    (PreemptionSettings, ("train", "preemption")), (SFTSettings, ("sft",)), (EvalSettings, ("eval",)),
    (TransferSettings, ("eval", "transfer")),
])
def test_each_settings_class_names_exactly_its_sections_schema_keys(cls, path):
    assert {f.name for f in dataclasses.fields(cls)} == _keys(*path)


def test_settings_carry_the_configs_values_and_the_schemas_defaults():
    config = load_config(ROOT / "config" / "config.yaml")
    train, rollout = TrainSettings.from_config(config), RolloutSettings.from_config(config)
    assert train.steps == config["train"]["steps"] and train.lr == config["train"]["lr"]
    assert train.betas == tuple(config["train"]["betas"]) and isinstance(train.betas, tuple)
    assert train.heldout.every == config["train"]["heldout"]["every"]
    assert train.preemption.repeat_seconds == config["train"]["preemption"]["repeat_seconds"]
    assert rollout.sampling() == {k: config["rollout"][k] for k in ("n", "temperature", "top_p", "max_new_tokens")}
    assert RewardSettings.from_config(config) == RewardSettings(**config["reward"])
    # a partial config (benchmarks, tests) gets the schema's defaults, not values written in code
    partial = TrainSettings.from_config({"train": {"steps": 3}})
    defaults = schema()["properties"]["train"]["properties"]
    assert partial.steps == 3 and partial.mini_batch_size == defaults["mini_batch_size"]["default"]
    assert partial.fsdp.reshard_after_forward == defaults["fsdp"]["properties"]["reshard_after_forward"]["default"]


def test_a_number_setting_written_as_an_integer_is_a_float_and_a_missing_key_the_schemas_default():
    sft = SFTSettings.from_config({"sft": {"lr": 1, "betas": [1, 0.98], "steps": 5}})
    assert sft.lr == 1.0 and isinstance(sft.lr, float) and sft.betas == (1.0, 0.98) and isinstance(sft.betas[0], float)
    assert sft.steps == 5 and isinstance(sft.steps, int)
    assert sft.seed == schema()["properties"]["sft"]["properties"]["seed"]["default"]
    assert sft.optimisation() == {"steps": 5, "batch_size": sft.batch_size, "lr": 1.0, "weight_decay": sft.weight_decay,
                                  "betas": [1.0, 0.98], "warmup_steps": sft.warmup_steps, "grad_clip": sft.grad_clip}


def test_settings_are_frozen():
    train = TrainSettings.from_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        train.steps = 1  # type: ignore[misc]
    rollout = RolloutSettings.from_config({"rollout": {"vllm": {"enforce_eager": True}}})
    with pytest.raises(TypeError):
        rollout.vllm["enforce_eager"] = False  # type: ignore[index]


def test_no_phase_of_the_training_loop_reads_the_config():
    """Past set-up, the loop's modules take typed settings: none of them subscripts a ``config`` or
    reads ``tcfg`` / ``rcfg``. Only the entry point (``loop.train``: the start model, the signal
    handler) and setup.py, which builds the settings once, read the config."""
    phases = ["loop.py", "step.py", "batch.py", "update.py", "end.py", "checkpoint.py", "state.py"]
    found = []
    for name in phases:
        tree = ast.parse((ROOT / "src" / "oar" / "trainer" / name).read_text(encoding="utf-8"))
        entry = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
        skip = {id(n) for e in entry for n in ast.walk(e)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in (
                    "config", "tcfg", "rcfg"):
                found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr in ("config", "tcfg", "rcfg") and isinstance(
                    node.value, ast.Name) and node.value.id in ("run", "loop"):
                found.append(f"{name}:{node.lineno}")
    assert not found, found
