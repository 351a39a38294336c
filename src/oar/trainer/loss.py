"""PPO-clip policy loss, loss aggregation modes and the k3 KL estimator (docs/methods.md,
1 GRPO and Dr. GRPO, 2 DAPO).

Shapes follow verl's ``core_algos.py``: ``(B, T)`` tensors over response tokens plus a response
mask. Per token, with ``ratio = exp(logp - old_logp)``::

    L_t = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high))        # = -min(ratio A, clip A)
    dual clip (A < 0, clip_ratio_c = c > 1): L_t = min(L_t, -A c)          # as verl compute_policy_loss

Aggregation modes (verl ``agg_loss``; see :func:`aggregate`): ``token-mean``, ``seq-mean-token-mean``,
``seq-mean-token-sum``, ``seq-mean-token-sum-norm``.
"""

from __future__ import annotations

import torch

__all__ = ["AGG_MODES", "aggregate", "policy_loss", "k3_kl"]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_bt(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape != mask.shape:
        raise ValueError(f"oar.trainer.loss: {name} and mask must both be (B, T), got {tuple(x.shape)} and {tuple(mask.shape)}")


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, max_len: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    Args:
        loss_mat: ``(B, T)`` per-token loss.
        mask: ``(B, T)`` loss mask (multiplied in, so 0/1 masks select tokens).
        mode: one of :data:`AGG_MODES`:

            - ``token-mean``: ``sum(L m) / sum(m)`` over the whole batch (DAPO);
            - ``seq-mean-token-mean``: mean over sequences of ``sum_t(L m) / sum_t(m)`` (original GRPO);
            - ``seq-mean-token-sum``: mean over sequences of ``sum_t(L m)``;
            - ``seq-mean-token-sum-norm``: ``sum(L m) / (B * max_len)`` (Dr. GRPO, docs/methods.md
              section 1); ``max_len`` defaults to ``T = loss_mat.shape[-1]``. (Older verl divides
              by ``T`` only; docs/methods.md's ``B * max_len`` is used here.)

            The two ``seq-mean`` modes average over sequences with at least one masked token (a
            sequence with none has no token mean); with no masked token at all every mode gives 0.
        max_len: override of ``T`` for ``seq-mean-token-sum-norm`` only.

    Returns:
        0-dim tensor (differentiable w.r.t. ``loss_mat``).

    Raises:
        ValueError: for an unknown mode (naming it and the valid ones), bad shapes, or ``max_len``
            with another mode / not positive.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"oar.trainer.loss.aggregate: unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")
    _check_bt("loss_mat", loss_mat, mask)
    if max_len is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"oar.trainer.loss.aggregate: max_len is only used by 'seq-mean-token-sum-norm', not {mode!r}")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    # where() keeps NaN/inf from padded positions out of the sum (0 * inf would be NaN).
    masked = torch.where(m != 0, masked, torch.zeros_like(masked))
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[-1] if max_len is None else int(max_len)
        if length <= 0:
            raise ValueError(f"oar.trainer.loss.aggregate: max_len must be > 0, got {max_len!r}")
        return masked.sum() / (loss_mat.shape[0] * length) if loss_mat.shape[0] > 0 else masked.sum()
    tokens = m.sum(dim=-1)
    seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp(min=1.0)
    has = (tokens > 0).to(loss_mat.dtype)
    return (seq * has).sum() / has.sum().clamp(min=1.0)


def k3_kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    log_ratio_clamp: float = 20.0,
    kl_clamp: float = 10.0,
) -> torch.Tensor:
    """Per-token k3 KL estimate to a reference policy: ``exp(d) - d - 1`` with ``d = ref - logp``.

    ``d`` is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` and the result to
    ``[-kl_clamp, kl_clamp]`` (as verl ``kl_penalty(..., "low_var_kl")``). Non-negative.

    Args:
        logp, ref_logp: ``(B, T)`` (or any equal shapes) log-probs of the sampled tokens.

    Returns:
        Tensor of the same shape (not masked; aggregate with :func:`aggregate`).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"oar.trainer.loss.k3_kl: shapes differ: {tuple(logp.shape)} vs {tuple(ref_logp.shape)}")
    d = (ref_logp - logp).clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    # expm1(d) - d == exp(d) - d - 1, but rounding can never make it negative.
    return (torch.expm1(d) - d).clamp(min=-kl_clamp, max=kl_clamp)


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = float(m.sum())
    if n == 0:
        return 0.0
    return float(torch.where(m, x, torch.zeros_like(x)).sum()) / n


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
    max_len: int | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss with optional dual clip (verl ``compute_policy_loss``).

    Args:
        logp: ``(B, T)`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``(B, T)`` log-probs under the sampling policy (no grad needed).
        advantages: ``(B, T)`` token advantages.
        mask: ``(B, T)`` response mask.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher: 0.2, 0.28).
        clip_ratio_c: dual-clip constant (> 1) for negative advantages, or None for no dual clip.
        agg: aggregation mode (:func:`aggregate`); max_len: its ``seq-mean-token-sum-norm`` override.
        log_ratio_clamp: ``logp - old_logp`` is clamped to ``+-log_ratio_clamp`` before ``exp``.

    Returns:
        ``(loss, stats)``: ``loss`` a 0-dim tensor; ``stats`` python floats, all means over masked tokens:

        - ``clipfrac``: fraction where the clipped term is the active (larger) one (verl ``pg_clipfrac``);
        - ``clipfrac_low``: ... because ``ratio < 1 - eps_low`` with ``A < 0``;
        - ``clipfrac_high``: ... because ``ratio > 1 + eps_high`` with ``A > 0``;
        - ``dualclip_frac`` (only when ``clip_ratio_c`` is set): fraction where the dual clip
          ``-A c`` is active (``A < 0``; verl's ``pg_clipfrac_lower``);
        - ``approx_kl``: k3 estimate of ``KL(old || new)``: mean of ``exp(r) - r - 1``, ``r = logp - old_logp``;
        - ``ppo_kl``: k1 estimate, mean of ``old_logp - logp`` (verl's ``ppo_kl``);
        - ``ratio_mean``: mean importance ratio.
    """
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        _check_bt(name, x, mask)
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise ValueError(f"oar.trainer.loss.policy_loss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low!r}, {eps_high!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"oar.trainer.loss.policy_loss: clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c!r}")
    old = old_logp.detach()
    adv = advantages.detach()
    log_ratio = (logp - old).clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    clipped_ratio = ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss2 = -adv * clipped_ratio
    loss_clip = torch.maximum(loss1, loss2)
    per_token = loss_clip
    if clip_ratio_c is not None:
        loss3 = -adv * clip_ratio_c
        per_token = torch.where(adv < 0, torch.minimum(loss_clip, loss3), loss_clip)
    loss = aggregate(per_token, mask, agg, max_len=max_len)

    with torch.no_grad():
        m = mask.bool()
        lr = log_ratio.detach()
        r = ratio.detach()
        stats: dict[str, float] = {
            "clipfrac": _masked_mean((loss2 > loss1).float(), m),
            "clipfrac_low": _masked_mean(((r < 1.0 - eps_low) & (adv < 0)).float(), m),
            "clipfrac_high": _masked_mean(((r > 1.0 + eps_high) & (adv > 0)).float(), m),
            "approx_kl": _masked_mean(torch.expm1(lr) - lr, m),
            "ppo_kl": _masked_mean(-lr, m),
            "ratio_mean": _masked_mean(r, m),
        }
        if clip_ratio_c is not None:
            stats["dualclip_frac"] = _masked_mean(((loss_clip.detach() > -adv * clip_ratio_c) & (adv < 0)).float(), m)
    return loss, stats
