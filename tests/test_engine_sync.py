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
    from oar.models import build_tiny

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
