"""Issue 23: preemption and full disks cost at most one step.

A SIGTERM, SIGINT or SIGUSR1 at a step boundary or in the middle of a step (rollout, update),
with one process and with FSDP over 2 processes (signalled on one rank, or on torchrun and every
worker at once as SLURM does): the step finishes, a checkpoint is written, ``oar train`` exits 75
and the MLflow run is KILLED with the step; the rerun resumes from that step and ends with weights
bit-identical to an uninterrupted run. A second signal ends the process at once; kill -9 during a
sharded checkpoint save leaves the previous checkpoint, which the rerun resumes. A truncated or
corrupt checkpoint file and a full disk (simulated, and a real small tmpfs) give one named line.
The training rule's SLURM signal, the rules' shell that outlives it, and torchrun's forwarding.

Each test prints what the interruption cost (steps trained again, seconds) as ``LOSS ...`` lines
(``pytest -s`` shows them).

Cost: every run of the module is on one thread and records to one MLflow database (a new one costs
seconds), the runs a test compares against are module fixtures, the rerun of a subprocess run is
in-process where that proves the same, and the FSDP interruptions are one chain of launches (each
resumes the previous one).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from oar.config.source import deep_merge
from oar.trainer.preemption import EXIT_INTERRUPTED, CheckpointSchedule, StopSignal
from oar.trainer.runs import CheckpointError, check_checkpoint_files, is_disk_full, write_manifest

from helpers import ROOT, filled_slurm_profile, small_overrides, with_stub_data

#: DAPO's overlong shaping gives a random tiny model's responses different rewards, so advantages
#: are not zero and the weights move: "bit-identical" then means something.
METHOD = "dapo"
STEPS = 4
#: the interruptions below come during step index 1, so the run stops after 2 steps
STOP_AT = 2


#: One MLflow database for every run of the module (set by the ``tracking_uri`` fixture): creating
#: one costs seconds, and a run is found by its id (run.json), so runs need no database of their own.
_TRACKING: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def tracking_uri(tmp_path_factory):
    """The module's MLflow database (autouse: every ``_config_file`` of the module records to it)."""
    _TRACKING["uri"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    yield _TRACKING["uri"]
    _TRACKING.clear()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The module's in-process runs on one thread, as its subprocesses (OMP_NUM_THREADS=1): the
    same float reductions, so weights compare bit for bit, and a tiny model's steps are faster (more
    threads only synchronize, and spin when other work holds the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config_file(tmp: Path, name: str, **train) -> Path:
    raw = deep_merge(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()),
                     small_overrides(tmp, train={"steps": STEPS, "save_every": 100, **train},
                                     tracking={"enabled": True, "uri": _TRACKING["uri"]}))
    path = tmp / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _subprocess_env(**extra: str) -> dict:
    """The environment of an ``oar train`` subprocess: this process's thread count (1, ``one_thread``),
    so its float reductions (and so its weights) are those of an in-process run (the references)."""
    return dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), **extra)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a / "model"), _weights(b / "model")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time_", "credit_importance"))}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_step(run: Path) -> int:
    return json.loads((run / "checkpoint" / "checkpoint.json").read_text())["step"]


def _leftovers(run: Path) -> list[str]:
    """Temporary or side copies of the checkpoint or model (a half-written write)."""
    return sorted(p.name for p in run.iterdir() if p.name.startswith((".checkpoint", ".model")))


def _oar(capsys, *args: str) -> tuple[int, str]:
    from oar.cli import main

    rc = main(list(args))
    return rc, capsys.readouterr().err


def _mlflow_run(cfg: Path, run: Path):
    import mlflow

    uri = yaml.safe_load(cfg.read_text())["tracking"]["uri"]
    run_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    return mlflow.tracking.MlflowClient(tracking_uri=uri).get_run(run_id)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tracking_uri):
    """An uninterrupted run of every test's config: (folder, config)."""
    from oar.cli import main

    tmp = tmp_path_factory.mktemp("preemption")
    cfg = _config_file(tmp, "cfg.yaml")
    run = tmp / "reference"
    assert main(["train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress"]) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["loss"] != 0 for r in rows)  # non-zero advantages: the weights move
    return run, cfg


# ------------------------------------------------------------------------------- the pieces


class _Ranks:
    """A strategy stand-in: the maximum over processes of one process is its own value."""

    def __init__(self, others: list[int] | None = None) -> None:
        self.others = others

    def max_over_ranks(self, values: list[int]) -> list[int]:
        return [max(v, o) for v, o in zip(values, self.others)] if self.others else list(values)


def test_schedule_saves_by_steps_minutes_and_signal_and_agrees_over_processes():
    now = [0.0]
    stop = StopSignal(repeat_seconds=1.0)
    sched = CheckpointSchedule(save_every=3, total_steps=10, save_every_minutes=1.5, stop=stop, strategy=_Ranks(),
                               clock=lambda: now[0])
    assert [sched.after_step(s).save for s in (1, 2, 3)] == [False, False, True]
    now[0] = 89.0
    assert not sched.after_step(4).save
    now[0] = 90.0
    assert sched.after_step(5).save  # 1.5 minutes since the start
    sched.saved()
    now[0] = 100.0
    assert not sched.after_step(7).save and sched.after_step(10).save  # the last step
    assert not sched.before_first_step()
    # another process was signalled: this one stops after the same step, with a checkpoint
    other = CheckpointSchedule(save_every=3, total_steps=10, save_every_minutes=None, stop=stop,
                               strategy=_Ranks([1, 0]))
    d = other.after_step(4)
    assert d.save and d.stop
    stop.request("SIGTERM")
    assert sched.after_step(8).stop and sched.before_first_step()


def test_stop_signal_flags_ignores_a_quick_repeat_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal(repeat_seconds=5.0) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same signal delivered twice: still running
        assert stop.requested and stop.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_signal_takes_back_a_handler_a_library_replaced():
    with StopSignal(repeat_seconds=5.0) as stop:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as an engine might while the run starts
        assert stop.reinstall() == ["SIGUSR1"] and stop.reinstall() == []
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1"


def test_checkpoint_manifest_names_a_truncated_or_missing_shard(tmp_path):
    ck = tmp_path / "checkpoint"
    (ck / "shards").mkdir(parents=True)
    (ck / "shards" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (ck / "shards" / ".metadata").write_bytes(b"m" * 10)
    (ck / "trainer_state.pt").write_bytes(b"t" * 10)
    write_manifest(ck, step=3)
    assert check_checkpoint_files(ck)["step"] == 3
    with open(ck / "shards" / "__0_0.distcp", "r+b") as f:
        f.truncate(400)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: unreadable \(400 bytes where 1000 were written: "
                                              r"truncated\).*--restart"):
        check_checkpoint_files(ck)
    (ck / "shards" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: unreadable \(missing\)"):
        check_checkpoint_files(ck)


def test_disk_full_is_recognised_in_every_writer_s_words(tmp_path, monkeypatch):
    import oar.trainer.runs

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path, 10)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path, 10)
    # safetensors (a Rust error in an exception that is not an OSError)
    assert is_disk_full(RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                     'message: "No space left on device" })'), tmp_path, 10)
    # torch.distributed.checkpoint wraps each process's failure
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert is_disk_full(wrapped, tmp_path, 10)
    # torch.save's zip writer loses the errno: a full disk when less is free than was needed
    torch_zip = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 218")
    monkeypatch.setattr(oar.trainer.runs, "free_bytes", lambda path: 100)
    assert is_disk_full(torch_zip, tmp_path, 1000) and not is_disk_full(torch_zip, tmp_path, 10)
    assert not is_disk_full(ValueError("bad value"), tmp_path, 1000)


# --------------------------------------------------------------------- signals, one process


def _signal_during(monkeypatch, phase: str, sig: signal.Signals, *, times: int = 1) -> list[int]:
    """Send ``sig`` (``times`` times in a row) to this process in ``phase`` of step index
    ``STOP_AT - 1``: before its rollout, before its update, or after it ("boundary"), the first
    time it runs. Returns the list the steps that ran are appended to."""
    import oar.evaluate.heldout
    import oar.trainer.step as tr  # the step calls collect_batch and update_policy

    ran: list[int] = []
    target = STOP_AT - 1
    fired: list[bool] = []

    def fire() -> None:  # once: the rerun is not signalled
        if not fired:
            fired.append(True)
            for _ in range(times):
                os.kill(os.getpid(), sig)

    real_collect, real_update, real_after = tr.collect_batch, tr.update_policy, oar.evaluate.heldout.HeldoutEval.after_step

    def collect(*a, **k):
        ran.append(k["step"])
        if phase == "rollout" and k["step"] == target:
            fire()
        return real_collect(*a, **k)

    def update(*a, **k):
        if phase == "update" and ran[-1] == target:
            fire()
        return real_update(*a, **k)

    def after(self, step, seconds):
        if phase == "boundary" and step == target + 1:
            fire()
        return real_after(self, step, seconds)

    monkeypatch.setattr(tr, "collect_batch", collect)
    monkeypatch.setattr(tr, "update_policy", update)
    monkeypatch.setattr(oar.evaluate.heldout.HeldoutEval, "after_step", after)
    return ran


@pytest.mark.slow
@pytest.mark.parametrize("phase, sig", [("boundary", signal.SIGTERM), ("rollout", signal.SIGTERM),
                                        ("update", signal.SIGTERM), ("rollout", signal.SIGINT),
                                        ("update", signal.SIGUSR1)])
def test_a_signal_checkpoints_the_step_and_the_rerun_is_bit_identical(reference, tmp_path, monkeypatch, capsys,
                                                                      phase, sig):
    ref, cfg = reference
    run = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress"]
    handler_before = signal.getsignal(sig)
    ran = _signal_during(monkeypatch, phase, sig, times=2)  # twice at once: one signal delivered twice
    t0 = time.perf_counter()
    rc, err = _oar(capsys, *args)
    seconds = time.perf_counter() - t0
    assert rc == EXIT_INTERRUPTED, err
    assert f"stopped by {sig.name} after step {STOP_AT}" in err and "run the same command again" in err
    assert signal.getsignal(sig) is handler_before
    assert ran == list(range(STOP_AT)) and _checkpoint_step(run) == STOP_AT
    assert [r["step"] for r in _rows(run)] == list(range(STOP_AT)) and not _leftovers(run)
    mlrun = _mlflow_run(cfg, run)
    assert mlrun.info.status == "KILLED"
    assert mlrun.data.tags["oar.interrupted_at_step"] == str(STOP_AT)
    assert mlrun.data.tags["oar.interrupted_by"] == sig.name

    ran.clear()
    assert _oar(capsys, *args)[0] == 0
    assert ran == list(range(STOP_AT, STEPS))  # resumed at the signalled step: nothing trained twice
    assert _same_weights(ref, run) and _rows(run) == _rows(ref)
    assert _mlflow_run(cfg, run).info.status == "FINISHED"
    print(f"LOSS signal {sig.name} at {phase}: 0 steps trained again; stopped {seconds:.1f} s after the start")


# -------------------------------------------------------------------- subprocesses (a driver)

#: Runs ``oar.cli.main`` with a hook (OAR_TEST_HOOK="<phase>:<step index>:<who>:<signal>[:<again after s>]"):
#: in ``phase`` (rollout, update, boundary, save = after writing the shards of the <step>-th
#: checkpoint) of that step, on rank OAR_TEST_RANK (default 0), send the signal to ``who``: self,
#: group (every process of the launch, torchrun and all its workers, as SLURM signals every
#: process of a job step; torchrun starts each worker in a session of its own).
#: With a fourth field, send it once more that many seconds later. The hook writes the time it
#: fires to OAR_TEST_STAMP.
_DRIVER = textwrap.dedent('''
    import os, signal, sys, time
    phase, at, who, sig, *again = os.environ["OAR_TEST_HOOK"].split(":")
    at, sig = int(at), getattr(signal, sig)
    mine = os.environ.get("RANK", "0") == os.environ.get("OAR_TEST_RANK", "0")
    import oar.evaluate.heldout, oar.trainer.strategy, oar.trainer.step as tr

    def everyone():  # torchrun and its workers (each in a session of its own), or this process alone
        if "RANK" not in os.environ:
            return [os.getpid()]
        launcher = os.getppid()
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            return [launcher, *(int(p) for p in f.read().split())]

    def fire():
        with open(os.environ["OAR_TEST_STAMP"], "w") as f:
            f.write(str(time.time()))
        send = (lambda s: [os.kill(p, s) for p in everyone()]) if who == "group" else (lambda s: os.kill(os.getpid(), s))
        send(sig)
        if again:
            time.sleep(float(again[0]))
            with open(os.environ["OAR_TEST_STAMP"], "w") as f:
                f.write(str(time.time()))
            send(sig)

    steps = []
    real_collect, real_update, real_after = tr.collect_batch, tr.update_policy, oar.evaluate.heldout.HeldoutEval.after_step

    def collect(*a, **k):
        steps.append(k["step"])
        if mine and phase == "rollout" and k["step"] == at:
            fire()
        return real_collect(*a, **k)

    def update(*a, **k):
        if mine and phase == "update" and steps[-1] == at:
            fire()
        return real_update(*a, **k)

    def after(self, step, seconds):
        if mine and phase == "boundary" and step == at + 1:
            fire()
        return real_after(self, step, seconds)

    tr.collect_batch, tr.update_policy, oar.evaluate.heldout.HeldoutEval.after_step = collect, update, after
    saves = []
    real_save = oar.trainer.strategy.FSDPStrategy.save_training_state

    def save(self, *a, **k):
        out = real_save(self, *a, **k)
        saves.append(1)
        if mine and phase == "save" and len(saves) == at:
            fire()
        return out

    oar.trainer.strategy.FSDPStrategy.save_training_state = save
    from oar.cli import main
    sys.exit(main(sys.argv[1:]))
''')


def _launch(tmp: Path, cfg: Path, run: Path, *, procs: int, hook: str | None = None, rank: int = 0,
            steps: int | None = None, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float | None]:
    """``oar train`` (under torchrun with ``procs`` > 1) through the driver, in a session of its
    own; returns the process and the time the hook fired (None if it did not)."""
    driver = tmp / "driver.py"
    driver.write_text(_DRIVER)
    stamp = tmp / f"stamp-{time.monotonic_ns()}"
    train = ["train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress",
             *(["--steps", str(steps)] if steps else [])]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
                 "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "300"]
                if procs > 1 else [sys.executable])
    env = _subprocess_env(OAR_TEST_HOOK=hook or "none:-1:self:SIGTERM", OAR_TEST_RANK=str(rank),
                          OAR_TEST_STAMP=str(stamp))
    proc = subprocess.run([*launcher, str(driver), *train], capture_output=True, text=True, timeout=timeout, env=env,
                          start_new_session=True)
    fired = float(stamp.read_text()) if stamp.exists() else None
    return proc, fired


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_the_previous_checkpoint_resumes(reference, tmp_path, capsys):
    ref, _ = reference
    cfg = _config_file(tmp_path, "cfg.yaml", save_every=1, preemption={"repeat_seconds": 0.5})
    run = tmp_path / "run"
    proc, fired = _launch(tmp_path, cfg, run, procs=1, hook=f"update:{STOP_AT - 1}:self:SIGTERM:1.5")
    died = time.time()
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert died - fired < 3.0  # at once (the process ends, then the test's wait returns)
    assert _checkpoint_step(run) == STOP_AT - 1  # the step in progress was not saved; its predecessor is
    rc, err = _oar(capsys, "train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress")
    assert rc == 0, err[-3000:]
    assert _same_weights(ref, run) and _rows(run) == _rows(ref)
    print(f"LOSS second signal: 1 step (the one in progress) trained again; exit {died - fired:.2f} s after it")


@pytest.mark.slow
def test_sigterm_from_outside_stops_after_the_step_in_progress(tmp_path, capsys):
    """The issue's reproduction: `oar train` with save_every 100 and SIGTERM after 5 steps."""
    cfg = _config_file(tmp_path, "cfg.yaml", steps=200, save_every=100)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "oar.cli", "train", "--config", str(cfg), "--method", METHOD, "--output", str(run),
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env())
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and len(_rows(run)) >= 5):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        seconds = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    done = len(_rows(run))
    assert done >= 5 and _checkpoint_step(run) == done  # the step in progress finished and was saved
    rc, more = _oar(capsys, *cmd[3:], "--steps", str(done + 2))  # the same command, in this process
    assert rc == 0, more[-3000:]
    assert [r["step"] for r in _rows(run)] == list(range(done + 2))  # resumed at `done`, nothing twice
    print(f"LOSS external SIGTERM after {done} steps: 0 steps trained again; exit 75 {seconds:.2f} s after the "
          f"signal (the step in progress and a checkpoint)")


# ------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, tracking_uri):
    """A run stopped after 2 steps with its checkpoint (save_every 1), to damage copies of."""
    from oar.config.load import load_config
    from oar.trainer.loop import train
    from oar.trainer.step import EndAfter

    tmp = tmp_path_factory.mktemp("checkpointed")
    cfg = _config_file(tmp, "cfg.yaml", save_every=1)
    run = tmp / "run"
    assert train(load_config(cfg), METHOD, 0, run, progress=False, observer=EndAfter(STOP_AT)) == {"interrupted_at": STOP_AT}
    assert _checkpoint_step(run) == STOP_AT
    return run, cfg


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe\xfd\xfc"  # inside the JSON header, same size
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("name, damage, says", [
    ("model.safetensors", lambda p: _truncate(p, 100), "model.safetensors: unreadable"),  # the case
    ("model.safetensors", lambda p: _truncate(p, p.stat().st_size // 2), "model.safetensors: unreadable"),
    ("model.safetensors", _flip_header, "model.safetensors: unreadable (its safetensors header is corrupt)"),
    ("trainer_state.pt", lambda p: _truncate(p, p.stat().st_size // 2), "trainer_state.pt: unreadable"),
    ("tokenizer.json", lambda p: _truncate(p, 10), "tokenizer.json: unreadable"),
    ("config.json", lambda p: p.unlink(), "config.json: unreadable (missing)"),
])
def test_an_unreadable_checkpoint_file_is_named_with_what_to_do(checkpointed, tmp_path, capsys, name, damage, says):
    src, cfg = checkpointed
    run = tmp_path / "run"
    shutil.copytree(src, run)
    damage(run / "checkpoint" / name)
    rc, err = _oar(capsys, "train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress")
    assert rc == 2 and says in err and "--restart" in err and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith(f"oar train: error: {run / 'checkpoint' / name}"), line
    print(f"LOSS corrupt {name}: the run cannot resume; --restart loses its {STOP_AT} steps")


@pytest.mark.slow
def test_an_unreadable_trainer_state_without_a_manifest_keeps_its_named_error(checkpointed, tmp_path, capsys):
    """A checkpoint of an oar before checkpoint.json: the loader's own errors still name the file."""
    src, cfg = checkpointed
    run = tmp_path / "run"
    shutil.copytree(src, run)
    (run / "checkpoint" / "checkpoint.json").unlink()
    _truncate(run / "checkpoint" / "trainer_state.pt", 1000)
    rc, err = _oar(capsys, "train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress")
    assert rc == 2 and "trainer_state.pt: not a loadable trainer state" in err and "--restart" in err, err


# --------------------------------------------------------------------------------- full disks


@pytest.mark.slow
def test_a_full_disk_names_the_intact_checkpoint_and_leaves_nothing_half_written(reference, tmp_path, monkeypatch,
                                                                                 capsys):
    import oar.trainer.strategy

    ref, _ = reference
    cfg = _config_file(tmp_path, "cfg.yaml", save_every=1)
    run = tmp_path / "run"
    real = oar.trainer.strategy.DDPStrategy.save_training_state
    saves = []

    def full(self, model, optimizer, folder, tokenizer):
        saves.append(folder)
        if len(saves) == STOP_AT:  # the disk fills up in the middle of the step-2 checkpoint
            (folder / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))
        return real(self, model, optimizer, folder, tokenizer)

    monkeypatch.setattr(oar.trainer.strategy.DDPStrategy, "save_training_state", full)
    args = ["train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress"]
    rc, err = _oar(capsys, *args)
    assert rc == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert f"{run / 'checkpoint'}: no space left on device writing the step-{STOP_AT} checkpoint: it needs about" in line
    assert f"The step-{STOP_AT - 1} checkpoint {run / 'checkpoint'} is intact" in line, line
    assert not _leftovers(run) and not saves[-1].exists() and _checkpoint_step(run) == STOP_AT - 1
    monkeypatch.setattr(oar.trainer.strategy.DDPStrategy, "save_training_state", real)
    assert _oar(capsys, *args)[0] == 0
    assert _same_weights(ref, run) and _rows(run) == _rows(ref)
    print("LOSS full disk (simulated ENOSPC): 1 step (the one whose checkpoint failed) trained again")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A mount point for a tmpfs of a chosen size (needs root; skipped where mount is refused)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    mounted = []

    def mount(size: int) -> Path:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for p in mounted:
        subprocess.run(["umount", str(p)], check=False)


def _pages(folder: Path, page: int = 4096) -> int:
    return sum(-(-p.stat().st_size // page) * page for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_real_full_disk_tmpfs(reference, tmp_path, small_tmpfs, capsys):
    """The run folder on a tmpfs that holds one checkpoint and half of another."""
    ref, _ = reference
    one = _pages(ref / "checkpoint")
    disk = small_tmpfs(one + one // 2 + 16 * 4096)
    cfg = _config_file(tmp_path, "cfg.yaml", save_every=1)
    run = disk / "run"
    args = ["train", "--config", str(cfg), "--method", METHOD, "--output", str(run), "--no-progress"]
    rc, err = _oar(capsys, *args)
    assert rc == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert ": no space left on device writing " in line and "are free there" in line, line
    intact = _checkpoint_step(run)
    assert intact >= 1 and f"The step-{intact} checkpoint {run / 'checkpoint'} is intact" in line, line
    assert not _leftovers(run)
    [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # no half row
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)  # "free space (or move the run folder)"
    assert _oar(capsys, *[a if a != str(run) else str(moved) for a in args])[0] == 0
    assert _same_weights(ref, moved) and _rows(moved) == _rows(ref)
    lost = len(_rows(run)) - intact  # steps after the intact checkpoint, trained again on resume
    print(f"LOSS full disk (tmpfs of {one + one // 2 + 16 * 4096} bytes, checkpoint {one}): "
          f"{lost} step(s) trained again; {line.split('error: ', 1)[1]}")


# -------------------------------------------------------------------------- FSDP, 2 processes


#: The FSDP chain: each launch resumes the previous one and is signalled in its second step (as the
#: one-process tests: in the first, the reward workers may still be starting), so it stops after
#: two more steps: (phase, who, rank) of its SIGTERM. self: only one worker is signalled, the other
#: stops after the same step (the decision is a maximum over them); group: torchrun and both
#: workers get SIGTERM, as SLURM sends it to every process of a job step, and torchrun forwards it
#: once more.
FSDP_SIGNALS = [("boundary", "self", 1), ("rollout", "self", 0), ("update", "group", 0)]
#: two steps per stopped launch, one for the launch killed during the final save
FSDP_STEPS = 2 * len(FSDP_SIGNALS) + 1


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory, tracking_uri):
    tmp = tmp_path_factory.mktemp("fsdp")
    cfg = _config_file(tmp, "cfg.yaml", strategy="fsdp", steps=FSDP_STEPS)
    run = tmp / "reference"
    proc, _ = _launch(tmp, cfg, run, procs=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(r["loss"] != 0 for r in _rows(run))
    return tmp, cfg, run


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_processes_stop_after_the_same_step_resume_bit_identically_and_survive_a_kill_9(fsdp_reference,
                                                                                               tmp_path):
    """One run of FSDP_SIGNALS' launches (the stopped launch's rerun is the next one; each stop marks
    the MLflow run KILLED with its step), a kill -9 during the final sharded save, the rerun that
    resumes the previous checkpoint and ends with the uninterrupted run's weights, and a truncated
    shard of the final checkpoint, named."""
    tmp, cfg, ref = fsdp_reference
    run = tmp_path / "run"
    for i, (phase, who, rank) in enumerate(FSDP_SIGNALS):
        at = 2 * i + 1  # the launch resumes at step 2 * i and is signalled in the next one
        t0 = time.time()
        proc, fired = _launch(tmp_path, cfg, run, procs=2, hook=f"{phase}:{at}:{who}:SIGTERM", rank=rank)
        ended = time.time()
        assert proc.returncode != 0 and fired is not None, (phase, proc.stderr[-4000:])
        assert proc.returncode != -signal.SIGKILL
        assert "stopped by " in proc.stderr and f"after step {at + 1}" in proc.stderr, proc.stderr[-4000:]
        assert _checkpoint_step(run) == at + 1 and [r["step"] for r in _rows(run)] == list(range(at + 1))
        assert len(list((run / "checkpoint" / "shards").glob("*.distcp"))) == 2 and not _leftovers(run)
        if who == "self":
            assert "exitcode  : 75" in proc.stderr, proc.stderr[-4000:]  # torchrun's report of the workers
        else:  # torchrun got it too and forwarded it: each worker had it twice, and stopped after its step
            assert "death signal, shutting down workers" in proc.stderr, proc.stderr[-4000:]
            assert "closing signal SIGTERM" in proc.stderr, proc.stderr[-4000:]
        mlrun = _mlflow_run(cfg, run)  # recorded by rank 0, signalled or not
        assert mlrun.info.status == "KILLED" and mlrun.data.tags["oar.interrupted_at_step"] == str(at + 1)
        assert mlrun.data.tags["oar.interrupted_by"] == ("SIGTERM" if rank == 0 else "a signal to another process")
        print(f"LOSS FSDP signal ({who}, rank {rank}) at {phase}: 0 steps trained again; launch ended "
              f"{ended - fired:.1f} s after the signal ({ended - t0:.1f} s in all)")

    # the rerun of the last stop writes the final checkpoint: after this process wrote its shards,
    # before the rename, every process dies
    proc, fired = _launch(tmp_path, cfg, run, procs=2, hook="save:1:group:SIGKILL")
    assert proc.returncode == -signal.SIGKILL and fired is not None, proc.stderr[-4000:]
    assert _checkpoint_step(run) == FSDP_STEPS - 1
    assert [p.name for p in run.iterdir() if p.name.endswith(".tmp")]  # the partial copy is there
    proc, _ = _launch(tmp_path, cfg, run, procs=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "removed the incomplete" in proc.stderr
    # every stop resumed its step, the kill -9 its checkpoint: the weights of the uninterrupted run
    assert _same_weights(ref, run) and _rows(run) == _rows(ref) and not _leftovers(run)
    assert _mlflow_run(cfg, run).info.status == "FINISHED"
    print("LOSS kill -9 during a sharded save: 1 step (the one being saved) trained again")

    # a truncated shard of the final checkpoint: named, nothing loaded
    shard = sorted((run / "checkpoint" / "shards").glob("*.distcp"))[0]
    _truncate(shard, shard.stat().st_size // 2)
    proc, _ = _launch(tmp_path, cfg, run, procs=2, steps=FSDP_STEPS + 1)
    assert proc.returncode != 0
    assert f"{shard}: unreadable (" in proc.stderr and "--restart" in proc.stderr, proc.stderr[-4000:]


# ------------------------------------------------------------------------------- the workflow

snakemake_missing = pytest.mark.skipif(__import__("importlib.util").util.find_spec("snakemake") is None,
                                       reason="snakemake not installed")


@pytest.mark.slow  # three snakemake dry runs: a few seconds each
@snakemake_missing
def test_slurm_training_jobs_ask_for_the_sized_early_sigterm(tmp_path):
    """The sbatch line of a training job (snakemake-executor-plugin-slurm) carries --signal=TERM@N,
    N sized by `oar plan` from the checkpoint's bytes, or train.preemption.signal_seconds; a time
    limit shorter than the signal is refused; the profile resubmits and lets SLURM requeue."""
    from types import SimpleNamespace

    from oar.config.load import load_config
    from oar.pipeline.launch import checkpoint_bytes, preemption_signal_seconds

    submit_string = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra
    from test_workflow import _config, dry_run, snakemake

    paper = load_config(ROOT / "config" / "paper.yaml")
    sized = preemption_signal_seconds(paper)
    p = paper["train"]["preemption"]
    assert sized == -(-(p["step_seconds"] + checkpoint_bytes(paper) / (p["write_gb_per_s"] * 1e9) + p["margin_seconds"])
                      // 1)
    assert 90e9 < checkpoint_bytes(paper) < 95e9  # 7.6B float32 weights + 2 AdamW states: config/paper.yaml's "~90 GB"

    class Resources(dict):
        __getattr__ = dict.__getitem__

    profile = ["--workflow-profile", str(filled_slurm_profile(tmp_path))]
    for change, seconds in (({}, sized), ({"signal_seconds": 900}, 900)):
        raw = with_stub_data(_config("paper.yaml"), tmp_path)  # no ../shared/data needed beside the clone
        raw["train"]["preemption"] = change
        path = tmp_path / "paper.yaml"
        path.write_text(yaml.safe_dump(raw))
        _, jobs = dry_run(*profile, "--configfile", str(path), results=tmp_path)
        train = [j for j in jobs if j["rule"] == "train"]
        assert train and all(j["resources"]["slurm_extra"] == f"--signal=TERM@{seconds}" for j in train)
        r = Resources({k: int(v) if v.isdigit() else v for k, v in train[0]["resources"].items()})
        job = SimpleNamespace(resources=r, threads=32, name="train", rule=SimpleNamespace(name="train"))
        validate_slurm_extra(job)  # not an option the plugin manages itself
        line = submit_string.get_submit_command(job, {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "c",
                                                      "account": "-A a", "partition": "-p gpu",
                                                      "workdir": str(tmp_path)})
        assert f" --signal=TERM@{seconds}" in line, line
        assert all(j["resources"].get("slurm_extra") is None for j in jobs if j["rule"] != "train")

    raw = with_stub_data(_config("paper.yaml"), tmp_path)
    raw["resources"]["train"]["runtime"] = 5  # minutes, less than the signal's lead
    path.write_text(yaml.safe_dump(raw))
    proc = snakemake("-n", *profile, "--configfile", str(path), "--config", f"results_dir={tmp_path}", check=False)
    assert proc.returncode != 0 and "train.preemption" in proc.stdout + proc.stderr
    assert "resources.train.runtime is 5 min" in proc.stdout + proc.stderr

    prof = yaml.safe_load((ROOT / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert prof["retries"] >= 1 and prof["slurm-requeue"] is True


#: steps of the workflow job: the SIGTERM after 3, margin for the step in progress, a few for the rerun
STEPS_WORKFLOW = 10


@pytest.mark.slow  # data + one training job through snakemake, twice: ~half a minute
@snakemake_missing
def test_a_sigterm_to_every_process_of_a_workflow_job_checkpoints_and_the_rerun_resumes(tmp_path):
    """What SLURM does at the time limit, on preemption or at the early --signal: SIGTERM to every
    process of the job step (Snakemake, the rule's bash, the trainer). Snakemake waits for its job,
    the rule's shell outlives the signal (common.smk's shell prefix), so the trainer's step and
    checkpoint end before the step's last process does, and a rerun resumes from that checkpoint."""
    from test_workflow import SNAKEFILE, _config, _env

    cfg = _config("smoke.yaml")
    cfg["results_dir"] = "results"
    cfg["tracking"]["uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    cfg["sft"]["enabled"] = False
    cfg["train"].update({"steps": STEPS_WORKFLOW, "save_every": 100, "heldout": {"every": 0}})
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "results" / "smoke" / "dapo" / "seed0"
    target = "results/smoke/dapo/seed0/train_summary.json"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path),
           "--configfile", str(path), "--cores", "1", target]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not ((run / "metrics.jsonl").exists() and len(_rows(run)) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # every process of the session: snakemake, bash, the trainer
        out, _ = proc.communicate(timeout=300)
        seconds = time.monotonic() - sent
        # when Snakemake (the step's main process) is gone, the trainer is already done (SLURM would kill it now)
        left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and not left, (left, out[-4000:])
    log = (tmp_path / "results" / "smoke" / "logs" / "train" / "dapo" / "seed0.log").read_text()
    done = len(_rows(run))
    assert f"stopped by SIGTERM after step {done}" in log, log[-3000:]
    assert _checkpoint_step(run) == done and not (run / "train_summary.json").exists()
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert [r["step"] for r in _rows(run)] == list(range(STEPS_WORKFLOW))  # resumed at `done`: nothing twice
    print(f"LOSS SIGTERM to a workflow job after {done} steps: 0 steps trained again; Snakemake ended "
          f"{seconds:.1f} s after the signal")


# ---------------------------------------------------------------------------- kept checkpoints


def test_keep_checkpoints_keeps_the_newest_and_prunes_after_a_newer_one_is_complete(tmp_path):
    """train.keep_checkpoints: 3 with a checkpoint every step of 4: checkpoint/ is step 4, and
    checkpoints/ keeps steps 3 and 2 (1 pruned); each kept one is a whole, loadable checkpoint. The
    default (1) keeps the latest only, as before."""
    from oar.config.load import load_config
    from oar.trainer.loop import train

    cfg = _config_file(tmp_path, "cfg.yaml", save_every=1, keep_checkpoints=3)
    run = tmp_path / "run"
    train(load_config(cfg), METHOD, 0, run, progress=False)
    assert _checkpoint_step(run) == STEPS
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_2", "step_3"]
    for name, step in (("step_2", 2), ("step_3", 3)):
        assert check_checkpoint_files(run / "checkpoints" / name)["step"] == step
    assert not _same_weights_files(run / "checkpoints" / "step_2", run / "checkpoint")
    one = tmp_path / "one"
    train(load_config(_config_file(tmp_path, "one.yaml", save_every=1)), METHOD, 0, one, progress=False)
    assert not (one / "checkpoints").exists()


def _same_weights_files(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_command_under_a_shell_that_ignores_sigterm_ends_on_sigterm(tmp_path):
    """A rule's shell ignores SIGTERM (oar.pipeline.launch.SHELL_PREFIX) and its children inherit that; every
    oar command but the trainer gives SIGTERM its default action back, so an evaluation under
    Snakemake ends on SLURM's SIGTERM (or scancel) at once instead of at the SIGKILL."""
    import subprocess
    import sys

    from oar.pipeline.launch import SHELL_PREFIX
    from oar.trainer.preemption import restore_ignored_signals

    code = ("import signal, sys, time\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # inherited from the shell\n"
            "from oar.trainer.preemption import restore_ignored_signals\n"
            "print(restore_ignored_signals(), flush=True)\n"
            "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(["bash", "-c", f"{SHELL_PREFIX}{sys.executable} -c {shlex.quote(code)}"], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "['SIGTERM']"
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # SLURM signals every process of the step
    proc.wait(timeout=30)
    assert time.monotonic() - t0 < 10  # ended on the SIGTERM, not on a later SIGKILL
    assert restore_ignored_signals() == []  # nothing was ignored in this process
    # the CLI does it for every command (it parses, restores, then runs the command)
    cli = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "from oar.cli import main\n"
           "main(['methods', '--config', 'config/smoke.yaml'])\n"
           "print('TERM', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    out = subprocess.run([sys.executable, "-c", cli], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "TERM True" in out.stdout, out.stderr[-2000:]
