"""Bi-Level (dual-tier) reshaping of token importance scores into advantage weights
(docs/methods.md, 4.4 Bi-Level reshaping).

Per response (row) over its ``L`` scored tokens (the mask, normally the reasoning tokens):

- ``l_t = log1p(s_t)``; ``n_t = (l_t - min l) / (max l - min l)`` (divide by 1 when the range is 0);
- ``tau = quantile(n, q)`` with linear interpolation, exactly as ``torch.quantile``;
- suppress ``n_t < tau``: ``w_t = max(n_t / (tau + eps), floor)``;
  boost ``n_t >= tau``: ``w_t = 1 + beta (n_t - tau) / (1 - tau + eps)``;
- preserve mass: ``w <- w L / sum(w)`` (if ``sum(w) <= 0``, all ones).

Token advantages are then ``A_i * w_{i,t}``; the weights are positive, so the sign of ``A_i`` is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["bilevel_weights", "masked_row_quantile", "reshaped_advantages", "RESHAPE_OPTIONS", "reshape_options",
           "reshaped_credit"]


def masked_row_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row ``q``-quantile over the masked entries, linear interpolation like ``torch.quantile``.

    Row ``i`` with ``L_i`` masked values interpolates between its order statistics ``lo_i =
    floor(q (L_i - 1))`` and ``hi_i = ceil(q (L_i - 1))`` with ``torch.lerp``, the same arithmetic
    as ``torch.quantile``, so results are bit-identical to it. Vectorized without a full sort: one
    ``torch.kthvalue`` over all rows (each row gets ``max(lo) - lo_i`` extra ``-inf`` entries, so the
    same ``k`` selects every row's ``lo_i``-th value; unmasked entries are ``+inf``), then the next
    order statistic from a count and a masked min.

    Args:
        values: ``(B, T)`` float, finite on masked entries.
        mask: ``(B, T)`` bool.
        q: quantile in ``[0, 1]``.

    Returns:
        ``(B,)`` quantiles; NaN for rows with no masked entry.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"oar.credit.reshape: quantile must be in [0, 1], got {q!r}")
    if values.dim() != 2 or mask.shape != values.shape:
        raise ValueError(
            f"oar.credit.reshape.masked_row_quantile: values and mask must both be (B, T), got "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    mask = mask.bool()
    n = mask.sum(dim=-1)
    if values.shape[0] == 0 or values.shape[-1] == 0:
        return torch.full(n.shape, torch.nan, dtype=values.dtype, device=values.device)
    # Same arithmetic as torch.quantile: rank in the values' dtype, lerp between neighbours.
    rank = q * (n - 1).clamp(min=0).to(values.dtype)
    lo = rank.floor().long()
    hi = rank.ceil().long()
    weight = rank - lo.to(values.dtype)
    k = int(lo.max())
    shift = k - lo
    padded = torch.where(mask, values, torch.inf)
    width = int(shift.max())
    if width > 0:
        cols = torch.arange(width, device=values.device)[None, :]
        extra = torch.where(cols < shift[:, None], -torch.inf, torch.inf).to(values.dtype)
        padded = torch.cat([padded, extra], dim=-1)
    below = torch.kthvalue(padded, k + 1, dim=-1).values
    n_le = (mask & (values <= below[:, None])).sum(dim=-1)
    next_up = torch.where(mask & (values > below[:, None]), values, torch.inf).amin(dim=-1)
    above = torch.where(n_le >= hi + 1, below, next_up)
    out = torch.lerp(below, above, weight)
    return torch.where(n > 0, out, torch.nan)


def bilevel_weights(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    quantile: float = 0.25,
    beta: float = 1.0,
    floor: float = 0.1,
    preserve_mass: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Bi-Level weights from raw token importance scores (docs/methods.md, 4.4 Bi-Level reshaping).

    Args:
        scores: ``(B, T)`` raw non-negative importance scores ``s_t`` (values > -1 are accepted;
            entries outside the mask are ignored and may be anything, even NaN).
        mask: ``(B, T)`` positions to reweight (nonzero = scored token, e.g. reasoning tokens).
        quantile: ``q`` of the per-row threshold ``tau``.
        beta: boost strength (weights of boosted tokens lie in ``[1, 1 + beta]`` before mass
            preservation).
        floor: minimum weight of suppressed tokens.
        preserve_mass: rescale each row so its masked weights average 1.
        eps: the small constant in the suppress/boost denominators.

    Returns:
        ``(B, T)`` float weights: the reshaped weights on masked positions, exactly 1.0 elsewhere
        (and on every position of a row with no masked entry). Inputs are not modified.
    """
    if scores.dim() != 2 or mask.shape != scores.shape:
        raise ValueError(
            f"oar.credit.reshape.bilevel_weights: scores and mask must both be (B, T), got "
            f"{tuple(scores.shape)} and {tuple(mask.shape)}"
        )
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"oar.credit.reshape.bilevel_weights: quantile must be in [0, 1], got {quantile!r}")
    for name, v in (("beta", beta), ("floor", floor), ("eps", eps)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"oar.credit.reshape.bilevel_weights: {name} must be finite and >= 0, got {v!r}")
    dtype = scores.dtype if scores.dtype.is_floating_point else torch.float32
    m = mask.bool()
    s = scores.detach().to(dtype)
    if s.numel() == 0:
        return torch.ones(s.shape, dtype=dtype, device=s.device)
    lg = torch.log1p(torch.where(m, s, 0.0))
    # log1p maps s <= -1, inf and NaN to non-finite values: one check covers all bad scores.
    if not bool(torch.isfinite(lg).all()):
        raise ValueError("oar.credit.reshape.bilevel_weights: masked scores must be finite and > -1")
    lmin = torch.where(m, lg, torch.inf).amin(dim=-1, keepdim=True)
    lmax = torch.where(m, lg, -torch.inf).amax(dim=-1, keepdim=True)
    has = m.any(dim=-1, keepdim=True)
    rng = lmax - lmin
    rng = torch.where(has & (rng > 0), rng, 1.0)
    lmin = torch.where(has, lmin, 0.0)
    nrm = torch.where(m, (lg - lmin) / rng, 0.0)
    tau = masked_row_quantile(nrm, m, quantile)[:, None]
    tau = torch.where(has, tau, 0.0)
    suppress = torch.clamp(nrm / (tau + eps), min=floor)
    boost = (nrm - tau).mul_(beta / (1.0 - tau + eps)).add_(1.0)
    w = torch.where(m & (nrm < tau), suppress, boost).masked_fill_(~m, 0.0)
    if preserve_mass:
        total = w.sum(dim=-1, keepdim=True)
        length = m.sum(dim=-1, keepdim=True).to(dtype)
        ok = total > 0
        scale = torch.where(ok, length / torch.where(ok, total, 1.0), 1.0)
        w = torch.where(ok, w * scale, 1.0)
    return torch.where(m, w, 1.0)


#: Options of the Bi-Level reshaping, accepted by every estimator that reshapes (OAR, the controls).
RESHAPE_OPTIONS: tuple[str, ...] = ("quantile", "beta", "floor", "preserve_mass")


def reshape_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`RESHAPE_OPTIONS` of an estimator's options, defaults filled (those of
    :func:`bilevel_weights`), as keyword arguments of :func:`reshaped_advantages`."""
    return {
        "quantile": float(options.get("quantile", 0.25)),
        "beta": float(options.get("beta", 1.0)),
        "floor": float(options.get("floor", 0.1)),
        "preserve_mass": bool(options.get("preserve_mass", True)),
    }


def reshaped_advantages(
    seq_adv: torch.Tensor,
    scores: torch.Tensor,
    score_mask: torch.Tensor,
    active: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    quantile: float = 0.25,
    beta: float = 1.0,
    floor: float = 0.1,
    preserve_mass: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token advantages ``A_i * w_{i,t}`` from importance scores, the step every reshaping method
    shares (OAR-P, OAR-G, the oracle controls and the nulls): only the scores differ between them.

    Args:
        seq_adv: ``(B,)`` sequence advantages ``A_i``.
        scores: ``(B, T)`` non-negative importance scores in response coordinates.
        score_mask: ``(B, T)`` positions reweighted by :func:`bilevel_weights` (the reasoning tokens).
        active: ``(B,)`` bool, rows that were scored; the other rows keep weight 1 (plain GRPO).
        response_mask: ``(B, T)`` 1 on real response tokens.
        quantile, beta, floor, preserve_mass: as :func:`bilevel_weights`.

    Returns:
        ``(weights, token_advantages)``, both ``(B, T)``: weights are the Bi-Level weights on
        scored positions of active rows, 1 on the other response tokens, 0 on padding.
    """
    m = response_mask.to(torch.float32)
    w = bilevel_weights(scores.to(m.device), score_mask.to(m.device), quantile=quantile, beta=beta, floor=floor,
                        preserve_mass=preserve_mass)
    weights = torch.where(active.to(w.device).unsqueeze(-1), w, torch.ones_like(w)) * m.to(w.dtype)
    return weights, seq_adv.to(weights.dtype).unsqueeze(-1) * weights


def reshaped_credit(name: str, batch: Any, options: Mapping[str, Any], allowed: Sequence[str],
                    scores_of: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]],
                    ) -> Any:
    """The estimator every reshaping method shares (OAR-P, OAR-G, the controls): check ``options``
    against ``allowed``, sequence advantages ``A`` (:func:`oar.credit.advantages.sequence_advantages`),
    the method's own ``scores_of(A) -> (scores (B, T), score_mask (B, T), active (B,), stats)``, then
    :func:`reshaped_advantages` with the options' :data:`RESHAPE_OPTIONS`.

    Args:
        name: the estimator's name (in option errors).
        batch: the step's :class:`oar.credit.CreditBatch`.

    Returns:
        a :class:`oar.credit.CreditResult` with the Bi-Level weights and the scores' stats.
    """
    from oar.credit import CreditResult
    from oar.credit.advantages import check_options, sequence_advantages

    check_options(name, options, allowed)
    A = sequence_advantages(batch, options)
    scores, mask, active, stats = scores_of(A)
    weights, token_adv = reshaped_advantages(A, scores, mask, active, batch.response_mask, **reshape_options(options))
    return CreditResult(token_advantages=token_adv, seq_advantages=A, weights=weights, stats=stats)
