"""OAR-P: perturbation importance (docs/methods.md, 4.2 OAR-P: perturbation).

:func:`perturbation_importance` replaces one reasoning token at a time by a neutral token. Since a
causal model's positions before ``t`` do not see token ``t``, the default path runs the
unperturbed probe once with a KV cache and, for each chunk of perturbed copies (sorted by ``t``),
reuses the cached keys/values of positions ``< t0`` (``t0`` = smallest ``t`` in the chunk) and
runs only positions ``>= t0``. ``naive=True`` runs every perturbed copy in full (reference
implementation; the two agree to float rounding).

Padding: the probe is left-padded and every row's answer ends at the last column, so a perturbed
copy at ``t`` computes no right padding, and its left padding (columns before the row's first real
token, all ``<= t``) lies in the cached prefix, not in the computed queries, except for columns
``[t0, t)`` of a chunk whose copies start at different ``t`` (the chunk's spread, a few columns:
copies are sorted by ``t`` and many rows share each column). ``benchmarks/bench_importance.py``
prints the query positions run against the ideal ``sum (L - t)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from oar.credit.importance.common import (
    answered,
    check_mode,
    divergence,
    eval_mode,
    logits_to_keep,
    logits_tail,
    make_cache,
    model_device,
    plain_cache_layers,
    warn_naive_fallback,
    outcome,
)
from oar.credit.probe import Probe

__all__ = ["TIES", "OarPOptions", "oar_p_scores", "oar_p_tie_ids", "perturbation_importance", "value_tie_ids"]

#: OAR-P's perturbation: ``none`` (one token at a time) or ``values`` (copy-aware: a number token
#: together with the later restatements of the same number, :func:`value_tie_ids`).
TIES: tuple[str, ...] = ("none", "values")


@dataclass(frozen=True)
class OarPOptions:
    """OAR-P's scoring options, the one place their defaults are written (the ``oar_p`` estimator's
    and the attribution benchmark's ``oar_p`` signals').

    Attributes:
        mode: outcome mode (:data:`oar.credit.importance.MODES`).
        chunk_size: sequences per forward (:func:`perturbation_importance`).
        conclude: the probe's conclude string; None: the caller's (the trainer's
            :data:`oar.credit.probe.DEFAULT_CONCLUDE`, the benchmark's ``attribution.conclude``).
        tie: :data:`TIES`; ``values``: the copy-aware perturbation (:func:`value_tie_ids`).
    """

    mode: str = "last"
    chunk_size: int = 128
    conclude: str | None = None
    tie: str = "none"

    def __post_init__(self) -> None:
        check_mode(self.mode, "OarPOptions")
        if self.tie not in TIES:
            raise ValueError(f"oar.credit.importance.OarPOptions: tie must be one of {list(TIES)}, got {self.tie!r}")
        object.__setattr__(self, "chunk_size", int(self.chunk_size))


def oar_p_tie_ids(tokenizer: Any, probe: Probe, response_ids: torch.Tensor, response_mask: torch.Tensor,
                  options: OarPOptions) -> torch.Tensor | None:
    """The tie ids OAR-P's ``options`` need on ``probe`` (:func:`value_tie_ids`; None with ``tie: none``)."""
    if options.tie != "values":
        return None
    return value_tie_ids(tokenizer, probe, response_ids, response_mask)


def oar_p_scores(model: torch.nn.Module, probe: Probe, options: OarPOptions,
                 tie_ids: torch.Tensor | None = None) -> torch.Tensor:
    """OAR-P's scores of ``probe`` under ``options`` (:func:`perturbation_importance`), the scorer of
    the ``oar_p`` estimator and of the benchmark's ``oar_p`` signals.

    Args:
        tie_ids: ``(B, L')`` from :func:`oar_p_tie_ids` for the probe's rows, right-aligned with the
            probe (``L' >= L``: a probe of some rows may have dropped leading pad columns), any device.

    Returns:
        ``(B, L)`` float32 on the probe's device.
    """
    t = None
    if tie_ids is not None:
        t = tie_ids.to(probe.input_ids.device)[:, tie_ids.shape[1] - probe.input_ids.shape[1]:]
    return perturbation_importance(model, probe, mode=options.mode, chunk_size=options.chunk_size, tie_ids=t)

#: A number as written in a response (its digits; a sign is not part of the value).
_NUMBER = re.compile(r"\d+")



def perturbation_importance(
    model: torch.nn.Module,
    probe: Probe,
    *,
    mode: str = OarPOptions.mode,
    mask_token_id: int | None = None,
    chunk_size: int = OarPOptions.chunk_size,
    naive: bool = False,
    tie_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """OAR-P: ``I_t = KL(P_orig || P_masked_t)`` (or ``phi_orig - phi_masked_t``) per reasoning token.

    For every reasoning position ``t`` of every answered row, a copy of the probe with token ``t``
    replaced by ``mask_token_id`` is run under ``torch.no_grad``. Rows are processed in groups of
    at most ``chunk_size`` (their unperturbed forward and KV cache), perturbed copies in chunks of
    at most ``chunk_size`` sequences, so memory is bounded by ``chunk_size`` sequences of length
    ``L`` (plus the group's cache).

    Args:
        model: causal LM (Hugging Face interface: ``attention_mask``, ``position_ids``, cache).
        probe: the outcome probe (rows without an answer get zeros and cost nothing).
        mode: ``last`` (default) | ``answer_mean`` | ``answer_joint``.
        mask_token_id: the neutral token; default ``probe.pad_token_id``.
        chunk_size: maximum number of sequences per forward.
        naive: run each perturbed copy in full instead of reusing the prefix KV cache. The cached
            path needs a plain full-attention ``DynamicCache`` (Llama/Qwen2-like models); for
            other caches it warns and falls back to the naive path.
        tie_ids: ``(B, L)`` long, probe-aligned, or None. The tied (copy-aware) perturbation: the
            copy for position ``t`` also masks every later reasoning position ``s > t`` with
            ``tie_ids[s] == tie_ids[t] != 0`` (e.g. :func:`value_tie_ids`: the later restatements
            of the value at ``t``), so a restated wrong value cannot keep the answer in place.

    Returns:
        ``(B, L)`` float32 scores on the probe's device, 0 where ``probe.reasoning_mask`` is 0.
    """
    check_mode(mode, "perturbation_importance")
    if chunk_size < 1:
        raise ValueError(f"oar.credit.importance.perturbation_importance: chunk_size must be >= 1, got {chunk_size}")
    mask_id = probe.pad_token_id if mask_token_id is None else int(mask_token_id)
    scores = torch.zeros(probe.input_ids.shape, dtype=torch.float32, device=probe.input_ids.device)
    rows_all, sub_all = answered(probe)
    if rows_all.numel() == 0 or not bool(sub_all.reasoning_mask.any()):
        return scores
    dev = model_device(model)
    with eval_mode(model), torch.no_grad():
        for g0 in range(0, rows_all.numel(), chunk_size):
            rows = rows_all[g0 : g0 + chunk_size]
            sub = probe.select(rows).to(dev)
            ties = None if tie_ids is None else _select_ties(probe, tie_ids, rows, sub.input_ids.shape[1]).to(dev)
            sc = _oar_p_group(model, sub, mode=mode, mask_id=mask_id, chunk_size=chunk_size, naive=naive, ties=ties)
            # the group's probe may have dropped leading pad columns: align on the right
            scores[rows, scores.shape[1] - sc.shape[1] :] = sc.to(scores.device)
    return scores * probe.reasoning_mask


def _select_ties(probe: Probe, tie_ids: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """``(len(rows), width)``: ``tie_ids`` of ``rows`` with the leading columns :meth:`Probe.select`
    drops dropped too (``width``: the columns of ``probe.select(rows)``, which the caller has)."""
    if tie_ids.shape != probe.input_ids.shape:
        raise ValueError(f"perturbation_importance: tie_ids shape {tuple(tie_ids.shape)} != probe shape "
                         f"{tuple(probe.input_ids.shape)}")
    return tie_ids.to(probe.input_ids.device)[rows][:, tie_ids.shape[1] - width :]


def value_tie_ids(tokenizer: Any, probe: Probe, response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` long probe-aligned tie ids: the tokens of every number written in a response's
    reasoning share an id with every other occurrence of the same number in that response (ids
    from 1, per row), 0 elsewhere. With :func:`perturbation_importance`'s ``tie_ids`` the copy
    that masks a value also masks its later restatements.

    In ``3+4=7, 7*2=14`` the two 7s share an id; 3, 4, 2 and 14 have one each.
    """
    from oar.task.parsing import token_char_spans

    B, T = response_ids.shape
    ties = torch.zeros((B, T), dtype=torch.long)
    for b in range(B):
        ids = response_ids[b][response_mask[b].bool()].tolist()
        text, starts, ends = token_char_spans(tokenizer, ids)
        by_value: dict[str, int] = {}
        for m in _NUMBER.finditer(text):
            vid = by_value.setdefault(m.group(0), len(by_value) + 1)
            hit = (starts < m.end()) & (ends > m.start())
            ties[b, : len(ids)][torch.from_numpy(hit)] = vid
    pm = probe.position_map.cpu()
    out = torch.where(pm >= 0, ties.gather(1, pm.clamp(min=0, max=T - 1)), torch.zeros_like(pm))
    return (out * probe.reasoning_mask.cpu().long()).to(probe.input_ids.device)


def _oar_p_group(
    model: torch.nn.Module, sub: Probe, *, mode: str, mask_id: int, chunk_size: int, naive: bool,
    ties: torch.Tensor | None = None,
) -> torch.Tensor:
    """OAR-P scores ``(N, L)`` of a probe whose rows all have an answer (on the model device)."""
    N, L = sub.input_ids.shape
    pos = sub.position_ids
    keep = logits_to_keep(sub)
    tail = L - keep
    logits, cache = logits_tail(
        model,
        keep,
        input_ids=sub.input_ids,
        attention_mask=sub.attention_mask,
        position_ids=pos,
        use_cache=not naive,
    )
    orig = outcome(logits, tail, sub.input_ids, sub.answer_mask, sub.last_index, mode)
    kv = None
    if not naive:
        kv = plain_cache_layers(cache)
        if kv is None:
            warn_naive_fallback("perturbation_importance", stacklevel=3)
    del cache

    r_idx, t_idx = sub.reasoning_mask.nonzero(as_tuple=True)
    order = torch.argsort(t_idx, stable=True)
    r_idx, t_idx = r_idx[order], t_idx[order]
    out = torch.zeros((N, L), dtype=torch.float32, device=sub.input_ids.device)
    for c0 in range(0, r_idx.numel(), chunk_size):
        r = r_idx[c0 : c0 + chunk_size]
        t = t_idx[c0 : c0 + chunk_size]
        n = r.numel()
        ids = sub.input_ids[r].clone()
        ids[torch.arange(n, device=ids.device), t] = mask_id
        if ties is not None:  # the tied perturbation: the value's later restatements too (all at > t)
            tc = ties[r]
            tt = tc[torch.arange(n, device=tc.device), t]
            later = torch.arange(L, device=tc.device)[None, :] > t[:, None]
            ids[(tc == tt[:, None]) & (tt[:, None] != 0) & later & sub.reasoning_mask[r]] = mask_id
        am = sub.attention_mask[r]
        k_c = int(sub.answer_length[r].max()) + 1
        t0 = int(t.min()) if kv is not None else 0
        if t0 > 0:
            prefix = [(k[r, :, :t0], v[r, :, :t0]) for k, v in kv]
            logits_c, _ = logits_tail(
                model,
                k_c,
                input_ids=ids[:, t0:],
                attention_mask=am,
                position_ids=pos[r, t0:],
                cache=make_cache(prefix),
            )
        else:
            logits_c, _ = logits_tail(model, k_c, input_ids=ids, attention_mask=am, position_ids=pos[r])
        new = outcome(logits_c, L - k_c, ids, sub.answer_mask[r], sub.last_index[r], mode)
        out[r, t] = divergence(orig[r], new, mode)
    return out


