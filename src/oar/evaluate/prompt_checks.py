"""Checks of the records against the model and the reward, before anything trains (``oar data``) and
again before anything is generated (``oar evaluate``, the prompts: a benchmark changed since).

A 1 MB question used to pass ``oar data`` and stop ``oar evaluate`` after all training (a ~1 TB
allocation); a gold answer math-verify cannot read scored every response wrong without a word.

- :func:`prompt_model` -- the config's model as the prompt check needs it (:class:`PromptModel`: its
  tokenizer and context length), read without loading the weights: ``tiny``'s tokenizer and
  ``model.tiny``; a local folder's tokenizer and ``config.json``; a GGUF file's own; a hub id's fetched
  copy (:func:`oar.models.fetch.with_fetched_model`) or its tokenizer in the local Hugging Face cache (never
  downloaded). Otherwise it says why the check is skipped. The context length is what
  :func:`oar.plan.shape.source_shape` reads (``max_position_embeddings``).
- :func:`check_prompts` -- every prompt, rendered with ``task.template`` and the model's tokenizer
  (:func:`oar.data.prompts.render_prompt`, tokenized as the rollout engines do), is shorter than the
  model's context (else a ValueError, one line naming the first record that is not, ``<file>:<line>``,
  and what to do); a prompt that leaves less than the generation budget (:data:`TRAIN_BUDGET_KEY` for
  the training set, :data:`EVAL_BUDGET_KEY` for the evaluation benchmarks) is counted in a warning
  (config/paper.yaml's 4,096-token context leaves 1,096 tokens for a prompt beside 3,000 new ones,
  and a few olympiadbench and MATH prompts are longer: their answers are cut short, as vLLM caps
  them, rather than the run stopping).
- :func:`unreadable_golds` -- the gold answers the reward cannot read as math
  (:func:`oar.reward.verify.gold_readable`, the reward's own gold parser), which :func:`gold_warning` words.
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
        oar.models.checks.ModelLoadError: a local model whose tokenizer does not load (naming its file).
        FileNotFoundError: ``model.source`` is a path that does not exist.
    """
    from oar.models.fetch import is_hub_model_id, with_fetched_model
    from oar.models.loading import load_tokenizer
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
                  what: str) -> tuple[int, str | None]:
    """Every record's prompt against ``model``'s context: a prompt as long as the whole context is
    refused (nothing could be generated after it; a 1 MB question once made a ~1 TB allocation); a
    prompt that leaves fewer than ``budget`` new tokens is counted in a warning (its answers may be
    cut short at the context's end, as vLLM caps them at ``max_model_len``).

    Args:
        located: ``(where, record)`` pairs (:func:`oar.data.benchmarks.load_benchmark_located`).
        template: ``task.template``.
        budget, budget_key: the generation budget and the config key that sets it.
        what: the set, for the messages (``eval.benchmarks.0 (aime24)``).

    Returns:
        ``(the longest prompt's tokens, the warning line or None)``.

    Raises:
        ValueError: one line naming the first record whose prompt fills the context (and how many more
            do), its length and what to do.
    """
    longest = 0
    too_long: list[tuple[str, int]] = []
    tight: list[tuple[str, int]] = []
    for lo in range(0, len(located), PROMPT_CHUNK):
        chunk = located[lo:lo + PROMPT_CHUNK]
        lengths = prompt_lengths(model.tokenizer, template, [str(rec["question"]) for _, rec in chunk])
        for (where, _), n in zip(chunk, lengths):
            longest = max(longest, n)
            if n >= model.max_positions:
                too_long.append((where, n))
            elif n > model.max_positions - budget:
                tight.append((where, n))
    context = f"{model.origin}: max_position_embeddings {model.max_positions}"
    if too_long:
        where, n = too_long[0]
        rest = [w for w, _ in too_long[1:]]
        more = f"; {len(rest)} more records do not fit either: {_shown(rest)}" if rest else ""
        raise ValueError(
            f"{where}: {what}: the prompt is {n} tokens ({template} template), as long as the model's whole context "
            f"or longer ({context}), so nothing can be generated after it{more}; shorten or drop the "
            f"record{'s' if rest else ''}, or use a model with a longer context")
    warning = None
    if tight:
        warning = (f"{what}: {len(tight)} of {len(located)} prompts leave fewer than {budget_key} {budget} new tokens in "
                   f"the model's context ({context}), so their answers may be cut short: "
                   f"{_shown([f'{w} ({n} tokens)' for w, n in tight])}; shorten them or lower {budget_key}")
    return longest, warning


def unreadable_golds(located: Located, *, timeout_s: float) -> list[tuple[str, str]]:
    """``(where, gold)`` of every record whose gold answer the reward cannot read as math
    (:func:`oar.reward.verify.gold_readable` under ``reward.timeout_s``), in order."""
    from oar.reward.verify import gold_readable

    return [(where, str(rec["answer"])) for where, rec in located
            if not gold_readable(str(rec["answer"]), timeout_s=timeout_s)]


def gold_warning(bad: Sequence[tuple[str, str]], total: int, what: str) -> str:
    """One line about the ``bad`` gold answers (:func:`unreadable_golds`) of ``total`` in ``what``: the
    count, the first :data:`RECORDS_SHOWN` records with their values, and what to do."""
    return (f"{what}: {len(bad)} of {total} gold answers do not read as math (math-verify, as the reward parses "
            f"them), so every response to them scores wrong unless it repeats their text: "
            f"{_shown([f'{where} {gold!r}' for where, gold in bad])}; fix or drop those records")
