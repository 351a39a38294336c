"""Pre-flight (src/oar/pipeline/preflight.py): every path a config names is resolved before anything runs, each
problem one line naming the config file, the key and what to do -- in `oar plan`, `oar data`,
`oar train` and `oar evaluate` (exit 2) and while the workflow loads (so `snakemake -n` stops too); and a profile's
placeholders (`<your-account>`) stop the workflow, naming the profile file and keys."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import ROOT, small_overrides
from oar.config.load import load_config
from oar.config.methods import resolve_methods
from oar.config.source import deep_merge
from oar.pipeline.preflight import check_config, path_problems, profile_files, profile_problems
from oar.core.problems import PreflightError

GSM8K_RECORD = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A working directory ``repo/`` beside ``shared/data/gsm8k/test.jsonl`` (the layout of
    ../shared/data), as the current directory."""
    data = tmp_path / "shared" / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps(GSM8K_RECORD) + "\n")
    (data / "train.jsonl").write_text(json.dumps(GSM8K_RECORD) + "\n")
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    return tmp_path / "repo"


def _config(tmp_path: Path, **over) -> dict:
    gsm8k = {"name": "gsm8k", "source": "../shared/data/gsm8k/test.jsonl"}
    base = small_overrides(tmp_path, eval={"benchmarks": [gsm8k]})
    return load_config(ROOT / "config" / "config.yaml", deep_merge(base, over))


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


# ----------------------------------------------------------------------------------- the paths


def test_a_misspelt_benchmark_path_is_one_line_naming_file_key_and_the_fix(repo):
    cfg = _config(repo, eval={"benchmarks": [{"name": "gsm8k", "source": "../shared/data/gsm8k/tset.jsonl"}]})
    (problem,) = path_problems(cfg, source="config/paper.yaml")
    assert str(problem) == ("config/paper.yaml: key eval.benchmarks[0].source: no file ../shared/data/gsm8k/tset.jsonl "
                            f"(did you mean test.jsonl?); paths are relative to the working directory {repo}")
    with pytest.raises(PreflightError) as e:
        check_config(cfg, source="config/paper.yaml")
    assert str(e.value) == str(problem) and "\n" not in str(e.value)


@pytest.mark.parametrize("change, key, text", [
    ({"eval": {"benchmarks": [{"name": "gsm8k", "source": "../shared/data/gsm8kk/test.jsonl"}]}},
     "eval.benchmarks[0].source", "(did you mean ../shared/data/gsm8k/test.jsonl?)"),
    ({"eval": {"benchmarks": [{"name": "gsm8k", "source": "../shared/data"}]}},
     "eval.benchmarks[0].source", "folder ../shared/data has no test.jsonl"),
    ({"eval": {"benchmarks": [{"name": "gsm8", "source": "../shared/data/gsm8k/test.jsonl"}]}},
     "eval.benchmarks[0].name", "unknown benchmark 'gsm8' (did you mean gsm8k?)"),
    ({"eval": {"benchmarks": [{"name": "gsm8k"}]}}, "eval.benchmarks[0].source", "needs a source"),
    ({"eval": {"transfer": {"benchmarks": [{"name": "gsm8k", "source": "../shared/data/gsm8k/tset.jsonl"}]}}},
     "eval.transfer.benchmarks[0].source", "no file ../shared/data/gsm8k/tset.jsonl (did you mean test.jsonl?)"),
    ({"eval": {"transfer": {"benchmarks": [{"name": "gsm8"}]}}}, "eval.transfer.benchmarks[0].name",
     "unknown benchmark 'gsm8' (did you mean gsm8k?)"),
    ({"task": {"kind": "benchmark", "benchmark": {"name": "gsm8k", "source": "../shared/data/gsm8k/trian.jsonl"}}},
     "task.benchmark.source", "no file ../shared/data/gsm8k/trian.jsonl (did you mean train.jsonl?)"),
    ({"model": {"source": "../models/qwen"}}, "model.source", "no model folder ../models/qwen"),
    ({"model": {"source": "../shared/data"}}, "model.source", "folder ../shared/data has no config.json"),
    ({"model": {"source": "../shared/data/gsm8k/test.jsonl"}}, "model.source", "is a file but not a .gguf"),
    ({"model": {"source": "../shared/data", "gguf_file": "m.gguf"}}, "model.gguf_file",
     "no GGUF file ../shared/data/m.gguf"),
    ({"train": {"init": "../results/tiny/sft/modle"}}, "train.init", "no model folder ../results/tiny/sft/modle"),
    ({"train": {"heldout": {"every": 2, "benchmark": "math500"}}}, "train.heldout.benchmark",
     "'math500' is not an eval.benchmarks name (gsm8k)"),
])
def test_every_path_key_is_resolved(repo, change, key, text):
    (problem,) = path_problems(_config(repo, **change), source="c.yaml")
    assert problem.key == f"key {key}" and text in problem.message, problem


def test_hub_ids_pass_unless_their_org_is_a_local_folder(repo):
    hub = _config(repo, model={"source": "Qwen/Qwen2.5-Math-1.5B"}, train={"init": "org/some-model"},
                  eval={"benchmarks": [{"name": "gsm8k", "source": "openai/gsm8k"}]})
    assert path_problems(hub, source="c.yaml") == []
    (repo / "models" / "qwen-7b").mkdir(parents=True)
    (problem,) = path_problems(_config(repo, model={"source": "models/qwen7b"}), source="c.yaml")
    assert problem.key == "key model.source"
    assert "no model folder models/qwen7b (did you mean qwen-7b?)" in problem.message


def test_the_shipped_configs_pass(monkeypatch):
    monkeypatch.chdir(ROOT)  # paths are relative to the repository root, as the workflow runs
    for name in ("config.yaml", "smoke.yaml", "ablations.yaml", "controls.yaml", "regimes.yaml"):
        assert path_problems(load_config(ROOT / "config" / name), source=name) == [], name


@pytest.mark.skipif(not (ROOT.parent / "shared" / "data").is_dir(), reason="../shared/data not here")
def test_the_real_data_configs_pass(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in ("paper.yaml", "smollm2.yaml"):  # a hub model and `smollm2` (a package's file) are not paths
        assert path_problems(load_config(ROOT / "config" / name), source=name) == [], name


@pytest.mark.parametrize("command, key", [("data", "eval.benchmarks"), ("plan", "eval.benchmarks"),
                                          ("train", "eval.benchmarks"), ("evaluate", "eval.benchmarks"),
                                          ("evaluate", "eval.transfer.benchmarks")])
def test_cli_stops_with_one_line_and_exit_2(repo, capsys, command, key):
    from oar.cli import main

    bad = [{"name": "gsm8k", "source": "../shared/data/gsm8k/tset.jsonl"}]
    cfg = _config(repo, eval={"benchmarks": bad} if key == "eval.benchmarks" else {"transfer": {"benchmarks": bad}})
    path = _write(repo / "bad.yaml", cfg)
    out = repo / "out"
    args = {"data": ["--output", str(out / "manifest.json")], "plan": ["--output", str(out / "plan.txt")],
            "train": ["--method", "grpo", "--output", str(out)], "evaluate": ["--output", str(out)]}[command]
    assert main([command, "--config", str(path), *args, *(["--transfer"] if "transfer" in key else [])]) == 2
    err = capsys.readouterr().err
    assert err == (f"oar {command}: error: {path}: key {key}[0].source: no file "
                   f"../shared/data/gsm8k/tset.jsonl (did you mean test.jsonl?); paths are relative to the working "
                   f"directory {repo}\n")
    assert not out.exists()


# --------------------------------------------------------------------------------- the profile


def test_placeholders_name_the_profile_file_and_keys(tmp_path):
    profile = tmp_path / "slurm" / "config.yaml"
    profile.parent.mkdir()
    profile.write_text(yaml.safe_dump({"default-resources": {"slurm_account": "<your-account>", "mem_mb": 4000},
                                       "set-resources": {"train": {"slurm_partition": "<gpu-partition>"},
                                                         "evaluate": {"slurm_partition": "<gpu-partition>"}}}))
    problems = profile_problems({"slurm_account": "<your-account>", "mem_mb": 4000, "slurm_partition": "'<cpu>'"},
                                {"train": {"slurm_partition": "<gpu-partition>"},
                                 "evaluate": {"slurm_partition": "<gpu-partition>"}}, profiles=[profile])
    assert [str(p) for p in problems] == [
        f"{profile}: key default-resources.slurm_account: '<your-account>' is a placeholder; replace it (in that "
        f"file, or in a copy of the profile) with your SLURM account (sacctmgr show associations user=$USER "
        f"format=account lists yours)",
        "command line: key --default-resources slurm_partition: '<cpu>' is a placeholder; replace it with a "
        "partition of your cluster (sinfo -s lists them)",
        f"{profile}: keys set-resources.train.slurm_partition, set-resources.evaluate.slurm_partition: "
        f"'<gpu-partition>' is a placeholder; replace it (in that file, or in a copy of the profile) with a "
        f"partition of your cluster (sinfo -s lists them)",
    ]
    assert profile_problems({"slurm_account": "acct", "runtime": 60}, {"train": {"slurm_partition": "gpu"}}) == []
    assert profile_problems(None, {}) == []


def test_profile_files_of_a_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("default", "slurm"):
        (tmp_path / "workflow" / "profiles" / name).mkdir(parents=True)
        (tmp_path / "workflow" / "profiles" / name / "config.yaml").write_text("jobs: 1\n")
    wdir = tmp_path / "workflow"
    assert profile_files(["snakemake", "-n"], workflow_dir=wdir, environ={}) == [
        wdir / "profiles" / "default" / "config.yaml"]
    assert profile_files(["snakemake", "--workflow-profile", "workflow/profiles/slurm"], workflow_dir=wdir,
                         environ={}) == [Path("workflow/profiles/slurm/config.yaml")]
    assert profile_files(["snakemake", "--workflow-profile=slurm"], workflow_dir=wdir, environ={}) == [
        wdir / "profiles" / "slurm" / "config.yaml"]
    assert profile_files(["snakemake", "--workflow-profile", "none"], workflow_dir=wdir, environ={}) == []


# -------------------------------------------------------------------------------- the workflow

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
pytestmark_snakemake = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None,
                                          reason="snakemake not installed")


def _snakemake(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([*SNAKEMAKE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # one snakemake dry run: a few seconds
@pytestmark_snakemake
def test_dry_run_stops_on_a_misspelt_path(tmp_path):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps(GSM8K_RECORD) + "\n")
    cfg = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    cfg["eval"]["benchmarks"].append({"name": "gsm8k", "source": str(data / "tset.jsonl")})
    path = _write(tmp_path / "typo.yaml", cfg)
    proc = _snakemake("-n", "--configfile", str(path), "--config", f"results_dir={tmp_path}")
    assert proc.returncode != 0
    line = (f"{path}: key eval.benchmarks[{len(cfg['eval']['benchmarks']) - 1}].source: no file "
            f"{data / 'tset.jsonl'} (did you mean test.jsonl?)\n")
    assert line in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "Job stats" not in proc.stdout + proc.stderr


@pytest.mark.slow  # three snakemake dry runs: a few seconds each
@pytestmark_snakemake
@pytest.mark.skipif(importlib.util.find_spec("snakemake_executor_plugin_slurm") is None,
                    reason="snakemake-executor-plugin-slurm not installed")
def test_slurm_profile_placeholders_stop_a_dry_run_and_filled_values_pass(tmp_path):
    profile = "workflow/profiles/slurm"
    results = ["--config", f"results_dir={tmp_path}"]
    proc = _snakemake("-n", "--workflow-profile", profile, *results)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Job stats" not in text
    for key, value in (("key default-resources.slurm_account", "<your-account>"),
                       ("key default-resources.slurm_partition", "<cpu-partition>"),
                       ("keys set-resources.train.slurm_partition, set-resources.evaluate.slurm_partition",
                        "<gpu-partition>")):
        assert f"{profile}/config.yaml: {key}" in text and f"'{value}' is a placeholder" in text, text[-3000:]
    # filled on the command line
    filled = ["--default-resources", "slurm_account=acct", "slurm_partition=cpu", "--set-resources",
              *(f"{r}:slurm_partition=gpu" for r in ("train", "evaluate", "evaluate_base", "evaluate_transfer",
                                                     "evaluate_transfer_base", "attribution"))]
    proc = _snakemake("-n", "--workflow-profile", profile, *filled, *results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Job stats" in proc.stdout + proc.stderr
    # a filled copy of the profile
    copy = tmp_path / "profile" / "config.yaml"
    copy.parent.mkdir()
    text = (ROOT / profile / "config.yaml").read_text()
    for placeholder, value in (("<your-account>", "acct"), ("<cpu-partition>", "cpu"), ("<gpu-partition>", "gpu")):
        text = text.replace(placeholder, value)
    copy.write_text(text)
    proc = _snakemake("-n", "--workflow-profile", str(copy.parent), *results)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------ disk

#: a 70B Llama's shape (plan.model): no disk here holds one of its checkpoints
BIG_MODEL = {"hidden_size": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8, "intermediate_size": 28672,
             "vocab_size": 128256, "tie_word_embeddings": False}


def test_a_training_keeps_its_checkpoints_and_its_model(tmp_path):
    from oar.pipeline.launch import checkpoint_bytes, model_bytes, training_disk_bytes
    from oar.plan import model_shape

    config = _config(tmp_path, model={"source": "smollm2"})
    p = model_shape(config).num_params
    assert model_bytes(config) == 4 * p  # float32 weights, as save_pretrained writes them
    assert checkpoint_bytes(config) == 3 * 4 * p  # float32 master weights + AdamW's two states
    assert training_disk_bytes(config) == 16 * p
    config["train"]["keep_checkpoints"] = 3
    assert training_disk_bytes(config) == 3 * 12 * p + 4 * p
    config["model"]["dtype"] = "bfloat16"
    assert model_bytes(config) == 2 * p and checkpoint_bytes(config) == 12 * p  # master weights stay float32


def test_disk_problems_count_what_each_unfinished_training_still_needs(tmp_path):
    from oar.pipeline.launch import checkpoint_bytes, disk_problems, model_bytes, training_disk_bytes

    config = _config(tmp_path, model={"source": "smollm2"})
    per_run, ckpt = training_disk_bytes(config), checkpoint_bytes(config)
    runs = [tmp_path / "grpo" / "seed0", tmp_path / "grpo" / "seed1"]
    need = 2 * per_run + ckpt  # and one checkpoint more: the one written beside the one it replaces
    assert disk_problems(config, source="c.yaml", runs=runs, sft=False, free=need) == []
    [problem] = disk_problems(config, source="c.yaml", runs=runs, sft=False, free=need - 1)
    assert (problem.source, problem.key) == ("c.yaml", "key results_dir")
    assert problem.message.startswith("the 2 training(s) still to run need about ")
    assert "plan.disk_check: false" in problem.message and f"free at {config['results_dir']}" in problem.message
    # the SFT's model, when the SFT still runs
    assert disk_problems(config, source="c.yaml", runs=runs, sft=True, free=need)
    assert disk_problems(config, source="c.yaml", runs=runs, sft=True, free=need + model_bytes(config)) == []
    # a resumed run: what its folder already holds is not needed again
    runs[0].mkdir(parents=True)
    (runs[0] / "part.bin").write_bytes(b"\0" * 1000)
    assert disk_problems(config, source="c.yaml", runs=runs, sft=False, free=need - 1000) == []
    # nothing to run, the check off, or a shape the plan does not know: no problem
    assert disk_problems(config, source="c.yaml", runs=[], sft=False, free=0) == []
    off = deep_merge(config, {"plan": {"disk_check": False}})
    assert disk_problems(off, source="c.yaml", runs=runs, sft=True, free=0) == []
    hub = deep_merge(config, {"model": {"source": "someorg/unknown-model"}})
    assert disk_problems(hub, source="c.yaml", runs=runs, sft=True, free=0) == []


@pytest.mark.slow  # two snakemake runs that stop in onstart: a few seconds each
@pytestmark_snakemake
def test_a_run_whose_trainings_do_not_fit_stops_before_any_job(tmp_path):
    cfg = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    cfg["plan"] = {"model": BIG_MODEL}
    path = _write(tmp_path / "big.yaml", cfg)
    results = ["--config", f"results_dir={tmp_path / 'results'}"]
    n_runs = len(cfg["seeds"]) * len(resolve_methods(load_config(path)))
    proc = _snakemake("--cores", "1", "--configfile", str(path), *results)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{path}: key results_dir: the {n_runs} training(s) still to run and the SFT need about " in text, text[-3000:]
    assert not list((tmp_path / "results").rglob("manifest.json")), "a job ran"
    # a target: only its training is counted
    name = cfg["name"]
    target = f"{tmp_path / 'results'}/{name}/grpo/seed0/train_summary.json"
    proc = _snakemake(target, "--cores", "1", "--configfile", str(path), *results)
    assert f"{path}: key results_dir: the 1 training(s) still to run and the SFT need about " in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- the device
from oar.core.device import CUDA_MIN_DRIVER, check_device, device_problem, nvidia_driver_version  # noqa: E402


def _node(monkeypatch, *, gpu: bool, driver: str | None = None, build: str | None = None) -> None:
    """This node as torch and the driver would show it: whether torch sees a GPU, the NVIDIA driver's
    version (None: no driver) and the CUDA version torch was built for (None: a CPU-only build)."""
    import oar.core.device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(oar.core.device, "nvidia_driver_version", lambda: driver)


@pytest.mark.parametrize("driver, build, expect", [
    (None, None, "no NVIDIA driver; install torch's CUDA build"),
    ("550.54.14", None, "NVIDIA driver 550.54.14; install torch's CUDA build"),
    (None, "13.0", "a CUDA 13.0 build), no NVIDIA driver; run the job on a GPU node"),
    ("550.54.14", "13.0", "NVIDIA driver 550.54.14; a CUDA 13.0 build needs NVIDIA driver >= 580.65.06: update the driver"),
    ("580.95.05", "13.0", "NVIDIA driver 580.95.05; check CUDA_VISIBLE_DEVICES"),
    ("535.104.05", "12.8", "NVIDIA driver 535.104.05; check CUDA_VISIBLE_DEVICES"),
])
def test_cuda_without_a_usable_gpu_is_one_line_naming_key_driver_and_torch_build(driver, build, expect, monkeypatch):
    _node(monkeypatch, gpu=False, driver=driver, build=build)
    problem = device_problem({"device": "cuda"}, source="config/paper.yaml")
    text = str(problem)
    assert text.startswith("config/paper.yaml: key device: asks for a GPU, but torch sees none on ")
    assert expect in text and "\n" not in text
    assert f"torch {torch.__version__} (" in text
    # a config that asks for none passes; so does a usable GPU
    assert device_problem({"device": "cpu"}, source="x") is None
    _node(monkeypatch, gpu=True)
    assert device_problem({"device": "cuda"}, source="x") is None


def test_auto_with_a_gpu_resource_is_a_gpu_profile(monkeypatch):
    cfg = {"device": "auto", "resources": {"eval": {"gpu": 0}, "train": {"gpu": 8}}}
    _node(monkeypatch, gpu=False, build="13.0")
    problem = device_problem(cfg, source="c.yaml")
    assert str(problem).startswith("c.yaml: key resources.train.gpu: asks for a GPU")
    assert device_problem({"device": "auto", "resources": {}}, source="c.yaml") is None


def test_the_driver_table_covers_the_pinned_torch_build():
    """torch 2.13.0 from PyPI is a CUDA 13 build (workflow/envs/gpu.yaml): the table knows its driver."""
    assert CUDA_MIN_DRIVER[13] == "580.65.06"
    assert nvidia_driver_version() is None or nvidia_driver_version()[0].isdigit()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_here_is_refused_by_every_job_and_by_the_strategy(repo, capsys):
    """On this GPU-less machine: ``oar train`` / ``evaluate`` / ``sft`` / ``attribution`` with ``device: cuda``
    exit 2 with one line and write nothing; the library's strategy refuses it too (no CPU fallback)."""
    from helpers import one_error_line, run_cli
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    path = _write(repo / "gpu.yaml", _config(repo, device="cuda"))
    out = repo / "out"
    for command, args in [("train", ["--method", "grpo", "--output", str(out)]),
                          ("evaluate", ["--output", str(out)]), ("sft", ["--output", str(out)]),
                          ("attribution", ["--model", str(repo), "--output", str(out)])]:
        rc, _, err = run_cli([command, "--config", str(path), *args], capsys)
        line = one_error_line(err, command)
        assert rc == 2 and f"{path}: key device: asks for a GPU, but torch sees none" in line, (command, err)
        assert not out.exists()
    with pytest.raises(PreflightError, match="key device: asks for a GPU"):
        check_device({"device": "cuda"}, source="c.yaml")
    with pytest.raises(PreflightError, match="key device: asks for a GPU"):
        make_strategy(TrainSettings.from_config({}), "cuda")
