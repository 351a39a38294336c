"""Shared fixtures: small configs for fast end-to-end tests."""

from __future__ import annotations

import pytest

from helpers import ROOT, SHARED_DATA, small_overrides  # noqa: F401  (re-exported for old imports)


@pytest.fixture
def small_config(tmp_path):
    from oar.config import load_config

    return load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))
