"""A step verifier: a practical first-mistake signal (docs/methods.md, 5.1).

A small language model reads a response and says how likely each step's written result is: trained
once per start model on the SFT demonstrations, whose wrong steps are labelled by the task that wrote
them (``demo_errors`` of :func:`oar.data.synthetic.generate`: the share ``task.demo_error_rate`` of
the demonstration steps carries a wrong result), with the next-token loss on the results of the right steps only, so it
learns what a right result is and not the demonstrations' slips. A step's probability of being wrong
is ``1 - exp(mean log p(its result tokens))`` under it (one forward per response gives every step's),
and during RL the first step whose probability is at least ``threshold`` is the located first mistake
(none: the response keeps GRPO's credit). The first-mistake credits of :mod:`oar.credit.controls`
take that location where the oracle takes the task's ground truth
(:func:`oar.credit.controls.first_mistake_credit`, ``shape`` ``pinpoint`` or ``suffix``).

Training it is the trainer's (:mod:`oar.trainer.verifier`, ``oar verifier``); this module reads it:

- :func:`load_verifier` -- a trained verifier (``save_pretrained``) or any causal language model;
- :func:`step_error_probs` -- the probability that each step of each response is wrong;
- the estimator ``step_verifier`` (options ``verifier``: :data:`TRAINED`, the one the config trains,
  or a folder; ``shape``; ``threshold``; the reshaping's), registered without ``needs_model``: it
  does not call the policy.

The verifier reads the synthetic task's steps (their result spans), as the oracles do; on a real
benchmark a process reward model would take its place, which this module does not provide.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Sequence

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.core.io import VERIFIER_TRAINED

__all__ = ["load_verifier", "step_error_probs", "encode_responses", "span_positions", "token_logprobs",
           "first_wrong_step", "localisation_stats", "verifier_importance", "step_probabilities", "DEFAULT_THRESHOLD",
           "step_verifier_estimator", "SHAPES", "TRAINED"]

#: The option ``verifier``'s value (its default) that names the verifier the config's workflow trains:
#: ``<results_dir>/<name>/verifier/model`` (:attr:`oar.config.tree.ResultsTree.verifier_model`), identified by
#: :func:`oar.config.identity.verifier_key`.
TRAINED = VERIFIER_TRAINED
#: A step is located as the first mistake from this probability of being wrong on (option ``threshold``).
DEFAULT_THRESHOLD = 0.5
#: How the located first mistake becomes credit (:func:`oar.credit.controls.first_mistake_credit`).
SHAPES: tuple[str, ...] = ("pinpoint", "suffix")


def encode_responses(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[tuple[list[int], list[int]]]]:
    """Right-padded ``prompt + response`` ids and mask, each row's prompt length in tokens, and each
    response's characters' token map (``(starts, ends)`` of its tokens: one token per character for
    the character tokenizer, so the map is by offsets)."""
    rows, p_lens, maps = [], [], []
    for prompt, response in zip(prompts, responses):
        p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        enc = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
        rows.append(p_ids + enc["input_ids"])
        p_lens.append(len(p_ids))
        maps.append(([a for a, _ in enc["offset_mapping"]], [b for _, b in enc["offset_mapping"]]))
    L = max(map(len, rows)) if rows else 0
    ids = torch.full((len(rows), L), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask, p_lens, maps


def span_positions(span: Sequence[int], p_len: int, token_map: tuple[list[int], list[int]]) -> list[int]:
    """The sequence positions of the response tokens that a character span covers."""
    starts, ends = token_map
    return [p_len + i for i, (a, b) in enumerate(zip(starts, ends)) if a < span[1] and b > span[0]]


def token_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` log-probability of each token given the ones before it (0 at position 0)."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@functools.lru_cache(maxsize=4)
def load_verifier(source: str, device: str = "cpu") -> tuple[Any, Any]:
    """The verifier and its tokenizer (a folder of :func:`save_verifier`, or any causal language
    model of the policy's tokenizer: a local folder or a hub id), in eval mode on ``device``; cached
    per process.

    Raises:
        FileNotFoundError: ``source`` cannot be loaded, naming it and what to do.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(source)
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"credit step_verifier: option verifier {source!r} does not load as a causal "
                                f"language model ({str(e).splitlines()[0]}); train one with the workflow's verifier "
                                "rule (oar verifier)") from None
    return model.to(device).eval(), tok


@torch.no_grad()
def step_error_probs(model: Any, tokenizer: Any, prompts: Sequence[str], responses: Sequence[str],
                     result_spans: Sequence[Sequence[Sequence[int]]], chunk: int = 256) -> list[list[float]]:
    """For each response, the probability that each of its steps' written result is wrong:
    ``1 - exp(mean log p)`` of the result's tokens under ``model`` (one forward per response;
    ``result_spans``: character spans per step, as :func:`oar.task.parsing.parse_response` gives them)."""
    out: list[list[float]] = []
    for lo in range(0, len(responses), chunk):
        ids, mask, p_lens, maps = encode_responses(tokenizer, prompts[lo:lo + chunk], responses[lo:lo + chunk])
        device = next(model.parameters()).device
        lp = token_logprobs(model, ids.to(device), mask.to(device)).cpu()
        for i, spans in enumerate(result_spans[lo:lo + chunk]):
            row = []
            for span in spans:
                pos = span_positions(span, p_lens[i], maps[i])
                row.append(1.0 - math.exp(float(lp[i, pos].mean())) if pos else 0.0)
            out.append(row)
    return out


def first_wrong_step(probs: Sequence[float], threshold: float) -> int:
    """The first step whose probability of being wrong is at least ``threshold``; -1 when none is."""
    return next((k for k, p in enumerate(probs) if p >= threshold), -1)


@register_estimator("step_verifier")
def step_verifier_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """The first mistake located by a step verifier, as first-mistake credit.

    Options: ``verifier`` (the verifier's folder: ``oar train`` puts the one its config trains in place
    of :data:`TRAINED`), ``shape``
    (``pinpoint``: the oracle's Bi-Level reshaping with importance 1 on the located step's result
    tokens; ``suffix``: the located step's result on spared from the correct prefix, as
    ``oracle_suffix``), ``threshold`` (0.5), ``norm_by_std``, ``eps`` and (``pinpoint``) the reshaping's
    ``quantile``, ``beta``, ``floor``, ``preserve_mass`` (``suffix``: ``preserve_mass``). Stats as the
    oracles', with ``verifier_s`` and :func:`localisation_stats`; rows scored: below their group's mean
    with a located step.
    """
    from oar.credit.controls import first_mistake_credit

    opts = dict(options)
    source = str(opts.pop("verifier", TRAINED))
    shape = opts.pop("shape", "pinpoint")
    if shape not in SHAPES:
        raise ValueError(f"credit step_verifier: shape {shape!r}; valid: {list(SHAPES)}")
    threshold = float(opts.pop("threshold", DEFAULT_THRESHOLD))
    t0 = time.perf_counter()
    first, labels, found = verifier_importance(batch, source, threshold)
    stats = {"verifier_s": time.perf_counter() - t0, **localisation_stats(found, batch)}
    return first_mistake_credit("step_verifier", batch, opts, labels=labels, first_mistake=first,
                                located=torch.tensor([k >= 0 for k in found], dtype=torch.bool), shape=shape, stats=stats)


def verifier_importance(batch: CreditBatch, source: str, threshold: float = DEFAULT_THRESHOLD
                        ) -> tuple[torch.Tensor, Any, list[int]]:
    """The verifier's located first mistake of each response of ``batch`` (the verifier ``source``:
    :func:`load_verifier`; steps parsed by :func:`oar.credit.controls.step_labels`).

    Returns:
        ``(importance, labels, found)``: ``(B, T)`` float, 1 on the result tokens of the first step
        whose probability of being wrong (:func:`step_error_probs`) is at least ``threshold``; the
        parsed steps; per response that step (0-based, -1 for none).
    """
    probs, labels = step_probabilities(batch, source)
    found = [first_wrong_step(row, threshold) for row in probs]
    first = torch.zeros_like(labels.results)
    for b, k in enumerate(found):
        if k >= 0:
            first[b] = (labels.result_step[b] == k + 1).to(first.dtype)
    return first, labels, found


def step_probabilities(batch: CreditBatch, source: str) -> tuple[list[list[float]], Any]:
    """Each response's steps (:func:`oar.credit.controls.step_labels`) and the verifier's probability
    that each is wrong (:func:`step_error_probs`, the prompts decoded from ``batch.prompt_ids``).

    Raises:
        ValueError: ``source`` is :data:`TRAINED` (``oar train`` and ``oar attribution`` put the
            config's verifier in its place; called directly, a folder must be named).
    """
    from oar.credit.controls import step_labels

    if str(source) == TRAINED:
        raise ValueError(f"step_verifier: verifier {TRAINED!r} names the verifier a config's workflow trains, which "
                         "`oar train` and `oar attribution` locate; called directly, name the verifier's folder")
    labels = step_labels(batch, name="step_verifier")
    model, tok = load_verifier(str(source), str(batch.response_ids.device))
    pmask = batch.prompt_mask if batch.prompt_mask is not None else torch.ones_like(batch.prompt_ids)
    prompts = [batch.tokenizer.decode(batch.prompt_ids[b][pmask[b].bool()].tolist(), skip_special_tokens=True)
               for b in range(batch.prompt_ids.shape[0])]
    return step_error_probs(model, tok, prompts, labels.texts, labels.result_spans), labels


def localisation_stats(found: Sequence[int], batch: CreditBatch) -> dict[str, float]:
    """How the verifier's locations (``found``: per response the 0-based step, -1 for none) compare with
    the task's ground truth (:func:`oar.credit.controls.oracle_labels`; read for these statistics only,
    never for the credit), as counts of the batch, so that they add up over processes and steps:

    - ``verifier_wrong_rows``: wrong responses whose first mistake the task locates;
    - ``verifier_hits``: of those, where the verifier locates that step (``hits / wrong_rows`` is the
      localisation accuracy a degraded oracle's ``localisation`` sets, docs/methods.md 5);
    - ``verifier_others``: of those, where it locates another step;
    - ``verifier_right_rows``: parsed responses with a positive reward;
    - ``verifier_false_alarms``: of those, where it locates a step (they keep GRPO's credit: only
      responses below their group's mean are scored).
    """
    from oar.credit.controls import oracle_labels

    truth = oracle_labels(batch, name="step_verifier")
    got = torch.tensor(list(found), dtype=torch.long)
    wrong = truth.located
    right = truth.parsed & (batch.rewards.detach().cpu() > 0)
    hit = got[wrong] == truth.mistake_step[wrong]
    return {"verifier_wrong_rows": float(wrong.sum()), "verifier_hits": float(hit.sum()),
            "verifier_others": float(((got[wrong] >= 0) & ~hit).sum()),
            "verifier_right_rows": float(right.sum()), "verifier_false_alarms": float((got[right] >= 0).sum())}
