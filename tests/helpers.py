"""Helpers the tests share (import them from here; conftest.py holds only fixtures)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def _sources(config: dict) -> list[str]:
    """The data files a raw config names (task.benchmark, eval.benchmarks, eval.transfer.benchmarks)."""
    task = (config.get("task") or {}).get("benchmark") or {}
    ev = config.get("eval") or {}
    entries = list(ev.get("benchmarks", [])) + list((ev.get("transfer") or {}).get("benchmarks", []))
    return [s for s in [task.get("source")] + [b.get("source") for b in entries] if s]


#: The shipped configs that read real benchmark files from ../shared/data.
SHARED_DATA_CONFIGS: tuple[str, ...] = ("paper.yaml", "smollm2.yaml", "smollm2_arith.yaml")


def _shared_sources() -> list[str]:
    import yaml

    return [s for name in SHARED_DATA_CONFIGS
            for s in _sources(yaml.safe_load((ROOT / "config" / name).read_text()))]


#: Whether the data files of config/paper.yaml and the SmolLM2 configs (../shared/data/...) are here:
#: the pre-flight (oar.pipeline.preflight) stops a workflow or `oar plan` run of a config whose files are missing.
PAPER_DATA = all((ROOT / s).exists() for s in _shared_sources())


def stub_paper_data(tmp_path: Path) -> Path:
    """Empty stand-ins for the data files of config/paper.yaml and the SmolLM2 configs, laid out as
    they are named (``../shared/data/<name>/...``) beside a working directory ``<tmp_path>/repo``,
    which is returned."""
    work = tmp_path / "repo"
    work.mkdir(exist_ok=True)
    for source in _shared_sources():
        f = work / source
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
    return work


def with_stub_data(config: dict, folder: Path) -> dict:
    """``config`` (a raw config) with every data file it names replaced by an empty stand-in under
    ``folder``, named by its absolute path: a dry run from another directory, which the pre-flight
    would stop on the relative ../shared/data paths."""
    import copy

    out = copy.deepcopy(config)
    ev = out.get("eval") or {}
    entries = ([(out.get("task") or {}).get("benchmark") or {}] + list(ev.get("benchmarks", []))
               + list((ev.get("transfer") or {}).get("benchmarks", [])))
    for entry in entries:
        if entry.get("source"):
            f = folder / "data" / str(entry["source"]).replace("../", "")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
            entry["source"] = str(f)
    return out


def small_overrides(tmp_path: Path, **extra) -> dict:
    """Overrides that shrink config/config.yaml to a run of a few seconds (tiny model, few prompts)."""
    from oar.config.source import deep_merge

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


#: The synthetic task of hand-built credit batches: fillers so / ok / well.
SYNTHETIC_TASK = {"kind": "synthetic", "synthetic": {"fillers": ["so", "ok", "well"]}}


def credit_batch(responses, rewards, prompts=None, task=None, model=None):
    """A CreditBatch of hand-written responses of the synthetic task, tokenized by the tiny (one token per
    character) tokenizer: prompts left-padded, responses right-padded with eos and two columns of padding.
    ``task`` defaults to the synthetic task with fillers so / ok / well; ``prompts`` to "Compute 4+3-2."."""
    from oar.credit import CreditBatch
    from oar.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    prompts = prompts or ["Compute 4+3-2.\n"] * len(responses)
    pid = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rid = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    B, P, T = len(responses), max(map(len, pid)), max(map(len, rid)) + 2
    p_ids, p_mask = torch.full((B, P), tok.pad_token_id), torch.zeros((B, P), dtype=torch.long)
    r_ids, r_mask = torch.full((B, T), tok.pad_token_id), torch.zeros((B, T), dtype=torch.long)
    for b in range(B):
        p_ids[b, P - len(pid[b]):] = torch.tensor(pid[b])
        p_mask[b, P - len(pid[b]):] = 1
        r_ids[b, : len(rid[b])] = torch.tensor(rid[b])
        r_mask[b, : len(rid[b])] = 1
    return CreditBatch(response_ids=r_ids, response_mask=r_mask, rewards=torch.tensor(rewards),
                       group_ids=torch.zeros(B, dtype=torch.long), prompt_ids=p_ids, prompt_mask=p_mask,
                       model=model, tokenizer=tok, task=task or SYNTHETIC_TASK, seed=3, step=1)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``oar <argv>`` in this process: (exit code, stdout, stderr); argparse's SystemExit becomes its code."""
    from oar.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_error_line(err: str, command: str) -> str:
    """The single ``oar <command>: error: ...`` line of ``err`` (asserting there is exactly one, no traceback)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"oar {command}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def stage_runs(cfg: dict, stage: str, *, current: bool = True, **tags) -> list:
    """The MLflow runs of ``cfg``'s experiment tagged ``oar.stage = stage`` (and ``oar.<key> = value``
    for each of ``tags``; ``current``: only those no rerun replaced, ``oar.current = true``), through
    MLflow's own search (MlflowClient.search_runs with a tag filter)."""
    if current:
        tags = {**tags, "current": "true"}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg["tracking"]["uri"])
    exp = client.get_experiment_by_name(cfg["tracking"].get("experiment") or cfg["name"])
    if exp is None:
        return []
    where = " AND ".join([f"tags.`oar.stage` = '{stage}'"] + [f"tags.`oar.{k}` = '{v}'" for k, v in tags.items()])
    return list(client.search_runs([exp.experiment_id], where, max_results=1000))


def check_mlflow_stage_runs(R: Path, cfg: dict, *, attribution: bool) -> None:
    """After a finished DAG of ``cfg`` (results folder ``R``): every stage's runs are in the MLflow
    store, found by their tags, finished, and their numbers are the results' files' and tables':
    1 SFT run; per method and seed one training run carrying its evaluation's scores
    (``eval/<bench>/<score>`` = summary.json = main.csv's value for that seed) and one evaluation run
    nested under it; one base evaluation; the attribution runs (when enabled); 1 report run with
    the tables and the main.md footer; provenance tags equal to the summaries' provenance."""
    import json

    import pandas as pd
    import pytest

    from oar.tracking.stage_metrics import EVAL_SCORES, metric_key

    def one(stage: str, **tags):
        runs = stage_runs(cfg, stage, **tags)
        assert len(runs) == 1, (stage, tags, [r.data.tags for r in runs])
        assert runs[0].info.status == "FINISHED", (stage, tags)
        return runs[0]

    def same_provenance(run, summary: dict) -> None:
        prov = summary["provenance"]
        assert run.data.tags.get("oar.git_commit") == prov["git_commit"]
        assert run.data.tags["oar.provenance.start_time"] == prov["start_time"]
        assert run.data.tags["oar.provenance.versions.torch"] == prov["versions"]["torch"]

    sft = one("sft")
    sft_summary = json.loads((R / "sft" / "model" / "sft_summary.json").read_text())
    assert sft.data.tags["oar.fingerprint"] == (R / "sft").resolve().name
    for split, acc in sft_summary["accuracy"].items():
        assert sft.data.metrics[f"sft/accuracy_{split}"] == pytest.approx(acc)
    same_provenance(sft, sft_summary)

    if (R / "verifier").exists():  # a method reads the step verifier the config trains
        verifier = one("verifier")
        v_summary = json.loads((R / "verifier" / "model" / "verifier_summary.json").read_text())
        assert verifier.data.tags["oar.fingerprint"] == (R / "verifier").resolve().name
        assert verifier.data.metrics["verifier/eval_accuracy"] == pytest.approx(v_summary["eval_accuracy"])
        same_provenance(verifier, v_summary)
    else:
        assert stage_runs(cfg, "verifier") == []

    main = pd.read_csv(R / "tables" / "main.csv")
    seeds = [int(s) for s in cfg["seeds"]]
    for method in cfg["methods"]:
        for seed in seeds:
            train = one("train", method=method, seed=seed)
            run_dir = R / method / f"seed{seed}"
            assert train.data.tags["oar.fingerprint"] == run_dir.parent.resolve().name
            same_provenance(train, json.loads((run_dir / "train_summary.json").read_text()))
            ev = one("evaluate", method=method, seed=seed)
            assert ev.data.tags["mlflow.parentRunId"] == train.info.run_id
            summary = json.loads((run_dir / "eval" / "summary.json").read_text())
            same_provenance(ev, summary)
            for bench, r in summary["benchmarks"].items():
                for score in EVAL_SCORES:
                    if r.get(score) is None:
                        continue
                    key = metric_key("eval", bench, score)
                    # MLflow in percent, as main.csv (per_seed in config order); summary.json in [0, 1]
                    assert train.data.metrics[key] == pytest.approx(100 * r[score]) == ev.data.metrics[key], (method, key)
                    cell = main[(main["metric"] == score) & (main["row"] == method) & (main["benchmark"] == bench)]
                    if len(cell):
                        per_seed = [float(v) for v in str(cell["per_seed"].item()).split(";")]
                        assert per_seed[seeds.index(seed)] == pytest.approx(train.data.metrics[key], abs=1e-3), (method, key)
    base = one("evaluate", method="base")
    base_summary = json.loads((R / "base" / "eval" / "summary.json").read_text())
    for bench, r in base_summary["benchmarks"].items():
        assert base.data.metrics[metric_key("eval", bench, "pass@1")] == pytest.approx(100 * r["pass@1"])
    assert len(stage_runs(cfg, "evaluate")) == len(cfg["methods"]) * len(seeds) + 1
    assert len(stage_runs(cfg, "train")) == len(cfg["methods"]) * len(seeds)

    trained = (cfg.get("attribution") or {}).get("trained") or []
    if attribution:
        start = one("attribution", method="base")
        loc = pd.read_csv(R / "attribution" / "localisation.csv")
        row = loc.iloc[0]
        assert start.data.metrics[f"attribution/localisation/{row['signal']}/{row['kind']}/top1"] == pytest.approx(row["top1"])
        same_provenance(start, json.loads((R / "attribution" / "summary.json").read_text()))
        assert len(stage_runs(cfg, "attribution")) == 1 + len(trained)
    else:
        assert stage_runs(cfg, "attribution") == []

    report = one("report")
    assert report.data.tags["oar.report.provenance"] == (R / "tables" / "main.md").read_text().splitlines()[-1]
    avg = main[(main["row"] == "base") & (main["benchmark"] == "Average")].iloc[0]
    key = metric_key("report", avg["metric"], "base", "Average", "mean")
    assert report.data.metrics[key] == pytest.approx(avg["mean"])


#: the placeholders of workflow/profiles/slurm (the pre-flight refuses them) and what a copy fills in
PROFILE_FILLED = {"<your-account>": "acct", "<cpu-partition>": "cpu", "<gpu-partition>": "gpu"}


def filled_slurm_profile(tmp_path: Path) -> Path:
    """A copy of workflow/profiles/slurm with its placeholders filled in (PROFILE_FILLED)."""
    text = (ROOT / "workflow" / "profiles" / "slurm" / "config.yaml").read_text()
    for placeholder, value in PROFILE_FILLED.items():
        text = text.replace(placeholder, value)
    folder = tmp_path / "profile"
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(text)
    return folder


#: Responses containing these strings make :func:`hang_for_test` hang / crash (test hook only).
TEST_HANG_MARKER = "<<oar-test-hang>>"
TEST_CRASH_MARKER = "<<oar-test-crash>>"
#: ``<<oar-test-term:PATH>>``: the worker sends itself SIGTERM the first time (while PATH does not exist).
TEST_TERM_MARKER = "<<oar-test-term:"
#: ``<<oar-test-crash-once:PATH>>``: the worker exits at once the first time (while PATH does not exist).
TEST_CRASH_ONCE_MARKER = "<<oar-test-crash-once:"
#: ``<<oar-test-mv-timeout>>``: the check reports math-verify's own timeout (None) on every try.
TEST_MV_TIMEOUT_MARKER = "<<oar-test-mv-timeout>>"


def _first_time(response: str, marker: str) -> bool:
    """Whether the flag file named after ``marker`` in ``response`` did not exist yet (it does now)."""
    flag = response.split(marker, 1)[1].split(">>", 1)[0]
    if os.path.exists(flag):
        return False
    open(flag, "w").close()
    return True


def hang_for_test(response: str, gold: str, *, parsing_timeout: int = 2, seconds: float = 3600.0) -> bool | None:
    """A reward pool's ``work_fn`` for the tests (importable by its workers, which get the parent's
    ``sys.path``): like ``oar.reward.verify.check_one``, but sleeps ``seconds`` in a loop
    (ignoring signals, as C code would) when the response contains ``TEST_HANG_MARKER``,
    exits the process at once when it contains ``TEST_CRASH_MARKER`` (``TEST_CRASH_ONCE_MARKER``:
    the first time only), and reports math-verify's timeout (None) for ``TEST_MV_TIMEOUT_MARKER``."""
    if TEST_CRASH_MARKER in response:
        os._exit(3)
    if TEST_CRASH_ONCE_MARKER in response and _first_time(response, TEST_CRASH_ONCE_MARKER):
        os._exit(3)
    if TEST_TERM_MARKER in response and _first_time(response, TEST_TERM_MARKER):  # preempted while scoring it
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    if TEST_MV_TIMEOUT_MARKER in response:
        return None
    if TEST_HANG_MARKER in response:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
        return True  # a "correct" verdict that must never be seen: the parent kills us first
    from oar.reward.verify import check_one

    return check_one(response, gold, parsing_timeout=parsing_timeout)


def copy_repository(base: Path) -> Path:
    """The repository's files (tracked and new, not ignored) copied to ``base/repo``, with ``../shared``
    beside it when the checkout has one (the paper config reads data from there). Returns the copy."""
    import shutil
    import subprocess

    dest = base / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (base / "shared").symlink_to(shared)
    return dest


def cpu_strategy():
    """The default training strategy (one-process DDP, float32 weights and compute) on the CPU: what
    ``oar sft`` and the RL update run on here."""
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy

    return make_strategy(TrainSettings.from_config({}), "cpu")
