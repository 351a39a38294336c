"""The policy update (step 4 of :mod:`oar.trainer.loop`): PPO epochs over mini-batches laid out in
micro-batches (:mod:`oar.models.packing`), the clipped loss and KL (:mod:`oar.trainer.loss`) and the optimizer step (its
learning-rate schedule: :mod:`oar.trainer.optim`); and :func:`policy_forward`, the same forward over a whole batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from oar.config.settings import TrainSettings
from oar.credit.metrics import credited_rows
from oar.trainer.loss import aggregate, k3_kl, policy_loss
from oar.models.packing import MicroBatch, micro_batch_logprobs, plan_micro_batches
from oar.rollout import Rollout
from oar.trainer.strategy import Strategy

__all__ = ["policy_forward", "update_policy", "UPDATE_EVENTS"]

#: What :func:`update_policy` tells its ``observe`` callback, in order: ``micro-batch`` (before each
#: micro-batch's forward), ``backward end`` (after its backward), ``step start`` / ``step`` (around
#: each optimizer step that is taken).
UPDATE_EVENTS: tuple[str, ...] = ("micro-batch", "backward end", "step start", "step")


def policy_forward(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packing: str = "length_grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens under ``model``, all rows in one forward.

    Positions are ``cumsum(attention_mask) - 1`` as in ``generate`` with left padding, so the
    result matches the rollout's log-probs. ``packing`` is the layout of the forward
    (:mod:`oar.models.packing`): ``none`` runs the rows as given (``[left-padded prompt | right-padded
    response]``), ``length_grouped`` (default) each sequence contiguous with right padding only and
    the lm_head only on positions that predict a response token; the results agree up to rounding.

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` left-padded prompts.
        response_ids, response_mask: ``(B, T)`` right-padded responses (the mask a prefix).
    Returns:
        logp ``(B, T)`` and entropy ``(B, T)`` (or None), both 0 outside ``response_mask``.
    """
    B, T = response_ids.shape
    (mb,) = plan_micro_batches(prompt_ids, prompt_mask, response_ids, response_mask, torch.arange(B),
                               packing=packing, micro_batch_size=max(B, 1)) or [None]
    if mb is None:  # no rows
        z = torch.zeros(B, T)
        return z, (z.clone() if with_entropy else None)
    logp, ent = micro_batch_logprobs(model, mb, temperature=temperature, with_entropy=with_entropy)
    # back to the caller's row order and width
    out = logp.new_zeros(B, T)
    out[mb.rows, : mb.T] = logp
    ent_out = None
    if ent is not None:
        ent_out = ent.new_zeros(B, T)
        ent_out[mb.rows, : mb.T] = ent
    return out, ent_out


def update_policy(model: Any, optimizer: Any, strategy: Strategy, ro: Rollout, token_adv: torch.Tensor,
                   ref_model: Any, *, recipe: dict, train: TrainSettings, temperature: float, agg_max_len: int | None,
                   generator: torch.Generator, observe: Callable[[str], None] | None = None,
                   ) -> tuple[dict[str, list[float]], int]:
    """Step 4 of the loop: ``ppo_epochs`` passes over shuffled mini-batches of ``ro``, each split
    into micro-batches laid out by ``train.packing`` (:mod:`oar.models.packing`; default ``shared_prompt``:
    one copy of each prompt followed by its responses, no padding inside a row, rows of similar
    length, at most ``train.micro_batch_tokens`` positions and ``micro_batch_size`` sequences per
    forward, the lm_head only where a response token is predicted), PPO clip loss with the recipe's range
    and aggregation, optional k3 KL to ``ref_model``, gradient clipping, one optimizer step per
    mini-batch (skipped when the loss or gradient is not finite on any process).

    With ``train.skip_zero_advantage`` and no KL term, only the credited rows
    (:func:`oar.credit.metrics.credited_rows`, those the step metric ``credited_share`` counts) are
    computed: a row whose token advantages are all 0 has a clipped loss of 0 whatever the log-probs,
    so the gradient is the same up to rounding (the aggregates still count it: :func:`_micro_weight`
    divides by the whole mini-batch's tokens or sequences). The token means of the statistics
    (clipfrac, approx_kl, entropy) are then over the computed rows.

    Each micro-batch's loss is weighted so that the micro-batches add up to the mini-batch's
    aggregate whatever their sizes (:func:`_micro_weight`): the loss and gradient do not depend on
    the layout. Gradients are reduced once per mini-batch (``strategy.sync_context``), not per
    micro-batch. Every process runs the same number of mini-batches and, in each, of micro-batches
    (the maximum over processes; a process short of them runs zero-weight ones), so their
    collectives stay in step.

    Args:
        ro: the step's rollout, ``(N, T)`` responses; token_adv: ``(N, T)`` token advantages; train: the layout.
        observe: called with each event of :data:`UPDATE_EVENTS` as it happens (a memory or time
            probe: :meth:`oar.trainer.step.StepObserver.event`, e.g. ``benchmarks/gpu_check.py``'s per-phase peaks).
    Returns:
        statistics, one value per mini-batch, each the mini-batch's own aggregate (loss, pg_loss,
        kl_ref: its loss aggregation; clipfrac, approx_kl, entropy: token means; grad_norm), and
        ``tokens_real`` / ``tokens_computed`` (token positions of the forwards: real, and computed
        with padding); and the number of skipped (non-finite) updates.
    """
    model.train()
    N = ro.response_ids.shape[0]
    mb = min(train.mini_batch_size, N)
    micro = min(train.micro_batch_size, train.mini_batch_size, max(N, 1))
    layout = dict(packing=train.packing, micro_batch_size=micro, micro_batch_tokens=train.micro_batch_tokens,
                  pack_length=train.pack_length)

    def plan(rows: torch.Tensor) -> list[MicroBatch]:
        return plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, rows, **layout)

    # without a KL term, a row whose every token advantage is 0 adds exactly 0 to the loss's gradient
    skip = train.skip_zero_advantage and ref_model is None
    n_mini = strategy.max_over_ranks([math.ceil(N / max(mb, 1))])[0]
    perms = [torch.randperm(N, generator=generator) for _ in range(train.ppo_epochs)]
    minis = [perm[b * mb : (b + 1) * mb] for perm in perms for b in range(n_mini)]
    plans = [plan(rows[credited_rows(token_adv[rows], ro.response_mask[rows])] if skip else rows) for rows in minis]
    # per mini-batch, over processes; at least one (a zero-weight one where no row is credited), so
    # that every parameter has a gradient and the optimizer steps as it would with every row computed
    n_micro = [max(c, 1) for c in strategy.max_over_ranks([len(p) for p in plans])]
    dummy = plan(torch.arange(min(N, 1)))  # a zero-weight micro-batch for a process short of them
    upd: dict[str, list[float]] = {"loss": [], "pg_loss": [], "kl_ref": [], "clipfrac": [], "approx_kl": [],
                                   "grad_norm": [], "entropy": [], "tokens_real": [], "tokens_computed": []}
    nonfinite = 0
    for rows, micro_batches, count in zip(minis, plans, n_micro):
        optimizer.zero_grad(set_to_none=True)
        total, n_seq = _mini_batch_backward(model, strategy, ro, token_adv, ref_model, rows, micro_batches,
                                            dummy, count, upd, recipe=recipe, temperature=temperature,
                                            agg_max_len=agg_max_len, observe=observe)
        grad_norm = strategy.clip_grad_norm_(model, train.grad_clip)
        bad = strategy.max_over_ranks([int(not (math.isfinite(total) and math.isfinite(grad_norm)))])[0]
        if bad:
            optimizer.zero_grad(set_to_none=True)  # skip this update (on every process)
            nonfinite += 1
            continue
        if observe is not None:
            observe("step start")
        optimizer.step()
        if observe is not None:
            observe("step")
        if n_seq:
            upd["loss"].append(total)
        upd["grad_norm"].append(grad_norm)
    return upd, nonfinite


def _mini_batch_backward(model: Any, strategy: Strategy, ro: Rollout, token_adv: torch.Tensor, ref_model: Any,
                         rows: torch.Tensor, micro_batches: list[MicroBatch], dummy: list[MicroBatch], count: int,
                         upd: dict[str, list[float]], *, recipe: dict, temperature: float,
                         agg_max_len: int | None, observe: Callable[[str], None] | None = None,
                         ) -> tuple[float, int]:
    """The forwards and backwards of one mini-batch (``rows`` of ``ro``): ``count`` micro-batches,
    those past ``micro_batches`` zero-weight runs of ``dummy[0]``, gradients reduced on the last one.
    Appends the mini-batch's statistics to ``upd`` (all but ``loss`` and ``grad_norm``, which depend
    on the optimizer step). Returns the mini-batch's weighted loss and its number of sequences."""
    agg = recipe["loss_agg"]
    resp_mask = ro.response_mask[rows]
    n_tok, n_seq = float(resp_mask.sum()), len(rows)
    n_has = int((resp_mask.sum(1) > 0).sum())
    total, pg_total, kl_total, clip_sum, akl_sum, ent_sum, n_computed = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for u in range(count):
        if observe is not None:
            observe("micro-batch")
        real = u < len(micro_batches)
        mbatch = micro_batches[u] if real else dummy[0]
        r, T = mbatch.rows, mbatch.T
        with strategy.sync_context(model, sync=u == count - 1):
            with strategy.forward_context():
                logp, ent = micro_batch_logprobs(model, mbatch, temperature=temperature, with_entropy=True)
                dev = logp.device
                adv = token_adv[r, :T].to(dev)
                old = ro.logprobs[r, :T].to(dev)
                m = ro.response_mask[r, :T].to(dev)
                pg, stats = policy_loss(logp, old, adv, m, eps_low=recipe["eps_low"], eps_high=recipe["eps_high"],
                                        clip_ratio_c=recipe["clip_ratio_c"], agg=agg, max_len=agg_max_len)
                loss = pg
                kl_val = 0.0
                if ref_model is not None:
                    with torch.no_grad():
                        ref_lp, _ = micro_batch_logprobs(ref_model, mbatch, temperature=temperature)
                    kl = aggregate(k3_kl(logp, ref_lp), m, agg, max_len=agg_max_len)
                    loss = loss + recipe["kl_coef"] * kl
                    kl_val = float(kl.detach())
            # weight so that the micro-batches add up to the mini-batch aggregate
            w = _micro_weight(agg, m, n_tok=n_tok, n_seq=n_seq, n_has=n_has) if real else 0.0
            strategy.backward(loss * w)
        if observe is not None:
            observe("backward end")
        if not real:
            continue
        tokens = float(m.sum())
        n_computed += tokens
        total += float(loss.detach()) * w
        pg_total += float(pg.detach()) * w
        kl_total += kl_val * w
        clip_sum += stats["clipfrac"] * tokens
        akl_sum += stats["approx_kl"] * tokens
        ent_sum += float(ent.sum())
        upd["tokens_real"].append(float(mbatch.real_tokens))
        upd["tokens_computed"].append(float(mbatch.computed_tokens))
    if n_seq:
        upd["pg_loss"].append(pg_total)
        upd["kl_ref"].append(kl_total)
        upd["clipfrac"].append(clip_sum / max(n_computed, 1.0))
        upd["approx_kl"].append(akl_sum / max(n_computed, 1.0))
        upd["entropy"].append(ent_sum / max(n_computed, 1.0))
    return total, n_seq


def _micro_weight(agg: str, mask: torch.Tensor, *, n_tok: float, n_seq: int, n_has: int) -> float:
    """Weight of a micro-batch's aggregated loss so that the weighted micro-batches of a mini-batch
    add up to the mini-batch's aggregate (:func:`oar.trainer.loss.aggregate`), whatever their sizes.

    Args:
        agg: the loss aggregation mode.
        mask: ``(b, T)`` the micro-batch's response mask.
        n_tok, n_seq, n_has: the mini-batch's response tokens, sequences, and sequences with at
            least one response token.
    Returns:
        ``token-mean``: its share of the tokens; ``seq-mean-token-sum-norm`` (divides by all
        sequences): its share of the sequences; the other ``seq-mean`` modes (mean over sequences
        with tokens): its share of those.
    """
    if agg == "token-mean":
        return float(mask.sum()) / max(n_tok, 1.0)
    if agg == "seq-mean-token-sum-norm":
        return mask.shape[0] / max(n_seq, 1)
    return float((mask.sum(1) > 0).sum()) / max(n_has, 1)
