"""A training run's set-up (oar.trainer.setup.setup_run): what it starts is closed when the run ends,
and also when the set-up itself fails part-way; a StepObserver sees every phase of every step."""

from __future__ import annotations

import pytest

from helpers import ROOT, small_overrides
from oar.config.load import load_config
from oar.trainer.loop import train
from oar.trainer.step import STEP_EVENTS, EndAfter, StepObserver
from oar.trainer.update import UPDATE_EVENTS


def _spy_on_parts(monkeypatch) -> dict[str, list]:
    """Record the run's reward pools and engines as set-up makes them, and their closing."""
    import oar.reward.pool
    import oar.trainer.setup as setup

    seen: dict[str, list] = {"pools": [], "pools_closed": [], "engines": [], "engines_closed": []}

    def recorded(make, kind):
        def wrapper(*a, **k):
            part = make(*a, **k)
            close = part.close
            seen[kind].append(part)
            part.close = lambda: (seen[f"{kind}_closed"].append(part), close())[1]
            return part
        return wrapper

    monkeypatch.setattr(oar.reward.pool, "RewardPool", recorded(oar.reward.pool.RewardPool, "pools"))
    monkeypatch.setattr(setup, "make_engine", recorded(setup.make_engine, "engines"))
    return seen


def test_a_set_up_that_fails_after_starting_the_engine_closes_it_and_the_reward_pool(tmp_path, monkeypatch):
    import oar.trainer.setup as setup

    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path))
    seen = _spy_on_parts(monkeypatch)

    def broken_tracker(*a, **k):
        raise RuntimeError("the tracker failed to start")

    monkeypatch.setattr(setup, "_tracker", broken_tracker)  # after the engine, before the held-out evaluation
    with pytest.raises(RuntimeError, match="tracker failed"):
        train(cfg, "grpo", 0, tmp_path / "run", progress=False)
    assert len(seen["engines"]) == 1 and seen["engines_closed"] == seen["engines"]
    assert len(seen["pools"]) == 1 and seen["pools_closed"] == seen["pools"]


def test_an_observer_sees_every_phase_and_ends_the_invocation_as_a_kill_would(tmp_path, monkeypatch):
    cfg = load_config(ROOT / "config" / "config.yaml", small_overrides(tmp_path, train={"steps": 3, "save_every": 1}))
    seen = _spy_on_parts(monkeypatch)

    class Recorder(EndAfter):
        def __init__(self):
            super().__init__(2)
            self.events, self.seen = [], []

        def event(self, name):
            self.events.append(name)

        def after_step(self, step, metrics):
            self.seen.append((step, metrics["reward"]))
            return super().after_step(step, metrics)

    obs = Recorder()
    assert train(cfg, "grpo", 0, tmp_path / "run", progress=False, observer=obs) == {"interrupted_at": 2}
    assert [s for s, _ in obs.seen] == [0, 1]
    phases = [e for e in obs.events if e in STEP_EVENTS]
    assert phases == list(STEP_EVENTS) * 2  # rollout, credit, update: each started and ended, per step
    assert {e for e in obs.events if e not in STEP_EVENTS} <= set(UPDATE_EVENTS)
    assert obs.events.count("step") >= 2  # at least one optimizer step per training step
    # ended as by a kill: the step-2 checkpoint (save_every 1) holds both steps; the rest resumes from it
    assert seen["engines_closed"] == seen["engines"] and seen["pools_closed"] == seen["pools"]
    summary = train(cfg, "grpo", 0, tmp_path / "run", progress=False, observer=StepObserver())
    assert summary["steps"] == 3 and summary["final"]["reward"] is not None
