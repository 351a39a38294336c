"""Token importance for OAR (docs/methods.md, 4.2 OAR-P to 4.4 Bi-Level reshaping): OAR-P and OAR-G.

Both score the reasoning positions of an outcome probe (:mod:`oar.credit.probe`) by how much they
move the model's distribution over its own final answer ("outcome"). Three outcome modes:

- ``last``: the next-token distribution at ``probe.last_index`` (end of prompt + reasoning +
  conclude);
- ``answer_mean``: the logits averaged over the positions that predict answer tokens, then softmax;
- ``answer_joint``: the scalar ``phi`` = mean log-prob of the answer tokens.

Importance is ``KL(P_orig || P_changed)`` for the first two and ``phi_orig - phi_changed`` for
``answer_joint`` (a signed difference, as in the method description).

- :func:`perturbation_importance` (OAR-P, :mod:`oar.credit.importance.oar_p`): one neutral-token
  replacement per reasoning token, prefix KV cache reused;
- :func:`gradient_importance` (OAR-G, :mod:`oar.credit.importance.oar_g`): gradient x input
  saliency after a small embedding perturbation, per-response noise, optionally averaged over
  ``draws`` or integrated along a path from a ``baseline``.

The registered estimators ``oar_p`` and ``oar_g`` turn scores into bi-level weights
(:func:`oar.credit.reshape.bilevel_weights`) and token advantages ``A_i * w_{i,t}``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import SEQ_OPTIONS
from oar.credit.reshape import RESHAPE_OPTIONS
from oar.credit.importance.common import MODES, check_mode, option_defaults, option_names, options_from, outcome
from oar.credit.importance.oar_g import (
    BASELINES,
    OarGOptions,
    draw_noise,
    gradient_importance,
    mix_seed,
    noise_keys,
    oar_g_scores,
)
from oar.credit.importance.oar_p import (
    TIES,
    OarPOptions,
    oar_p_scores,
    oar_p_tie_ids,
    perturbation_importance,
    value_tie_ids,
)
from oar.credit.probe import DEFAULT_CONCLUDE, Probe, build_probe

__all__ = [
    "MODES",
    "BASELINES",
    "outcome",
    "perturbation_importance",
    "value_tie_ids",
    "TIES",
    "gradient_importance",
    "draw_noise",
    "mix_seed",
    "noise_keys",
    "OarPOptions",
    "OarGOptions",
    "IMPORTANCE_OPTIONS",
    "importance_options",
    "option_names",
    "option_defaults",
    "options_from",
    "oar_p_scores",
    "oar_p_tie_ids",
    "oar_g_scores",
    "oar_p_estimator",
    "oar_g_estimator",
    "importance_scores",
    "OAR_G_OPTIONS",
]


# --------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------

#: The options type of each importance method (one per method: its scoring options and their defaults).
IMPORTANCE_OPTIONS: dict[str, type] = {"oar_p": OarPOptions, "oar_g": OarGOptions}


def importance_options(name: str, options: Mapping[str, Any], where: str | None = None) -> Any:
    """The :data:`IMPORTANCE_OPTIONS` of method ``name`` from the scoring keys of ``options`` (an
    estimator's options: the sequence-advantage and reshaping keys are left out).

    Raises:
        ValueError: an invalid value (naming ``where``, default ``estimator '<name>'``).
    """
    cls = IMPORTANCE_OPTIONS[name]
    keys = set(option_names(cls))
    return options_from(cls, {k: v for k, v in options.items() if k in keys}, where or f"estimator {name!r}")


def importance_scores(
    name: str, batch: CreditBatch, options: dict[str, Any], seq_adv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """OAR-P's (``name="oar_p"``) or OAR-G's (``"oar_g"``) importance scores of a batch.

    Only responses with an answer and ``seq_adv != 0`` are scored (the others keep GRPO's weight).

    Args:
        batch: the step's :class:`oar.credit.CreditBatch` (``model``, ``tokenizer``, ``prompt_ids`` set).
        options: the estimator's options (as :func:`oar_p_estimator` / :func:`oar_g_estimator`).
        seq_adv: ``(B,)`` sequence advantages.

    Returns:
        ``(scores, reasoning, active, stats)``: ``(B, T)`` non-negative scores and ``(B, T)`` float
        mask of the reasoning tokens, both in response coordinates; ``(B,)`` bool scored rows;
        timing and coverage statistics.
    """
    for field in ("model", "tokenizer", "prompt_ids"):
        if getattr(batch, field) is None:
            raise ValueError(f"estimator {name!r}: CreditBatch.{field} is None (the OAR probe needs it)")
    opts = importance_options(name, options)
    B, T = batch.response_ids.shape
    t_probe = time.perf_counter()
    probe = build_probe(
        batch.tokenizer,
        batch.prompt_ids,
        batch.response_ids,
        conclude=DEFAULT_CONCLUDE if opts.conclude is None else opts.conclude,
        prompt_mask=batch.prompt_mask,
        response_mask=batch.response_mask,
    )
    # Only responses with an answer and a nonzero advantage need importance scores.
    active = probe.has_answer & (seq_adv.to(probe.has_answer.device) != 0)
    scores = torch.zeros_like(probe.input_ids, dtype=torch.float32)
    t0 = time.perf_counter()
    probe_seconds = t0 - t_probe
    if bool(active.any()):
        s = _active_scores(batch, probe, active, opts)
        if opts.mode == "answer_joint":
            # phi differences are signed; the reshaping uses the size of the influence
            # (our choice, like the KL modes and OAR-G's |.|; bilevel_weights needs s > -1).
            s = s.abs()
        rows = active.nonzero().flatten()
        scores[rows, scores.shape[1] - s.shape[1] :] = s
    stats = {
        "importance_s": float(time.perf_counter() - t0),
        "probe_s": float(probe_seconds),
        "probe_fraction": float(probe.has_answer.float().mean()) if B else 0.0,
        "scored_fraction": float(active.float().mean()) if B else 0.0,
    }
    return probe.to_response(scores, T), probe.to_response(probe.reasoning_mask.float(), T), active, stats


def _active_scores(batch: CreditBatch, probe: Probe, active: torch.Tensor, opts: Any) -> torch.Tensor:
    """The method's scores of the ``active`` rows of the batch's probe (:func:`oar_p_scores` with
    the tie ids of the whole batch; :func:`oar_g_scores` with per-response noise: base seed from
    ``(seed, step)``, a key per (group, rank in group))."""
    sub = probe.select(active)
    if isinstance(opts, OarPOptions):
        ties = oar_p_tie_ids(batch.tokenizer, probe, batch.response_ids, batch.response_mask, opts)
        ties = None if ties is None else ties.to(probe.input_ids.device)[active]
        return oar_p_scores(batch.model, sub, opts, tie_ids=ties)
    seed = opts.seed if opts.seed is not None else batch.seed
    if seed is not None and batch.step is not None:
        seed = mix_seed(int(seed), int(batch.step))
    keys = noise_keys(batch.group_ids)[active.cpu()]
    return oar_g_scores(batch.model, sub, replace(opts, seed=None if seed is None else int(seed)), row_keys=keys)


#: Options of OAR-G (and of the nulls built on its scores): the sequence advantage's, the reshaping's
#: and :class:`OarGOptions`'.
OAR_G_OPTIONS = SEQ_OPTIONS + RESHAPE_OPTIONS + option_names(OarGOptions)
#: Options of OAR-P.
OAR_P_OPTIONS = SEQ_OPTIONS + RESHAPE_OPTIONS + option_names(OarPOptions)


def _oar_estimator(name: str, batch: CreditBatch, options: dict[str, Any]) -> CreditResult:
    from oar.credit.reshape import reshaped_credit

    allowed = OAR_P_OPTIONS if name == "oar_p" else OAR_G_OPTIONS
    return reshaped_credit(name, batch, options, allowed, lambda A: importance_scores(name, batch, options, A))


@register_estimator("oar_p", needs_model=True)
def oar_p_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """OAR-P: GRPO advantage reshaped by perturbation importance (METHODS 4.2, 4.4).

    Options: the sequence advantage's (``norm_by_std``, ``eps``), the Bi-Level reshaping's
    (``quantile``, ``beta``, ``floor``, ``preserve_mass``: :data:`oar.credit.reshape.RESHAPE_OPTIONS`)
    and :class:`OarPOptions` (``mode``, ``chunk_size``, ``conclude``: None for
    :data:`oar.credit.probe.DEFAULT_CONCLUDE`, ``tie``: ``values`` for the copy-aware perturbation
    that masks a number with its later restatements, :data:`TIES`), defaults there.

    Weights are 1 on response tokens of rows without an answer or with ``A_i == 0`` (not
    scored), 0 on padding. In ``answer_joint`` mode the reshaping uses
    ``|phi_orig - phi_masked|``. Stats: ``importance_s`` (model time), ``probe_s`` (probe
    construction), ``probe_fraction`` (share of responses with an answer), ``scored_fraction``
    (share actually scored).
    """
    return _oar_estimator("oar_p", batch, options)


@register_estimator("oar_g", needs_model=True)
def oar_g_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """OAR-G: GRPO advantage reshaped by gradient x input saliency (METHODS 4.3, 4.4).

    Options: the sequence advantage's and the reshaping's (as ``oar_p``) and :class:`OarGOptions`
    (``mode``, ``noise_std``, ``seed``: None for ``CreditBatch.seed``, and the global RNG
    without it; combined with ``CreditBatch.step`` when present, ``chunk_size``, ``chunk_tokens``,
    ``draws``, ``baseline``, ``conclude``), defaults there. Each response's noise is drawn from its
    own generator (:func:`oar.credit.importance.noise_keys`), so its scores do not depend on the
    batch's chunking.
    """
    return _oar_estimator("oar_g", batch, options)
