"""``mc_value``: step credit from Monte-Carlo values of the current policy (VinePPO, arXiv 2410.01679).

OAR-P and OAR-G hold the rest of a response fixed, so a wrong value restated in the next step keeps
the answer where it is when the first copy is masked (``oar attribution``: earlier-step mistakes in
the top 3 only 1-24% of the time). Regenerating the continuation removes that blind spot: the value
of a prefix is the mean reward of ``K`` fresh continuations of the policy from it, and a step's
credit is how much it moved that value.

For response ``i`` split at step boundaries ``0 < b_1 < ... < b_m < L_i`` (token positions,
:func:`step_boundaries`), with ``b_0 = 0`` and ``b_{m+1} = L_i``:

- ``V_0`` = mean reward of the response's group (the group is ``n`` Monte-Carlo samples from the
  prompt, so the start value costs nothing; ``root: continuation`` estimates it like the other
  values, from the policy's own continuations of the bare prompt: with ``greedy`` the value of the
  policy's mode throughout, so a mistake the policy would make anyway is blamed on no step),
  ``V_{m+1} = r_i`` (the response's own reward),
- ``V_k`` (``1 <= k <= m``) = mean reward of ``K`` continuations sampled from prompt + tokens
  ``[0, b_k)``, scored like the rollout (all prefixes of the batch in one call of the engine),
- the tokens of segment ``k`` (``[b_k, b_{k+1})``) get ``delta_k = V_{k+1} - V_k``; with
  ``norm_by_std`` divided by the group's reward std (as GRPO; groups with equal rewards are not
  divided), so the deltas of a response sum to its GRPO advantage ``A_i`` (telescoping),
- token advantage = ``seq_weight * A_i + alpha * delta_k * w_t``. ``seq_weight: 0, alpha: 1`` is VinePPO's
  credit; ``seq_weight: 1`` adds it to GRPO's. ``w_t = 1`` unless ``refine`` (OAR-G's options) is set:
  then a step's credit is spread over its tokens by OAR-G's scores ``g``,
  ``w_t = floor + (1 - floor) * g_t / mean_{t' in step} g_t'`` (:func:`segment_weights`; mean 1 over
  every step, so each step keeps its total credit and its result tokens take more of it than its
  separators and fillers).

Unlike GRPO, a group whose responses are all wrong (or all right) still gets step credit where a
step changes the value.

Step boundaries come from a rule on the decoded response (:data:`STEP_SPLITS`): ``synthetic`` (the
task's ``=`` and ``", "`` / ``". "``, so a result is a segment of its own), ``newline``,
``sentence``, or any regular expression; a boundary is the token that holds the first character after
a match (on a character-level tokenizer the token that starts there; on a byte-level BPE one a token
such as ``" so"`` or ``"=-"`` that begins inside the match). Shapes as :mod:`oar.credit`: ``B``
responses, ``T`` response tokens, ``S`` the most segments of a row.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import SEQ_OPTIONS, check_options, group_moments, sequence_advantages
from oar.credit.importance import OarGOptions, importance_scores, option_names, options_from

__all__ = [
    "STEP_SPLITS",
    "MC_VALUE_OPTIONS",
    "McValueOptions",
    "ROOTS",
    "ContinuationContext",
    "step_boundaries",
    "segment_ids",
    "segment_weights",
    "group_stats",
    "continuation_values",
    "step_advantages",
    "mc_step_credit",
    "mc_value_estimator",
]

#: Named step-boundary rules (regular expressions; a boundary follows each match).
STEP_SPLITS: dict[str, str] = {
    "synthetic": r"=|, |\. ",
    "newline": r"\n+",
    "sentence": r"(?<=[.!?])\s+|\n+",
}

#: Where ``V_0`` comes from: the group's mean reward, or continuations of the bare prompt.
ROOTS: tuple[str, ...] = ("group", "continuation")


@dataclass(frozen=True)
class McValueOptions:
    """``mc_value``'s options (besides the sequence advantage's), the one place their defaults are
    written (the estimator's, :func:`mc_step_credit`'s and the attribution benchmark's ``mc_value``
    signals').

    Attributes:
        k: continuations per step boundary (VinePPO's K).
        greedy: one greedy continuation per boundary instead of ``k`` sampled ones.
        step_split: step boundaries (:data:`STEP_SPLITS` or a regular expression).
        max_steps: at most this many boundaries per response (the first ones).
        reasoning_only: no boundary after the last ``\\boxed{``.
        root: :data:`ROOTS`, where ``V_0`` comes from.
        refine: None, or OAR-G's options (:class:`oar.credit.importance.OarGOptions`) that spread each
            step's credit over its tokens.
        refine_floor: with ``refine``, the weight of a token OAR-G scores 0.
        seq_weight: weight of the GRPO sequence advantage added to every token.
        alpha: weight of the step advantage.
    """

    k: int = 1
    greedy: bool = False
    step_split: str = "synthetic"
    max_steps: int = 8
    reasoning_only: bool = True
    root: str = "group"
    refine: Mapping[str, Any] | None = None
    refine_floor: float = 0.1
    seq_weight: float = 0.0
    alpha: float = 1.0

    def __post_init__(self) -> None:
        for key, cast in (("k", int), ("greedy", bool), ("step_split", str), ("max_steps", int),
                          ("reasoning_only", bool), ("root", str), ("refine_floor", float), ("seq_weight", float),
                          ("alpha", float)):
            object.__setattr__(self, key, cast(getattr(self, key)))


#: Options of the ``mc_value`` estimator.
MC_VALUE_OPTIONS: tuple[str, ...] = SEQ_OPTIONS + option_names(McValueOptions)
#: OAR-G's options that ``refine`` takes: its scoring options (:class:`oar.credit.importance.OarGOptions`).
REFINE_OPTIONS: tuple[str, ...] = option_names(OarGOptions)


@dataclass
class ContinuationContext:
    """What sampling and scoring continuations needs, row-aligned with a batch of responses.

    Attributes:
        engine: a rollout engine (:class:`oar.rollout.RolloutEngine`: HF or vLLM) holding the current policy.
        prompts: ``(B,)`` the rendered prompt text of each response.
        golds: ``(B,)`` the gold answer of each response.
        score: ``score(texts, golds) -> rewards``, the rollout's reward (same correct/wrong values).
        temperature, top_p, max_new_tokens: the rollout's sampling settings (the continuation budget
            is ``max_new_tokens`` minus the shortest prefix).
        seed: seed of the continuations' sampling.
    """

    engine: Any
    prompts: Sequence[str]
    golds: Sequence[str]
    score: Callable[[Sequence[str], Sequence[str]], Sequence[float]]
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0


def _split_regex(step_split: str) -> re.Pattern[str]:
    try:
        return re.compile(STEP_SPLITS.get(step_split, step_split))
    except re.error as e:
        raise ValueError(f"mc_value: step_split {step_split!r} is neither one of {sorted(STEP_SPLITS)} "
                         f"nor a valid regular expression: {e}") from None


def step_boundaries(tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor, *,
                    step_split: str = "synthetic", max_steps: int = 8, reasoning_only: bool = True,
                    ) -> tuple[list[list[int]], list[str], list[list[int]]]:
    """Step boundaries of every response, from a rule on its decoded text.

    Args:
        tokenizer: the policy's tokenizer.
        response_ids, response_mask: ``(B, T)`` right-padded responses.
        step_split: a name of :data:`STEP_SPLITS` or a regular expression.
        max_steps: keep at most this many boundaries per response (the first ones).
        reasoning_only: only boundaries before the last ``\\boxed{`` (the answer is not a step).

    Returns:
        ``(boundaries, texts, char_starts)``: per row, the sorted token positions ``0 < b < L_i``
        that start a new segment; the decoded response (special tokens kept); the character offset
        at which each boundary's token starts (so ``texts[i][:char_starts[i][k]]`` is the prefix).
    """
    from oar.task.parsing import token_char_spans

    rx = _split_regex(step_split)
    out, texts, chars = [], [], []
    for b in range(response_ids.shape[0]):
        ids = response_ids[b][response_mask[b].bool()].tolist()
        text, starts, ends = token_char_spans(tokenizer, ids)
        box = text.rfind("\\boxed{")
        limit = box if (reasoning_only and box >= 0) else len(text)
        bounds: list[int] = []
        for m in rx.finditer(text, 0, limit):
            # the token holding the first character after the match (a BPE token such as " so" or "=-"
            # starts inside the match: it opens the next segment, as that character does)
            after = ends > m.end()
            k = int(after.argmax()) if after.any() else len(ids)
            if 0 < k < len(ids) and (not bounds or k > bounds[-1]) and int(starts[k]) <= limit:
                bounds.append(k)
        bounds = bounds[:max_steps]
        out.append(bounds)
        texts.append(text)
        chars.append([int(starts[k]) for k in bounds])
    return out, texts, chars


def segment_ids(boundaries: Sequence[Sequence[int]], response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` long: the segment index ``k`` of each response token (``[b_k, b_{k+1})``), -1 on padding.

    >>> segment_ids([[2, 4]], torch.ones(1, 6)).tolist()
    [[0, 0, 1, 1, 2, 2]]
    """
    B, T = response_mask.shape
    seg = torch.zeros((B, T), dtype=torch.long)
    for i, bs in enumerate(boundaries):
        for b in bs:
            seg[i, int(b):] += 1
    return torch.where(response_mask.bool().cpu(), seg, torch.full_like(seg, -1))


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` of each response's group reward, both ``(B,)`` float64 on the CPU; std unbiased
    (:func:`oar.credit.advantages.group_moments`), 0 for a group of one or of equal rewards."""
    idx, _, mean, std = group_moments(rewards.detach().cpu(), group_ids.cpu())
    std = std[idx]
    std = torch.where(std < 1e-12, torch.zeros_like(std), std)
    return mean[idx], std


def continuation_values(ctx: ContinuationContext, texts: Sequence[str], char_starts: Sequence[Sequence[int]],
                        boundaries: Sequence[Sequence[int]], *, k: int, greedy: bool = False,
                        ) -> tuple[list[list[float]], dict[str, float]]:
    """Monte-Carlo value of every prefix: the mean reward of ``k`` continuations sampled from
    prompt + ``texts[i][:char_starts[i][j]]``, all prefixes of the batch in one engine call
    (``greedy``: one greedy continuation each, ``k`` is 1: the value of the policy's mode, not of
    the policy, biased but without sampling noise).

    Identical prefixes (the responses of a group often share their first steps) are one state and
    are continued once: their value is one estimate from ``k`` continuations. The engine is told
    each state's rendered prompt (``shared_prefix``), which all states of a group share, so an engine
    that can (``rollout.sampler: lean_compact``) runs its forward once.

    Returns:
        per row, one value per boundary; and the cost: ``mc_prefixes`` (boundaries),
        ``mc_states`` (distinct prefixes continued), ``mc_continuations``, ``mc_tokens``
        (continuation tokens sampled), ``mc_seconds``.
    """
    t0 = time.perf_counter()
    k = 1 if greedy else k
    state_of: dict[tuple[str, str], int] = {}  # (prompt + prefix, gold) -> state index
    states: list[tuple[str, str, str, str]] = []  # (engine prompt, response prefix, gold, rendered prompt)
    where: list[tuple[int, int]] = []  # (row, state) of every boundary, in row order
    for i, cs in enumerate(char_starts):
        for c in cs:
            key = (ctx.prompts[i] + texts[i][:c], str(ctx.golds[i]))
            if key not in state_of:
                state_of[key] = len(states)
                states.append((key[0], texts[i][:c], key[1], ctx.prompts[i]))
            where.append((i, state_of[key]))
    values: list[list[float]] = [[] for _ in char_starts]
    stats = {"mc_prefixes": float(len(where)), "mc_states": float(len(states)),
             "mc_continuations": float(len(states) * k), "mc_tokens": 0.0}
    if states:
        shortest = min(min(bs) for bs in boundaries if bs)
        budget = max(1, int(ctx.max_new_tokens) - int(shortest))
        ro = ctx.engine.generate([s[0] for s in states], n=k, temperature=ctx.temperature, top_p=ctx.top_p,
                                 max_new_tokens=budget, seed=ctx.seed, greedy=greedy,
                                 shared_prefix=[s[3] for s in states])
        p_idx = ro.prompt_index.tolist()
        rewards = ctx.score([states[p][1] + ro.texts[j] for j, p in enumerate(p_idx)], [states[p][2] for p in p_idx])
        total = [0.0] * len(states)
        for j, p in enumerate(p_idx):
            total[p] += float(rewards[j])
        for i, st in where:
            values[i].append(total[st] / k)
        stats["mc_tokens"] = float(ro.response_mask.sum())
    stats["mc_seconds"] = time.perf_counter() - t0
    return values, stats


def segment_weights(scores: torch.Tensor, seg: torch.Tensor, floor: float = 0.1) -> torch.Tensor:
    """Token weights inside each step from token scores, mean 1 over every step.

    Args:
        scores: ``(B, T)`` non-negative token scores (OAR-G's ``|grad . x|``).
        seg: ``(B, T)`` long segment index of each token (:func:`segment_ids`), -1 on padding.
        floor: the weight of a token scored 0 (in ``[0, 1]``).

    Returns:
        ``(B, T)`` float32: ``floor + (1 - floor) * s_t / mean_{t' in step} s_t'``; 1 on a step whose
        scores are all 0, 0 on padding.

    >>> segment_weights(torch.tensor([[1.0, 3.0, 0.0, 0.0, 5.0]]), torch.tensor([[0, 0, 1, 1, -1]]), 0.0).tolist()
    [[0.5, 1.5, 1.0, 1.0, 0.0]]
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"mc_value: refine_floor must be in [0, 1], got {floor!r}")
    s = scores.detach().float().cpu()
    seg = seg.cpu()
    valid = seg >= 0
    idx = seg.clamp(min=0)
    n_seg = int(idx.max()) + 1 if idx.numel() else 1
    total = torch.zeros(s.shape[0], n_seg).scatter_add_(1, idx, torch.where(valid, s, 0.0))
    count = torch.zeros(s.shape[0], n_seg).scatter_add_(1, idx, valid.float())
    mean = (total / count.clamp(min=1)).gather(1, idx)
    w = torch.where(mean > 0, floor + (1.0 - floor) * s / mean.clamp(min=1e-30), torch.ones_like(s))
    return torch.where(valid, w, torch.zeros_like(w))


def step_advantages(values: torch.Tensor, seg: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token step advantages ``V_{k+1} - V_k`` on the tokens of segment ``k``.

    Args:
        values: ``(B, S + 1)`` float, ``V_0 .. V_S`` of each row (``V_{m+1}`` = the reward at the
            row's own last segment ``m``; entries after it are not read).
        seg: ``(B, T)`` long segment index of each token (:func:`segment_ids`), -1 on padding.
        response_mask: ``(B, T)``.

    Returns:
        ``(B, T)`` float, 0 outside the mask.

    >>> step_advantages(torch.tensor([[0.5, 1.0, 0.0]]), torch.tensor([[0, 0, 1, -1]]), torch.tensor([[1, 1, 1, 0]])).tolist()
    [[0.5, 0.5, -1.0, 0.0]]
    """
    s = seg.clamp(min=0).to(values.device)
    delta = values.gather(1, (s + 1).clamp(max=values.shape[1] - 1)) - values.gather(1, s)
    return torch.where(response_mask.bool().to(values.device) & (seg >= 0).to(values.device), delta,
                       torch.zeros((), dtype=values.dtype, device=values.device))


def mc_step_credit(ctx: ContinuationContext, tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor,
                   rewards: torch.Tensor, group_ids: torch.Tensor, *, k: int = McValueOptions.k,
                   step_split: str = McValueOptions.step_split, max_steps: int = McValueOptions.max_steps,
                   reasoning_only: bool = McValueOptions.reasoning_only, norm_by_std: bool = True,
                   greedy: bool = McValueOptions.greedy, group_moments: tuple[torch.Tensor, torch.Tensor] | None = None,
                   root: str = McValueOptions.root,
                   token_scores: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
                   refine_floor: float = McValueOptions.refine_floor,
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Step deltas of a batch: ``(delta (B, T) float32, values (B, S + 1) float64, cost stats)``.

    ``delta`` sums over a response's tokens' segments (one value per segment) to
    ``(r_i - mean_g) / std_g`` with ``norm_by_std`` (``r_i - mean_g`` without, or when the group's
    rewards are equal; ``r_i - V_0`` with ``root: continuation``); see the module docstring.
    ``group_moments``: each row's group ``(mean, std)`` ``(B,)`` when the batch holds only some
    members of its groups (default: :func:`group_stats` of ``rewards`` and ``group_ids``).
    ``token_scores``: ``(B, T)`` scores that spread each step's delta over its tokens
    (:func:`segment_weights` with ``refine_floor``; each step's sum is unchanged), or a function that
    returns them given the ``(B,)`` bool rows whose delta is not 0 everywhere (the only rows whose
    scores are read: a response whose values never change has nothing to spread).
    """
    if k < 1:
        raise ValueError(f"mc_value: k must be >= 1, got {k}")
    if root not in ROOTS:
        raise ValueError(f"mc_value: root must be one of {list(ROOTS)}, got {root!r}")
    bounds, texts, chars = step_boundaries(tokenizer, response_ids, response_mask, step_split=step_split,
                                           max_steps=max_steps, reasoning_only=reasoning_only)
    if root == "continuation":  # the bare prompt is one more prefix to continue (once per prompt)
        vals, stats = continuation_values(ctx, texts, [[0, *c] for c in chars], [[0, *b] for b in bounds],
                                          k=k, greedy=greedy)
        roots, mids = [v[0] for v in vals], [v[1:] for v in vals]
    else:
        mids, stats = continuation_values(ctx, texts, chars, bounds, k=k, greedy=greedy)
    mean, std = group_moments if group_moments is not None else group_stats(rewards, group_ids)
    S = max((len(b) for b in bounds), default=0) + 1
    values = torch.zeros((len(bounds), S + 1), dtype=torch.float64)
    r = rewards.detach().to(torch.float64).cpu()
    starts = roots if root == "continuation" else mean.tolist()
    for i, v in enumerate(mids):
        row = [float(starts[i]), *v, float(r[i])]
        values[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        values[i, len(row):] = float(r[i])
    seg = segment_ids(bounds, response_mask)
    delta = step_advantages(values, seg, response_mask.cpu())
    if token_scores is not None:
        if callable(token_scores):
            token_scores = token_scores((delta != 0).any(dim=1))
        delta = delta * segment_weights(token_scores, seg, refine_floor).to(delta.dtype)
    if norm_by_std:
        scale = torch.where(std > 0, std, torch.ones_like(std))
        delta = delta / scale[:, None]
    n_b = [len(b) for b in bounds]
    stats["mc_steps_per_response"] = float(sum(n_b) / max(1, len(n_b)))
    return delta.float(), values, stats


@register_estimator("mc_value", needs_model=True, needs_continuations=True)
def mc_value_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """``mc_value``: Monte-Carlo step credit (module docstring), ``seq_weight * A_i + alpha * delta``.

    Options: :class:`McValueOptions` (defaults there: ``k`` continuations per boundary, ``greedy``
    (sampled at the rollout's temperature, or one greedy continuation), ``step_split``,
    ``max_steps``, ``reasoning_only``, ``root`` (``group``: ``V_0`` is the group's mean reward;
    ``continuation``: from continuations of the bare prompt), ``refine`` (a mapping of OAR-G's
    options, e.g. ``{mode: answer_joint}``: each step's credit spread over its tokens by OAR-G's
    scores, one OAR-G pass over the answered responses whose step values move), ``refine_floor``, ``seq_weight``,
    ``alpha``) and the sequence advantage's ``norm_by_std`` (True), ``eps``.
    Needs ``batch.tokenizer`` and ``batch.continuations`` (a :class:`ContinuationContext`,
    set by the trainer). Stats: the continuation cost (``mc_prefixes``, ``mc_states``,
    ``mc_continuations``, ``mc_tokens``, ``mc_seconds``), ``mc_steps_per_response`` and, with ``refine``,
    ``refine_s`` and ``refine_fraction`` (the share of responses OAR-G scored).
    """
    check_options("mc_value", options, MC_VALUE_OPTIONS)
    ctx = batch.continuations
    if ctx is None or batch.tokenizer is None:
        raise ValueError("estimator 'mc_value': CreditBatch.continuations (a ContinuationContext: the "
                         "rollout engine, prompts, gold answers and reward) and CreditBatch.tokenizer are needed")
    A = sequence_advantages(batch, options)
    o = options_from(McValueOptions, {k: v for k, v in options.items() if k not in SEQ_OPTIONS}, "estimator 'mc_value'")
    scores: Callable[[torch.Tensor], torch.Tensor] | None = None
    refine_stats: dict[str, float] = {}
    refine = o.refine
    if refine is not None:
        if not isinstance(refine, Mapping) or set(refine) - set(REFINE_OPTIONS):
            raise ValueError(f"estimator 'mc_value': refine must be a mapping of OAR-G options {list(REFINE_OPTIONS)}, "
                             f"got {refine!r}")

        def refine_scores(rows: torch.Tensor) -> torch.Tensor:
            # the answered responses whose step values move, also in a group whose rewards are all equal
            s, _, active, st = importance_scores("oar_g", batch, dict(refine), rows.float())
            refine_stats.update(refine_s=st["importance_s"] + st["probe_s"], refine_fraction=float(active.float().mean()))
            return s

        scores = refine_scores
    delta, _, stats = mc_step_credit(
        ctx, batch.tokenizer, batch.response_ids, batch.response_mask, batch.rewards, batch.group_ids,
        k=o.k, step_split=o.step_split, max_steps=o.max_steps, reasoning_only=o.reasoning_only,
        norm_by_std=bool(options.get("norm_by_std", True)), greedy=o.greedy, root=o.root, token_scores=scores,
        refine_floor=o.refine_floor)
    stats.update(refine_stats)
    m = batch.response_mask.to(torch.float32)
    token_adv = o.seq_weight * A.float()[:, None] * m + o.alpha * delta.to(m.device) * m
    return CreditResult(token_advantages=token_adv, seq_advantages=A, weights=None, stats=stats)
