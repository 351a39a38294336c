"""Attribution-fidelity benchmark (``oar attribution``): do the token-credit signals find the
tokens that matter?

On responses SAMPLED from a (warm-started) policy for synthetic ``test`` prompts, every reasoning
token is scored by each credit signal and the scores are compared with a ground truth read off the
response itself:

- **pivotal** tokens (positives): the digits of each step's result, the right-hand side of ``=``
  in ``"<a><op><b>=<c>"`` (sign excluded, like ``result_spans`` of :mod:`oar.data.synthetic`).
  The model copies them into the next step and into its box, so they decide its answer.
- **filler** tokens (negatives): the filler words of the task (``task.synthetic.fillers``); the
  generator draws them independently of the problem, so they carry no information.
- every other token (operands, operators, punctuation) is unlabeled and only enters the
  correlation between signals.

The ground truth comes from the sampled text, not the reference solution: a response is parsed
with the task's grammar (:func:`parse_response`: steps joined by ``", "``, the last one followed
by ``". "``, an optional filler word plus space in each gap, then ``\\boxed{...}``). Responses that
do not follow the grammar or have no boxed answer are skipped and counted. Character spans map to
tokens through each token's character offsets (:func:`token_char_spans`; exact for any
tokenizer whose decode is monotone in the prefix, 1:1 for the tiny character tokenizer).

Signals (response-aligned ``(n, T)`` scores; larger = more important):

- ``oar_p``: OAR-P, mode ``last`` (:func:`oar.credit.importance.perturbation_importance`);
- ``oar_p_answer_mean``: OAR-P, mode ``answer_mean``;
- ``oar_g``: OAR-G, mode ``answer_mean``, ``noise_std`` 1e-3, seeded generator
  (:func:`oar.credit.importance.gradient_importance`);
- ``ktae``: ``|K|`` of the KTAE key-token score (:func:`oar.credit.ktae.ktae_scores_batch`, group
  statistics over the ``n_samples`` responses of each prompt, rewards from
  :func:`oar.reward.score_batch`). The magnitude is the importance: ``K > 0`` marks a token id
  associated with correct responses and ``K < 0`` one associated with wrong ones, and a wrong
  intermediate result is as pivotal as a right one; OAR's KL scores are unsigned too.
- ``ktae_signed``: ``K`` itself, for comparison.
- ``random``: uniform noise from a seeded generator (the chance baseline).

Metrics per signal (:func:`fidelity_table`): AUROC of pivotal (positive) vs filler (negative)
tokens pooled over all responses, the mean of per-response AUROCs over responses that have both
classes, the per-response Spearman correlation with ``oar_p`` over all reasoning tokens (mean and
median over responses where it is defined), and seconds per response of the signal's batch
computation (wall time of the call divided by the number of responses it scored; OAR signals
exclude the shared probe construction, KTAE excludes reward scoring; both are reported in the
summary). AUROC is the Mann-Whitney statistic with average ranks for ties (:func:`auroc`).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from oar.answer import BOXED_MARKERS, last_boxed_span

__all__ = [
    "SIGNALS",
    "DEFAULT_SIGNALS",
    "FIDELITY_COLUMNS",
    "average_ranks",
    "auroc",
    "spearman",
    "ParsedResponse",
    "parse_response",
    "token_char_spans",
    "token_labels",
    "label_responses",
    "compute_signals",
    "fidelity_table",
    "AttributionResult",
    "run_attribution",
    "plot_fidelity",
    "attribution_from_config",
]

#: Signals :func:`compute_signals` knows.
SIGNALS: tuple[str, ...] = ("oar_p", "oar_p_answer_mean", "oar_g", "ktae", "ktae_signed", "random")
#: Signals computed by default (all of them).
DEFAULT_SIGNALS: tuple[str, ...] = SIGNALS
#: Columns of ``fidelity.csv`` (in order).
FIDELITY_COLUMNS: tuple[str, ...] = (
    "signal",
    "auroc_pooled",
    "auroc_mean_per_response",
    "n_responses",
    "n_pivotal",
    "n_filler",
    "seconds_per_response",
    "spearman_vs_oar_p",
    "spearman_vs_oar_p_median",
    "n_responses_both_classes",
    "n_responses_spearman",
)

#: Label values of :func:`token_labels`.
PIVOTAL, FILLER, UNLABELED = 1, 0, -1


# --------------------------------------------------------------------------------------------
# rank statistics
# --------------------------------------------------------------------------------------------


def average_ranks(x: np.ndarray | Sequence[float]) -> np.ndarray:
    """1-based ranks of ``x`` with ties given their average rank (like ``scipy.stats.rankdata``).

    Args:
        x: ``(n,)`` finite values.

    Returns:
        ``(n,)`` float64 ranks.
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size and not np.isfinite(a).all():
        raise ValueError("oar.attribution.average_ranks: scores must be finite (got NaN or inf)")
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    # value group g covers ranks (cum[g] - counts[g], cum[g]]: its average is cum - (counts - 1)/2
    avg = np.cumsum(counts) - (counts - 1) / 2.0
    return avg[inverse.ravel()]


def auroc(scores: np.ndarray | Sequence[float], labels: np.ndarray | Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive), ties counted 1/2.

    The Mann-Whitney form ``(sum of positive ranks - n1 (n1 + 1) / 2) / (n1 n0)`` with average
    ranks, i.e. ``P(s_pos > s_neg) + P(s_pos == s_neg) / 2`` over all positive/negative pairs.

    Args:
        scores: ``(n,)`` finite scores (larger = more positive).
        labels: ``(n,)`` booleans.

    Returns:
        AUROC in ``[0, 1]``; NaN when either class is empty.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"oar.attribution.auroc: scores shape {s.shape} != labels shape {y.shape}")
    n1 = int(y.sum())
    n0 = int(y.size - n1)
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = average_ranks(s)
    u = r[y].sum() - n1 * (n1 + 1) / 2.0
    return float(u / (n1 * n0))


def spearman(x: np.ndarray | Sequence[float], y: np.ndarray | Sequence[float]) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks); NaN when fewer than two
    values or when either input is constant."""
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"oar.attribution.spearman: shapes {a.shape} and {b.shape} differ")
    if a.size < 2:
        return float("nan")
    ra = average_ranks(a) - (a.size + 1) / 2.0
    rb = average_ranks(b) - (b.size + 1) / 2.0
    den = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    if den == 0.0:
        return float("nan")
    return float((ra * rb).sum() / den)


# --------------------------------------------------------------------------------------------
# ground truth: parse the sampled response
# --------------------------------------------------------------------------------------------

_STEP_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?)(\d+)")


@dataclass
class ParsedResponse:
    """Ground truth of one response that follows the task grammar.

    Attributes:
        pivotal_spans: ``[start, end)`` character spans of the digits of each step's result.
        filler_spans: ``[start, end)`` character spans of the filler words.
        steps: ``(a, op, b, c)`` of each step as written (not checked for correct arithmetic).
        reasoning_end: character offset where the answer marker (``\\boxed{``) starts.
        answer: the boxed content.
    """

    pivotal_spans: list[list[int]]
    filler_spans: list[list[int]]
    steps: list[tuple[int, str, int, int]]
    reasoning_end: int
    answer: str


def _marker_start(text: str, content_start: int, markers: Sequence[str]) -> int | None:
    for m in markers:
        if content_start >= len(m) and text[content_start - len(m) : content_start] == m:
            return content_start - len(m)
    return None


def parse_response(
    text: str,
    *,
    fillers: Sequence[str],
    markers: tuple[str, ...] = BOXED_MARKERS,
) -> ParsedResponse | None:
    """Parse a response of the synthetic task and locate its pivotal and filler characters.

    Grammar of the reasoning (everything before the last answer marker), matched exactly::

        STEP ( ", " [FILLER " "] STEP )* ". " [FILLER " "]        STEP = a op b "=" ["-"] c

    with ``a`` an optionally negative integer, ``b`` and ``c`` non-negative digit strings, ``op`` in
    ``+ - *`` and ``FILLER`` one of ``fillers``. The boxed answer must be complete and non-empty;
    what follows its closing brace (e.g. an end-of-text token) is ignored. The arithmetic is not
    checked: a wrong intermediate result still decides the model's answer.

    Args:
        text: the decoded response.
        fillers: the task's filler words.
        markers: answer markers (as :func:`oar.answer.last_boxed_span`).

    Returns:
        a :class:`ParsedResponse`, or None when the response has no answer or does not follow the
        grammar. For a reference solution of :func:`oar.data.synthetic.generate` the spans equal
        the record's ``result_spans`` and ``filler_spans``.
    """
    span = last_boxed_span(text, markers)
    if span is None or span[1] <= span[0] or not text[span[0] : span[1]].strip():
        return None
    end = _marker_start(text, span[0], markers)
    if end is None:
        return None
    words = sorted({str(f) for f in fillers}, key=len, reverse=True)
    filler_re = re.compile("(?:" + "|".join(re.escape(w) for w in words) + ") ") if words else None

    pivotal: list[list[int]] = []
    filler: list[list[int]] = []
    steps: list[tuple[int, str, int, int]] = []
    pos = 0

    def take_step() -> bool:
        nonlocal pos
        m = _STEP_RE.match(text, pos, end)
        if m is None:
            return False
        pivotal.append([m.start(5), m.end(5)])
        c = int(m.group(5))
        steps.append((int(m.group(1)), m.group(2), int(m.group(3)), -c if m.group(4) else c))
        pos = m.end()
        return True

    def take_filler() -> None:
        nonlocal pos
        if filler_re is None:
            return
        m = filler_re.match(text, pos, end)
        if m is not None:
            filler.append([m.start(), m.end() - 1])
            pos = m.end()

    if not take_step():
        return None
    while True:
        if text.startswith(", ", pos) and pos + 2 <= end:
            pos += 2
            take_filler()
            if not take_step():
                return None
        elif text.startswith(". ", pos) and pos + 2 <= end:
            pos += 2
            take_filler()
            break
        else:
            return None
    if pos != end:
        return None
    return ParsedResponse(pivotal, filler, steps, end, text[span[0] : span[1]])


def token_char_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, np.ndarray, np.ndarray]:
    """Character span of every token of a decoded sequence.

    The text is ``tokenizer.decode(ids)`` with special tokens kept and no clean-up. When the
    single-token decodes concatenate to that text (character-level and byte-level BPE tokenizers
    on ASCII) the spans are their cumulative lengths; otherwise token ``k`` covers
    ``[len(decode(ids[:k])), len(decode(ids[:k+1])))`` (decoded prefixes; one decode per token).

    Args:
        tokenizer: a Hugging Face tokenizer.
        ids: ``(T,)`` token ids (no padding).

    Returns:
        ``(text, starts, ends)`` with ``(T,)`` int64 arrays; ``text[starts[k]:ends[k]]`` is token
        ``k``'s text (possibly empty).
    """
    ids = [int(i) for i in ids]

    def dec(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    text = dec(ids)
    pieces = [dec([i]) for i in ids]
    if "".join(pieces) == text:
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        ends = np.cumsum(lengths)
    else:
        ends = np.array([len(dec(ids[: k + 1])) for k in range(len(ids))], dtype=np.int64)
        ends = np.minimum(np.maximum.accumulate(ends), len(text)) if len(ends) else ends
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]]) if len(ends) else ends.copy()
    return text, starts, ends


def token_labels(
    starts: np.ndarray,
    ends: np.ndarray,
    pivotal_spans: Sequence[Sequence[int]],
    filler_spans: Sequence[Sequence[int]],
    n_chars: int,
) -> np.ndarray:
    """Label each token from character spans: 1 (pivotal), 0 (filler), -1 (neither).

    A token is pivotal when its characters overlap a pivotal span and no filler span, filler in
    the mirror case, unlabeled otherwise (including tokens that straddle both kinds).

    Args:
        starts, ends: ``(T,)`` character span of each token (:func:`token_char_spans`).
        pivotal_spans, filler_spans: ``[start, end)`` character spans.
        n_chars: length of the text.

    Returns:
        ``(T,)`` int64 labels.
    """

    def char_count(spans: Sequence[Sequence[int]]) -> np.ndarray:
        """``(n_chars + 1,)``: entry ``k`` = number of characters of ``text[:k]`` inside ``spans``."""
        diff = np.zeros(n_chars + 1, dtype=np.int64)
        for s, e in spans:
            diff[s] += 1
            diff[e] -= 1
        inside = np.cumsum(diff[:n_chars]) > 0
        return np.concatenate([[0], np.cumsum(inside)])

    cp = char_count(pivotal_spans)  # cp[k] = pivotal chars among text[:k]
    cf = char_count(filler_spans)
    st = np.asarray(starts, dtype=np.int64)
    en = np.asarray(ends, dtype=np.int64)
    piv = (cp[en] - cp[st]) > 0
    fil = (cf[en] - cf[st]) > 0
    out = np.full(st.shape, UNLABELED, dtype=np.int64)
    out[piv & ~fil] = PIVOTAL
    out[fil & ~piv] = FILLER
    return out


def label_responses(
    tokenizer: Any,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    fillers: Sequence[str],
    markers: tuple[str, ...] = BOXED_MARKERS,
) -> tuple[torch.Tensor, list[str]]:
    """Ground-truth token labels of a batch of right-padded responses.

    Args:
        tokenizer: the policy tokenizer.
        response_ids: ``(B, T)`` long.
        response_mask: ``(B, T)`` 1 on real response tokens.
        fillers: the task's filler words.
        markers: answer markers.

    Returns:
        ``labels`` ``(B, T)`` long (1 pivotal, 0 filler, -1 otherwise and in skipped rows) and a
        status per row: ``"ok"``, ``"no_answer"`` (no complete boxed answer) or ``"unparsed"``
        (an answer, but the reasoning does not follow the task grammar).
    """
    B, T = response_ids.shape
    labels = torch.full((B, T), UNLABELED, dtype=torch.long)
    status: list[str] = []
    ids_cpu, mask_cpu = response_ids.detach().cpu(), response_mask.detach().cpu().bool()
    for b in range(B):
        pos = mask_cpu[b].nonzero().flatten()
        ids = ids_cpu[b, pos].tolist()
        text, starts, ends = token_char_spans(tokenizer, ids)
        span = last_boxed_span(text, markers)
        if span is None or span[1] <= span[0] or not text[span[0] : span[1]].strip():
            status.append("no_answer")
            continue
        parsed = parse_response(text, fillers=fillers, markers=markers)
        if parsed is None:
            status.append("unparsed")
            continue
        lab = token_labels(starts, ends, parsed.pivotal_spans, parsed.filler_spans, len(text))
        labels[b, pos] = torch.from_numpy(lab)
        status.append("ok")
    return labels, status


# --------------------------------------------------------------------------------------------
# signals
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_signals(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    rows: torch.Tensor,
    signals: Sequence[str] = DEFAULT_SIGNALS,
    conclude: str | None = None,
    oar_p_chunk_size: int = 128,
    noise_std: float = 1e-3,
    ktae_options: Mapping[str, Any] | None = None,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, Any]]:
    """Score the responses ``rows`` with each signal, aligned with response positions.

    OAR signals run on the probe of the ``rows`` only; KTAE needs whole groups, so it runs on all
    ``B`` responses (its statistics use every response of a group) and its scores are then taken at
    ``rows``.

    Args:
        model, tokenizer: the policy.
        prompt_ids, prompt_mask: ``(B, P)`` left-padded prompts of every sampled response.
        response_ids, response_mask: ``(B, T)`` right-padded responses.
        rewards: ``(B,)`` outcome rewards (correct when ``> 0``).
        group_ids: ``(B,)`` prompt index of each response (KTAE groups).
        rows: ``(n,)`` long indices of the responses to score.
        signals: names from :data:`SIGNALS`.
        conclude: probe conclude string (default :data:`oar.credit.probe.DEFAULT_CONCLUDE`).
        oar_p_chunk_size: sequences per OAR-P forward.
        noise_std: OAR-G embedding noise.
        ktae_options: keywords of :func:`oar.credit.ktae.ktae_scores_batch` (default ignores eos).
        seed: seed of the OAR-G noise and the random baseline.
        warmup: run each OAR function once on one response before timing (first-call overheads).
        repeats: run each signal's batch call this many times and report the fastest (the machine
            is shared and noisy; the scores of every repeat are identical, the first is kept).

    Returns:
        ``scores`` (name -> ``(n, T)`` float32 on CPU), ``seconds`` (name -> wall seconds of the
        signal's batch call) and ``info`` (``probe_seconds``, ``n_scored`` per signal,
        ``reasoning_mask`` ``(n, T)`` bool of the probe's reasoning tokens, ``has_answer`` ``(n,)``).
    """
    from oar.credit.importance import gradient_importance, perturbation_importance
    from oar.credit.ktae import ktae_scores_batch
    from oar.credit.probe import DEFAULT_CONCLUDE, build_probe

    unknown = [s for s in signals if s not in SIGNALS]
    if unknown:
        raise ValueError(f"oar.attribution.compute_signals: unknown signals {unknown}; valid: {list(SIGNALS)}")
    if repeats < 1:
        raise ValueError(f"oar.attribution.compute_signals: repeats must be >= 1, got {repeats}")
    rows = torch.as_tensor(rows, dtype=torch.long)
    n, T = int(rows.numel()), int(response_ids.shape[1])
    device = next(model.parameters()).device
    conclude = DEFAULT_CONCLUDE if conclude is None else conclude

    t0 = time.perf_counter()
    probe = build_probe(
        tokenizer,
        prompt_ids[rows],
        response_ids[rows],
        conclude=conclude,
        prompt_mask=prompt_mask[rows],
        response_mask=response_mask[rows],
    )
    probe_seconds = time.perf_counter() - t0
    reasoning = probe.to_response(probe.reasoning_mask.float(), T) > 0
    info: dict[str, Any] = {
        "probe_seconds": probe_seconds,
        "reasoning_mask": reasoning.cpu(),
        "has_answer": probe.has_answer.cpu(),
        "n_scored": {},
    }
    probe_dev = probe.to(device)

    oar_calls: dict[str, Callable[[Any], torch.Tensor]] = {
        "oar_p": lambda p: perturbation_importance(model, p, mode="last", chunk_size=oar_p_chunk_size),
        "oar_p_answer_mean": lambda p: perturbation_importance(
            model, p, mode="answer_mean", chunk_size=oar_p_chunk_size
        ),
        "oar_g": lambda p: gradient_importance(
            model,
            p,
            mode="answer_mean",
            noise_std=noise_std,
            generator=torch.Generator(device=device).manual_seed(seed),
        ),
    }
    scores: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    answered = probe.has_answer.nonzero().flatten()
    if warmup and answered.numel():
        one = probe_dev.select(answered[:1])
        for name in signals:
            if name in oar_calls:
                oar_calls[name](one)
    def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        best, first = float("inf"), None
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
            first = out if first is None else first
        assert first is not None
        return first, best

    for name in signals:
        if name in oar_calls:
            s, seconds[name] = timed(lambda: oar_calls[name](probe_dev))
            scores[name] = probe.to_response(s.float().cpu(), T)
            info["n_scored"][name] = n
    ktae_wanted = [s for s in signals if s in ("ktae", "ktae_signed")]
    if ktae_wanted:
        opts = dict(ktae_options or {})
        if "ignore_token_ids" not in opts and getattr(tokenizer, "eos_token_id", None) is not None:
            opts["ignore_token_ids"] = (int(tokenizer.eos_token_id),)
        k, dt = timed(lambda: ktae_scores_batch(response_ids, response_mask, rewards.float(), group_ids.long(), **opts))
        k = k.float().cpu()[rows]
        for name in ktae_wanted:
            scores[name] = k.abs() if name == "ktae" else k
            seconds[name] = dt
            info["n_scored"][name] = int(response_ids.shape[0])
    if "random" in signals:
        scores["random"], seconds["random"] = timed(
            lambda: torch.rand((n, T), generator=torch.Generator().manual_seed(seed)) * response_mask[rows].cpu().float()
        )
        info["n_scored"]["random"] = n
    ordered = {name: scores[name] for name in signals}
    return ordered, {name: seconds[name] for name in signals}, info


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


def fidelity_table(
    scores: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    reasoning_mask: torch.Tensor,
    *,
    seconds_per_response: Mapping[str, float] | None = None,
    reference: str = "oar_p",
) -> tuple["Any", "Any"]:
    """Fidelity metrics of each signal.

    Args:
        scores: signal name -> ``(n, T)`` scores aligned with ``labels``.
        labels: ``(n, T)`` long, 1 pivotal, 0 filler, -1 unlabeled (:func:`label_responses`).
        reasoning_mask: ``(n, T)`` bool, tokens over which signals are correlated with ``reference``.
        seconds_per_response: signal -> seconds per response (NaN when absent).
        reference: the signal the Spearman correlations are taken against (NaN when absent).

    Returns:
        ``(fidelity, per_response)`` DataFrames: one row per signal with :data:`FIDELITY_COLUMNS`,
        and one row per response with ``n_reasoning``, ``n_pivotal``, ``n_filler`` and
        ``auroc_<signal>`` / ``spearman_<signal>`` (vs ``reference``) columns.
    """
    import pandas as pd

    lab = labels.detach().cpu().numpy()
    rmask = reasoning_mask.detach().cpu().numpy().astype(bool)
    n = lab.shape[0]
    labeled = lab >= 0
    if labeled.any() and not rmask[labeled].all():
        raise ValueError(
            "oar.attribution.fidelity_table: a labeled token lies outside the probe's reasoning "
            "tokens (the ground-truth parse and the probe disagree on where the answer starts)"
        )
    ref = scores[reference].detach().cpu().numpy() if reference in scores else None
    seconds_per_response = dict(seconds_per_response or {})
    per: dict[str, Any] = {
        "n_reasoning": rmask.sum(1),
        "n_pivotal": (lab == PIVOTAL).sum(1),
        "n_filler": (lab == FILLER).sum(1),
    }
    rows = []
    for name, sc in scores.items():
        s = sc.detach().cpu().numpy().astype(np.float64)
        if s.shape != lab.shape:
            raise ValueError(f"oar.attribution.fidelity_table: scores[{name!r}] shape {s.shape} != labels {lab.shape}")
        pooled = auroc(s[labeled], lab[labeled] == PIVOTAL)
        per_auc = np.array([auroc(s[i][labeled[i]], lab[i][labeled[i]] == PIVOTAL) for i in range(n)])
        per[f"auroc_{name}"] = per_auc
        if ref is not None:
            rho = np.array([spearman(s[i][rmask[i]], ref[i][rmask[i]]) for i in range(n)])
        else:
            rho = np.full(n, np.nan)
        per[f"spearman_{name}"] = rho
        ok_auc = per_auc[~np.isnan(per_auc)]
        ok_rho = rho[~np.isnan(rho)]
        rows.append(
            {
                "signal": name,
                "auroc_pooled": pooled,
                "auroc_mean_per_response": float(ok_auc.mean()) if ok_auc.size else float("nan"),
                "n_responses": n,
                "n_pivotal": int((lab == PIVOTAL).sum()),
                "n_filler": int((lab == FILLER).sum()),
                "seconds_per_response": float(seconds_per_response.get(name, float("nan"))),
                "spearman_vs_oar_p": float(ok_rho.mean()) if ok_rho.size else float("nan"),
                "spearman_vs_oar_p_median": float(np.median(ok_rho)) if ok_rho.size else float("nan"),
                "n_responses_both_classes": int(ok_auc.size),
                "n_responses_spearman": int(ok_rho.size),
            }
        )
    fidelity = pd.DataFrame(rows, columns=list(FIDELITY_COLUMNS))
    per_response = pd.DataFrame(per)
    return fidelity, per_response


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


@dataclass
class AttributionResult:
    """Result of :func:`run_attribution`.

    Attributes:
        fidelity: one row per signal (:data:`FIDELITY_COLUMNS`).
        per_response: one row per evaluated response (metrics, reward, prompt index, text).
        summary: counts (sampled, evaluated, skipped by reason), sample accuracy, probe and reward
            seconds, and the settings used.
    """

    fidelity: Any
    per_response: Any
    summary: dict = field(default_factory=dict)


def run_attribution(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    task_options: Mapping[str, Any] | None = None,
    n_prompts: int,
    n_samples: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    template: str = "tiny",
    split: str = "test",
    signals: Sequence[str] = DEFAULT_SIGNALS,
    conclude: str | None = None,
    oar_p_chunk_size: int = 128,
    noise_std: float = 1e-3,
    ktae_options: Mapping[str, Any] | None = None,
    correct: float = 1.0,
    wrong: float = 0.0,
    reward_timeout_s: float = 5.0,
    reward_workers: int | None = None,
    batch_size: int = 256,
    repeats: int = 1,
) -> AttributionResult:
    """Sample responses to synthetic prompts and measure how well each signal finds pivotal tokens.

    Steps: ``n_prompts`` records of ``split`` (seed ``seed``, options ``task_options``), rendered
    with ``template``; ``n_samples`` sampled responses per prompt (:class:`oar.rollout.HFEngine`,
    seed ``seed``); rewards with :func:`oar.reward.score_batch`; ground-truth labels
    (:func:`label_responses`, fillers from ``task_options["fillers"]`` or the task default); the
    signals (:func:`compute_signals`) on the responses that parse; metrics (:func:`fidelity_table`).

    Args:
        model, tokenizer: the policy (e.g. the warm-started tiny model).
        task_options: keyword options of :func:`oar.data.synthetic.generate` (config ``task.synthetic``).
        n_prompts: number of prompts.
        n_samples: responses per prompt (the KTAE group size).
        temperature, top_p, max_new_tokens: sampling settings.
        seed: seed of the prompts, the sampling, the OAR-G noise and the random baseline.
        template: prompt template (:func:`oar.data.prompts.render_prompt`).
        split: synthetic split of the prompts.
        signals, conclude, oar_p_chunk_size, noise_std, ktae_options: see :func:`compute_signals`.
        correct, wrong, reward_timeout_s, reward_workers: reward settings (KTAE: correct when ``> 0``).
        batch_size: sequences per ``generate`` call.
        repeats: timing repeats per signal (fastest reported), see :func:`compute_signals`.

    Returns:
        an :class:`AttributionResult`. When no response parses, ``fidelity`` has NaN metrics and
        ``n_responses`` 0.
    """
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import DEFAULT_FILLERS, generate
    from oar.reward import score_batch
    from oar.rollout import HFEngine

    if n_prompts < 1 or n_samples < 1:
        raise ValueError(f"oar.attribution.run_attribution: n_prompts and n_samples must be >= 1, got {n_prompts}, {n_samples}")
    t_start = time.perf_counter()
    opts = dict(task_options or {})
    fillers = list(opts.get("fillers", DEFAULT_FILLERS))
    records = generate(split, n_prompts, seed=seed, **opts)
    prompts = [render_prompt(template, r["question"], tokenizer) for r in records]

    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    t0 = time.perf_counter()
    ro = engine.generate(prompts, n=n_samples, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, seed=seed)
    sample_seconds = time.perf_counter() - t0
    golds = [records[i]["answer"] for i in ro.prompt_index.tolist()]
    t0 = time.perf_counter()
    rewards = torch.tensor(
        score_batch(ro.texts, golds, correct=correct, wrong=wrong, timeout_s=reward_timeout_s, workers=reward_workers),
        dtype=torch.float32,
    )
    reward_seconds = time.perf_counter() - t0

    labels_all, status = label_responses(tokenizer, ro.response_ids, ro.response_mask, fillers=fillers)
    rows = torch.tensor([i for i, s in enumerate(status) if s == "ok"], dtype=torch.long)
    n_total = len(status)

    scores, seconds, info = compute_signals(
        model,
        tokenizer,
        prompt_ids=ro.prompt_ids,
        prompt_mask=ro.prompt_mask,
        response_ids=ro.response_ids,
        response_mask=ro.response_mask,
        rewards=rewards,
        group_ids=ro.prompt_index,
        rows=rows,
        signals=signals,
        conclude=conclude,
        oar_p_chunk_size=oar_p_chunk_size,
        noise_std=noise_std,
        ktae_options=ktae_options,
        seed=seed,
        repeats=repeats,
    )
    if rows.numel() and not bool(info["has_answer"].all()):
        raise RuntimeError("oar.attribution.run_attribution: the probe found no answer in a response that parsed")
    sec_per = {k: (seconds[k] / info["n_scored"][k] if info["n_scored"][k] else float("nan")) for k in seconds}
    fidelity, per_response = fidelity_table(
        scores, labels_all[rows], info["reasoning_mask"], seconds_per_response=sec_per
    )
    per_response.insert(0, "response", rows.numpy())
    per_response.insert(1, "prompt_index", ro.prompt_index[rows].numpy())
    per_response.insert(2, "reward", rewards[rows].numpy())
    per_response["text"] = [ro.texts[i] for i in rows.tolist()]

    counts = {s: status.count(s) for s in ("ok", "no_answer", "unparsed")}
    summary = {
        "n_prompts": n_prompts,
        "n_samples": n_samples,
        "n_sampled": n_total,
        "n_evaluated": counts["ok"],
        "n_skipped_no_answer": counts["no_answer"],
        "n_skipped_unparsed": counts["unparsed"],
        "sample_accuracy": float((rewards > 0).float().mean()) if n_total else float("nan"),
        "evaluated_accuracy": float((rewards[rows] > 0).float().mean()) if rows.numel() else float("nan"),
        "n_groups_mixed": int(_mixed_groups(rewards, ro.prompt_index)),
        "seconds_sampling": sample_seconds,
        "seconds_reward": reward_seconds,
        "seconds_probe": info["probe_seconds"],
        "seconds_probe_per_response": info["probe_seconds"] / max(int(rows.numel()), 1),
        "seconds_signal": seconds,
        "n_scored": info["n_scored"],
        "seconds_total": time.perf_counter() - t_start,
        "settings": {
            "split": split,
            "template": template,
            "seed": seed,
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "signals": list(signals),
            "noise_std": noise_std,
            "oar_p_chunk_size": oar_p_chunk_size,
            "timing_repeats": repeats,
            "fillers": fillers,
            "torch_threads": torch.get_num_threads(),
        },
    }
    return AttributionResult(fidelity=fidelity, per_response=per_response, summary=summary)


def _mixed_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> int:
    """Number of groups with both correct and wrong responses (where KTAE is non-zero)."""
    g = group_ids.long()
    if g.numel() == 0:
        return 0
    uniq, inv = torch.unique(g, return_inverse=True)
    pos = torch.zeros(uniq.numel()).index_add_(0, inv, (rewards > 0).float())
    cnt = torch.zeros(uniq.numel()).index_add_(0, inv, torch.ones_like(rewards, dtype=torch.float32))
    return int(((pos > 0) & (pos < cnt)).sum())


def plot_fidelity(fidelity: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Bar chart of AUROC per signal (pooled and mean per response, chance line at 0.5) and a
    panel of seconds per response (log scale); written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oar.io import atomic_path

    names = list(fidelity["signal"])
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.38
    ax1.bar(x - w / 2, fidelity["auroc_pooled"].to_numpy(dtype=float), w, label="pooled")
    ax1.bar(x + w / 2, fidelity["auroc_mean_per_response"].to_numpy(dtype=float), w, label="mean per response")
    ax1.axhline(0.5, color="k", linestyle="--", linewidth=1, label="chance")
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylim(0, 1.15)
    ax1.set_yticks(np.linspace(0, 1, 6))
    ax1.set_ylabel("AUROC, pivotal vs filler tokens")
    ax1.legend(loc="upper center", ncol=3, fontsize=8, frameon=False)
    secs = fidelity["seconds_per_response"].to_numpy(dtype=float)
    ax2.bar(x, np.where(np.isfinite(secs) & (secs > 0), secs, np.nan))
    ax2.set_yscale("log")
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax2.set_ylabel("seconds per response")
    n = int(fidelity["n_responses"].iloc[0]) if len(fidelity) else 0
    fig.suptitle(title or f"Attribution fidelity ({n} responses)")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def _write_csv(df: Any, path: Path) -> None:
    from oar.io import atomic_path

    with atomic_path(path, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)


def attribution_from_config(
    config: Mapping[str, Any],
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    signals: Sequence[str] = DEFAULT_SIGNALS,
    repeats: int = 3,
) -> Any:
    """Run the benchmark as the config says and write its outputs.

    Uses ``attribution.n_responses`` (total responses; ``ceil(n_responses / rollout.n)`` prompts
    with ``rollout.n`` samples each) and ``attribution.seed``; sampling from ``rollout``
    (``n``, ``temperature``, ``top_p``, ``max_new_tokens``, ``batch_size``); the task from ``task``
    (``kind`` must be ``synthetic``; ``template``, ``synthetic`` options); reward settings from
    ``reward``; ``device``. ``attribution.enabled`` is for the workflow: this function always runs.

    Writes (atomically) into ``output_dir``: ``fidelity.csv`` (:data:`FIDELITY_COLUMNS`),
    ``per_response.csv``, ``fidelity.png`` and ``summary.json``.

    Args:
        config: a validated config (:func:`oar.config.load_config`).
        model_dir: the warm-started policy (a folder written by ``oar sft``), loaded with
            :func:`oar.models.load_policy`.
        output_dir: output folder (created).
        signals: signals to compute.
        repeats: timing repeats per signal (the fastest is reported).

    Returns:
        the fidelity DataFrame.
    """
    from oar.io import atomic_write_json
    from oar.models import load_policy

    def section(name: str) -> Mapping[str, Any]:
        sec = config.get(name)
        if not isinstance(sec, Mapping):
            raise ValueError(f"config: missing or malformed section {name!r}")
        return sec

    attr, rollout, task = section("attribution"), section("rollout"), section("task")
    reward = config.get("reward") or {}
    if task.get("kind", "synthetic") != "synthetic":
        raise ValueError(f"config: task.kind={task.get('kind')!r}: the attribution benchmark needs 'synthetic'")
    for sec_name, sec, key in (("attribution", attr, "n_responses"), ("rollout", rollout, "n")):
        if key not in sec:
            raise ValueError(f"config: missing key {sec_name}.{key}")
    n_samples = int(rollout["n"])
    n_responses = int(attr["n_responses"])
    n_prompts = max(1, math.ceil(n_responses / n_samples))

    model, tokenizer = load_policy(model_dir)
    model.to(config.get("device", "cpu"))
    result = run_attribution(
        model,
        tokenizer,
        task_options=dict(task.get("synthetic") or {}),
        n_prompts=n_prompts,
        n_samples=n_samples,
        temperature=float(rollout.get("temperature", 1.0)),
        top_p=float(rollout.get("top_p", 1.0)),
        max_new_tokens=int(rollout.get("max_new_tokens", 64)),
        seed=int(attr.get("seed", 0)),
        template=str(task.get("template", "tiny")),
        signals=signals,
        reward_timeout_s=float(reward.get("timeout_s", 5.0)),
        reward_workers=reward.get("workers"),
        batch_size=int(rollout.get("batch_size", 256)),
        repeats=repeats,
    )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(result.fidelity, out / "fidelity.csv")
    _write_csv(result.per_response, out / "per_response.csv")
    plot_fidelity(result.fidelity, out / "fidelity.png")
    atomic_write_json(out / "summary.json", {**result.summary, "model_dir": str(model_dir)})
    return result.fidelity
