"""The attribution benchmark (``oar attribution``): does a credit signal find the mistake of a
wrong response, and does it hold still?

1. **Sampling.** Prompts of the synthetic ``split`` are sampled ``n_samples`` times each (one
   group per prompt), in rounds of ``prompts_per_round`` prompts, until there are ``n_sampled``
   wrong responses with a located first mistake and ``n_counterfactual`` counterfactuals, or
   ``max_prompts`` prompts were used. Each response is parsed with the task grammar
   (:func:`oar.attribution.parsing.parse_response`) and replayed against the question
   (:func:`oar.attribution.grammar.check_steps`).
2. **Kinds of responses.** ``sampled``: wrong responses (reward ``<= 0``) whose first arithmetic
   mistake is located (and, with ``propagated_only``, is the only thing that goes wrong).
   Both kinds keep responses of at least ``min_steps`` steps, at most ``max_per_prompt`` per prompt.
   ``counterfactual``: correct responses whose steps are all consistent, with one step's result
   moved (:func:`oar.attribution.grammar.draw_counterfactual`), the rest re-derived, and the edited
   text scored teacher-forced as a response of the same prompt.
3. **Signals** (:mod:`oar.attribution.signals`) score every reasoning token. KTAE's groups: for
   ``sampled``, the sampled group of the prompt; for ``counterfactual``, the sampled group of the
   prompt with the original response replaced by its edit (reward recomputed), one copy of the
   group per edit.
4. **Metrics** (:mod:`oar.attribution.metrics`): error localisation per kind, pivotal-vs-filler
   fidelity over all scored responses, stability, and cost. Stability: stochastic signals (OAR-G,
   random) are recomputed with seed ``seed + 1``; KTAE is recomputed on a second, independently
   sampled group of the prompt (``n_samples - 1`` fresh responses plus the scored response itself,
   so both groups hold it and have the same size).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from oar.attribution.grammar import StepCheck, check_steps, draw_counterfactual, mistake_spans, question_terms
from oar.attribution.metrics import cost_table, fidelity_table, localisation_table, stability_table
from oar.attribution.parsing import UNLABELED, ParsedResponse, parse_response, token_char_spans, token_labels
from oar.attribution.signals import SignalSpec, compute_signals, signal_specs

__all__ = ["KINDS", "DEFAULT_BENCHMARK_SIGNALS", "AttributionResult", "run_attribution", "attribution_from_config"]

#: Kinds of responses of the error-localisation benchmark.
KINDS: tuple[str, ...] = ("sampled", "counterfactual")

#: Signals of :func:`run_attribution` when none are given (config ``attribution.signals`` default).
DEFAULT_BENCHMARK_SIGNALS: tuple[dict, ...] = (
    {"name": "oar_p", "kind": "oar_p", "mode": "last"},
    {"name": "oar_p_answer_mean", "kind": "oar_p", "mode": "answer_mean"},
    {"name": "oar_p_joint", "kind": "oar_p", "mode": "answer_joint"},
    {"name": "oar_g", "kind": "oar_g", "mode": "answer_mean", "noise_std": 1.0e-3},
    {"name": "oar_g_k4", "kind": "oar_g", "mode": "answer_mean", "noise_std": 1.0e-3, "draws": 4},
    {"name": "oar_g_joint", "kind": "oar_g", "mode": "answer_joint", "noise_std": 1.0e-3},
    {"name": "oar_g_joint_k2", "kind": "oar_g", "mode": "answer_joint", "noise_std": 1.0e-3, "draws": 2},
    {"name": "oar_g_joint_k4", "kind": "oar_g", "mode": "answer_joint", "noise_std": 1.0e-3, "draws": 4},
    {"name": "oar_g_joint_n0", "kind": "oar_g", "mode": "answer_joint", "noise_std": 0.0},
    {"name": "oar_g_joint_ig4", "kind": "oar_g", "mode": "answer_joint", "noise_std": 0.0, "baseline": "pad", "draws": 4},
    {"name": "ktae", "kind": "ktae"},
    {"name": "random", "kind": "random"},
    {"name": "uniform", "kind": "uniform"},
)


def _derived_seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()[:4], "big")


@dataclass
class _Response:
    """One response of the benchmark (sampled or edited): real tokens, text, parse, check."""

    prompt: int  # index into the records
    prompt_ids: list[int]
    ids: list[int]
    reward: float
    text: str
    starts: np.ndarray
    ends: np.ndarray
    parsed: ParsedResponse | None
    check: StepCheck | None
    kind: str = ""
    source: "_Response | None" = None  # counterfactual: the response it edits
    edit: Any = None


@dataclass
class AttributionResult:
    """Result of :func:`run_attribution`.

    Attributes:
        localisation: one row per (signal, kind) (:func:`oar.attribution.metrics.localisation_columns`).
        stability: one row per (stochastic signal, kind) (:data:`~oar.attribution.metrics.STABILITY_COLUMNS`).
        cost: one row per signal (:data:`~oar.attribution.metrics.COST_COLUMNS`).
        fidelity: pivotal vs filler, one row per signal (:data:`~oar.attribution.metrics.FIDELITY_COLUMNS`).
        per_response: one row per scored response (kind, prompt, texts, metrics).
        summary: counts, settings and timings.
    """

    localisation: Any
    stability: Any
    cost: Any
    fidelity: Any
    per_response: Any
    summary: dict = field(default_factory=dict)


def _pad(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts and right-padded responses: ``(B, P)`` ids and mask, ``(B, T)`` ids and mask
    (:func:`oar.rollout.base.pad_batch`, the rollout's layout)."""
    from oar.rollout.base import pad_batch

    return pad_batch(prompts, responses, pad_id)


class _Batch:
    """Responses grouped for KTAE; ``add_group`` returns the rows of its members."""

    def __init__(self) -> None:
        self.members: list[_Response] = []
        self.groups: list[int] = []
        self.n_groups = 0

    def add_group(self, members: Sequence[_Response]) -> list[int]:
        start = len(self.members)
        self.members.extend(members)
        self.groups.extend([self.n_groups] * len(members))
        self.n_groups += 1
        return list(range(start, len(self.members)))

    def tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        p_ids, p_mask, r_ids, r_mask = _pad([m.prompt_ids for m in self.members], [m.ids for m in self.members], pad_id)
        return {
            "prompt_ids": p_ids,
            "prompt_mask": p_mask,
            "response_ids": r_ids,
            "response_mask": r_mask,
            "rewards": torch.tensor([m.reward for m in self.members], dtype=torch.float32),
            "group_ids": torch.tensor(self.groups, dtype=torch.long),
        }


def _mistake_labels(r: _Response, T: int) -> np.ndarray:
    """``(T,)`` labels: 1 on the mistake's result tokens, 0 on the other steps' tokens, -1 elsewhere."""
    out = np.full(T, UNLABELED, dtype=np.int64)
    i = r.check.mistake_step if r.check is not None else None
    if r.parsed is None or i is None:
        return out
    pos, neg = mistake_spans(r.parsed, i)
    lab = token_labels(r.starts, r.ends, pos, neg, len(r.text))
    out[: len(lab)] = lab
    return out


def _fidelity_labels(r: _Response, T: int) -> np.ndarray:
    out = np.full(T, UNLABELED, dtype=np.int64)
    if r.parsed is not None:
        lab = token_labels(r.starts, r.ends, r.parsed.pivotal_spans, r.parsed.filler_spans, len(r.text))
        out[: len(lab)] = lab
    return out


def run_attribution(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    task_options: Mapping[str, Any] | None = None,
    n_samples: int,
    n_sampled: int = 300,
    n_counterfactual: int = 300,
    max_prompts: int = 2000,
    prompts_per_round: int = 64,
    propagated_only: bool = True,
    min_steps: int = 2,
    max_per_prompt: int = 2,
    max_delta: int = 9,
    top_k: Sequence[int] = (1, 3),
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    template: str = "tiny",
    split: str = "test",
    signals: Sequence[str | Mapping[str, Any] | SignalSpec] = DEFAULT_BENCHMARK_SIGNALS,
    conclude: str | None = None,
    oar_p_chunk_size: int = 128,
    noise_std: float = 1e-3,
    ktae_options: Mapping[str, Any] | None = None,
    cost_reference: str = "oar_g",
    stability: bool = True,
    correct: float = 1.0,
    wrong: float = 0.0,
    reward_timeout_s: float = 5.0,
    reward_workers: int | None = None,
    batch_size: int = 256,
    repeats: int = 1,
) -> AttributionResult:
    """Sample, locate mistakes, build counterfactuals, score every signal and measure it (see the
    module docstring).

    Args:
        model, tokenizer: the policy (e.g. the warm-started tiny model).
        task_options: keyword options of :func:`oar.data.synthetic.generate` (config ``task.synthetic``).
        n_samples: responses per prompt (the KTAE group size).
        n_sampled, n_counterfactual: wanted responses of each kind (fewer when ``max_prompts``
            prompts do not yield them; the summary says how many).
        max_prompts: most prompts to sample (the records drawn from ``split``).
        prompts_per_round: prompts per sampling round (the collection stops after the round that
            reaches both targets).
        propagated_only: keep only sampled mistakes that are the only thing going wrong.
        min_steps: keep only responses with at least this many steps (2: there is a correct step
            to compare the mistake with).
        max_per_prompt: at most this many responses of each kind per prompt (spreads the
            responses over prompts).
        max_delta: counterfactual results move by ``1..max_delta`` either way.
        top_k: the ``k`` of the top-k hit rates.
        temperature, top_p, max_new_tokens, batch_size: sampling settings.
        seed: seed of the prompts, the sampling, the edits, the OAR-G noise and the random baseline.
        template, split: prompt template and synthetic split.
        signals: names, config dicts or specs (:func:`oar.attribution.signals.signal_specs`).
        conclude, oar_p_chunk_size, noise_std, ktae_options: see
            :func:`oar.attribution.signals.compute_signals`.
        cost_reference: the signal the cost ratios are taken against ("one OAR-G pass").
        stability: compute the stability table (a second pass of each stochastic signal, a
            second sampled group per prompt for KTAE).
        correct, wrong, reward_timeout_s, reward_workers: reward settings (correct when ``> 0``).
        repeats: timing repeats per signal (the fastest is reported).

    Returns:
        an :class:`AttributionResult`.
    """
    import pandas as pd

    from oar.credit.mc_value import ContinuationContext
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import DEFAULT_FILLERS, generate
    from oar.reward import score_batch
    from oar.rollout import HFEngine

    if n_samples < 1 or max_prompts < 1 or prompts_per_round < 1:
        raise ValueError("oar.attribution.run_attribution: n_samples, max_prompts and prompts_per_round must be >= 1")
    if n_sampled < 0 or n_counterfactual < 0:
        raise ValueError("oar.attribution.run_attribution: n_sampled and n_counterfactual must be >= 0")
    specs = signal_specs(signals)
    t_start = time.perf_counter()
    opts = dict(task_options or {})
    fillers = list(opts.get("fillers", DEFAULT_FILLERS))
    records = generate(split, max_prompts, seed=seed, **opts)
    terms = [question_terms(r["question"]) for r in records]
    prompts = [render_prompt(template, r["question"], tokenizer) for r in records]
    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    pad_id = int(tokenizer.pad_token_id)
    edit_rng = random.Random(_derived_seed("oar-attribution-edits", seed))

    def reward_of(texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        return score_batch(list(texts), list(golds), correct=correct, wrong=wrong,
                           timeout_s=reward_timeout_s, workers=reward_workers)

    def responses_of(ro: Any, prompt_list: Sequence[int]) -> list[_Response]:
        golds = [records[prompt_list[i]]["answer"] for i in ro.prompt_index.tolist()]
        rewards = reward_of(ro.texts, golds)
        out = []
        for b in range(len(ro.texts)):
            pi = prompt_list[int(ro.prompt_index[b])]
            ids = ro.response_ids[b][ro.response_mask[b].bool()].tolist()
            text, starts, ends = token_char_spans(tokenizer, ids)
            parsed = parse_response(text, fillers=fillers)
            check = None if parsed is None else check_steps(parsed.steps, *terms[pi], parsed.answer)
            out.append(_Response(pi, ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist(), ids, float(rewards[b]),
                                 text, starts, ends, parsed, check))
        return out

    # ---- 1. sample until both kinds are complete
    groups: dict[int, list[_Response]] = {}
    sampled: list[_Response] = []
    edited: list[_Response] = []
    counts: dict[str, int] = {}
    per_prompt: dict[str, dict[int, int]] = {k: {} for k in KINDS}
    n_prompts_used = 0
    t0 = time.perf_counter()
    for r0 in range(0, max_prompts, prompts_per_round):
        if len(sampled) >= n_sampled and len(edited) >= n_counterfactual:
            break
        plist = list(range(r0, min(r0 + prompts_per_round, max_prompts)))
        ro = engine.generate([prompts[i] for i in plist], n=n_samples, temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens, seed=_derived_seed("oar-attribution-sample", seed, r0))
        n_prompts_used = plist[-1] + 1
        for r in responses_of(ro, plist):
            groups.setdefault(r.prompt, []).append(r)
            if r.parsed is None:
                status = "unparsed"
            else:
                assert r.check is not None
                status = r.check.status + ("_propagated" if r.check.status == "mistake" and r.check.propagated else "")
            counts[status] = counts.get(status, 0) + 1
            ok = r.reward > 0
            counts["correct" if ok else "wrong"] = counts.get("correct" if ok else "wrong", 0) + 1
            if r.check is None or r.parsed is None or len(r.parsed.steps) < min_steps:
                continue
            if (not ok and r.check.status == "mistake" and (r.check.propagated or not propagated_only)
                    and len(sampled) < n_sampled and per_prompt["sampled"].get(r.prompt, 0) < max_per_prompt):
                r.kind = "sampled"
                sampled.append(r)
                per_prompt["sampled"][r.prompt] = per_prompt["sampled"].get(r.prompt, 0) + 1
            elif (ok and r.check.status == "consistent" and len(edited) < n_counterfactual
                  and per_prompt["counterfactual"].get(r.prompt, 0) < max_per_prompt):
                assert r.parsed is not None
                cf = draw_counterfactual(*terms[r.prompt], r.parsed.gap_fillers, records[r.prompt]["answer"],
                                         edit_rng, max_delta=max_delta)
                if cf is None:
                    counts["edit_failed"] = counts.get("edit_failed", 0) + 1
                    continue
                ids = list(tokenizer(cf.text, add_special_tokens=False)["input_ids"])
                if eos is not None and r.ids and r.ids[-1] == eos:
                    ids.append(int(eos))
                text, starts, ends = token_char_spans(tokenizer, ids)
                parsed = parse_response(text, fillers=fillers)
                check = None if parsed is None else check_steps(parsed.steps, *terms[r.prompt], parsed.answer)
                if check is None or check.mistake_step != cf.step or not check.propagated:
                    raise RuntimeError(f"oar.attribution: the counterfactual {cf.text!r} does not parse back to its edit")
                edited.append(_Response(r.prompt, r.prompt_ids, ids, float("nan"), text, starts, ends, parsed, check,
                                        kind="counterfactual", source=r, edit=cf))
                per_prompt["counterfactual"][r.prompt] = per_prompt["counterfactual"].get(r.prompt, 0) + 1
    sample_seconds = time.perf_counter() - t0
    if edited:
        cf_rewards = reward_of([e.text for e in edited], [records[e.prompt]["answer"] for e in edited])
        for e, rw in zip(edited, cf_rewards):
            e.reward = float(rw)
    scored = sampled + edited
    kinds = [r.kind for r in scored]

    # ---- 2. one batch: the groups of sampled responses, one group copy per edit
    batch = _Batch()
    rows: list[int] = []
    group_rows: dict[int, dict[int, int]] = {}
    for r in sampled:
        if r.prompt not in group_rows:
            members = groups[r.prompt]
            group_rows[r.prompt] = {id(m): row for m, row in zip(members, batch.add_group(members))}
        rows.append(group_rows[r.prompt][id(r)])
    for e in edited:
        members = [e if m is e.source else m for m in groups[e.prompt]]
        rows.append(batch.add_group(members)[next(i for i, m in enumerate(members) if m is e)])  # identity, not ==
    summary_counts = {"n_prompts_sampled": n_prompts_used, "n_sampled_responses": sum(len(g) for g in groups.values()),
                      "status": counts, "n_sampled": len(sampled), "n_counterfactual": len(edited),
                      "counterfactual_still_correct": int(sum(e.reward > 0 for e in edited))}

    names = [s.name for s in specs]
    n = len(scored)
    if n == 0:
        empty = {name: torch.zeros(0, 1) for name in names}
        T = 1
        reasoning = torch.zeros(0, 1, dtype=torch.bool)
        seconds = {name: float("nan") for name in names}
        info: dict[str, Any] = {"n_scored": {name: 0 for name in names}, "notes": {name: "" for name in names},
                                "probe_seconds": 0.0}
        scores = empty
        tens = None
    else:
        tens = batch.tensors(pad_id)
        T = int(tens["response_ids"].shape[1])
        continuations = ContinuationContext(
            engine=engine, prompts=[prompts[m.prompt] for m in batch.members],
            golds=[records[m.prompt]["answer"] for m in batch.members], score=reward_of, temperature=temperature,
            top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        scores, seconds, info = compute_signals(
            model, tokenizer, **tens, rows=torch.tensor(rows), signals=specs, conclude=conclude,
            oar_p_chunk_size=oar_p_chunk_size, noise_std=noise_std, ktae_options=ktae_options, seed=seed,
            repeats=repeats, continuations=continuations,
        )
        if not bool(info["has_answer"].all()):
            raise RuntimeError("oar.attribution.run_attribution: the probe found no answer in a response that parsed")
        reasoning = info["reasoning_mask"]

    mistake = torch.from_numpy(np.stack([_mistake_labels(r, T) for r in scored])) if n else torch.zeros(0, 1, dtype=torch.long)
    fid_lab = torch.from_numpy(np.stack([_fidelity_labels(r, T) for r in scored])) if n else torch.zeros(0, 1, dtype=torch.long)

    loc, loc_per = localisation_table(scores, mistake, reasoning, kinds, top_k=top_k)
    present = set(kinds)
    blank = {c: float("nan") for c in loc.columns}
    missing = [{**blank, "signal": s_, "kind": k, "n_responses": 0, "n_auroc": 0, "n_positive": 0, "n_negative": 0}
               for s_ in names for k in KINDS if k not in present]
    if missing:  # one row per (signal, kind) even when a kind has no response
        loc = pd.concat([loc, pd.DataFrame(missing, columns=loc.columns)], ignore_index=True)
    rank = loc["signal"].map({s_: i for i, s_ in enumerate(names)}) * len(KINDS) + loc["kind"].map(
        {k: i for i, k in enumerate(KINDS)})
    loc = loc.iloc[np.argsort(rank.to_numpy(), kind="stable")].reset_index(drop=True)
    sec_per = {k: (seconds[k] / info["n_scored"][k] if info["n_scored"].get(k) else float("nan")) for k in seconds}
    fid, fid_per = fidelity_table(scores, fid_lab, reasoning, seconds_per_response=sec_per)
    cost = cost_table(seconds, info["n_scored"], reference=cost_reference, notes=info["notes"])

    # ---- 3. stability
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, str]] = {}
    stab_seconds = 0.0
    if stability and n:
        assert tens is not None
        t0 = time.perf_counter()
        stoch = [s for s in specs if s.stochastic]
        if stoch:
            again, _, _ = compute_signals(
                model, tokenizer, **tens, rows=torch.tensor(rows), signals=stoch, conclude=conclude,
                oar_p_chunk_size=oar_p_chunk_size, noise_std=noise_std, ktae_options=ktae_options, seed=seed + 1,
                warmup=False, continuations=continuations,
            )
            seed_kind = {"oar_g": "noise seed", "mc_value": "continuation seed"}
            for s in stoch:
                pairs[s.name] = (scores[s.name], again[s.name], seed_kind.get(s.kind, "random seed"))
        ktae = [s for s in specs if s.kind == "ktae"]
        if ktae and n_samples > 1:
            plist = sorted({r.prompt for r in scored})
            ro = engine.generate([prompts[i] for i in plist], n=n_samples - 1, temperature=temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens, seed=_derived_seed("oar-attribution-group2", seed))
            fresh: dict[int, list[_Response]] = {}
            for r in responses_of(ro, plist):
                fresh.setdefault(r.prompt, []).append(r)
            b2 = _Batch()
            rows2 = [b2.add_group(fresh[r.prompt] + [r])[-1] for r in scored]
            k2, _, _ = compute_signals(model, tokenizer, **b2.tensors(pad_id), rows=torch.tensor(rows2), signals=ktae,
                                       conclude=conclude, ktae_options=ktae_options, seed=seed, warmup=False)
            for s in ktae:
                # both batches hold the same rows right-padded: align the second on the first's width
                b = torch.zeros_like(scores[s.name])
                w = min(T, k2[s.name].shape[1])
                b[:, :w] = k2[s.name][:, :w]
                pairs[s.name] = (scores[s.name], b, "sampled group")
        stab_seconds = time.perf_counter() - t0
    stab, stab_per = stability_table(pairs, reasoning, kinds)

    # ---- 4. per-response rows and summary
    per = pd.DataFrame({
        "kind": kinds,
        "prompt_index": [r.prompt for r in scored],
        "question": [records[r.prompt]["question"] for r in scored],
        "gold": [records[r.prompt]["answer"] for r in scored],
        "reward": [r.reward for r in scored],
        "mistake_step": [r.check.mistake_step if r.check else -1 for r in scored],
        "n_steps": [len(r.parsed.steps) if r.parsed else 0 for r in scored],
    })
    fid_cols = fid_per[["n_pivotal", "n_filler"]] if n else pd.DataFrame(columns=["n_pivotal", "n_filler"])
    per = pd.concat([per, loc_per.drop(columns=["kind"]), fid_cols.reset_index(drop=True), stab_per], axis=1)
    per["text"] = [r.text for r in scored]
    per["original_text"] = [r.source.text if r.source is not None else "" for r in scored]

    summary = {
        **summary_counts,
        "sample_accuracy": counts.get("correct", 0) / max(counts.get("correct", 0) + counts.get("wrong", 0), 1),
        "n_batch_rows": len(batch.members),
        "seconds_sampling": sample_seconds,
        "seconds_probe": info["probe_seconds"],
        "seconds_signal": seconds,
        "n_scored": info["n_scored"],
        "seconds_stability": stab_seconds,
        "seconds_total": time.perf_counter() - t_start,
        "settings": {
            "split": split, "template": template, "seed": seed, "n_samples": n_samples, "temperature": temperature,
            "top_p": top_p, "max_new_tokens": max_new_tokens, "n_sampled": n_sampled,
            "n_counterfactual": n_counterfactual, "max_prompts": max_prompts, "prompts_per_round": prompts_per_round,
            "propagated_only": propagated_only, "min_steps": min_steps, "max_per_prompt": max_per_prompt,
            "max_delta": max_delta, "top_k": list(top_k),
            "signals": [{"name": s.name, "kind": s.kind, **dict(s.options)} for s in specs],
            "conclude": conclude, "cost_reference": cost_reference, "timing_repeats": repeats,
            "fillers": fillers, "torch_threads": torch.get_num_threads(),
        },
    }
    return AttributionResult(localisation=loc, stability=stab, cost=cost, fidelity=fid, per_response=per, summary=summary)


def attribution_from_config(
    config: Mapping[str, Any],
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    repeats: int | None = None,
) -> AttributionResult:
    """Run the benchmark as the config says and write its outputs.

    Settings: ``attribution`` (``signals``, ``n_sampled``, ``n_counterfactual``, ``max_prompts``,
    ``prompts_per_round``, ``propagated_only``, ``min_steps``, ``max_per_prompt``, ``max_delta``, ``top_k``, ``conclude``,
    ``cost_reference``, ``stability``, ``timing_repeats``, ``split``, ``seed``); sampling from
    ``rollout`` (``n`` = the group size, ``temperature``, ``top_p``, ``max_new_tokens``,
    ``batch_size``); the task from ``task`` (``kind`` must be ``synthetic``); reward settings from
    ``reward``; ``device``. ``attribution.enabled`` is for the workflow: this function always runs.

    Writes (atomically) into ``output_dir``: ``localisation.csv``, ``stability.csv``, ``cost.csv``,
    ``fidelity.csv``, ``per_response.csv``, ``attribution.md`` (the three tables),
    ``localisation.png``, ``fidelity.png`` and ``summary.json``.

    Args:
        config: a validated config (:func:`oar.config.load_config`).
        model_dir: the warm-started policy (loaded with :func:`oar.models.load_policy`).
        output_dir: output folder (created).
        repeats: timing repeats per signal (default ``attribution.timing_repeats``).

    Returns:
        the :class:`AttributionResult`.
    """
    from oar.attribution.report import write_outputs
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
    if "n" not in rollout:
        raise ValueError("config: missing key rollout.n")
    model, tokenizer = load_policy(model_dir)
    model.to(config.get("device", "cpu"))
    result = run_attribution(
        model,
        tokenizer,
        task_options=dict(task.get("synthetic") or {}),
        n_samples=int(rollout["n"]),
        n_sampled=int(attr.get("n_sampled", 300)),
        n_counterfactual=int(attr.get("n_counterfactual", 300)),
        max_prompts=int(attr.get("max_prompts", 2000)),
        prompts_per_round=int(attr.get("prompts_per_round", 64)),
        propagated_only=bool(attr.get("propagated_only", True)),
        min_steps=int(attr.get("min_steps", 2)),
        max_per_prompt=int(attr.get("max_per_prompt", 2)),
        max_delta=int(attr.get("max_delta", 9)),
        top_k=tuple(int(k) for k in attr.get("top_k", (1, 3))),
        temperature=float(rollout.get("temperature", 1.0)),
        top_p=float(rollout.get("top_p", 1.0)),
        max_new_tokens=int(rollout.get("max_new_tokens", 64)),
        seed=int(attr.get("seed", 0)),
        template=str(task.get("template", "tiny")),
        split=str(attr.get("split", "test")),
        signals=list(attr.get("signals") or DEFAULT_BENCHMARK_SIGNALS),
        conclude=attr.get("conclude"),
        cost_reference=str(attr.get("cost_reference", "oar_g")),
        stability=bool(attr.get("stability", True)),
        reward_timeout_s=float(reward.get("timeout_s", 5.0)),
        reward_workers=reward.get("workers"),
        batch_size=int(rollout.get("batch_size", 256)),
        repeats=int(attr.get("timing_repeats", 1) if repeats is None else repeats),
    )
    result.summary["model_dir"] = str(model_dir)
    write_outputs(result, Path(output_dir))
    return result
