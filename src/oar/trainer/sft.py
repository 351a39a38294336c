"""Warm-start supervised fine-tuning (SFT) on reference solutions, and greedy accuracy.

The RL stage needs a policy that already solves some problems (a policy with zero reward gets no
learning signal from GRPO-style estimators). For the tiny model this SFT is that warm start; for a
real model (config/smollm2.yaml) it is a format warm-up on GSM8K's reference solutions rewritten to
end in ``\\boxed{}``, so that the start model writes answers the reward can read.

- :func:`build_sft_batch` -- tokenize prompt + response (+ eos), labels only on response tokens
  (:func:`sft_rows` then :func:`pad_sft_rows`).
- :func:`sft_step` -- one batch's gradient, accumulated over length-sorted micro-batches.
- :func:`run_sft` -- AdamW, linear warmup then cosine decay, gradient clipping, fixed step budget, on
  the training's :class:`oar.trainer.strategy.Strategy` (its placement, master weights, autocast,
  backward and clipping; one process).
- :func:`greedy_accuracy` -- greedy pass@1 through :func:`oar.evaluate.evaluation.evaluate_records` with an
  :class:`oar.rollout.HFEngine` on the model.
- :func:`sft_data` -- training records and held-out sets from the config's task (synthetic, or a
  benchmark with reference solutions).
- :func:`sft_from_config` -- the config-level entry: build the model, read the data, train,
  evaluate on the held-out sets, save atomically.
- :func:`sft_or_cached` -- ``oar sft``: :func:`sft_from_config`, or a copy of the same SFT from
  ``sft.cache_dir`` (keyed by :func:`oar.config.identity.sft_cache_key`).

Loss: the mean token cross-entropy over all response tokens of the batch (prompt and padding
tokens carry label -100), i.e. Hugging Face's ``labels=`` loss. The response is
``record["solution"]`` followed by the eos token, so the model learns to stop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from oar.data.prompts import render_prompt
from oar.trainer.optim import make_scheduler
from oar.trainer.strategy import Strategy

__all__ = ["IGNORE_INDEX", "build_sft_batch", "run_sft", "greedy_accuracy", "save_sft_model"]


#: Label of positions that do not count in the loss (prompt and padding).
IGNORE_INDEX = -100
LogFn = Callable[[int, dict], None]


def build_sft_batch(
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    add_eos: bool = True,
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Tokenize ``prompt + response (+ eos)`` pairs into a right-padded training batch.

    The prompt is tokenized with the tokenizer's special tokens (as at generation time), the
    response without, so the boundary between them is exact for any tokenizer.

    Returns a dict of (B, T) tensors: ``input_ids`` (padding = pad id), ``attention_mask``
    (1 on real tokens), ``labels`` (the token id on response tokens and eos, ``IGNORE_INDEX``
    on prompt and padding) and ``position_ids`` (0, 1, ... from each sequence's first real token).

    Raises:
        ValueError: different numbers of prompts and responses, an empty response, or a sequence
            longer than ``max_length`` (the message gives its index and length).
    """
    return pad_sft_rows(tokenizer, sft_rows(tokenizer, prompts, responses, add_eos=add_eos, max_length=max_length))


def sft_rows(
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    add_eos: bool = True,
    max_length: int | None = None,
) -> list[tuple[list[int], int]]:
    """Token ids of each ``prompt + response (+ eos)`` and its prompt length (see :func:`build_sft_batch`)."""
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError("add_eos=True but the tokenizer has no eos token")
    rows: list[tuple[list[int], int]] = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p_ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(r, add_special_tokens=False)["input_ids"]
        if add_eos:
            r_ids = r_ids + [tokenizer.eos_token_id]
        if not r_ids:
            raise ValueError(f"record {i}: empty response")
        ids = p_ids + r_ids
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"record {i}: {len(ids)} tokens exceed max_length={max_length} (prompt {p!r})")
        rows.append((ids, len(p_ids)))
    return rows


def pad_sft_rows(tokenizer, rows: Sequence[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """Right-pad :func:`sft_rows` into the (B, T) tensors of :func:`build_sft_batch`."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    T = max(len(ids) for ids, _ in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for b, (ids, n_prompt) in enumerate(rows):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[b, : len(ids)] = t
        attention_mask[b, : len(ids)] = 1
        labels[b, n_prompt : len(ids)] = t[n_prompt:]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "position_ids": position_ids}


def sft_step(model, tokenizer, prompts: Sequence[str], responses: Sequence[str], *, micro_batch_size: int | None,
             strategy: Strategy) -> tuple[torch.Tensor, int]:
    """Accumulate the gradient of one SFT batch, ``micro_batch_size`` sequences at a time, on
    ``strategy`` (its device, forward context and backward).

    With a ``micro_batch_size`` the pairs are tokenized once (:func:`sft_rows`), sorted by length and
    cut into micro-batches (:func:`pad_sft_rows` each), so a micro-batch pads to lengths close to its
    own. Each micro-batch adds ``sum of its response-token cross-entropies / the batch's response
    tokens`` to the gradient, so the result equals one backward pass over the whole batch of Hugging
    Face's mean token loss, whatever the split (up to float rounding: the sums run in another order).

    ``micro_batch_size=None`` is that one pass, exactly: the batch in record order
    (:func:`build_sft_batch`) and the model's own ``labels=`` loss, the computation of every SFT before
    micro-batches existed, so a config that leaves the option at null trains the same weights, bit
    for bit, as before (its fingerprint is unchanged, :data:`oar.config.identity.NEW_KEYS_AT_DEFAULT`).

    Returns:
        ``(loss, n_tokens)``: the batch's mean token loss (detached) and its response-token count.
    """
    device = strategy.device
    if micro_batch_size is None:
        batch = {k: v.to(device) for k, v in build_sft_batch(tokenizer, prompts, responses).items()}
        with strategy.forward_context():
            loss = model(**batch).loss
        strategy.backward(loss)
        return loss.detach(), int((batch["labels"] != IGNORE_INDEX).sum())
    if micro_batch_size < 1:
        raise ValueError(f"sft.micro_batch_size: must be >= 1, got {micro_batch_size}")
    rows = sorted(sft_rows(tokenizer, prompts, responses), key=lambda row: len(row[0]))
    batches = [pad_sft_rows(tokenizer, rows[j : j + micro_batch_size]) for j in range(0, len(rows), micro_batch_size)]
    n_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    total = torch.zeros((), device=device)
    for j, b in enumerate(batches):
        b = {k: v.to(device) for k, v in b.items()}
        labels = b.pop("labels")
        with strategy.sync_context(model, sync=j == len(batches) - 1), strategy.forward_context():
            logits = model(**b).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
        strategy.backward(loss)
        total += loss.detach()
    return total, n_tokens


def run_sft(
    model,
    tokenizer,
    train_records: Sequence[Mapping[str, Any]],
    *,
    strategy: Strategy,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
    warmup_steps: int,
    grad_clip: float,
    seed: int,
    template: str = "tiny",
    eval_records: Sequence[Mapping[str, Any]] | None = None,
    eval_every: int | None = None,
    eval_max_new_tokens: int = 96,
    progress: bool = True,
    log_fn: LogFn | None = None,
    min_lr_ratio: float = 0.0,
    micro_batch_size: int | None = None,
) -> dict:
    """Supervised fine-tuning on ``prompt + solution + eos`` with the loss on response tokens only.

    Each step draws ``batch_size`` records without replacement from a seeded shuffle of
    ``train_records`` (reshuffled each pass). With ``micro_batch_size`` the step's records are sorted
    by length and run in micro-batches of that size, gradients accumulated (:func:`sft_step`): the
    same loss and gradient as one batch, with less padding and memory (real records differ in length
    by 2x and more; padded as one batch, half the compute can go to padding). AdamW (``lr``,
    ``betas``, ``weight_decay`` on matrices only: :func:`oar.trainer.optim.decay_groups`), learning rate
    :func:`oar.trainer.optim.lr_factor` (linear warmup over ``warmup_steps``, cosine decay to
    ``min_lr_ratio * lr`` at the last step), gradients clipped to norm ``grad_clip``.

    The training runs on ``strategy`` as RL's update does (:meth:`oar.trainer.strategy.Strategy.prepare`:
    ``train.master_dtype`` weights on its device, wrapped or sharded per ``train.strategy``; its
    autocast, backward and clipping), in one process. The model is trained in place (with FSDP it
    becomes its sharded self: save it with :func:`save_sft_model` and the same strategy) and left in
    eval mode.

    Args:
        train_records: dicts with ``question`` and ``solution``.
        eval_records: optional dicts with ``id``, ``question`` and ``answer``; greedy accuracy on them
            every ``eval_every`` steps and after the last step (needs ``eval_every``).
        log_fn: called as ``log_fn(step, metrics)`` after every step (``sft/loss``, ``sft/lr``,
            ``sft/grad_norm``; 1-based step) and after every evaluation (``sft/eval_accuracy``).

    Raises:
        ValueError: a bad argument, or ``strategy`` spans several processes (:func:`_check_sft_inputs`).

    Returns:
        ``{"steps", "batch_size", "loss_curve": [(step, loss), ...] (every step, 1-based),
        "final_loss" (last step), "final_loss_mean10" (mean of the last 10 steps), "seconds" (wall,
        evaluations included), "train_seconds" (wall, evaluations excluded), "steps_per_s" (from
        train_seconds), "cpu_seconds" (process CPU time, all threads; less sensitive to other load on
        the machine), "response_tokens" (trained on), "eval_curve": [(step, accuracy), ...]}``.
    """
    _check_sft_inputs(train_records, steps=steps, batch_size=batch_size, strategy=strategy)
    if eval_records is not None and eval_every is None:
        eval_every = steps
    prompts = [render_prompt(template, r["question"], tokenizer) for r in train_records]
    solutions = [r["solution"] for r in train_records]
    # AdamW with weight decay on matrices only (oar.trainer.optim.rl_param_groups)
    model, optimizer = strategy.prepare(model, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=warmup_steps, floor_step=steps - 1, schedule="cosine",
                               min_ratio=min_lr_ratio)
    bar = _progress_bar(steps) if progress else None
    t0, c0 = time.perf_counter(), time.process_time()
    model.train()
    try:
        curves = _sft_steps(model, tokenizer, strategy, prompts, solutions, optimizer, scheduler,
                            _sft_batches(len(train_records), batch_size, seed), steps=steps,
                            micro_batch_size=micro_batch_size, grad_clip=grad_clip, eval_records=eval_records,
                            eval_every=eval_every, template=template, eval_max_new_tokens=eval_max_new_tokens,
                            log_fn=log_fn, bar=bar)
    finally:
        model.eval()
        if bar is not None:
            bar.close()
    return _sft_summary(curves, steps=steps, batch_size=batch_size, t0=t0, c0=c0)


def _check_sft_inputs(train_records: Sequence[Mapping[str, Any]], *, steps: int, batch_size: int,
                      strategy: Strategy) -> None:
    """Raise ValueError for :func:`run_sft`'s bad arguments: ``steps`` or ``batch_size`` below 1, no
    training records, a first record without ``question`` or ``solution``, or a strategy over
    several processes (SFT runs in one)."""
    if strategy.world > 1:
        raise ValueError(f"sft: runs in one process; this one is rank {strategy.rank} of {strategy.world} "
                         f"(start oar sft without torchrun)")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"sft: steps and batch_size must be >= 1 (got steps={steps}, batch_size={batch_size})")
    if not train_records:
        raise ValueError("sft: no training records")
    for i, r in enumerate(train_records[:1]):
        for k in ("question", "solution"):
            if k not in r:
                raise ValueError(f"sft: training record {i} has no {k!r} key (keys: {sorted(r)})")


def _progress_bar(steps: int) -> Any:
    """The SFT's progress bar over ``steps`` steps."""
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc="sft", unit="step", dynamic_ncols=True)


def _sft_batches(n_records: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """The record indices of every SFT step: ``batch_size`` at a time, without replacement, from a
    permutation of ``range(n_records)`` drawn from a generator seeded ``seed`` (a new permutation
    each pass; a batch can span two)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_records, generator=gen).tolist()
    cursor = 0
    while True:
        idx: list[int] = []
        while len(idx) < batch_size:
            if cursor >= len(order):
                order = torch.randperm(n_records, generator=gen).tolist()
                cursor = 0
            take = order[cursor : cursor + batch_size - len(idx)]
            idx.extend(take)
            cursor += len(take)
        yield idx


@dataclass
class _SftCurves:
    """What :func:`_sft_steps` records: ``loss_curve`` and ``eval_curve`` as ``[(step, value), ...]``,
    the response tokens trained on, and the seconds spent in evaluations."""

    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    eval_curve: list[tuple[int, float]] = field(default_factory=list)
    n_tokens: int = 0
    eval_seconds: float = 0.0


def _sft_steps(
    model,
    tokenizer,
    strategy: Strategy,
    prompts: Sequence[str],
    solutions: Sequence[str],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: Iterator[list[int]],
    *,
    steps: int,
    micro_batch_size: int | None,
    grad_clip: float,
    eval_records: Sequence[Mapping[str, Any]] | None,
    eval_every: int | None,
    template: str,
    eval_max_new_tokens: int,
    log_fn: LogFn | None,
    bar: Any,
) -> _SftCurves:
    """The ``steps`` optimizer steps of :func:`run_sft` (the model in train mode), each on the next
    indices of ``batches``; logs every step, evaluates every ``eval_every`` steps and after the last.

    Raises:
        FloatingPointError: a step's loss is not finite.
    """
    curves = _SftCurves()
    for step in range(1, steps + 1):
        idx = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss, n_step_tokens = sft_step(model, tokenizer, [prompts[i] for i in idx], [solutions[i] for i in idx],
                                       micro_batch_size=micro_batch_size, strategy=strategy)
        curves.n_tokens += n_step_tokens
        if not torch.isfinite(loss):
            raise FloatingPointError(f"sft: loss is {loss.item()} at step {step}")
        grad_norm = strategy.clip_grad_norm_(model, grad_clip)
        cur_lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        loss_v = float(loss.detach())
        curves.loss_curve.append((step, loss_v))
        if log_fn is not None:
            log_fn(step, {"sft/loss": loss_v, "sft/lr": cur_lr, "sft/grad_norm": grad_norm})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.4f}", lr=f"{cur_lr:.2e}", refresh=False)
        if eval_records is not None and (step % eval_every == 0 or step == steps):
            te = time.perf_counter()
            with strategy.local_phase(model):
                acc, _ = greedy_accuracy(strategy.policy(model), tokenizer, eval_records, template=template,
                                         max_new_tokens=eval_max_new_tokens)
            curves.eval_seconds += time.perf_counter() - te
            curves.eval_curve.append((step, acc))
            if log_fn is not None:
                log_fn(step, {"sft/eval_accuracy": acc})
            if bar is not None:
                bar.write(f"sft step {step}: eval accuracy {acc:.3f}")
            model.train()
    return curves


def _sft_summary(curves: _SftCurves, *, steps: int, batch_size: int, t0: float, c0: float) -> dict:
    """:func:`run_sft`'s result from its curves, ``t0`` (``time.perf_counter()``) and ``c0``
    (``time.process_time()``) taken when the steps started."""
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    train_seconds = seconds - curves.eval_seconds
    last = [v for _, v in curves.loss_curve[-10:]]
    return {
        "steps": steps,
        "batch_size": batch_size,
        "loss_curve": curves.loss_curve,
        "final_loss": curves.loss_curve[-1][1],
        "final_loss_mean10": sum(last) / len(last),
        "seconds": seconds,
        "train_seconds": train_seconds,
        "steps_per_s": steps / train_seconds if train_seconds > 0 else float("inf"),
        "cpu_seconds": cpu_seconds,
        "response_tokens": curves.n_tokens,
        "eval_curve": curves.eval_curve,
    }


def greedy_accuracy(
    model,
    tokenizer,
    records: Sequence[Mapping[str, Any]],
    *,
    template: str,
    max_new_tokens: int,
    batch_size: int = 256,
    timeout_s: float = 5.0,
    workers: int | None = None,
) -> tuple[float, list[str]]:
    """Share of ``records`` whose greedy response has the right final answer.

    The greedy pass of :func:`oar.evaluate.evaluation.evaluate_records` with an :class:`oar.rollout.HFEngine`
    on ``model`` (``batch_size`` prompts per ``generate`` call, left padding, prompts rendered with
    ``template`` and encoded with special tokens as in :func:`build_sft_batch`); responses are the
    new tokens up to eos, special tokens skipped, scored by :func:`oar.reward.score.score_batch` against
    ``record["answer"]``. The global torch RNG is not reseeded (safe to call inside training).

    Args:
        records: dicts with ``id``, ``question`` and ``answer``.

    Returns:
        ``(accuracy, responses)``, responses in the order of ``records``.

    Raises:
        ValueError: no records, or a record without one of the keys above.
    """
    from oar.evaluate.evaluation import evaluate_records
    from oar.rollout import HFEngine

    if not records:
        raise ValueError("greedy_accuracy: no records")
    for i, r in enumerate(records):
        missing = [k for k in ("id", "question", "answer") if k not in r]
        if missing:
            raise ValueError(f"greedy_accuracy: record {i} has no {missing} key(s) (keys: {sorted(r)})")
    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    summary, rows = evaluate_records(
        engine, tokenizer, records, template=template, greedy=True, samples=0,
        max_new_tokens=max_new_tokens, seed=None, timeout_s=timeout_s, workers=workers,
    )
    return summary["pass@1"], [row["response"] for row in rows]


def save_sft_model(output_dir: str | os.PathLike, model, tokenizer, summary: dict, *, started: float,
                   strategy: Strategy) -> None:
    """Write ``model`` (trained on ``strategy``: its full weights,
    :meth:`oar.trainer.strategy.Strategy.save_pretrained`), ``tokenizer`` and ``summary`` (as
    ``sft_summary.json``) to ``output_dir`` atomically.

    Everything goes into a temporary folder beside ``output_dir`` that is renamed onto it
    (:func:`oar.core.io.atomic_path`), so ``output_dir`` is either complete or absent.
    ``summary["seconds"]`` is set to the time since ``started`` (a ``time.perf_counter()`` value).
    """
    from oar.core.io import atomic_path, atomic_write_json

    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        strategy.save_pretrained(model, tokenizer, tmp)
        summary["seconds"] = time.perf_counter() - started
        atomic_write_json(Path(tmp) / "sft_summary.json", summary)
