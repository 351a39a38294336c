"""Credit-concentration metrics (docs/methods.md, 4.5 Credit-concentration metrics; our own definitions, the paper's are not public).

- :func:`ess_ratio`: ``(sum_t w_t)^2 / (L * sum_t w_t^2)`` per row over its ``L`` masked tokens;
  1 for uniform weights, smaller when the weights concentrate.
- :func:`top_mass`: share of ``sum_t |A_{i,t}|`` held by the ``k = max(1, ceil(frac * L))`` tokens with
  the largest ``|A_{i,t}|``; ``k / L`` (about ``frac``) for uniform advantages.
- :func:`uniform_top_mass`: that ``k / L`` of each row, what :func:`top_mass` gives uniform credit.
- :func:`credited_rows`: the rows with a non-zero advantage on some token (a group with equal
  rewards gives none: nothing is learned from it).
- :func:`credited_concentration`: the share of credited rows, and :func:`top_mass` and
  :func:`uniform_top_mass` averaged over them (the step metrics ``credited_share``,
  ``top10_mass_credited`` and ``top10_mass_uniform``): token credit is concentrated when the second
  exceeds the third.

Report batch means of either (e.g. ``ess_ratio(w, m).mean()``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ess_ratio", "top_mass", "uniform_top_mass", "credited_rows", "credited_concentration"]


def _check(x: torch.Tensor, mask: torch.Tensor, fn: str) -> None:
    if x.dim() != 2 or mask.shape != x.shape:
        raise ValueError(
            f"oar.credit.metrics.{fn}: values and mask must both be (B, T), got {tuple(x.shape)} and {tuple(mask.shape)}"
        )


def ess_ratio(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Effective-sample-size ratio of each row's token weights.

    Args:
        weights: ``(B, T)`` non-negative token weights.
        mask: ``(B, T)`` tokens to include (nonzero = included).

    Returns:
        ``(B,)`` float in ``[1/L, 1]``. Conventions: a row with no masked token gets 1.0 (nothing to
        concentrate, as uniform GRPO); a row whose masked weights are all 0 gets 0.0.
    """
    _check(weights, mask, "ess_ratio")
    m = mask.bool()
    w = torch.where(m, weights.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=weights.device))
    s1 = w.sum(dim=-1)
    s2 = (w * w).sum(dim=-1)
    length = m.sum(dim=-1).to(torch.float64)
    ess = s1 * s1 / (length * s2).clamp(min=1e-300)
    ess = torch.where(s2 > 0, ess, torch.zeros_like(ess))
    ess = torch.where(length > 0, ess, torch.ones_like(ess))
    out_dtype = weights.dtype if weights.dtype.is_floating_point else torch.float32
    return ess.to(out_dtype)


def _top_count(length: torch.Tensor, frac: float) -> torch.Tensor:
    """``k = max(1, ceil(frac * L - 1e-9))``, at most ``L``, per row of ``length`` ``(B,)``."""
    k = torch.ceil(length.to(torch.float64) * frac - 1e-9).long().clamp(min=1)
    return torch.minimum(k, length.clamp(min=1))


def top_mass(token_advantages: torch.Tensor, mask: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """Share of each row's absolute advantage mass held by its top ``frac`` tokens.

    ``k = max(1, ceil(frac * L - 1e-9))`` tokens (the tiny slack keeps ``0.1 * 30`` at 3, not 4).

    Args:
        token_advantages: ``(B, T)`` float token advantages.
        mask: ``(B, T)`` tokens to include.
        frac: fraction of tokens in ``(0, 1]``.

    Returns:
        ``(B,)`` float in ``[k/L, 1]``. Conventions: a row with no masked token, or whose masked
        advantages are all 0 (e.g. a group with equal rewards), gets 0.0.
    """
    _check(token_advantages, mask, "top_mass")
    if not (0.0 < frac <= 1.0) or not math.isfinite(frac):
        raise ValueError(f"oar.credit.metrics.top_mass: frac must be in (0, 1], got {frac!r}")
    m = mask.bool()
    a = torch.where(
        m, token_advantages.detach().to(torch.float64).abs(), torch.zeros((), dtype=torch.float64, device=mask.device)
    )
    length = m.sum(dim=-1)
    out_dtype = token_advantages.dtype if token_advantages.dtype.is_floating_point else torch.float32
    if a.shape[-1] == 0:
        return torch.zeros(a.shape[0], dtype=out_dtype, device=a.device)
    k = _top_count(length, frac)
    srt, _ = torch.sort(a, dim=-1, descending=True)
    csum = srt.cumsum(dim=-1)
    top = csum.gather(-1, (k - 1)[:, None]).squeeze(-1)
    total = csum[:, -1]
    share = top / total.clamp(min=1e-300)
    share = torch.where((total > 0) & (length > 0), share, torch.zeros_like(share))
    return share.to(out_dtype)


def uniform_top_mass(mask: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """What :func:`top_mass` gives a row whose advantages are equal on every token: ``k / L``.

    Args:
        mask: ``(B, T)`` tokens to include.
        frac: fraction of tokens in ``(0, 1]``.

    Returns:
        ``(B,)`` float64; 0.0 for a row with no masked token.
    """
    if mask.dim() != 2:
        raise ValueError(f"oar.credit.metrics.uniform_top_mass: mask must be (B, T), got {tuple(mask.shape)}")
    length = mask.bool().sum(dim=-1)
    k = _top_count(length, frac).to(torch.float64)
    return torch.where(length > 0, k / length.clamp(min=1).to(torch.float64), torch.zeros_like(k))


def credited_rows(token_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows with a non-zero advantage on at least one masked token.

    Args:
        token_advantages: ``(B, T)`` float token advantages.
        mask: ``(B, T)`` tokens to include.

    Returns:
        ``(B,)`` bool.
    """
    _check(token_advantages, mask, "credited_rows")
    return ((token_advantages.detach() != 0) & mask.bool()).any(dim=-1)


def credited_concentration(token_advantages: torch.Tensor, mask: torch.Tensor,
                           frac: float = 0.1) -> tuple[float, float, float]:
    """How much of a batch got credit, and how concentrated that credit is.

    Args:
        token_advantages: ``(B, T)`` float token advantages.
        mask: ``(B, T)`` tokens to include.
        frac: fraction of tokens of :func:`top_mass`.

    Returns:
        ``(share, top, uniform)``: the share of rows of :func:`credited_rows`, and the means of
        :func:`top_mass` and :func:`uniform_top_mass` over those rows (both 0.0 when no row has
        credit). ``top == uniform`` for sequence-level credit (GRPO); ``top > uniform`` when credit
        concentrates on some tokens.
    """
    rows = credited_rows(token_advantages, mask)
    if not bool(rows.any()):
        return 0.0, 0.0, 0.0
    top = top_mass(token_advantages[rows].to(torch.float64), mask[rows], frac=frac).mean()  # float64 as uniform
    uniform = uniform_top_mass(mask[rows], frac=frac).mean()
    return float(rows.float().mean()), float(top), float(uniform)
