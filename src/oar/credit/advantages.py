"""Sequence-level outcome advantages: GRPO and Dr. GRPO (docs/methods.md, 1 GRPO and Dr. GRPO).

Shapes follow verl's ``core_algos.py``: ``B`` responses, ``T`` response tokens (right-padded).

- :func:`grpo_advantages`: ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` per group ``g``, unbiased
  std; Dr. GRPO (``norm_by_std=False``) drops the division: ``A_i = r_i - mean_g(r)``.
- :func:`broadcast_seq`: ``A_{i,t} = A_i * m_{i,t}`` (exactly 0 outside the mask).
- Registered estimators ``grpo`` and ``drgrpo`` (see :mod:`oar.credit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator

__all__ = [
    "GroupMoments",
    "group_moments",
    "grpo_advantages",
    "broadcast_seq",
    "group_index",
    "check_options",
    "SEQ_OPTIONS",
    "sequence_advantages",
    "grpo_estimator",
    "drgrpo_estimator",
]


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to contiguous indices ``0..NG-1``.

    Args:
        group_ids: ``(B,)`` integer tensor; ids need not be contiguous or sorted.

    Returns:
        ``(idx, NG)``: ``idx`` is ``(B,)`` long with ``idx[i] == idx[j]`` iff the ids are equal.
    """
    if group_ids.dim() != 1:
        raise ValueError(f"oar.credit.advantages: group_ids must be 1-D (B,), got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"oar.credit.advantages: group_ids must be an integer tensor, got {group_ids.dtype}")
    uniq, idx = torch.unique(group_ids, return_inverse=True)
    return idx, int(uniq.numel())


class GroupMoments(NamedTuple):
    """Per-group reward moments (:func:`group_moments`); ``NG`` groups, ``B`` responses.

    Attributes:
        index: ``(B,)`` long, the contiguous group index of each response (:func:`group_index`).
        count: ``(NG,)`` float64, responses per group.
        mean: ``(NG,)`` float64, mean reward of each group.
        std: ``(NG,)`` float64, unbiased standard deviation of each group's rewards.
    """

    index: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def group_moments(rewards: torch.Tensor, group_ids: torch.Tensor, *, unit_singletons: bool = False) -> GroupMoments:
    """Mean and unbiased std of the rewards of each group, in float64 on ``rewards``' device.

    ``mean_g = sum_g(r) / n_g`` and ``std_g = sqrt(sum_g((r - mean_g)^2) / max(n_g - 1, 1))``, with
    index_add over groups (no Python loop). Gather ``mean[index]`` for a per-response ``(B,)`` view.

    A group of one response (``n_g == 1``) has, by default, the moments of one sample: its own
    reward as mean and std 0 (``mc_value``). With ``unit_singletons`` it has mean 0 and std 1 instead
    (GRPO, as verl's ``compute_grpo_outcome_advantage``: its advantage is ``r / (1 + eps)``).

    Args:
        rewards: ``(B,)`` scalar reward of each response (any real dtype; detached).
        group_ids: ``(B,)`` integer, responses with equal ids form a group.
        unit_singletons: a group of one gets mean 0 and std 1 (else its reward and 0).

    Returns:
        :class:`GroupMoments` ``(index (B,), count (NG,), mean (NG,), std (NG,))``.
    """
    idx, ng = group_index(group_ids)
    r = rewards.detach().to(torch.float64)
    idx = idx.to(r.device)
    count = torch.zeros(ng, dtype=torch.float64, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(ng, dtype=torch.float64, device=r.device).index_add_(0, idx, r) / count
    centered = r - mean[idx]
    sq = torch.zeros(ng, dtype=torch.float64, device=r.device).index_add_(0, idx, centered * centered)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count == 1
    if unit_singletons:
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
    else:
        std = torch.where(single, torch.zeros_like(std), std)
    return GroupMoments(idx, count, mean, std)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO (``norm_by_std=True``) or Dr. GRPO (``norm_by_std=False``) sequence advantages.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``g`` is the group of response ``i`` and
    ``std`` is the unbiased standard deviation (as ``torch.std``; :func:`group_moments`). A group of
    one response has mean 0 and std 1 (so ``A = r / (1 + eps)``, or ``A = r`` for Dr. GRPO), as verl's
    ``compute_grpo_outcome_advantage``. A group whose rewards are all equal gets exactly 0 (this is
    enforced, so float rounding of the mean cannot leak ``1e-9 / eps``-sized advantages).

    Computed in float64 with scatter/index_add over groups (no Python loop over groups).

    Args:
        rewards: ``(B,)`` float, scalar reward of each response.
        group_ids: ``(B,)`` integer, responses with equal ids come from the same prompt.
        norm_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std in the denominator.

    Returns:
        ``(B,)`` advantages, in the floating dtype of ``rewards`` (float32 for integer rewards).
    """
    if rewards.dim() != 1:
        raise ValueError(f"oar.credit.advantages: rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"oar.credit.advantages: group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    idx, count, mean, std = group_moments(rewards, group_ids, unit_singletons=True)
    ng = count.numel()
    r = rewards.detach().to(torch.float64)
    single = count == 1
    rmax = torch.full((ng,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, idx, r, reduce="amax", include_self=True
    )
    rmin = torch.full((ng,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, idx, r, reduce="amin", include_self=True
    )
    equal = (rmax == rmin) & ~single
    adv = r - mean[idx]
    if norm_by_std:
        adv = adv / (std[idx] + eps)
    adv = torch.where(equal[idx], torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def broadcast_seq(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast sequence advantages to tokens: ``A_{i,t} = A_i * m_{i,t}``.

    Args:
        seq_adv: ``(B,)`` float sequence advantages.
        mask: ``(B, T)`` response mask (nonzero = real token).

    Returns:
        ``(B, T)`` in the dtype of ``seq_adv``; exactly 0 where the mask is 0.
    """
    if seq_adv.dim() != 1 or mask.dim() != 2 or mask.shape[0] != seq_adv.shape[0]:
        raise ValueError(
            f"oar.credit.advantages.broadcast_seq: need seq_adv (B,) and mask (B, T), "
            f"got {tuple(seq_adv.shape)} and {tuple(mask.shape)}"
        )
    m = mask.bool()
    vals = seq_adv[:, None].expand(m.shape)
    return torch.where(m, vals, torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device))


def check_options(estimator: str, options: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Raise ``TypeError`` naming any option of ``estimator`` that is not in ``allowed``."""
    allowed = sorted(allowed)
    unknown = sorted(k for k in options if k not in allowed)
    if unknown:
        raise TypeError(f"estimator {estimator!r}: unknown option(s) {unknown}; valid options: {allowed}")


#: Options of the sequence advantage, accepted by every estimator built on it.
SEQ_OPTIONS: tuple[str, ...] = ("norm_by_std", "eps")


def sequence_advantages(batch: CreditBatch, options: Mapping[str, Any], *, default_norm: bool = True) -> torch.Tensor:
    """``(B,)`` GRPO (``norm_by_std``, default ``default_norm``) or Dr. GRPO advantages of the batch,
    from an estimator's options (``eps`` default 1e-6)."""
    return grpo_advantages(batch.rewards, batch.group_ids, norm_by_std=bool(options.get("norm_by_std", default_norm)),
                           eps=float(options.get("eps", 1e-6)))


def _seq_estimator(name: str, batch: CreditBatch, default_norm: bool, options: dict[str, Any]) -> CreditResult:
    check_options(name, options, SEQ_OPTIONS)
    seq = sequence_advantages(batch, options, default_norm=default_norm)
    return CreditResult(token_advantages=broadcast_seq(seq, batch.response_mask), seq_advantages=seq, weights=None)


@register_estimator("grpo")
def grpo_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """GRPO: group-normalized outcome advantage on every response token. Options: ``norm_by_std``
    (default True), ``eps`` (default 1e-6)."""
    return _seq_estimator("grpo", batch, True, options)


@register_estimator("drgrpo")
def drgrpo_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """Dr. GRPO: like GRPO without the std division. Options: ``norm_by_std`` (default False),
    ``eps`` (default 1e-6)."""
    return _seq_estimator("drgrpo", batch, False, options)
