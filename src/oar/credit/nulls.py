"""Null controls: credit whose scores are shuffled within each response or inverted, so a method's
scores are tested against the same mass spent without their information.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.controls import seeded_generator
from oar.credit.reshape import reshaped_credit

__all__ = ["shuffle_scores", "invert_scores", "shuffled_estimator", "inverted_estimator"]

#: Salt of the shuffled null's draws (with the run seed and the step: :func:`oar.credit.controls.seeded_generator`).
_SHUFFLE_SALT = 0x5EED


def shuffle_scores(scores: torch.Tensor, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Permute each row's scores among its masked positions at random.

    Args:
        scores: ``(B, T)`` float; mask: ``(B, T)`` positions to permute among.
        generator: the random stream (CPU).

    Returns:
        ``(B, T)``: row ``b`` holds the same multiset of masked values in a random order; entries
        outside the mask are unchanged.
    """
    out = scores.clone()
    m = mask.bool()
    for b in range(scores.shape[0]):
        pos = m[b].nonzero().flatten()
        perm = torch.randperm(len(pos), generator=generator).to(pos.device)
        out[b, pos] = scores[b, pos[perm]]
    return out


def invert_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reflect each row's scores within its range over the masked positions: ``max + min - s``.

    Args:
        scores: ``(B, T)`` non-negative; mask: ``(B, T)``.

    Returns:
        ``(B, T)`` non-negative, the most important masked token now the least; unchanged outside the mask.
    """
    m = mask.bool()
    hi = torch.where(m, scores, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(m, scores, torch.inf).amin(-1, keepdim=True)
    return torch.where(m, hi + lo - scores, scores)


def _null_scores(batch: CreditBatch, options: dict[str, Any], transform: Callable[..., torch.Tensor]):
    from oar.credit.importance import importance_scores

    def scores_of(A: torch.Tensor):
        scores, reasoning, active, stats = importance_scores("oar_g", batch, options, A)
        return transform(scores, reasoning * active.to(reasoning.dtype).unsqueeze(-1)), reasoning, active, stats

    return scores_of


@register_estimator("shuffled", needs_model=True)
def shuffled_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Null control: OAR-G's importance permuted within each response, then Bi-Level reshaped.

    Options: those of ``oar_g``. The permutation is seeded by (``seed`` or the run's seed, step).
    """
    from oar.credit.importance import OAR_G_OPTIONS

    gen = seeded_generator(batch, options, _SHUFFLE_SALT)
    return reshaped_credit("shuffled", batch, options, OAR_G_OPTIONS,
                     _null_scores(batch, options, lambda s, m: shuffle_scores(s.cpu(), m.cpu(), gen).to(s.device)))


@register_estimator("inverted", needs_model=True)
def inverted_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Null control: OAR-G's importance reflected within each response (``max + min - s``), then
    Bi-Level reshaped. Options: those of ``oar_g``."""
    from oar.credit.importance import OAR_G_OPTIONS

    return reshaped_credit("inverted", batch, options, OAR_G_OPTIONS, _null_scores(batch, options, invert_scores))
