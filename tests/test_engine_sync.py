"""The rollout engines' weight-sync and sleep interface, without vLLM (a stand-in ``llm`` object).

The real vLLM checks are in tests/test_vllm.py (opt-in: ``pytest -m vllm``).
"""

from __future__ import annotations

import pytest
import torch

from oar.rollout import HFEngine, VLLMEngine


class _Tok:
    pad_token_id = 0
    eos_token_id = 2


class FakeLLM:
    """Records the calls VLLMEngine makes; ``reload_weights`` consumes the iterator like vLLM's loader."""

    def __init__(self, *, has_reload: bool = True, fail_after: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.received: list[str] = []
        self.has_reload = has_reload
        self.fail_after = fail_after
        self.on_item = None  # callback(name) run as each item arrives

    def _consume(self, weights) -> None:
        assert not isinstance(weights, (list, tuple, dict)), "weights must be streamed, not materialised"
        for name, t in weights:
            assert isinstance(t, torch.Tensor) and not t.requires_grad
            self.received.append(name)
            if self.on_item is not None:
                self.on_item(name)
            if self.fail_after is not None and len(self.received) == self.fail_after:
                raise AttributeError("boom mid-stream")

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method))
        if not self.has_reload:
            raise AttributeError("'Worker' object has no attribute 'reload_weights'")
        self._consume(kwargs["weights_iterator"])

    def apply_model(self, fn):
        self.calls.append(("apply_model",))
        llm = self

        class _Model:
            def load_weights(self, weights):
                llm._consume(weights)

        return fn(_Model())

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))


def _engine(llm: FakeLLM, *, sleep_mode: bool = False) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vllm.LLM: drive the engine with the stand-in
    engine._setup(llm, _Tok(), sleep_mode=sleep_mode)
    return engine


def _gathered(names, log):
    """Like the trainer's FSDP gather: each full tensor is produced only when the consumer asks for it."""
    for name in names:
        log.append(name)
        yield name, torch.randn(3, 2, requires_grad=True)  # detached by the engine


NAMES = [f"model.layers.{i}.{p}.weight" for i in range(3) for p in ("q_proj", "k_proj", "mlp")] + ["lm_head.weight"]


def test_engines_say_whether_they_need_weights():
    assert VLLMEngine.needs_weights is True
    assert HFEngine.needs_weights is False
    from oar.models.tiny import build_tiny

    model, tok = build_tiny(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    hf = HFEngine(model, tok)
    assert hf.needs_weights is False
    produced: list[str] = []
    hf.sync_weights(_gathered(NAMES, produced))  # a no-op that does not even consume the stream
    hf.sleep()
    hf.wake_up()
    assert produced == []


@pytest.mark.parametrize("has_reload", [True, False], ids=["reload_weights", "apply_model"])
def test_vllm_engine_streams_weights_lazily_in_order(has_reload):
    llm = FakeLLM(has_reload=has_reload)
    produced: list[str] = []
    # lazy: when the i-th item arrives, the producer has made exactly i items (none gathered ahead)
    llm.on_item = lambda name: _assert_lazy(produced, llm.received)
    engine = _engine(llm)
    engine.sync_weights(_gathered(NAMES, produced))
    assert llm.received == NAMES and produced == NAMES
    expected = [("collective_rpc", "reload_weights")] + ([] if has_reload else [("apply_model",)])
    assert llm.calls == expected + [("reset_prefix_cache",)]


def _assert_lazy(produced, received):
    assert len(produced) == len(received), (produced, received)


def test_vllm_engine_does_not_replay_a_partly_consumed_stream():
    llm = FakeLLM(fail_after=2)
    with pytest.raises(AttributeError, match="mid-stream"):
        _engine(llm).sync_weights(_gathered(NAMES, []))
    assert ("apply_model",) not in llm.calls


def test_vllm_engine_accepts_a_module():
    lin = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    llm = FakeLLM()
    _engine(llm).sync_weights(lin)
    assert llm.received == list(lin.state_dict())


def test_vllm_engine_sleep_wake_sync_order():
    llm = FakeLLM()
    engine = _engine(llm, sleep_mode=True)
    engine.sleep()
    engine.sleep()  # idempotent
    engine.wake_up()
    engine.sync_weights(_gathered(NAMES, []))
    # weights mapped back first, loaded, and only then the KV cache re-allocated (no stale prefix blocks)
    assert llm.calls == [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("collective_rpc", "reload_weights"),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]
    assert engine._asleep == set()


def test_vllm_engine_sync_wakes_slept_weights_first():
    """huggingface/trl#5312: weights written while asleep (or overwritten on wake) give stale rollouts."""
    llm = FakeLLM()
    engine = _engine(llm, sleep_mode=True)
    engine.sleep()
    engine.sync_weights(_gathered(NAMES, []))  # no explicit wake_up
    assert [c[0] for c in llm.calls[:3]] == ["sleep", "wake_up", "collective_rpc"]
    assert llm.calls[1] == ("wake_up", ("weights",))
    assert ("wake_up", ("kv_cache",)) in llm.calls[3:]


def test_vllm_engine_without_sleep_mode_never_sleeps():
    llm = FakeLLM()
    engine = _engine(llm, sleep_mode=False)
    engine.sleep()
    engine.wake_up()
    assert llm.calls == []


# ------------------------------------------------------------------- placement of training engines
class _FakeVllm:
    """A stand-in ``vllm`` module whose ``LLM`` records its arguments and seeds the global generators
    (as vLLM's start-up does)."""

    def __init__(self) -> None:
        self.built: list[dict] = []
        fake = self

        class LLM(FakeLLM):
            def __init__(self, **kwargs):
                super().__init__()
                fake.built.append(kwargs)
                torch.manual_seed(int(kwargs.get("seed") or 0))

        self.LLM = LLM


@pytest.fixture
def fake_vllm(monkeypatch):
    import sys

    fake = _FakeVllm()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return fake


@pytest.mark.parametrize("rank, world", [(0, 1), (0, 2), (1, 2), (5, 8)])
def test_a_training_engine_per_process_uses_the_external_launcher(fake_vllm, monkeypatch, rank, world):
    """With several training processes each builds its engine with vLLM's external_launcher (its
    worker in the process, on cuda:{LOCAL_RANK}) and its own seed; one process keeps vLLM's default
    executor and the run seed; an evaluation engine (not colocated) never takes the launcher. The
    trainer's random generators are as they were before the engine's start-up."""
    import oar.rollout.vllm as mod
    from oar.core.seeds import rank_seed

    monkeypatch.setattr(mod, "_process_group", lambda: (rank, world))
    env = {}
    monkeypatch.setattr(mod.os, "environ", env)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    engine = VLLMEngine("/m", _Tok(), seed=7, colocated=True, dtype="float32")
    assert torch.equal(torch.rand(1), expected_next)  # vLLM's seeding did not leak into the trainer
    built = fake_vllm.built[-1]
    assert built["seed"] == rank_seed(7, rank) and built["model"] == "/m" and built["dtype"] == "float32"
    if world > 1:
        assert built["distributed_executor_backend"] == "external_launcher"
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
    else:
        assert "distributed_executor_backend" not in built and rank_seed(7, 0) == 7
    assert engine.placement["seed"] == built["seed"]
    VLLMEngine("/m", _Tok(), seed=7)  # evaluation: vLLM's default executor and the run seed
    assert "distributed_executor_backend" not in fake_vllm.built[-1] and fake_vllm.built[-1]["seed"] == 7


def test_rank_seeds_differ_between_ranks_and_runs():
    from oar.core.seeds import rank_seed

    seeds = {rank_seed(s, r) for s in range(4) for r in range(8)}
    assert len(seeds) == 32 and all(0 <= x < 2**32 for x in seeds)


@pytest.mark.parametrize("env, kwargs, text", [
    ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, {}, "VLLM_ENABLE_V1_MULTIPROCESSING=1 (environment) runs vLLM's "
                                                  "engine core in another process"),
    ({}, {"distributed_executor_backend": "mp"}, "rollout.vllm.distributed_executor_backend: 'mp' cannot take"),
    ({}, {"tensor_parallel_size": 2}, "rollout.vllm.tensor_parallel_size: 2 cannot take the weight sync"),
    ({}, {"data_parallel_size": 4}, "rollout.vllm.data_parallel_size: 4 cannot take"),
])
def test_settings_the_sync_cannot_work_with_are_refused_at_engine_start(fake_vllm, monkeypatch, env, kwargs, text):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:
        VLLMEngine("/m", _Tok(), colocated=True, **kwargs)
    assert str(e.value).startswith("rollout.engine vllm: ") and text in str(e.value) and "\n" not in str(e.value)
    assert fake_vllm.built == []  # refused before vLLM starts
    VLLMEngine("/m", _Tok(), **kwargs)  # an evaluation engine is never synced: it may run them
    assert fake_vllm.built[-1] == {"model": "/m", "enable_prefix_caching": True, "seed": 0, **kwargs}


def test_a_multiprocessing_vllm_fails_the_weight_sync_as_refused(monkeypatch):
    """What the refusal prevents: with the engine core in another process vLLM serialises
    collective_rpc's arguments, and a generator of tensors cannot be (vLLM 0.32.0's msgpack encoder
    raises TypeError); the sync made no progress the trainer could see."""
    class MultiprocessLLM(FakeLLM):
        def collective_rpc(self, method, kwargs=None):
            import pickle

            pickle.dumps(kwargs)  # the engine-core client's encoder, pickle fallback

    engine = VLLMEngine.__new__(VLLMEngine)
    engine._setup(MultiprocessLLM(), _Tok(), sleep_mode=False)
    with pytest.raises(TypeError, match="generator"):
        engine.sync_weights(torch.nn.Linear(2, 2))


def test_close_shuts_the_engine_core_down_once():
    calls = []

    class Core:
        def shutdown(self):
            calls.append("shutdown")

    llm = FakeLLM()
    llm.llm_engine = type("E", (), {"engine_core": Core()})()
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._setup(llm, _Tok(), sleep_mode=False)
    engine.close()
    assert calls == ["shutdown"]
    assert HFEngine.close(object.__new__(HFEngine)) is None  # nothing to release
