"""Provenance (oar.core.provenance): every key present, the git commit and dirty state of a checkout, None
outside git or without git, the MLflow tags, and the one-line account of main.md's footer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from oar.core.provenance import PACKAGES, describe, git_state, provenance, provenance_tags, with_end_time

KEYS = {"git_commit", "git_dirty", "python", "versions", "device", "cpu_model", "cpu_capability", "gpu", "hostname",
        "argv", "start_time"}

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git checkout with one committed file, code.py."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "code.py").write_text("x = 1\n")
    _git(r, "add", "code.py")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return r


def test_every_key_is_present_and_json_ready():
    started = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    p = with_end_time(provenance(device="cpu", started=started, argv=["oar", "train", "--seed", "0"]))
    assert set(p) == KEYS | {"end_time"}
    assert set(p["versions"]) == set(PACKAGES) and p["versions"]["torch"] and p["versions"]["numpy"]
    assert p["device"] == "cpu" and p["gpu"] is None
    assert p["python"] == ".".join(map(str, sys.version_info[:3]))
    assert p["start_time"] == "2024-01-02T03:04:05+00:00" and p["end_time"] >= p["start_time"]
    assert p["argv"] == ["oar", "train", "--seed", "0"] and p["hostname"]
    import torch

    assert p["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert json.loads(json.dumps(p)) == p


def test_device_names_are_reduced_to_their_kind():
    assert provenance(device="cuda:1", root=Path("/"))["device"] == "cuda"
    import torch

    assert provenance(device="auto", root=Path("/"))["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


@needs_git
def test_git_commit_and_dirty_state_of_a_checkout(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert git_state(repo / "code.py") == (head, False)
    assert provenance(root=repo / "code.py")["git_commit"] == head
    (repo / "untracked.txt").write_text("not part of the code")
    assert git_state(repo / "code.py") == (head, False)  # untracked files do not make it dirty
    (repo / "code.py").write_text("x = 2\n")
    assert git_state(repo / "code.py") == (head, True)


@needs_git
def test_an_untracked_path_inside_a_checkout_is_not_its_code(repo):
    """A package installed into an ignored folder of some clone (a venv) is not that clone's code."""
    (repo / ".venv").mkdir()
    (repo / ".venv" / "mod.py").write_text("")
    assert git_state(repo / ".venv" / "mod.py") == (None, None)


def test_outside_git_and_without_git(tmp_path, monkeypatch):
    (tmp_path / "code.py").write_text("")
    assert git_state(tmp_path / "code.py") == (None, None)
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))  # no git at all: no failure, None
    p = provenance(root=Path(__file__))
    assert p["git_commit"] is None and p["git_dirty"] is None


@needs_git
def test_the_package_records_the_commit_of_this_checkout():
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not run from a git checkout")
    import oar

    commit, dirty = git_state(Path(oar.__file__))
    assert commit == _git(root, "rev-parse", "HEAD") and isinstance(dirty, bool)


def test_tags_flatten_the_versions_and_quote_the_command_line():
    p = {"git_commit": "abc", "git_dirty": False, "gpu": None, "versions": {"torch": "2.1", "mlflow": None},
         "argv": ["oar", "evaluate", "--output", "a b"]}
    assert provenance_tags(p) == {"oar.provenance.git_commit": "abc", "oar.provenance.git_dirty": "False",
                                  "oar.provenance.versions.torch": "2.1",
                                  "oar.provenance.argv": "oar evaluate --output 'a b'"}
    assert provenance_tags(None) == {}


def _prov(commit="0123456789abcdef", dirty=False, cpu="CPU A", cap="AVX2", torch="2.13.0"):
    return {"git_commit": commit, "git_dirty": dirty, "cpu_model": cpu, "cpu_capability": cap,
            "versions": {"torch": torch}}


def test_describe_names_shared_values_once_and_counts_differing_ones():
    assert describe([]) is None and describe([None, None]) is None
    same = describe([_prov(), _prov()], what="the 2 results")
    assert same == ("Provenance of the 2 results: commit 0123456789ab (clean); CPU CPU A; CPU capability AVX2; "
                    "torch 2.13.0.")
    mixed = describe([_prov(), _prov(), _prov(commit="fedcba9876543210", dirty=True, cap="AVX512"), None])
    assert "2 commits: 0123456789ab (clean) x 2, fedcba987654 (dirty) x 1" in mixed
    assert "2 CPU capabilities: AVX2 x 2, AVX512 x 1" in mixed and "CPU CPU A;" in mixed
    assert mixed.endswith("1 of them without a recorded provenance.")
    assert "commit not a git checkout" in describe([_prov(commit=None)])

