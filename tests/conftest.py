"""Shared fixtures: small configs for fast end-to-end tests."""

from __future__ import annotations

import pytest

from helpers import ROOT, SHARED_DATA, small_overrides  # noqa: F401  (re-exported for old imports)


@pytest.fixture
def small_config(tmp_path):
    from oar.config.load import load_config

    return load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Every in-process test runs torch on one thread, whatever ran before it (a test that sets the
    thread count no longer leaks it into the tests after it, so results do not depend on order).
    The models here are tiny: more threads only synchronize, and they spin when a subprocess of the
    same test (a torchrun worker, a Snakemake job) holds the other core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_FIRST = ("e2e", "distributed", "slow")


def pytest_collection_modifyitems(config, items):
    """Long tests first (whole pipelines, then several processes, then slow), each file's tests kept
    in their order: with two workers taking one file at a time, the longest file no longer starts last."""

    def rank(item) -> int:
        marks = {m.name for m in item.iter_markers()}
        return next((i for i, name in enumerate(_FIRST) if name in marks), len(_FIRST))

    by_file: dict[str, int] = {}
    for item in items:
        by_file[item.fspath.strpath] = min(by_file.get(item.fspath.strpath, len(_FIRST)), rank(item))
    items.sort(key=lambda item: by_file[item.fspath.strpath])
