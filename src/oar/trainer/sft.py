"""Warm-start supervised fine-tuning (SFT) on reference solutions, and greedy accuracy.

The RL stage needs a policy that already solves some problems (a policy with zero reward gets no
learning signal from GRPO-style estimators). For the tiny model this SFT is that warm start; for a
real model (config/smollm2.yaml) it is a format warm-up on GSM8K's reference solutions rewritten to
end in ``\\boxed{}``, so that the start model writes answers the reward can read.

- :func:`build_sft_batch` -- tokenize prompt + response (+ eos), labels only on response tokens
  (:func:`sft_rows` then :func:`pad_sft_rows`).
- :func:`sft_step` -- one batch's gradient, accumulated over length-sorted micro-batches.
- :func:`run_sft` -- AdamW, linear warmup then cosine decay, gradient clipping, fixed step budget.
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
from oar.config.identity import sft_cache_key
from oar.trainer.optim import decay_groups, make_scheduler

__all__ = [
    "IGNORE_INDEX",
    "build_sft_batch",
    "run_sft",
    "greedy_accuracy",
    "save_sft_model",
    "sft_from_config",
    "sft_or_cached",
]

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
             device: torch.device | str) -> tuple[torch.Tensor, int]:
    """Accumulate the gradient of one SFT batch, ``micro_batch_size`` sequences at a time.

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
    if micro_batch_size is None:
        batch = {k: v.to(device) for k, v in build_sft_batch(tokenizer, prompts, responses).items()}
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), int((batch["labels"] != IGNORE_INDEX).sum())
    if micro_batch_size < 1:
        raise ValueError(f"sft.micro_batch_size: must be >= 1, got {micro_batch_size}")
    rows = sorted(sft_rows(tokenizer, prompts, responses), key=lambda row: len(row[0]))
    batches = [pad_sft_rows(tokenizer, rows[j : j + micro_batch_size]) for j in range(0, len(rows), micro_batch_size)]
    n_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    total = torch.zeros((), device=device)
    for b in batches:
        b = {k: v.to(device) for k, v in b.items()}
        labels = b.pop("labels")
        logits = model(**b).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                 ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
        loss.backward()
        total += loss.detach()
    return total, n_tokens


def run_sft(
    model,
    tokenizer,
    train_records: Sequence[Mapping[str, Any]],
    *,
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
    The model is trained in place and left in eval mode.

    Args:
        train_records: dicts with ``question`` and ``solution``.
        eval_records: optional dicts with ``id``, ``question`` and ``answer``; greedy accuracy on them
            every ``eval_every`` steps and after the last step (needs ``eval_every``).
        log_fn: called as ``log_fn(step, metrics)`` after every step (``sft/loss``, ``sft/lr``,
            ``sft/grad_norm``; 1-based step) and after every evaluation (``sft/eval_accuracy``).

    Returns:
        ``{"steps", "batch_size", "loss_curve": [(step, loss), ...] (every step, 1-based),
        "final_loss" (last step), "final_loss_mean10" (mean of the last 10 steps), "seconds" (wall,
        evaluations included), "train_seconds" (wall, evaluations excluded), "steps_per_s" (from
        train_seconds), "cpu_seconds" (process CPU time, all threads; less sensitive to other load on
        the machine), "response_tokens" (trained on), "eval_curve": [(step, accuracy), ...]}``.
    """
    _check_sft_inputs(train_records, steps=steps, batch_size=batch_size)
    if eval_records is not None and eval_every is None:
        eval_every = steps
    prompts = [render_prompt(template, r["question"], tokenizer) for r in train_records]
    solutions = [r["solution"] for r in train_records]
    optimizer = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=tuple(betas))
    scheduler = make_scheduler(optimizer, warmup_steps=warmup_steps, floor_step=steps - 1, schedule="cosine",
                               min_ratio=min_lr_ratio)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="sft", unit="step", dynamic_ncols=True)
    t0, c0 = time.perf_counter(), time.process_time()
    model.train()
    try:
        curves = _sft_steps(model, tokenizer, prompts, solutions, optimizer, scheduler,
                            _sft_batches(len(train_records), batch_size, seed), steps=steps,
                            micro_batch_size=micro_batch_size, grad_clip=grad_clip, eval_records=eval_records,
                            eval_every=eval_every, template=template, eval_max_new_tokens=eval_max_new_tokens,
                            log_fn=log_fn, bar=bar)
    finally:
        model.eval()
        if bar is not None:
            bar.close()
    return _sft_summary(curves, steps=steps, batch_size=batch_size, t0=t0, c0=c0)


def _check_sft_inputs(train_records: Sequence[Mapping[str, Any]], *, steps: int, batch_size: int) -> None:
    """Raise ValueError for :func:`run_sft`'s bad arguments: ``steps`` or ``batch_size`` below 1, no
    training records, or a first record without ``question`` or ``solution``."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"sft: steps and batch_size must be >= 1 (got steps={steps}, batch_size={batch_size})")
    if not train_records:
        raise ValueError("sft: no training records")
    for i, r in enumerate(train_records[:1]):
        for k in ("question", "solution"):
            if k not in r:
                raise ValueError(f"sft: training record {i} has no {k!r} key (keys: {sorted(r)})")


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
    device = next(model.parameters()).device
    curves = _SftCurves()
    for step in range(1, steps + 1):
        idx = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss, n_step_tokens = sft_step(model, tokenizer, [prompts[i] for i in idx], [solutions[i] for i in idx],
                                       micro_batch_size=micro_batch_size, device=device)
        curves.n_tokens += n_step_tokens
        if not torch.isfinite(loss):
            raise FloatingPointError(f"sft: loss is {loss.item()} at step {step}")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
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
            acc, _ = greedy_accuracy(model, tokenizer, eval_records, template=template,
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


def save_sft_model(output_dir: str | os.PathLike, model, tokenizer, summary: dict, *, started: float) -> None:
    """Write ``model``, ``tokenizer`` and ``summary`` (as ``sft_summary.json``) to ``output_dir`` atomically.

    Everything goes into a temporary folder beside ``output_dir`` that is renamed onto it
    (:func:`oar.core.io.atomic_path`), so ``output_dir`` is either complete or absent.
    ``summary["seconds"]`` is set to the time since ``started`` (a ``time.perf_counter()`` value).
    """
    from oar.core.io import atomic_path, atomic_write_json

    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        summary["seconds"] = time.perf_counter() - started
        atomic_write_json(Path(tmp) / "sft_summary.json", summary)

def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    sec = config.get(name)
    if not isinstance(sec, Mapping):
        raise ValueError(f"config: missing or malformed section {name!r}")
    return sec


def _key(sec: Mapping[str, Any], section: str, key: str) -> Any:
    if key not in sec:
        raise ValueError(f"config: missing key {section}.{key}")
    return sec[key]


def sft_data(config: Mapping[str, Any]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The warm-start SFT's training records and its held-out evaluation sets, from ``config["task"]``.

    - ``task.kind: synthetic``: ``task.train_size`` generated training records (seed ``task.seed``,
      options ``task.synthetic``); evaluation sets ``test`` and ``ood`` of ``sft.eval_size`` records.
    - ``task.kind: benchmark``: the records of ``task.benchmark`` (:func:`oar.data.records.training_records`),
      which must carry a reference ``solution`` (gsm8k's, rewritten to end in ``\\boxed{}``); the
      file's last ``sft.eval_size`` records are held out as the evaluation set ``heldout``, and the
      first ``task.train_size`` of the rest are trained on. A format warm-up on real data, so that the
      start of RL answers in the form the reward reads.

    Returns:
        ``(train_records, {split: eval_records})``; training records have ``question`` and ``solution``.

    Raises:
        ValueError: an unknown ``task.kind``; benchmark records without a ``solution`` (names the
            benchmark and its source); fewer records than ``sft.eval_size`` + 1.
    """
    from oar.data.records import training_records
    from oar.data.synthetic import generate

    task = _section(config, "task")
    sft = _section(config, "sft")
    kind = _key(task, "task", "kind")
    eval_size = int(_key(sft, "sft", "eval_size"))
    train_size = int(_key(task, "task", "train_size"))
    if kind == "synthetic":
        options = dict(_key(task, "task", "synthetic"))
        seed = int(_key(task, "task", "seed"))
        evals = {split: generate(split, eval_size, seed=seed, **options) for split in ("test", "ood")}
        return training_records({**task, "synthetic": options, "seed": seed, "train_size": train_size}), evals
    if kind != "benchmark":
        raise ValueError(f"config: task.kind={kind!r}: SFT supports 'synthetic' and 'benchmark'")
    _key(task, "task", "benchmark")
    records = training_records(task)
    name, source = task["benchmark"]["name"], task["benchmark"].get("source")
    if "solution" not in records[0]:
        raise ValueError(f"config: task.benchmark: the {name!r} records of {source} carry no reference 'solution' "
                         f"to fine-tune on (gsm8k's do); set sft.enabled: false")
    if len(records) <= eval_size:
        raise ValueError(f"config: sft.eval_size={eval_size}: {source} has only {len(records)} {name} records, "
                         f"none left to train on")
    return records[:-eval_size][:train_size], {"heldout": records[-eval_size:]}


def sft_from_config(
    config: Mapping[str, Any],
    output_dir: str | os.PathLike,
    *,
    progress: bool = True,
    log_fn: LogFn | None = None,
    n_examples: int = 5,
) -> dict:
    """Warm-start SFT as the config says; save the model to ``output_dir`` atomically.

    Steps: build the policy from ``config["model"]`` (for ``source: tiny`` the initialisation
    seed is ``sft.seed``); the training records and held-out sets of :func:`sft_data`; :func:`run_sft`
    with ``config["sft"]``; greedy accuracy and the share of answers with an extractable final answer
    on each held-out set (``sft.max_new_tokens`` new tokens, reward settings from ``config["reward"]``);
    then write model, tokenizer and ``sft_summary.json`` into a temporary folder beside ``output_dir``
    and rename it onto ``output_dir`` (:func:`oar.core.io.atomic_path`), so ``output_dir`` is either
    complete or absent.

    Returns:
        The summary written to ``sft_summary.json``: ``accuracy`` and ``extracted`` (per held-out set:
        ``test``/``ood`` for the synthetic task, ``heldout`` for a benchmark), ``seconds`` (whole
        call), ``sft`` (the :func:`run_sft` result incl. ``loss_curve``), ``examples`` (first
        ``n_examples`` questions of the first set with response and gold), the ``sft`` config section
        used, model facts (parameters, attention implementation, threads), and ``provenance``
        (:func:`oar.core.provenance.provenance`, with the end time).
    Raises:
        oar.core.io.OutputPathError: ``output_dir`` cannot be a folder this process writes (checked first).
        oar.models.checks.ModelLoadError: a file of the model cannot be loaded.
    """
    from datetime import datetime, timezone

    from oar.core.io import check_output_folder
    from oar.models.loading import load_policy
    from oar.core.device import job_device
    from oar.core.provenance import provenance, with_end_time

    t0 = time.perf_counter()
    check_output_folder(output_dir, what="the SFT output folder (--output)")  # before the training, not after
    started = datetime.now(timezone.utc)
    model_spec = dict(_section(config, "model"))
    task = _section(config, "task")
    sft = _section(config, "sft")
    reward = _section(config, "reward")
    template = _key(task, "task", "template")
    sft_seed = int(_key(sft, "sft", "seed"))
    max_new_tokens = int(_key(sft, "sft", "max_new_tokens"))
    train_records, eval_sets = sft_data(config)

    if model_spec.get("source") == "tiny":
        model_spec["tiny"] = {"seed": sft_seed, **dict(model_spec.get("tiny") or {})}
    model, tokenizer = load_policy(model_spec)
    device = job_device(config)
    model.to(device)

    result = run_sft(model, tokenizer, train_records, **_run_sft_options(sft), seed=sft_seed,
                     micro_batch_size=sft.get("micro_batch_size"), template=template, progress=progress,
                     log_fn=log_fn)
    accuracy, extracted, examples = _heldout_accuracy(
        model, tokenizer, eval_sets, reward, template=template, max_new_tokens=max_new_tokens, step=result["steps"],
        log_fn=log_fn, n_examples=n_examples)
    summary = {
        "accuracy": accuracy,
        "extracted": extracted,
        "eval_size": int(_key(sft, "sft", "eval_size")),
        "seconds": None,  # filled below
        "sft": result,
        "examples": examples,
        "config_sft": dict(sft),
        "model": _model_facts(model, model_spec.get("source")),
        "train_size": len(train_records),
        "template": template,
        "provenance": with_end_time(provenance(device=str(device), started=started)),
    }
    save_sft_model(output_dir, model, tokenizer, summary, started=t0)
    return summary


def _model_facts(model, source: Any) -> dict[str, Any]:
    """The summary's ``model`` entry: ``source`` (``model.source``), parameter count, attention
    implementation and torch's thread count."""
    return {
        "source": source,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(),
    }


def _run_sft_options(sft: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`run_sft`'s optimisation settings from the ``sft`` section (``steps``, ``batch_size``,
    ``lr``, ``weight_decay``, ``betas``, ``warmup_steps``, ``grad_clip``; read in that order, the first
    missing one a ValueError)."""
    return dict(
        steps=int(_key(sft, "sft", "steps")),
        batch_size=int(_key(sft, "sft", "batch_size")),
        lr=float(_key(sft, "sft", "lr")),
        weight_decay=float(_key(sft, "sft", "weight_decay")),
        betas=[float(b) for b in _key(sft, "sft", "betas")],
        warmup_steps=int(_key(sft, "sft", "warmup_steps")),
        grad_clip=float(_key(sft, "sft", "grad_clip")),
    )


def _heldout_accuracy(
    model,
    tokenizer,
    eval_sets: Mapping[str, Sequence[Mapping[str, Any]]],
    reward: Mapping[str, Any],
    *,
    template: str,
    max_new_tokens: int,
    step: int,
    log_fn: LogFn | None,
    n_examples: int,
) -> tuple[dict[str, float], dict[str, float], list[dict]]:
    """Greedy accuracy (:func:`greedy_accuracy`, the ``reward`` section's ``timeout_s`` and
    ``workers``) and the share of responses with an extractable final answer on each held-out set,
    each logged at ``step``; with the first ``n_examples`` questions of the first set, their responses
    and gold answers.

    Returns:
        ``(accuracy, extracted, examples)``, the first two keyed by set name.
    """
    from oar.reward.score import extracted_answer

    reward_kw = {
        "timeout_s": float(_key(reward, "reward", "timeout_s")),
        "workers": _key(reward, "reward", "workers"),
    }
    accuracy: dict[str, float] = {}
    extracted: dict[str, float] = {}
    examples: list[dict] = []
    for split, recs in eval_sets.items():
        acc, responses = greedy_accuracy(model, tokenizer, recs, template=template,
                                         max_new_tokens=max_new_tokens, **reward_kw)
        accuracy[split] = acc
        extracted[split] = sum(extracted_answer(r) is not None for r in responses) / len(responses)
        if log_fn is not None:
            log_fn(step, {f"sft/accuracy_{split}": acc, f"sft/extracted_{split}": extracted[split]})
        if not examples:
            examples = [
                {"question": r["question"], "response": resp, "answer": r["answer"]}
                for r, resp in zip(recs[:n_examples], responses[:n_examples])
            ]
    return accuracy, extracted, examples


def sft_or_cached(config: Mapping[str, Any], output_dir: str | os.PathLike, *, progress: bool = True,
                  log_fn: LogFn | None = None) -> dict:
    """:func:`sft_from_config` through the cache ``config["sft"]["cache_dir"]`` (null: no cache).

    A cache entry is the folder ``<cache_dir>/<sft_cache_key(config)>/``
    (:func:`oar.config.identity.sft_cache_key`) holding a finished SFT (model, tokenizer,
    ``sft_summary.json``). When it exists it is copied to ``output_dir`` (atomically) instead of
    training; otherwise SFT runs and its output is copied into the cache (atomically: two runs filling
    one entry leave one complete copy). Settings that differ in anything the model, task or sft sections
    hold, or in the device, have another key, so a copy is always the model this config's SFT would
    train (up to the float-level differences of another machine or thread count).

    Returns:
        The summary, with ``cached_from`` (the entry's path) when it was copied from the cache.
    """
    import json
    import shutil

    from oar.core.io import atomic_path, atomic_write_json, check_output_folder

    check_output_folder(output_dir, what="the SFT output folder (--output)")
    cache_dir = config["sft"].get("cache_dir")
    if not cache_dir:
        return sft_from_config(config, output_dir, progress=progress, log_fn=log_fn)
    check_output_folder(cache_dir, what="the SFT cache (sft.cache_dir)")
    entry = Path(cache_dir) / sft_cache_key(config)
    if (entry / "sft_summary.json").is_file():
        summary = json.loads((entry / "sft_summary.json").read_text(encoding="utf-8"))
        summary["cached_from"] = str(entry)
        with atomic_path(output_dir) as tmp:
            shutil.copytree(entry, tmp)
            atomic_write_json(tmp / "sft_summary.json", summary)
        print(f"sft: copied {entry} (a finished SFT with the same model, task and sft settings) to {output_dir}",
              flush=True)
        return summary
    summary = sft_from_config(config, output_dir, progress=progress, log_fn=log_fn)
    with atomic_path(entry) as tmp:
        shutil.copytree(output_dir, tmp)
    return summary
