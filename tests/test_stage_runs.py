"""Each stage's MLflow run (oar.tracking.stage_runs) against a SQLite store in tmp_path, without the DAG: the
tags the UI filters on, the metrics equal to the files', the evaluation's scores on its training run
(found by id, else by tags) as a nested child, artifacts, the report's footer, tracking off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import stage_runs
from oar.config.validate import validate_config
from oar.config.tree import store_location
from oar.tracking.stage_metrics import EVAL_SCORES, eval_metrics, metric_key
from oar.tracking.stage_runs import CURRENT_TAG, EVAL_SET_TAG, log_attribution_run, log_evaluation_run, log_sft_run, train_run_tags
from oar.report.logged import log_report_run
from oar.tracking.client import PARENT_RUN_TAG, Tracker, search_runs

BENCHES = ("synthetic-test", "synthetic-ood")
PROV = {"git_commit": "0123456789abcdef0123", "git_dirty": False, "cpu_model": "CPU A", "cpu_capability": "AVX2",
        "versions": {"torch": "2.13.0"}, "start_time": "2024-01-01T00:00:00+00:00"}


#: One SQLite store for the module (creating one takes seconds); each test has its own experiment.
_STORE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _store(tmp_path_factory):
    _STORE["uri"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    yield


def _config(tmp_path: Path, **tracking) -> dict:
    """A config named after the test's folder (so its experiment is the test's own)."""
    return validate_config({
        "name": tmp_path.name, "results_dir": str(tmp_path / "results"), "seeds": [0],
        "tracking": {"uri": _STORE["uri"], **tracking},
        "model": {"source": "tiny"}, "task": {"kind": "synthetic"}, "recipes": {"grpo": {}},
        "methods": {"grpo": {"recipe": "grpo", "credit": "none"}, "oar_g": {"recipe": "grpo", "credit": "oar_g"}},
        "eval": {"benchmarks": [{"name": b, "n": 4} for b in BENCHES], "samples": 2},
    })


def _client(cfg: dict):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=cfg["tracking"]["uri"])


def _eval_summary(scale: float) -> dict:
    benches = {b: {"n": 4, "pass@1": 0.25 * scale * (i + 1), "avg@k": 0.125 * scale * (i + 1), "pass@k": 0.5,
                   "k": 2, "answered": 1.0, "mean_response_tokens": 12.5, "seconds": 0.1}
               for i, b in enumerate(BENCHES)}
    average = {k: sum(r[k] for r in benches.values()) / len(benches) for k in EVAL_SCORES}
    return {"model": "m", "model_identity": "id", "benchmarks": benches, "average": average, "provenance": PROV}


def _write_eval(out: Path, summary: dict, *, big: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary))
    for b, r in summary["benchmarks"].items():
        (out / f"{b}.json").write_text(json.dumps(r))
        (out / f"{b}.jsonl").write_text(("x" * (2 * 1024 * 1024) if big else '{"id": 1}') + "\n")


def _train_run(cfg: dict, run: Path, method: str, seed: int, *, record_id: bool = True) -> str:
    """A finished training run as oar.trainer.loop leaves it: the MLflow run and train_summary.json."""
    (run / "model").mkdir(parents=True)
    tr = Tracker(None, uri=cfg["tracking"]["uri"], experiment=cfg["tracking"]["experiment"],
                 run_name=f"{method}-seed{seed}", tags=train_run_tags(cfg, method, seed, run, PROV))
    tr.finish()
    summary = {"method": method, "seed": seed, "mlflow_run_id": tr.run_id if record_id else None, "provenance": PROV}
    (run / "train_summary.json").write_text(json.dumps(summary))
    return tr.run_id


def test_metric_keys_are_valid_mlflow_names():
    assert metric_key("eval", "gsm8k", "avg@k") == "eval/gsm8k/avg_at_k"
    assert metric_key("eval", "a+b (x)", "pass@1") == "eval/a_b _x_/pass_at_1"
    assert eval_metrics(_eval_summary(1.0))["eval/synthetic-ood/pass_at_1"] == 50.0  # percent, as the tables


def test_store_location_of_a_view_and_outside_the_store(tmp_path):
    target = tmp_path / "results" / "store" / "runs" / "grpo-abc123" / "seed0"
    target.mkdir(parents=True)
    view = tmp_path / "results" / "unit" / "grpo"
    view.parent.mkdir(parents=True)
    view.symlink_to("../store/runs/grpo-abc123")
    loc = store_location(view / "seed0" / "eval")
    assert (loc.kind, loc.key, loc.rest) == ("runs", "grpo-abc123", "seed0/eval")
    assert store_location(tmp_path / "elsewhere" / "store") is None


def test_evaluation_run_is_a_child_of_its_training_run_and_adds_its_scores_to_it(tmp_path):
    cfg = _config(tmp_path)
    store = tmp_path / "results" / "store" / "runs" / "grpo-abc123" / "seed0"
    train_id = _train_run(cfg, store, "grpo", 0)
    summary = _eval_summary(1.0)
    _write_eval(store / "eval", summary)
    eval_id = log_evaluation_run(cfg, store / "model", store / "eval", summary, seed=0)
    client = _client(cfg)
    run, train = client.get_run(eval_id), client.get_run(train_id)
    tags = run.data.tags
    assert tags[PARENT_RUN_TAG] == train_id and train.data.tags["oar.eval_run_id"] == eval_id
    assert (tags["oar.stage"], tags["oar.method"], tags["oar.seed"]) == ("evaluate", "grpo", "0")
    assert tags["oar.config"] == cfg["name"]
    assert tags["oar.fingerprint"] == train.data.tags["oar.fingerprint"] == "grpo-abc123"
    assert tags["oar.git_commit"] == PROV["git_commit"] and tags["oar.provenance.cpu_capability"] == "AVX2"
    assert run.info.status == "FINISHED" and train.info.status == "FINISHED"  # the training run stays finished
    for bench, r in summary["benchmarks"].items():
        for k in EVAL_SCORES:
            assert run.data.metrics[metric_key("eval", bench, k)] == pytest.approx(100 * r[k])  # percent
            assert train.data.metrics[metric_key("eval", bench, k)] == pytest.approx(100 * r[k])
        assert run.data.metrics[f"eval/{bench}/answered"] == 100.0
        assert f"eval/{bench}/answered" not in train.data.metrics  # only the scores go onto the training run
    assert train.data.metrics["eval/average/avg_at_k"] == pytest.approx(100 * summary["average"]["avg@k"])
    assert run.data.params["eval.samples"] == "2"
    names = {f.path for f in client.list_artifacts(eval_id)}
    assert {"summary.json", "synthetic-test.json", "synthetic-test.jsonl"} <= names
    # the artifacts lie beside the SQLite store, not in the working directory
    store_dir = str(Path(_STORE["uri"][len("sqlite:///"):]).parent)
    assert client.get_experiment(run.info.experiment_id).artifact_location.startswith(store_dir)


def test_training_run_found_by_tags_when_the_summary_names_no_run_of_this_store(tmp_path):
    cfg = _config(tmp_path, max_artifact_mb=1)
    store = tmp_path / "results" / "store" / "runs" / "oar_g-def456" / "seed1"
    train_id = _train_run(cfg, store, "oar_g", 1, record_id=False)
    other = tmp_path / "results" / "store" / "runs" / "oar_g-0ther" / "seed1"
    _train_run(cfg, other, "oar_g", 1)  # same method and seed, another fingerprint: not this one
    summary = _eval_summary(0.5)
    _write_eval(store / "eval", summary, big=True)
    eval_id = log_evaluation_run(cfg, store / "model", store / "eval", summary, seed=1)
    client = _client(cfg)
    run = client.get_run(eval_id)
    assert run.data.tags[PARENT_RUN_TAG] == train_id
    assert client.get_run(train_id).data.metrics["eval/synthetic-test/pass_at_1"] == pytest.approx(12.5)
    assert "synthetic-test.jsonl" in run.data.tags["oar.artifacts_skipped"]  # over tracking.max_artifact_mb
    assert "synthetic-test.jsonl" not in {f.path for f in client.list_artifacts(eval_id)}


def test_start_model_evaluation_is_the_base_row(tmp_path):
    cfg = _config(tmp_path)
    base = tmp_path / "results" / "store" / "base" / "b4se" / "eval"
    summary = _eval_summary(1.0)
    _write_eval(base, summary)
    eval_id = log_evaluation_run(cfg, tmp_path / "results" / "store" / "sft" / "k" / "model", base, summary, seed=0)
    tags = _client(cfg).get_run(eval_id).data.tags
    assert (tags["oar.method"], tags["oar.seed"], tags["oar.fingerprint"]) == ("base", "0", "b4se")
    assert PARENT_RUN_TAG not in tags
    found = search_runs(cfg["tracking"]["uri"], cfg["name"], {"oar.stage": "evaluate", "oar.method": "base"})
    assert [r.info.run_id for r in found] == [eval_id]


def test_transfer_evaluation_is_a_run_of_its_own_told_apart_by_its_tag(tmp_path):
    """`oar evaluate --transfer`: another evaluate run under the same training run, tagged oar.eval_set
    transfer (the main one: main), its scores named transfer/... there and on the training run."""
    cfg = _config(tmp_path)
    store = tmp_path / "results" / "store" / "runs" / "grpo-abc123" / "seed0"
    train_id = _train_run(cfg, store, "grpo", 0)
    main, transfer = _eval_summary(1.0), _eval_summary(0.5)
    _write_eval(store / "eval", main)
    _write_eval(store / "transfer", transfer)
    eval_id = log_evaluation_run(cfg, store / "model", store / "eval", main, seed=0)
    transfer_id = log_evaluation_run(cfg, store / "model", store / "transfer", transfer, seed=0, transfer=True)
    client = _client(cfg)
    ev, run, train = client.get_run(eval_id), client.get_run(transfer_id), client.get_run(train_id)
    assert (ev.data.tags[EVAL_SET_TAG], run.data.tags[EVAL_SET_TAG]) == ("main", "transfer")
    assert (run.data.tags["oar.stage"], run.data.tags["oar.method"], run.info.run_name) == (
        "evaluate", "grpo", "grpo-seed0/transfer")
    assert run.data.tags[PARENT_RUN_TAG] == train_id and ev.data.tags[CURRENT_TAG] == "true"  # not superseded
    assert (train.data.tags["oar.eval_run_id"], train.data.tags["oar.transfer_run_id"]) == (eval_id, transfer_id)
    for bench, r in transfer["benchmarks"].items():
        key = metric_key("transfer", bench, "pass@1")
        assert run.data.metrics[key] == pytest.approx(100 * r["pass@1"]) == train.data.metrics[key]
        assert train.data.metrics[metric_key("eval", bench, "pass@1")] == pytest.approx(
            100 * main["benchmarks"][bench]["pass@1"])
    assert not [k for k in run.data.metrics if k.startswith("eval/")]


def test_sft_run_has_its_accuracy_loss_curve_and_summary(tmp_path):
    cfg = _config(tmp_path)
    out = tmp_path / "results" / "store" / "sft" / "5f7key" / "model"
    out.mkdir(parents=True)
    summary = {"accuracy": {"test": 0.5, "ood": 0.25}, "extracted": {"test": 1.0, "ood": 0.75}, "seconds": 3.0,
               "sft": {"steps": 3, "final_loss": 0.7, "final_loss_mean10": 0.8, "loss_curve": [[1, 1.0], [2, 0.9], [3, 0.7]],
                       "eval_curve": []},
               "provenance": PROV}
    (out / "sft_summary.json").write_text(json.dumps(summary))
    run_id = log_sft_run(cfg, out, summary)
    client = _client(cfg)
    run = client.get_run(run_id)
    assert run.data.tags["oar.stage"] == "sft" and run.data.tags["oar.fingerprint"] == "5f7key"
    assert run.data.metrics["sft/accuracy_test"] == 0.5 and run.data.metrics["sft/final_loss"] == 0.7
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "sft/loss")] == [(1, 1.0), (2, 0.9), (3, 0.7)]
    assert run.data.params["sft.steps"] == str(cfg["sft"]["steps"])
    assert [f.path for f in client.list_artifacts(run_id)] == ["sft_summary.json"]


def test_attribution_run_metrics_are_the_tables(tmp_path):
    cfg = _config(tmp_path)
    out = tmp_path / "results" / cfg["name"] / "attribution"
    out.mkdir(parents=True)
    (out / "localisation.csv").write_text("signal,kind,n_responses,top1,top3,auroc_mean\n"
                                          "oar_p,sampled,4,0.5,0.75,0.8\noar_p,counterfactual,4,0.25,0.5,\n")
    (out / "fidelity.csv").write_text("signal,auroc_pooled,n_responses\noar_g,0.6,8\n")
    (out / "cost.csv").write_text("signal,seconds_per_response,reference,note\nktae,0.01,oar_p,n/a\n")
    summary = {"sample_accuracy": 0.4, "n_sampled": 4, "settings": {"a": 1}, "provenance": PROV}
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "attribution.md").write_text("# tables\n")
    run_id = log_attribution_run(cfg, tmp_path / "results" / cfg["name"] / "sft" / "model", out, summary)
    client = _client(cfg)
    run = client.get_run(run_id)
    m = run.data.metrics
    assert m["attribution/localisation/oar_p/sampled/top1"] == 0.5
    assert m["attribution/localisation/oar_p/counterfactual/top3"] == 0.5
    assert "attribution/localisation/oar_p/counterfactual/auroc_mean" not in m  # an empty cell is no metric
    assert m["attribution/fidelity/oar_g/auroc_pooled"] == 0.6 and m["attribution/cost/ktae/seconds_per_response"] == 0.01
    assert m["attribution/summary/sample_accuracy"] == 0.4
    assert run.data.tags["oar.stage"] == "attribution" and run.data.tags["oar.method"] == "base"
    assert len(run.data.tags["oar.fingerprint"]) == 16
    assert {"summary.json", "attribution.md", "localisation.csv"} <= {f.path for f in client.list_artifacts(run_id)}


def test_report_run_has_the_tables_figures_and_footer(tmp_path):
    cfg = _config(tmp_path)
    tables, figures = tmp_path / "R" / "tables", tmp_path / "R" / "figures"
    tables.mkdir(parents=True)
    figures.mkdir()
    (tables / "main.csv").write_text("metric,row,benchmark,mean,std,diff\navg@k,grpo,Average,40.5,,\n"
                                     "avg@k,oar_g,Average,42.0,1.5,1.5\n")
    (tables / "main.md").write_text("# main\n")
    (figures / "curves.png").write_bytes(b"png")
    paths = {"main_csv": tables / "main.csv", "main_md": tables / "main.md", "curves": figures / "curves.png"}
    run_id = log_report_run(cfg, paths, footer="Provenance of the 2 results: commit x.", params={"seed": 0})
    client = _client(cfg)
    run = client.get_run(run_id)
    assert run.data.metrics["report/avg_at_k/oar_g/Average/diff"] == 1.5
    assert run.data.metrics["report/avg_at_k/grpo/Average/mean"] == 40.5
    assert "report/avg_at_k/grpo/Average/std" not in run.data.metrics
    assert run.data.tags["oar.stage"] == "report" and run.data.tags["oar.report.provenance"].startswith("Provenance")
    assert run.data.tags["oar.git_commit"]  # this process's provenance (the tests run from a git checkout)
    assert {f.path for f in client.list_artifacts(run_id, "tables")} == {"tables/main.csv", "tables/main.md"}
    assert {f.path for f in client.list_artifacts(run_id, "figures")} == {"figures/curves.png"}


def test_tracking_off_logs_nothing(tmp_path):
    cfg = _config(tmp_path, enabled=False, uri=f"sqlite:///{tmp_path}/mlflow.db")
    summary = _eval_summary(1.0)
    _write_eval(tmp_path / "eval", summary)
    assert log_evaluation_run(cfg, None, tmp_path / "eval", summary, seed=0) is None
    assert log_sft_run(cfg, tmp_path, {"accuracy": {}}) is None
    assert log_report_run(cfg, {}) is None
    assert not (tmp_path / "mlflow.db").exists()


def test_stage_runs_helper_lists_runs_by_stage(tmp_path):
    cfg = _config(tmp_path)
    store = tmp_path / "results" / "store" / "runs" / "grpo-abc123" / "seed0"
    _train_run(cfg, store, "grpo", 0)
    assert len(stage_runs(cfg, "train")) == 1 and stage_runs(cfg, "report") == []
    assert len(stage_runs(cfg, "train", method="grpo", seed=0)) == 1 and stage_runs(cfg, "train", method="oar_g") == []


def test_a_stage_run_again_into_the_same_output_supersedes_its_earlier_run(tmp_path):
    """A job rerun (an interrupted workflow, --forcerun): both runs stay, the earlier one tagged
    oar.current = false and oar.superseded_by; the training run holds the latest scores."""
    cfg = _config(tmp_path)
    store = tmp_path / "results" / "store" / "runs" / "grpo-abc123" / "seed0"
    train_id = _train_run(cfg, store, "grpo", 0)
    first, second = _eval_summary(1.0), _eval_summary(0.5)
    _write_eval(store / "eval", first)
    one = log_evaluation_run(cfg, store / "model", store / "eval", first, seed=0)
    two = log_evaluation_run(cfg, store / "model", store / "eval", second, seed=0)
    client = _client(cfg)
    assert client.get_run(one).data.tags["oar.current"] == "false"
    assert client.get_run(one).data.tags["oar.superseded_by"] == two
    assert [r.info.run_id for r in stage_runs(cfg, "evaluate")] == [two]
    assert {r.info.run_id for r in stage_runs(cfg, "evaluate", current=False)} == {one, two}
    assert client.get_run(train_id).data.metrics["eval/synthetic-test/pass_at_1"] == pytest.approx(12.5)
    other = tmp_path / "results" / "store" / "base" / "b" / "eval"  # another output: not superseded
    _write_eval(other, first)
    log_evaluation_run(cfg, None, other, first, seed=0)
    assert len(stage_runs(cfg, "evaluate")) == 2


def test_a_run_says_whether_the_workflow_or_a_hand_launched_it(monkeypatch):
    """The workflow's jobs carry OAR_LAUNCHED_BY=workflow (oar.pipeline.launch.oar_env); a hand-run oar command
    is tagged ``command line``, so the config's grid (filtered on workflow) has no row without an
    evaluation."""
    from oar.pipeline.launch import oar_env
    from oar.tracking.stage_runs import LAUNCHED_BY_ENV, stage_tags

    cfg = {"name": "tiny"}
    monkeypatch.delenv(LAUNCHED_BY_ENV, raising=False)
    assert stage_tags(cfg, "train", method="grpo", seed=0)["oar.launched_by"] == "command line"
    assert oar_env("/repo/src").startswith(f"{LAUNCHED_BY_ENV}=workflow ")
    monkeypatch.setenv(LAUNCHED_BY_ENV, "workflow")
    assert stage_tags(cfg, "train", method="grpo", seed=0)["oar.launched_by"] == "workflow"
