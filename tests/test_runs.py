"""Runs never mix, never lose, never run what they read (issue 11, items 1-5): resume identity,
the evaluation cache, interruptions at every point of a checkpoint write, a tampered trainer
state, two writers into one folder, and first use of a new MLflow store by two processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from oar.config.load import load_config
from oar.config.source import deep_merge
from oar.core.io import FolderLockedError, atomic_path, exclusive_lock, recover_atomic_dir
from oar.trainer.runs import RunMismatchError, identity_diff, load_trainer_state, restore_rng, save_trainer_state
from oar.trainer.loop import train
from oar.trainer.step import EndAfter

from helpers import ROOT, small_overrides


def _config_file(tmp_path: Path, name: str = "cfg.yaml", **extra) -> Path:
    cfg = deep_merge(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), small_overrides(tmp_path, **extra))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _oar(capsys, *args: str) -> tuple[int, str]:
    from oar.cli import main

    rc = main(list(args))
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------ 1. resume identity


@pytest.mark.slow
def test_resume_refuses_other_settings_method_or_start_model(tmp_path, capsys):
    """The issue's reproduction: grpo for a few steps, then another lr, --method dapo, another --init;
    each is refused naming what differs and the flag, and loses nothing; --restart starts over."""
    cfg = _config_file(tmp_path, train={"save_every": 1})
    run = tmp_path / "run"
    base = ["train", "--config", str(cfg), "--output", str(run), "--no-progress", "--method"]
    assert _oar(capsys, *base, "grpo", "--steps", "2")[0] == 0
    before = _weights(run / "checkpoint")

    lr_cfg = _config_file(tmp_path, "lr.yaml", train={"save_every": 1, "lr": 1e-3})
    rc, err = _oar(capsys, "train", "--config", str(lr_cfg), "--output", str(run), "--no-progress", "--method",
                   "grpo", "--steps", "3")
    first_lr = yaml.safe_load(cfg.read_text())["train"]["lr"]
    assert rc == 2 and f"train.lr: {first_lr!r} -> 0.001" in err and "--restart" in err, err

    rc, err = _oar(capsys, *base, "dapo", "--steps", "3")
    assert rc == 2 and 'method.method: grpo -> dapo' in err and "--restart" in err, err

    from oar.models.tiny import build_tiny

    other = tmp_path / "other_start"
    model, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                            max_position_embeddings=128, seed=7)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    rc, err = _oar(capsys, *base, "grpo", "--steps", "3", "--init", str(other))
    assert rc == 2 and "start_model:" in err, err

    # nothing was lost or changed by the refusals
    after = _weights(run / "checkpoint")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _steps(run) == [0, 1] and json.loads((run / "train_summary.json").read_text())["method"] == "grpo"

    # the same settings with more steps continue the run
    rc, err = _oar(capsys, *base, "grpo", "--steps", "3")
    assert rc == 0, err
    assert _steps(run) == [0, 1, 2]

    # --restart discards the grpo run and trains dapo from step 0
    assert _oar(capsys, *base, "dapo", "--steps", "2", "--restart")[0] == 0
    assert _steps(run) == [0, 1]
    assert json.loads((run / "train_summary.json").read_text())["method"] == "dapo"


def test_identity_diff_names_changed_added_and_removed_keys():
    assert identity_diff({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b: 2 -> 3", "c: <absent> -> 4"]
    assert identity_diff({"a": "1"}, {"a": "1"}) == []


# --------------------------------------------------------------------------- 2. evaluation cache


@pytest.mark.slow
def test_evaluate_reruns_when_the_model_at_the_path_is_replaced(tmp_path):
    from oar.evaluate.evaluation import evaluate_from_config
    from oar.models.tiny import build_tiny

    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(
        tmp_path, eval={"benchmarks": [{"name": "synthetic-test", "n": 4}], "samples": 0, "max_new_tokens": 8}))
    path, out = tmp_path / "model", tmp_path / "eval"

    def save(seed):
        model, tok = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)
        if path.exists():
            shutil.rmtree(path)
        model.save_pretrained(path)
        tok.save_pretrained(path)

    save(0)
    first = evaluate_from_config(cfg, path, out)
    stamp = (out / "synthetic-test.json").stat().st_mtime_ns
    assert evaluate_from_config(cfg, path, out)["model_identity"] == first["model_identity"]
    assert (out / "synthetic-test.json").stat().st_mtime_ns == stamp  # same model: cached
    save(1)  # another model at the same path
    second = evaluate_from_config(cfg, path, out)
    assert second["model_identity"] != first["model_identity"]
    assert (out / "synthetic-test.json").stat().st_mtime_ns != stamp  # evaluated again
    cached = json.loads((out / "synthetic-test.json").read_text())
    assert cached["settings"]["model_identity"] == second["model_identity"]


# ----------------------------------------------------------------------------- 3. interruptions


@pytest.mark.slow
def test_kill_before_the_first_checkpoint_leaves_no_duplicate_rows_or_running_orphan(tmp_path):
    import mlflow

    cfg = load_config(ROOT / "config" / "config.yaml",
                      small_overrides(tmp_path, train={"steps": 3, "save_every": 10}, tracking={"enabled": True}))
    run = tmp_path / "run"
    assert train(cfg, "grpo", 0, run, progress=False, observer=EndAfter(2)) == {"interrupted_at": 2}  # killed at step 2
    assert not (run / "checkpoint").exists() and _steps(run) == [0, 1]
    orphan = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    client = mlflow.tracking.MlflowClient(tracking_uri=cfg["tracking"]["uri"])
    assert client.get_run(orphan).info.status == "RUNNING"

    summary = train(cfg, "grpo", 0, run, progress=False)
    assert _steps(run) == [0, 1, 2]  # not 0,1,0,1,2
    assert client.get_run(orphan).info.status == "KILLED"
    assert client.get_run(orphan).data.tags["oar.replaced_by"] == summary["mlflow_run_id"] != orphan
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"


def _swap_states(tmp_path: Path) -> dict[str, Path]:
    """A folder ``d`` with complete copies 'old' and 'new', and helpers to stage each kill point."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "w").write_text("old")
    return {"d": d, "new": tmp_path / ".ckpt.new", "old": tmp_path / ".ckpt.old"}


def test_recover_after_a_kill_while_writing_removes_the_partial_copy(tmp_path):
    p = _swap_states(tmp_path)
    (tmp_path / ".ckpt.x1y2.tmp").mkdir()
    (tmp_path / ".ckpt.x1y2.tmp" / "w").write_text("half")
    actions = recover_atomic_dir(p["d"])
    assert len(actions) == 1 and "incomplete" in actions[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"] and (p["d"] / "w").read_text() == "old"


@pytest.mark.parametrize("kill_after", ["tmp->new", "path->old"])
def test_recover_after_a_kill_between_renames_keeps_the_newest_complete_copy(tmp_path, kill_after):
    p = _swap_states(tmp_path)
    p["new"].mkdir()
    (p["new"] / "w").write_text("new")
    if kill_after == "path->old":
        os.replace(p["d"], p["old"])  # no `ckpt/` at all: the state the issue reproduced
    assert recover_atomic_dir(p["d"])
    assert (p["d"] / "w").read_text() == "new"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


def test_recover_restores_the_old_copy_when_only_it_is_left(tmp_path):
    p = _swap_states(tmp_path)
    os.replace(p["d"], p["old"])
    assert recover_atomic_dir(p["d"]) == ["restored ckpt from .ckpt.old"]
    assert (p["d"] / "w").read_text() == "old" and not p["old"].exists()
    assert recover_atomic_dir(p["d"]) == []  # nothing left to do


def test_atomic_path_replaces_a_folder_and_leaves_no_side_copies(tmp_path):
    p = _swap_states(tmp_path)
    with atomic_path(p["d"]) as tmp:
        tmp.mkdir()
        (tmp / "w").write_text("new")
    assert (p["d"] / "w").read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.slow
def test_training_resumes_from_a_checkpoint_swap_killed_between_renames(tmp_path):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"steps": 3, "save_every": 1}))
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, "grpo", 0, full, progress=False)
    train(cfg, "grpo", 0, part, progress=False, observer=EndAfter(2))
    # the kill came after `checkpoint -> .checkpoint.old` and before `.checkpoint.new -> checkpoint`
    shutil.copytree(part / "checkpoint", part / ".checkpoint.old")
    os.replace(part / "checkpoint", part / ".checkpoint.new")
    (part / ".checkpoint.q9.tmp").mkdir()  # and an earlier kill left a partial write
    train(cfg, "grpo", 0, part, progress=False)
    assert _steps(part) == [0, 1, 2]  # resumed at step 2, did not start over
    wa, wb = _weights(full / "model"), _weights(part / "model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sorted(x.name for x in part.iterdir() if x.name.startswith(".checkpoint")) == []


# ---------------------------------------------------------------------------------- 4. security


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_trainer_state_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "trainer_state.pt"
    torch.save({"optimizer": _Payload(marker), "scheduler": {}, "rng": {}, "state": {}}, path)
    with pytest.raises(ValueError, match="not a loadable trainer state.*--restart"):
        load_trainer_state(path)
    assert not marker.exists()
    # the pickle really is malicious: the unsafe load the trainer used before runs it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_trainer_state_round_trips_rng_and_optimizer_under_weights_only(tmp_path):
    import random

    import numpy as np

    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_trainer_state(tmp_path / "s.pt", optimizer_state=opt.state_dict(), scheduler=sch, state={"step": 4}, identity={"a": "1"})
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    saved = load_trainer_state(tmp_path / "s.pt")
    restore_rng(saved)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    assert saved["state"] == {"step": 4} and saved["identity"] == {"a": "1"}
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.slow
def test_training_refuses_a_tampered_checkpoint(tmp_path, capsys):
    cfg = _config_file(tmp_path, train={"save_every": 1})
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    marker = tmp_path / "PWNED"
    torch.save({"optimizer": _Payload(marker)}, run / "checkpoint" / "trainer_state.pt")
    rc, err = _oar(capsys, "train", "--config", str(cfg), "--output", str(run), "--method", "grpo", "--no-progress")
    assert rc == 2 and "trainer_state.pt: not a loadable trainer state" in err and not marker.exists()


# ------------------------------------------------------------------------------ 5. two writers


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from oar.core.io import exclusive_lock
            with exclusive_lock({str(folder)!r}, purpose="oar train grpo seed 0"):
                print("locked", flush=True)
                sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderLockedError, match=rf"pid {holder.pid} .*oar train grpo seed 0"):
            with exclusive_lock(folder):
                pass
    finally:
        holder.communicate("\n", timeout=30)
    with exclusive_lock(folder):  # released when the holder exits
        pass


@pytest.mark.slow
def test_train_into_a_folder_in_use_fails_before_writing(tmp_path, capsys):
    cfg = _config_file(tmp_path)
    run = tmp_path / "run"
    with exclusive_lock(run, purpose="another trainer"):
        rc, err = _oar(capsys, "train", "--config", str(cfg), "--output", str(run), "--method", "grpo", "--no-progress")
    assert rc == 2 and f"pid {os.getpid()}" in err and "another trainer" in err, err
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def _open_tracker(uri: str, barrier, out) -> None:
    from oar.tracking.client import Tracker

    barrier.wait()
    try:
        t = Tracker(Path(uri[len("sqlite:///"):]).with_suffix(f".{os.getpid()}.jsonl"), uri=uri, experiment="e",
                    run_name="r")
        t.log_metrics({"x": 1.0}, 0)
        t.finish()
        out.put("ok")
    except Exception as e:  # reported to the parent
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.slow
def test_two_trackers_on_a_new_store_at_the_same_moment(tmp_path):
    """Both processes import first and then meet at a barrier, so they create the store together."""
    ctx = mp.get_context("spawn")
    uri = f"sqlite:///{tmp_path}/new/mlflow.db"
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_tracker, args=(uri, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok", "ok"], results
