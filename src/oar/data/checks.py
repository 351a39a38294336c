"""Checks of the records against the model and the reward, before anything trains (``oar data``) and
again before anything is generated (``oar evaluate``, the prompts: a benchmark changed since).

A 1 MB question used to pass ``oar data`` and stop ``oar evaluate`` after all training (a ~1 TB
allocation); a gold answer math-verify cannot read scored every response wrong without a word.

- :func:`prompt_model` -- the config's model as the prompt check needs it (:class:`PromptModel`: its
  tokenizer and context length), read without loading the weights: ``tiny``'s tokenizer and
  ``model.tiny``; a local folder's tokenizer and ``config.json``; a GGUF file's own; a hub id's fetched
  copy (:func:`oar.fetch.with_fetched_model`) or its tokenizer in the local Hugging Face cache (never
  downloaded). Otherwise it says why the check is skipped. The context length is what
  :func:`oar.plan.shape.source_shape` reads (``max_position_embeddings``).
- :func:`check_prompts` -- every prompt, rendered with ``task.template`` and the model's tokenizer
  (:func:`oar.data.prompts.render_prompt`, tokenized as the rollout engines do), fits the context
  less the generation budget (:data:`TRAIN_BUDGET_KEY` for the training set, :data:`EVAL_BUDGET_KEY`
  for the evaluation benchmarks); else a ValueError, one line naming the first record that does not
  fit (``<file>:<line>``) and what to do.
- :func:`unreadable_golds` -- the gold answers the reward cannot read as math
  (:func:`oar.reward.gold_readable`, the reward's own gold parser), which :func:`gold_warning` words.
  They are a warning, not an error: 15 of the 17,779 gold answers of the shipped benchmarks
  (../shared/data: minerva_math 5, olympiadbench 2, math_train 8) read only as text, and refusing them
  would stop every config that uses those files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
    "TRAIN_BUDGET_KEY",
    "EVAL_BUDGET_KEY",
    "RECORDS_SHOWN",
    "PromptModel",
    "prompt_model",
    "loaded_prompt_model",
    "prompt_lengths",
    "check_prompts",
    "unreadable_golds",
    "gold_warning",
]

#: The generation budget that the training set's prompts share the context with (rollouts).
TRAIN_BUDGET_KEY = "rollout.max_new_tokens"
#: The generation budget that the evaluation benchmarks' prompts share the context with.
EVAL_BUDGET_KEY = "eval.max_new_tokens"
#: How many records a message names beyond the first (the rest are counted).
RECORDS_SHOWN = 3
#: Prompts tokenized in one call (bounded memory for a large set).
PROMPT_CHUNK = 256

Located = Sequence[tuple[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class PromptModel:
    """What the prompt check needs of a model: its ``tokenizer``, its context length
    (``max_positions``, ``max_position_embeddings``) and where that length was read (``origin``)."""

    tokenizer: Any
    max_positions: int
    origin: str


def prompt_model(config: Mapping[str, Any]) -> PromptModel | str:
    """The :class:`PromptModel` of ``config``'s ``model`` (a validated config), without loading weights;
    or, when it cannot be had here, why (a one-line note: the check is skipped, ``oar evaluate``
    checks again with the model it loads).

    Raises:
        oar.models.ModelLoadError: a local model whose tokenizer does not load (naming its file).
        FileNotFoundError: ``model.source`` is a path that does not exist.
    """
    from oar.fetch import is_hub_model_id, with_fetched_model
    from oar.models import load_tokenizer
    from oar.plan.shape import PlanError, source_shape

    spec = with_fetched_model(dict(config))["model"]
    source = str(spec["source"])
    try:
        tokenizer = load_tokenizer(spec)
    except FileNotFoundError:
        if not is_hub_model_id(source):
            raise
        return (f"model.source {source!r} is a hub id that is not fetched yet (rule fetch_model) nor in the local "
                f"Hugging Face cache, so its tokenizer is not here and no prompt is checked against its context "
                f"(oar evaluate checks them before it generates)")
    try:
        shape = source_shape(spec)
    except PlanError as e:
        return f"the context length of model.source {source!r} is unknown ({e}), so no prompt is checked against it"
    if not shape.max_position_embeddings:
        return f"{shape.origin} gives no max_position_embeddings, so no prompt is checked against the context"
    return PromptModel(tokenizer, int(shape.max_position_embeddings), shape.origin)


def loaded_prompt_model(model: Any, tokenizer: Any, origin: str) -> PromptModel | None:
    """The :class:`PromptModel` of a loaded ``model`` and its ``tokenizer`` (its config's
    ``max_position_embeddings``), ``origin`` naming it; None when the config gives no length."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return PromptModel(tokenizer, int(positions), origin) if positions else None


def prompt_lengths(tokenizer: Any, template: str, questions: Sequence[str]) -> list[int]:
    """Tokens of each question's prompt: rendered with ``template`` (:func:`oar.data.prompts.render_prompt`)
    and tokenized as the rollout engines tokenize a batch of prompts
    (:func:`oar.rollout.base.prompt_add_special_tokens`)."""
    from oar.data.prompts import render_prompt
    from oar.rollout.base import prompt_add_special_tokens

    prompts = [render_prompt(template, q, tokenizer) for q in questions]
    if not prompts:
        return []
    special = prompt_add_special_tokens(tokenizer, prompts)
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=special)["input_ids"]]


def _shown(items: Sequence[str]) -> str:
    """The first :data:`RECORDS_SHOWN` of ``items``, comma-separated, ``...`` when there are more."""
    return ", ".join(items[:RECORDS_SHOWN]) + (", ..." if len(items) > RECORDS_SHOWN else "")


def check_prompts(located: Located, *, template: str, model: PromptModel, budget: int, budget_key: str,
                  what: str) -> int:
    """That every record's prompt fits ``model``'s context with ``budget`` new tokens after it.

    Args:
        located: ``(where, record)`` pairs (:func:`oar.data.benchmarks.load_benchmark_located`).
        template: ``task.template``.
        budget, budget_key: the generation budget and the config key that sets it.
        what: the set, for the message (``eval.benchmarks.0 (aime24)``).

    Returns:
        The longest prompt's tokens (0 for no records).

    Raises:
        ValueError: one line naming the first record whose prompt does not fit (and how many more do
            not), its length, the room the context leaves and what to do; or naming ``budget_key`` when
            the budget leaves no room at all.
    """
    room = model.max_positions - budget
    if room < 1:
        raise ValueError(f"{budget_key}: {budget} new tokens leave no room for a prompt in the model's context "
                         f"({model.origin}: max_position_embeddings {model.max_positions}); lower {budget_key}")
    longest = 0
    too_long: list[tuple[str, int]] = []
    for lo in range(0, len(located), PROMPT_CHUNK):
        chunk = located[lo:lo + PROMPT_CHUNK]
        lengths = prompt_lengths(model.tokenizer, template, [str(rec["question"]) for _, rec in chunk])
        for (where, _), n in zip(chunk, lengths):
            longest = max(longest, n)
            if n > room:
                too_long.append((where, n))
    if too_long:
        where, n = too_long[0]
        rest = [w for w, _ in too_long[1:]]
        more = f"; {len(rest)} more records do not fit either: {_shown(rest)}" if rest else ""
        raise ValueError(
            f"{where}: {what}: the prompt is {n} tokens ({template} template), more than the {room} the model's "
            f"context leaves for it ({model.origin}: max_position_embeddings {model.max_positions} minus "
            f"{budget_key} {budget}){more}; shorten or drop the record{'s' if rest else ''}, or give the prompts "
            f"more room: lower {budget_key} or use a model with a longer context")
    return longest


def unreadable_golds(located: Located, *, timeout_s: float) -> list[tuple[str, str]]:
    """``(where, gold)`` of every record whose gold answer the reward cannot read as math
    (:func:`oar.reward.gold_readable` under ``reward.timeout_s``), in order."""
    from oar.reward import gold_readable

    return [(where, str(rec["answer"])) for where, rec in located
            if not gold_readable(str(rec["answer"]), timeout_s=timeout_s)]


def gold_warning(bad: Sequence[tuple[str, str]], total: int, what: str) -> str:
    """One line about the ``bad`` gold answers (:func:`unreadable_golds`) of ``total`` in ``what``: the
    count, the first :data:`RECORDS_SHOWN` records with their values, and what to do."""
    return (f"{what}: {len(bad)} of {total} gold answers do not read as math (math-verify, as the reward parses "
            f"them), so every response to them scores wrong unless it repeats their text: "
            f"{_shown([f'{where} {gold!r}' for where, gold in bad])}; fix or drop those records")
