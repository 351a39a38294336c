"""The training run's typed settings, built once from the validated config.

``oar train`` reads its sections through these frozen dataclasses, as the attribution benchmark
reads ``attribution:`` through ``AttributionSettings``: :class:`TrainSettings` (``train:``, with
:class:`HeldoutSettings`, :class:`FSDPSettings` and :class:`PreemptionSettings` for its nested
sections), :class:`RolloutSettings` (``rollout:``), :class:`RewardSettings` (``reward:``) and
:class:`EvalSettings` (``eval:``, which the held-out evaluation samples by too); the warm-start SFT
reads :class:`SFTSettings` (``sft:``).

The schema stays the one home of every default: a section the config leaves partly out (tests,
benchmarks, ``gpu_check``) is completed from ``section_defaults``, and each dataclass names exactly
the schema's keys of its section (``tests/test_settings.py`` holds them equal), so a new key is one
schema entry plus one field.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from oar.config.source import deep_merge
from oar.config.validate import section_defaults

if TYPE_CHECKING:
    from oar.reward.pool import RewardPool

__all__ = [
    "EvalSettings",
    "FSDPSettings",
    "HeldoutSettings",
    "PreemptionSettings",
    "RewardSettings",
    "RolloutSettings",
    "SFTSettings",
    "TrainSettings",
    "TransferSettings",
    "settings_from_section",
]

S = TypeVar("S")


@dataclass(frozen=True)
class HeldoutSettings:
    """``train.heldout``: the in-training held-out evaluation (``every`` 0: none)."""

    every: int
    size: int
    samples: int
    benchmark: str


@dataclass(frozen=True)
class FSDPSettings:
    """``train.fsdp``: FSDP2's options (``train.strategy: fsdp``)."""

    cpu_offload: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class PreemptionSettings:
    """``train.preemption``: how a signal stops a run and when the checkpoint schedule saves early."""

    signal_seconds: int | None
    step_seconds: float
    write_gb_per_s: float
    margin_seconds: float
    repeat_seconds: float


@dataclass(frozen=True)
class TrainSettings:
    """``train:``: the loop's length and batch, the update's layout, the optimizer and its schedule,
    checkpoints, the parallel strategy and dtypes."""

    steps: int
    prompts_per_step: int
    mini_batch_size: int
    micro_batch_size: int
    packing: str
    micro_batch_tokens: int | None
    pack_length: int | None
    ppo_epochs: int
    skip_zero_advantage: bool
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    schedule: str
    grad_clip: float
    save_every: int
    keep_checkpoints: int
    save_every_minutes: float | None
    preemption: PreemptionSettings
    max_nonfinite: int
    init: str | None
    strategy: str
    compute_dtype: str
    master_dtype: str
    gradient_checkpointing: bool
    heldout: HeldoutSettings
    fsdp: FSDPSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "TrainSettings":
        return settings_from_section(cls, "train", config)


@dataclass(frozen=True)
class RolloutSettings:
    """``rollout:``: the engine and how it samples (``n`` responses per prompt)."""

    engine: str
    sampler: str
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    batch_invariant: bool
    sleep_mode: bool
    vllm: Mapping[str, Any]  # keyword arguments for vllm.LLM, passed on as they are

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "RolloutSettings":
        return settings_from_section(cls, "rollout", config)

    def sampling(self) -> dict[str, Any]:
        """The keyword arguments of an engine's ``generate``: ``n``, ``temperature``, ``top_p``, ``max_new_tokens``."""
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens)


@dataclass(frozen=True)
class TransferSettings:
    """``eval.transfer``: benchmarks evaluated only on the start model and the methods listed."""

    benchmarks: tuple[Mapping[str, Any], ...]
    methods: tuple[str, ...]


@dataclass(frozen=True)
class EvalSettings:
    """``eval:``: the benchmarks, the engine and how it samples, the reward's bootstrap, transfer."""

    engine: str
    sampler: str
    benchmarks: tuple[Mapping[str, Any], ...]  # entries as the schema's ``benchmark`` definition
    greedy: bool
    samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    chunk_size: int
    bootstrap: int
    transfer: TransferSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "EvalSettings":
        return settings_from_section(cls, "eval", config)


@dataclass(frozen=True)
class SFTSettings:
    """``sft:``: the warm-start SFT (its own loop, optimizer and schedule) and its held-out check."""

    enabled: bool
    steps: int
    batch_size: int
    micro_batch_size: int | None
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    grad_clip: float
    eval_size: int
    max_new_tokens: int
    seed: int
    cache_dir: str | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "SFTSettings":
        return settings_from_section(cls, "sft", config)

    def optimisation(self) -> dict[str, Any]:
        """``oar.trainer.sft.run_sft``'s optimisation keywords: steps, batch size, AdamW and its schedule."""
        return dict(steps=self.steps, batch_size=self.batch_size, lr=self.lr, weight_decay=self.weight_decay,
                    betas=list(self.betas), warmup_steps=self.warmup_steps, grad_clip=self.grad_clip)


@dataclass(frozen=True)
class RewardSettings:
    """``reward:``: each answer check's time limit and the reward pool's worker processes."""

    timeout_s: float
    workers: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "RewardSettings":
        return settings_from_section(cls, "reward", config)

    def pool(self) -> "RewardPool":
        """A reward pool of these settings (its workers start with the first answers it scores); the
        caller owns it and closes it (a training run, an evaluation)."""
        from oar.reward.pool import RewardPool

        return RewardPool(workers=self.workers, timeout_s=self.timeout_s)


def settings_from_section(cls: type[S], section: str, config: Mapping[str, Any]) -> S:
    """``cls`` built from ``config[section]`` completed by the schema's defaults of the section.

    A field whose type is one of this module's dataclasses is built from its nested section; a list
    becomes a tuple and a mapping a read-only view, so the settings do not change after they are built.

    Raises:
        KeyError: naming ``section.key`` where the section lacks a key the dataclass has (a schema
            entry without a default: the config was not validated).
    """
    merged = deep_merge(section_defaults(section), dict(config.get(section) or {}))
    return _build(cls, merged, section)


def _build(cls: type[S], values: Mapping[str, Any], where: str) -> S:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            raise KeyError(f"{where}.{f.name}: missing (validate the config with oar.config.load.load_config)")
        value = values[f.name]
        nested = _NESTED.get(f.name) if isinstance(value, Mapping) else None
        if nested is not None:
            value = _build(nested, value, f"{where}.{f.name}")
        elif isinstance(value, list):
            value = tuple(float(v) if "float" in str(f.type) and isinstance(v, int) else v for v in value)
        elif str(f.type).startswith("float") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # YAML's 1 for a number setting: the float it means
        elif isinstance(value, Mapping):
            value = types.MappingProxyType(dict(value))
        kwargs[f.name] = value
    return cls(**kwargs)


#: The nested sections' dataclasses, by key.
_NESTED: dict[str, type] = {"heldout": HeldoutSettings, "fsdp": FSDPSettings, "preemption": PreemptionSettings,
                            "transfer": TransferSettings}
