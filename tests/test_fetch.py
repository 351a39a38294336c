"""A hub model.source fetched once (src/oar/models/fetch.py, workflow/rules/model.smk): which sources are hub
ids and where their copy goes, the fetch offline (one line naming model.source and what to do; a
complete copy in the local Hugging Face cache is used), `oar sft` reading the fetched copy, and a
dry run of a hub-model config: one fetch_model job, every job that loads the model after it and
reading its folder; the default config has none."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT
from oar.config.load import load_config
from oar.models.fetch import MARKER, HubModel, ModelFetchError, fetch_model, hub_model, is_hub_model_id, with_fetched_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cfg(**over) -> dict:
    return load_config(ROOT / "config" / "config.yaml", over)


def test_which_sources_are_fetched_and_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_model(_cfg()) is None  # tiny: built, not fetched
    assert hub_model(_cfg(model={"source": "smollm2"})) is None
    hub = hub_model(_cfg(model={"source": "Qwen/Qwen2.5-Math-7B"}))
    assert hub == HubModel("Qwen/Qwen2.5-Math-7B", "results/models/Qwen--Qwen2.5-Math-7B")
    assert hub.marker == f"results/models/Qwen--Qwen2.5-Math-7B/{MARKER}" and hub.source == hub.folder
    gguf = hub_model(_cfg(models_dir="/scratch/m", model={"source": "org/name-GGUF", "gguf_file": "q4.gguf"}))
    assert gguf.folder == "/scratch/m/org--name-GGUF" and gguf.source == "/scratch/m/org--name-GGUF/q4.gguf"
    (tmp_path / "org" / "local").mkdir(parents=True)  # an existing local folder is not a hub id
    assert hub_model(_cfg(model={"source": "org/local"})) is None
    assert not is_hub_model_id("./org/name") and not is_hub_model_id("~/name") and not is_hub_model_id("a/b/c")


def test_fetch_offline_without_a_copy_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelFetchError) as e:
        fetch_model("someorg/some-model", tmp_path / "models" / "someorg--some-model")
    assert str(e.value) == (
        "model.source 'someorg/some-model': cannot download it: the Hugging Face hub cannot be reached "
        "(HF_HUB_OFFLINE=1 is set) and the local Hugging Face cache has no copy; download it where the hub is "
        "reachable (hf download someorg/some-model --local-dir <folder>) and point model.source at that folder, or "
        "run the workflow where the hub is reachable")
    assert not (tmp_path / "models" / "someorg--some-model" / MARKER).exists()


def _env(hf_home: Path) -> dict:
    return dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1",
                PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _fake_cache(hf_home: Path, repo: str) -> None:
    """The local Hugging Face cache holding ``repo`` at :data:`COMMIT` (config.json, a weights file)."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for name, content in (("config.json", '{"model_type": "llama"}'), ("model.safetensors", "weights")):
        (root / "blobs" / name).write_text(content)
        (snap / name).symlink_to(Path("..", "..", "blobs", name))


def test_cli_fetch_offline(tmp_path):
    """`oar fetch-model` with HF_HUB_OFFLINE=1: exit 2 and one line without a copy; with a complete copy
    in the local cache, the folder (files resolved from the cache's links) and its marker, written last;
    a second fetch into the folder gives the same marker."""
    hf = tmp_path / "hf"
    out = tmp_path / "models" / "someorg--tiny"
    cmd = [sys.executable, "-m", "oar.cli", "fetch-model", "--source", "someorg/tiny", "--output", str(out)]
    proc = subprocess.run(cmd, env=_env(hf), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        "oar fetch-model: error: model.source 'someorg/tiny': cannot download it: the Hugging Face hub cannot be "
        "reached (HF_HUB_OFFLINE=1 is set)")
    assert not out.exists()

    _fake_cache(hf, "someorg/tiny")
    for _ in range(2):
        proc = subprocess.run(cmd, env=_env(hf), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        marker = json.loads((out / MARKER).read_text())
        assert marker == {"repo_id": "someorg/tiny", "commit": COMMIT, "gguf_file": None, "origin": "cache",
                          "files": {"config.json": 23, "model.safetensors": 7}}
        assert (out / "model.safetensors").read_text() == "weights" and not (out / "config.json").is_symlink()
    assert sorted(p.name for p in out.parent.iterdir()) == ["someorg--tiny"]  # no partial or swap folders left


def test_sft_reads_the_fetched_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(model={"source": "org/name", "gguf_file": "x.gguf"})
    assert with_fetched_model(cfg) is cfg  # not fetched yet: the hub id as it is
    hub = hub_model(cfg)
    Path(hub.folder).mkdir(parents=True)
    Path(hub.marker).write_text("{}")
    fetched = with_fetched_model(cfg)
    assert fetched["model"]["source"] == f"results/models/org--name/x.gguf" and fetched["model"]["gguf_file"] is None
    assert cfg["model"]["source"] == "org/name"  # the config itself is left as it was
    assert with_fetched_model(_cfg()) == _cfg()


# -------------------------------------------------------------------------------- the workflow

def _dry_run(config: Path, results: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--configfile", str(config), "--config",
                           f"results_dir={results}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _jobs(text: str) -> list[dict]:
    jobs = []
    for block in re.split(r"\n\s*\n", text):
        m = re.search(r"^(?:localrule|rule) (\w+):", block, re.M)
        if m:
            inp = re.search(r"^\s+input: (.*)$", block, re.M)
            shell = re.search(r"^Shell command: (.*)$", block, re.M)
            jobs.append({"rule": m.group(1), "input": inp.group(1).split(", ") if inp else [],
                         "shell": shell.group(1) if shell else ""})
    return jobs


@pytest.mark.slow  # two snakemake dry runs: a few seconds each
@pytest.mark.skipif(importlib.util.find_spec("snakemake") is None, reason="snakemake not installed")
def test_dry_run_of_a_hub_model_fetches_it_once_before_every_job_that_loads_it(tmp_path):
    smoke = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    folder = f"{tmp_path}/models/Qwen--Qwen2.5-Math-1.5B"
    marker = f"{folder}/{MARKER}"
    for sft in (False, True):
        cfg = dict(smoke, model=dict(smoke["model"], source="Qwen/Qwen2.5-Math-1.5B"),
                   sft=dict(smoke["sft"], enabled=sft), attribution={"enabled": False})
        path = tmp_path / f"hub_sft{int(sft)}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        jobs = _jobs(_dry_run(path, tmp_path))
        (fetch,) = [j for j in jobs if j["rule"] == "fetch_model"]
        assert f"fetch-model --source Qwen/Qwen2.5-Math-1.5B --output {folder}" in fetch["shell"]
        loaders = {"sft"} if sft else {"train", "evaluate_base", "verifier"}  # the verifier fine-tunes the start model
        for j in jobs:
            assert (marker in j["input"]) == (j["rule"] in loaders), j
            if j["rule"] == "train" and not sft:
                assert f"--init {folder} " in j["shell"]
            if j["rule"] == "evaluate_base" and not sft:
                assert f"--model {folder} " in j["shell"]
        assert "Qwen/Qwen2.5-Math-1.5B" not in " ".join(j["shell"] for j in jobs if j["rule"] != "fetch_model")
