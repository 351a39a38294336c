"""Issue 30: a sourceable scripts/setup.sh, and dotted overrides (``oar ... --set train.lr=1e-3``,
``snakemake --config set="train.lr=1e-3 rollout.n=4"``) whose errors name where the value came from
(the command line, or the file, line and ``extends:`` chain), suggest the nearest key for a misspelt
one, and name ``methods.<x>.base`` for a typo in a method's base."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

CONFIG = ROOT / "config" / "config.yaml"
SETUP = ROOT / "scripts" / "setup.sh"


# ------------------------------------------------------------------------------ 1. source setup.sh
@pytest.fixture
def fake_venv(tmp_path) -> Path:
    """A venv whose ``bin/python`` only logs its arguments to ``calls`` and exits ``$FAKE_RC`` (0): setup.sh
    installs nothing, in well under a second, and never touches a real environment."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/../calls"\nexit "${FAKE_RC:-0}"\n')
    python.chmod(0o755)
    return venv


def _bash(script: str, venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OAR_VENV": str(venv), **env})


_OPTIONS = 'echo "opts=$-"; set -o | grep -w pipefail'


def test_sourcing_setup_leaves_the_callers_shell_options_unchanged(fake_venv):
    proc = _bash(f"set +e; {_OPTIONS}; source scripts/setup.sh; echo rc=$?; {_OPTIONS}; "
                 'case ":$PATH:" in *":$OAR_VENV/bin:"*) echo on-path;; esac', fake_venv)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    before, after = lines[:2], lines[3:5]
    assert lines[2] == "rc=0"
    assert after == before, proc.stdout
    opts = after[0].removeprefix("opts=")
    assert "e" not in opts and "u" not in opts and after[1].split() == ["pipefail", "off"]
    assert lines[5] == "on-path"  # what sourcing is for
    assert len((fake_venv / "calls").read_text().splitlines()) == 2  # torch, then the package
    # the stamp: a second source installs nothing
    assert _bash("source scripts/setup.sh", fake_venv).returncode == 0
    assert len((fake_venv / "calls").read_text().splitlines()) == 2


def test_a_failed_install_returns_to_the_sourcing_shell_instead_of_closing_it(fake_venv):
    proc = _bash(f"set +e; source scripts/setup.sh; echo rc=$?; {_OPTIONS}", fake_venv, FAKE_RC="3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "rc=3" and "e" not in lines[1].removeprefix("opts=") and lines[2].split() == ["pipefail", "off"]
    assert "setup.sh: installing into" in proc.stderr and not (fake_venv / ".oar-setup-stamp").exists()


def test_setup_run_with_bash_stays_strict(fake_venv):
    proc = subprocess.run(["bash", str(SETUP)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OAR_VENV": str(fake_venv), "FAKE_RC": "3"})
    assert proc.returncode == 3
    assert len((fake_venv / "calls").read_text().splitlines()) == 1  # stopped at the first failure
    assert not (fake_venv / ".oar-setup-stamp").exists()
