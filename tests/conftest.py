"""Shared fixtures: small configs for fast end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def small_overrides(tmp_path: Path, **extra) -> dict:
    """Overrides that shrink config/config.yaml to a run of a few seconds (tiny model, few prompts)."""
    from oar.config import deep_merge

    base = {
        "model": {"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                           "max_position_embeddings": 128}},
        "task": {"train_size": 64},
        "train": {"steps": 3, "prompts_per_step": 4, "mini_batch_size": 8, "micro_batch_size": 8, "save_every": 2,
                  "heldout": {"every": 0}},
        "rollout": {"n": 4, "max_new_tokens": 24},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "enabled": False},
        "reward": {"workers": 1},
    }
    return deep_merge(base, extra)


@pytest.fixture
def small_config(tmp_path):
    from oar.config import load_config

    return load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))
