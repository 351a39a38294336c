"""A process reward model from the hub as the first-mistake signal on real benchmarks (docs/methods.md, 5.1).

The step verifier (:mod:`oar.credit.verifier`) reads the synthetic task's steps; on a real benchmark a
process reward model (PRM) takes its place: ``step_prm`` splits each response into steps at a separator
(a line by default), asks the PRM how likely each step is to be right, and spends the first step it
doubts as the oracles spend the first mistake (:func:`oar.credit.controls.first_mistake_credit`:
``shape`` ``pinpoint`` puts the Bi-Level importance on that step's tokens, ``suffix`` spares the steps
before it).

The PRM is read as TRL's ``PRMTrainer`` trains one (``trl.experimental.prm``; its ``tokenize_row``):
an ``AutoModelForTokenClassification`` with two labels, fed ``[bos] prompt step_1 sep step_2 sep ...``
(every step followed by the separator, the last one too), whose label 1 ("the step is right") is
read at the last token of the separator after each step: ``p_wrong(k) = softmax(logits)[0]`` there
(:func:`prm_inputs`, :func:`prm_error_probs`). ``trl-lib/Qwen2-0.5B-Reward-Math-Sheperd`` is such a
model (config/paper_prm.yaml). PRMs with a head of their own (``Qwen/Qwen2.5-Math-PRM-7B``, remote code
and ``<extra_0>`` separators) or a language-model interface (Math-Shepherd's ``ки`` tag) read steps
differently and are not this estimator's.

The response text is re-tokenized with the PRM's tokenizer, so the PRM need not share the policy's;
the prompt is the policy's prompt decoded without its special tokens (a chat template's role names
stay in it).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator

__all__ = ["DEFAULT_SEPARATOR", "LineSteps", "line_steps", "load_prm", "prm_inputs", "prm_error_probs",
           "step_prm_estimator"]

#: TRL's ``PRMConfig.step_separator`` default: a step is a line.
DEFAULT_SEPARATOR = "\n"


@dataclass(frozen=True)
class LineSteps:
    """The steps of one response text (:func:`line_steps`), as :func:`oar.credit.controls.text_steps`
    reads them: each step's character span is both its ``step_spans`` and ``result_spans`` entry (a
    step of free text has no separate result)."""

    step_spans: list[list[int]]
    reasoning_end: int
    answer: str = ""

    @property
    def result_spans(self) -> list[list[int]]:
        return self.step_spans

    @property
    def steps(self) -> list[Any]:
        return []


def line_steps(text: str, separator: str = DEFAULT_SEPARATOR, end_markers: Sequence[str] = ()) -> LineSteps | None:
    """The non-blank pieces of ``text`` between ``separator``\\ s, up to the first of ``end_markers``
    (the tokenizer's end-of-sequence text), as character spans without their surrounding whitespace;
    None when there is none.

    >>> line_steps("a=1\\n\\n b=2 \\nx<eos>", end_markers=["<eos>"]).step_spans
    [[0, 3], [6, 9], [11, 12]]
    """
    end = min([i for i in (text.find(m) for m in end_markers if m) if i >= 0] + [len(text)])
    spans, start = [], 0
    for piece in text[:end].split(separator):
        lead = len(piece) - len(piece.lstrip())
        body = piece.strip()
        if body:
            spans.append([start + lead, start + lead + len(body)])
        start += len(piece) + len(separator)
    return LineSteps(step_spans=spans, reasoning_end=spans[-1][1]) if spans else None


@functools.lru_cache(maxsize=4)
def load_prm(source: str, device: str = "cpu") -> tuple[Any, Any]:
    """The PRM (``AutoModelForTokenClassification``, two labels) and its tokenizer, in eval mode on
    ``device``; cached per process.

    Raises:
        FileNotFoundError: ``source`` does not load as such a model, naming it and what to do.
    """
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    try:
        model = AutoModelForTokenClassification.from_pretrained(source)
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"credit step_prm: option prm {source!r} does not load as a token-classification "
                                f"model ({str(e).splitlines()[0]}); name a PRM trained as TRL's PRMTrainer trains "
                                "one (a local folder or a hub id)") from None
    arch = list(getattr(model.config, "architectures", None) or [])
    if not any(a.endswith("ForTokenClassification") for a in arch):  # else its head would be new, random weights
        raise FileNotFoundError(f"credit step_prm: option prm {source!r} is a {', '.join(arch) or 'model'} checkpoint, "
                                "not a token-classification PRM (its head would start random); name a PRM trained as "
                                "TRL's PRMTrainer trains one")
    if int(getattr(model.config, "num_labels", 0)) != 2:
        raise FileNotFoundError(f"credit step_prm: option prm {source!r} has {model.config.num_labels} labels; a PRM "
                                "of TRL's PRMTrainer has 2 (wrong, right)")
    return model.to(device).eval(), tok


def prm_inputs(tokenizer: Any, prompt: str, steps: Sequence[str], separator: str = DEFAULT_SEPARATOR
               ) -> tuple[list[int], list[int]]:
    """TRL's ``PRMTrainer.tokenize_row`` layout: ``[bos] + prompt + (step + separator) per step``, and the
    position of the last separator token after each step (where the PRM's label is).

    >>> from oar.models.loading import build_tiny_tokenizer
    >>> ids, at = prm_inputs(build_tiny_tokenizer(), "Q", ["1+1=2", "2+2=5"])
    >>> len(ids), at
    (14, [7, 13])
    """
    sep = tokenizer.encode(separator, add_special_tokens=False)
    ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [])
    ids = ids + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    positions = []
    for step in steps:
        ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + sep
        positions.append(len(ids) - 1)
    return ids, positions


@torch.no_grad()
def prm_error_probs(model: Any, tokenizer: Any, prompts: Sequence[str], steps: Sequence[Sequence[str]],
                    separator: str = DEFAULT_SEPARATOR, chunk: int = 16) -> list[list[float]]:
    """For each response (its ``steps`` texts), the PRM's probability that each step is wrong:
    ``softmax(logits)[0]`` at the separator after it (:func:`prm_inputs`); right-padded batches of
    ``chunk`` responses on the model's device."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out: list[list[float]] = []
    for lo in range(0, len(steps), chunk):
        rows = [prm_inputs(tokenizer, p, s, separator) for p, s in zip(prompts[lo:lo + chunk], steps[lo:lo + chunk])]
        L = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), L), int(pad), dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        probs = torch.softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1)[..., 0]
        out += [[float(probs[i, k]) for k in at] for i, (_, at) in enumerate(rows)]
    return out


@register_estimator("step_prm")
def step_prm_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """The first step a process reward model doubts, as first-mistake credit (any task).

    Options: ``prm`` (required: a local folder or hub id of a PRM as TRL's ``PRMTrainer`` trains one),
    ``separator`` (``"\\n"``: the PRM's step separator; the response is split at it), ``threshold``
    (0.5: a step is the located mistake from this probability of being wrong), ``shape``
    (``pinpoint`` | ``suffix``), ``norm_by_std``, ``eps`` and the reshaping's (``pinpoint``:
    ``quantile``, ``beta``, ``floor``, ``preserve_mass``; ``suffix``: ``preserve_mass``). Stats as the
    oracles' (``located_fraction``: responses with a doubted step), with ``prm_s``.
    """
    from oar.credit.controls import first_mistake_credit, text_steps
    from oar.credit.verifier import DEFAULT_THRESHOLD, SHAPES, first_wrong_step

    opts = dict(options)
    source = opts.pop("prm", None)
    if not source:
        raise ValueError("credit step_prm: set the option prm (a PRM trained as TRL's PRMTrainer trains one)")
    separator = str(opts.pop("separator", DEFAULT_SEPARATOR))
    threshold = float(opts.pop("threshold", DEFAULT_THRESHOLD))
    shape = opts.pop("shape", "pinpoint")
    if shape not in SHAPES:
        raise ValueError(f"credit step_prm: shape {shape!r}; valid: {list(SHAPES)}")
    t0 = time.perf_counter()
    tok = batch.tokenizer
    ends = [t for t in (getattr(tok, "eos_token", None), getattr(tok, "pad_token", None)) if t]
    labels = text_steps(batch, lambda text: line_steps(text, separator, ends), name="step_prm")
    model, prm_tok = load_prm(str(source), str(batch.response_ids.device))
    pmask = batch.prompt_mask if batch.prompt_mask is not None else torch.ones_like(batch.prompt_ids)
    prompts = [tok.decode(batch.prompt_ids[b][pmask[b].bool()].tolist(), skip_special_tokens=True)
               for b in range(batch.prompt_ids.shape[0])]
    steps = [[text[a:e] for a, e in spans] for text, spans in zip(labels.texts, labels.step_spans)]
    probs = prm_error_probs(model, prm_tok, prompts, steps, separator)
    found = [first_wrong_step(row, threshold) for row in probs]
    first = torch.zeros_like(labels.results)
    for b, k in enumerate(found):
        if k >= 0:
            first[b] = (labels.result_step[b] == k + 1).to(first.dtype)
    return first_mistake_credit("step_prm", batch, opts, labels=labels, first_mistake=first,
                                located=torch.tensor([k >= 0 for k in found], dtype=torch.bool), shape=shape,
                                stats={"prm_s": time.perf_counter() - t0})
