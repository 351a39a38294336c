"""What the attribution benchmark is asked (:class:`AttributionSettings`, typed, built once from the
validated config) and what it returns (:class:`AttributionResult`), with the responses it scores and
the labels it scores them against.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from oar.attribution.specs import signal_specs
from oar.credit.verifier import TRAINED
from oar.task.grammar import StepCheck, mistake_spans
from oar.task.parsing import ParsedResponse, UNLABELED, token_labels

__all__ = ["KINDS", "AttributionSettings", "AttributionResult"]


#: Kinds of responses of the error-localisation benchmark.
KINDS: tuple[str, ...] = ("sampled", "counterfactual")


def derived_seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()[:4], "big")


@dataclass
class AttributionResponse:
    """One response of the benchmark (sampled or edited): real tokens, text, parse, check."""

    prompt: int  # index into the records
    prompt_ids: list[int]
    ids: list[int]
    reward: float
    text: str
    starts: np.ndarray
    ends: np.ndarray
    parsed: ParsedResponse | None
    check: StepCheck | None
    kind: str = ""
    source: "AttributionResponse | None" = None  # counterfactual: the response it edits
    edit: Any = None


@dataclass
class AttributionResult:
    """Result of :func:`run_attribution`.

    Attributes:
        localisation: one row per (signal, kind) (:func:`oar.attribution.metrics.localisation_columns`).
        stability: one row per (stochastic signal, kind) (:data:`~oar.attribution.metrics.STABILITY_COLUMNS`).
        cost: one row per signal (:data:`~oar.attribution.metrics.COST_COLUMNS`).
        fidelity: pivotal vs filler, one row per signal (:data:`~oar.attribution.metrics.FIDELITY_COLUMNS`).
        per_response: one row per scored response (kind, prompt, texts, metrics).
        summary: counts, settings and timings.
    """

    localisation: Any
    stability: Any
    cost: Any
    fidelity: Any
    per_response: Any
    summary: dict = field(default_factory=dict)


def located_signals(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``attribution.signals`` with a ``step_verifier`` signal's ``verifier: trained`` (its default) made
    the folder of the verifier the config trains (:attr:`oar.config.tree.ResultsTree.verifier_model`)."""
    from oar.config.tree import ResultsTree

    out = []
    for sig in config["attribution"]["signals"]:
        if sig.get("kind") == "step_verifier" and sig.get("verifier") in (None, TRAINED):
            sig = {**sig, "verifier": ResultsTree.of(config).verifier_model}
        out.append(sig)
    return out


def pad_rows(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts and right-padded responses: ``(B, P)`` ids and mask, ``(B, T)`` ids and mask
    (:func:`oar.rollout.base.pad_batch`, the rollout's layout)."""
    from oar.rollout.base import pad_batch

    return pad_batch(prompts, responses, pad_id)


def mistake_labels(r: AttributionResponse, T: int) -> np.ndarray:
    """``(T,)`` labels: 1 on the mistake's result tokens, 0 on the other steps' tokens, -1 elsewhere."""
    out = np.full(T, UNLABELED, dtype=np.int64)
    i = r.check.mistake_step if r.check is not None else None
    if r.parsed is None or i is None:
        return out
    pos, neg = mistake_spans(r.parsed, i)
    lab = token_labels(r.starts, r.ends, pos, neg, len(r.text))
    out[: len(lab)] = lab
    return out


def fidelity_labels(r: AttributionResponse, T: int) -> np.ndarray:
    out = np.full(T, UNLABELED, dtype=np.int64)
    if r.parsed is not None:
        lab = token_labels(r.starts, r.ends, r.parsed.pivotal_spans, r.parsed.filler_spans, len(r.text))
        out[: len(lab)] = lab
    return out


@dataclass(frozen=True)
class AttributionSettings:
    """Every setting of one benchmark run, read from a validated config by :meth:`from_config` (the
    schema holds the defaults; nothing here repeats them).

    Sampling (config ``rollout``): ``n_samples`` (the group size, ``rollout.n``), ``temperature``,
    ``top_p``, ``max_new_tokens``, ``batch_size``, ``sampler``. Task (``task``): ``template`` and ``task_options``
    (``task.synthetic``, the keywords of :func:`oar.data.synthetic.generate`). Reward (``reward``):
    ``reward_timeout_s``, ``reward_workers``. The benchmark (``attribution``): ``n_sampled``,
    ``n_counterfactual`` (wanted responses of each kind), ``max_prompts``, ``prompts_per_round``,
    ``propagated_only``, ``min_steps``, ``max_per_prompt``, ``max_delta``, ``top_k``, ``seed``,
    ``split``, ``signals`` (:func:`oar.attribution.specs.signal_specs`), ``conclude``,
    ``cost_reference``, ``stability``, ``repeats`` (``timing_repeats``). Not config keys:
    ``correct`` / ``wrong`` (reward values; correct when ``> 0``), ``ktae_options`` (see
    :func:`oar.attribution.signals.compute_signals`). A signal's options (OAR-P's chunk size, OAR-G's
    noise, ...) are its own, with the defaults of its kind's options type.
    """

    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    sampler: str
    template: str
    task_options: Mapping[str, Any]
    reward_timeout_s: float
    reward_workers: int | None
    n_sampled: int
    n_counterfactual: int
    max_prompts: int
    prompts_per_round: int
    propagated_only: bool
    min_steps: int
    max_per_prompt: int
    max_delta: int
    top_k: tuple[int, ...]
    seed: int
    split: str
    signals: tuple[Any, ...]
    conclude: str | None
    cost_reference: str
    stability: bool
    repeats: int
    correct: float = 1.0
    wrong: float = 0.0
    ktae_options: Mapping[str, Any] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> "AttributionSettings":
        """The settings of a validated config (:func:`oar.config.load.load_config`), with ``overrides``.

        Raises:
            ValueError: the task is not the synthetic one.
        """
        attr, ro, task, reward = config["attribution"], config["rollout"], config["task"], config["reward"]
        if task["kind"] != "synthetic":
            raise ValueError(f"config: task.kind={task['kind']!r}: the attribution benchmark needs 'synthetic'")
        settings = cls(
            n_samples=int(ro["n"]), temperature=float(ro["temperature"]), top_p=float(ro["top_p"]),
            max_new_tokens=int(ro["max_new_tokens"]), batch_size=int(ro["batch_size"]),
            sampler=str(ro["sampler"]), template=str(task["template"]), task_options=dict(task["synthetic"]),
            reward_timeout_s=float(reward["timeout_s"]), reward_workers=reward["workers"],
            n_sampled=int(attr["n_sampled"]), n_counterfactual=int(attr["n_counterfactual"]),
            max_prompts=int(attr["max_prompts"]), prompts_per_round=int(attr["prompts_per_round"]),
            propagated_only=bool(attr["propagated_only"]), min_steps=int(attr["min_steps"]),
            max_per_prompt=int(attr["max_per_prompt"]), max_delta=int(attr["max_delta"]),
            top_k=tuple(int(k) for k in attr["top_k"]), seed=int(attr["seed"]), split=str(attr["split"]),
            signals=tuple(located_signals(config)), conclude=attr["conclude"], cost_reference=str(attr["cost_reference"]),
            stability=bool(attr["stability"]), repeats=int(attr["timing_repeats"]),
        )
        return replace(settings, **overrides)

    def check(self) -> None:
        """Raise ``ValueError`` for settings the benchmark cannot run."""
        if self.n_samples < 1 or self.max_prompts < 1 or self.prompts_per_round < 1:
            raise ValueError("oar.attribution.run_attribution: n_samples, max_prompts and prompts_per_round must be >= 1")
        if self.n_sampled < 0 or self.n_counterfactual < 0:
            raise ValueError("oar.attribution.run_attribution: n_sampled and n_counterfactual must be >= 0")
        if self.repeats < 1:
            raise ValueError(f"oar.attribution.run_attribution: repeats must be >= 1, got {self.repeats}")

    def as_summary(self, fillers: Sequence[str]) -> dict[str, Any]:
        """The settings as recorded in ``summary.json``."""
        return {
            "split": self.split, "template": self.template, "seed": self.seed, "n_samples": self.n_samples,
            "temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
            "sampler": self.sampler, "n_sampled": self.n_sampled, "n_counterfactual": self.n_counterfactual, "max_prompts": self.max_prompts,
            "prompts_per_round": self.prompts_per_round, "propagated_only": self.propagated_only,
            "min_steps": self.min_steps, "max_per_prompt": self.max_per_prompt, "max_delta": self.max_delta,
            "top_k": list(self.top_k),
            "signals": [{"name": s.name, "kind": s.kind, **dict(s.options)} for s in signal_specs(self.signals)],
            "conclude": self.conclude, "cost_reference": self.cost_reference, "timing_repeats": self.repeats,
            "fillers": list(fillers), "torch_threads": torch.get_num_threads(),
        }


#: What the second computation of a stochastic signal changes (the stability table's comparison).
SEED_KIND = {"oar_g": "noise seed", "mc_value": "continuation seed"}


def seed_kind(spec: Any) -> str:
    """The stability comparison of ``spec``: greedy ``mc_value`` refined by OAR-G varies by OAR-G's noise only."""
    if spec.kind == "mc_value" and spec.options.get("greedy"):
        return SEED_KIND["oar_g"]
    return SEED_KIND.get(spec.kind, "random seed")
