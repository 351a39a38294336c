"""The attribution benchmark (``oar attribution``): does a credit signal find the mistake of a
wrong response, and does it hold still?

1. **Sampling.** Prompts of the synthetic ``split`` are sampled ``n_samples`` times each (one
   group per prompt), in rounds of ``prompts_per_round`` prompts, until there are ``n_sampled``
   wrong responses with a located first mistake and ``n_counterfactual`` counterfactuals, or
   ``max_prompts`` prompts were used. Each response is parsed with the task grammar
   (:func:`oar.task.parsing.parse_response`) and replayed against the question
   (:func:`oar.task.grammar.check_steps`).
2. **Kinds of responses.** ``sampled``: wrong responses (reward ``<= 0``) whose first arithmetic
   mistake is located (and, with ``propagated_only``, is the only thing that goes wrong).
   Both kinds keep responses of at least ``min_steps`` steps, at most ``max_per_prompt`` per prompt.
   ``counterfactual``: correct responses whose steps are all consistent, with one step's result
   moved (:func:`oar.task.grammar.draw_counterfactual`), the rest re-derived, and the edited
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

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from oar.attribution.metrics import cost_table, fidelity_table, localisation_table, stability_table
from oar.attribution.settings import AttributionResponse, AttributionResult, AttributionSettings, KINDS, derived_seed, fidelity_labels, mistake_labels, pad_rows, seed_kind
from oar.attribution.signals import compute_signals
from oar.attribution.specs import SignalSpec, signal_specs
from oar.task.grammar import check_steps, draw_counterfactual, question_terms
from oar.task.parsing import parse_response, token_char_spans

__all__ = ["run_attribution", "attribution_from_config"]


class _Batch:
    """Responses grouped for KTAE; ``add_group`` returns the rows of its members."""

    def __init__(self) -> None:
        self.members: list[AttributionResponse] = []
        self.groups: list[int] = []
        self.n_groups = 0

    def add_group(self, members: Sequence[AttributionResponse]) -> list[int]:
        start = len(self.members)
        self.members.extend(members)
        self.groups.extend([self.n_groups] * len(members))
        self.n_groups += 1
        return list(range(start, len(self.members)))

    def tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        p_ids, p_mask, r_ids, r_mask = pad_rows([m.prompt_ids for m in self.members], [m.ids for m in self.members], pad_id)
        return {
            "prompt_ids": p_ids,
            "prompt_mask": p_mask,
            "response_ids": r_ids,
            "response_mask": r_mask,
            "rewards": torch.tensor([m.reward for m in self.members], dtype=torch.float32),
            "group_ids": torch.tensor(self.groups, dtype=torch.long),
        }


@dataclass
class _Run:
    """What every phase of one run reads: the settings, the policy and its engine, the prompts."""

    s: AttributionSettings
    model: torch.nn.Module
    tokenizer: Any
    specs: list[SignalSpec]
    records: list[dict]
    terms: list[Any]
    prompts: list[str]
    fillers: list[str]
    engine: Any
    pad_id: int
    pool: Any  # the benchmark's reward pool (oar.reward.pool.RewardPool), closed when it ends

    @classmethod
    def start(cls, model: torch.nn.Module, tokenizer: Any, s: AttributionSettings) -> "_Run":
        from oar.data.prompts import render_prompt
        from oar.data.synthetic import generate, task_fillers
        from oar.reward.pool import RewardPool
        from oar.rollout import HFEngine

        s.check()
        opts = dict(s.task_options)
        records = generate(s.split, s.max_prompts, seed=s.seed, **opts)
        return cls(s=s, model=model, tokenizer=tokenizer, specs=signal_specs(s.signals), records=records,
                   terms=[question_terms(r["question"]) for r in records],
                   prompts=[render_prompt(s.template, r["question"], tokenizer) for r in records],
                   fillers=task_fillers(opts),
                   engine=HFEngine(model, tokenizer, batch_size=s.batch_size, sampler=s.sampler), pad_id=int(tokenizer.pad_token_id),
                   pool=RewardPool(workers=s.reward_workers, timeout_s=s.reward_timeout_s))

    def reward_of(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        from oar.reward.score import score_batch

        return score_batch(list(texts), list(golds), correct=self.s.correct, wrong=self.s.wrong, pool=self.pool)

    def responses_of(self, ro: Any, prompt_list: Sequence[int]) -> list[AttributionResponse]:
        """The responses of a rollout of ``prompt_list``: scored, parsed and checked against the question."""
        golds = [self.records[prompt_list[i]]["answer"] for i in ro.prompt_index.tolist()]
        rewards = self.reward_of(ro.texts, golds)
        out = []
        for b in range(len(ro.texts)):
            pi = prompt_list[int(ro.prompt_index[b])]
            ids = ro.response_ids[b][ro.response_mask[b].bool()].tolist()
            out.append(self.response(pi, ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist(), ids, float(rewards[b])))
        return out

    def response(self, prompt: int, prompt_ids: list[int], ids: list[int], reward: float, **kw: Any) -> AttributionResponse:
        """One response: decoded with token spans, parsed and checked."""
        text, starts, ends = token_char_spans(self.tokenizer, ids)
        parsed = parse_response(text, fillers=self.fillers)
        check = None if parsed is None else check_steps(parsed.steps, *self.terms[prompt], parsed.answer)
        return AttributionResponse(prompt, prompt_ids, ids, reward, text, starts, ends, parsed, check, **kw)

    def continuations(self, batch: "_Batch") -> Any:
        """The continuation context of ``mc_value`` signals, row-aligned with ``batch``."""
        from oar.credit.mc_value import ContinuationContext

        return ContinuationContext(
            engine=self.engine, prompts=[self.prompts[m.prompt] for m in batch.members],
            golds=[self.records[m.prompt]["answer"] for m in batch.members], score=self.reward_of,
            temperature=self.s.temperature, top_p=self.s.top_p, max_new_tokens=self.s.max_new_tokens, seed=self.s.seed)


@dataclass
class _Collected:
    """Phase 1's output: the sampled groups and the scored responses of both kinds."""

    groups: dict[int, list[AttributionResponse]]
    sampled: list[AttributionResponse]
    edited: list[AttributionResponse]
    counts: dict[str, int]
    n_prompts_used: int
    seconds: float

    @property
    def scored(self) -> list[AttributionResponse]:
        return self.sampled + self.edited

    @property
    def kinds(self) -> list[str]:
        return [r.kind for r in self.scored]


@dataclass
class _Scored:
    """Phase 3's output: every signal's scores of the scored rows, aligned with response positions."""

    scores: dict[str, torch.Tensor]
    seconds: dict[str, float]
    info: dict[str, Any]
    reasoning: torch.Tensor
    T: int
    tens: dict[str, torch.Tensor] | None
    rows: list[int]
    continuations: Any


def run_attribution(model: torch.nn.Module, tokenizer: Any, settings: AttributionSettings, *,
                    progress: bool = False) -> AttributionResult:
    """Sample, locate mistakes, build counterfactuals, score every signal and measure it (see the
    module docstring), as a list of phases.

    Args:
        model, tokenizer: the policy (e.g. the warm-started tiny model).
        settings: :class:`AttributionSettings` (:meth:`AttributionSettings.from_config`).
        progress: progress bars on stderr over the mistakes collected and the signals scored.

    Returns:
        an :class:`AttributionResult`.
    """
    t_start = time.perf_counter()
    run = _Run.start(model, tokenizer, settings)
    try:
        collected = _collect(run, progress)              # 1. sample until both kinds are complete
        batch, rows = _group_batch(collected)            # 2. one batch: the groups KTAE needs
        scored = _score(run, collected, batch, rows, progress)   # 3. every signal on the scored rows
        loc, loc_per, fid, fid_per, cost = _measure(run, collected, scored)   # 4. localisation, fidelity, cost
        stab, stab_per, stab_seconds = _stability(run, collected, scored)     # 5. stability
    finally:
        run.pool.close()
    per = _per_response(run, collected, loc_per, fid_per, stab_per)       # 6. rows and summary
    summary = _summary(run, collected, batch, scored, stab_seconds, time.perf_counter() - t_start)
    return AttributionResult(localisation=loc, stability=stab, cost=cost, fidelity=fid, per_response=per, summary=summary)


def _collect(run: _Run, progress: bool = False) -> _Collected:
    """Phase 1: sample rounds of prompts until there are ``n_sampled`` located mistakes and
    ``n_counterfactual`` edits (or the prompts run out); edits are scored teacher-forced."""
    from tqdm.auto import tqdm

    s, tok = run.s, run.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    edit_rng = random.Random(derived_seed("oar-attribution-edits", s.seed))
    c = _Collected(groups={}, sampled=[], edited=[], counts={}, n_prompts_used=0, seconds=0.0)
    per_prompt: dict[str, dict[int, int]] = {k: {} for k in KINDS}

    def bump(key: str) -> None:
        c.counts[key] = c.counts.get(key, 0) + 1

    t0 = time.perf_counter()
    bar = tqdm(total=s.n_sampled + s.n_counterfactual, desc="attribution: mistakes", unit="response",
               disable=not progress, dynamic_ncols=True)
    for r0 in range(0, s.max_prompts, s.prompts_per_round):
        bar.update(len(c.sampled) + len(c.edited) - bar.n)
        bar.set_postfix(prompts=r0, refresh=False)
        if len(c.sampled) >= s.n_sampled and len(c.edited) >= s.n_counterfactual:
            break
        plist = list(range(r0, min(r0 + s.prompts_per_round, s.max_prompts)))
        ro = run.engine.generate([run.prompts[i] for i in plist], n=s.n_samples, temperature=s.temperature,
                                 top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                 seed=derived_seed("oar-attribution-sample", s.seed, r0))
        c.n_prompts_used = plist[-1] + 1
        for r in run.responses_of(ro, plist):
            c.groups.setdefault(r.prompt, []).append(r)
            if r.parsed is None:
                bump("unparsed")
            else:
                assert r.check is not None
                bump(r.check.status + ("_propagated" if r.check.status == "mistake" and r.check.propagated else ""))
            ok = r.reward > 0
            bump("correct" if ok else "wrong")
            if r.check is None or r.parsed is None or len(r.parsed.steps) < s.min_steps:
                continue
            if (not ok and r.check.status == "mistake" and (r.check.propagated or not s.propagated_only)
                    and len(c.sampled) < s.n_sampled and per_prompt["sampled"].get(r.prompt, 0) < s.max_per_prompt):
                r.kind = "sampled"
                c.sampled.append(r)
                per_prompt["sampled"][r.prompt] = per_prompt["sampled"].get(r.prompt, 0) + 1
            elif (ok and r.check.status == "consistent" and len(c.edited) < s.n_counterfactual
                  and per_prompt["counterfactual"].get(r.prompt, 0) < s.max_per_prompt):
                assert r.parsed is not None
                cf = draw_counterfactual(*run.terms[r.prompt], r.parsed.gap_fillers, run.records[r.prompt]["answer"],
                                         edit_rng, max_delta=s.max_delta)
                if cf is None:
                    bump("edit_failed")
                    continue
                ids = list(tok(cf.text, add_special_tokens=False)["input_ids"])
                if eos is not None and r.ids and r.ids[-1] == eos:
                    ids.append(int(eos))
                e = run.response(r.prompt, r.prompt_ids, ids, float("nan"), kind="counterfactual", source=r, edit=cf)
                if e.check is None or e.check.mistake_step != cf.step or not e.check.propagated:
                    raise RuntimeError(f"oar.attribution: the counterfactual {cf.text!r} does not parse back to its edit")
                c.edited.append(e)
                per_prompt["counterfactual"][r.prompt] = per_prompt["counterfactual"].get(r.prompt, 0) + 1
    bar.update(len(c.sampled) + len(c.edited) - bar.n)
    bar.close()
    c.seconds = time.perf_counter() - t0
    if c.edited:
        rewards = run.reward_of([e.text for e in c.edited], [run.records[e.prompt]["answer"] for e in c.edited])
        for e, rw in zip(c.edited, rewards):
            e.reward = float(rw)
    return c


def _group_batch(c: _Collected) -> tuple["_Batch", list[int]]:
    """Phase 2: the groups of the sampled responses (each once), one group copy per edit (the edit in
    place of its source); returns the batch and the row of every scored response."""
    batch = _Batch()
    rows: list[int] = []
    group_rows: dict[int, dict[int, int]] = {}
    for r in c.sampled:
        if r.prompt not in group_rows:
            members = c.groups[r.prompt]
            group_rows[r.prompt] = {id(m): row for m, row in zip(members, batch.add_group(members))}
        rows.append(group_rows[r.prompt][id(r)])
    for e in c.edited:
        members = [e if m is e.source else m for m in c.groups[e.prompt]]
        rows.append(batch.add_group(members)[next(i for i, m in enumerate(members) if m is e)])  # identity, not ==
    return batch, rows


def _signal_kwargs(run: _Run) -> dict[str, Any]:
    s = run.s
    return dict(conclude=s.conclude, ktae_options=s.ktae_options,
                task={"kind": "synthetic", "synthetic": dict(s.task_options)})


def _score(run: _Run, c: _Collected, batch: "_Batch", rows: list[int], progress: bool = False) -> _Scored:
    """Phase 3: every signal's scores of the scored rows (``compute_signals``)."""
    names = [sp.name for sp in run.specs]
    if not c.scored:
        return _Scored(scores={n: torch.zeros(0, 1) for n in names}, seconds={n: float("nan") for n in names},
                       info={"n_scored": {n: 0 for n in names}, "notes": {n: "" for n in names}, "probe_seconds": 0.0},
                       reasoning=torch.zeros(0, 1, dtype=torch.bool), T=1, tens=None, rows=rows, continuations=None)
    tens = batch.tensors(run.pad_id)
    cont = run.continuations(batch)
    scores, seconds, info = compute_signals(run.model, run.tokenizer, **tens, rows=torch.tensor(rows),
                                            signals=run.specs, seed=run.s.seed, repeats=run.s.repeats,
                                            continuations=cont, progress=progress, **_signal_kwargs(run))
    if not bool(info["has_answer"].all()):
        raise RuntimeError("oar.attribution.run_attribution: the probe found no answer in a response that parsed")
    return _Scored(scores=scores, seconds=seconds, info=info, reasoning=info["reasoning_mask"],
                   T=int(tens["response_ids"].shape[1]), tens=tens, rows=rows, continuations=cont)


def _measure(run: _Run, c: _Collected, sc: _Scored) -> tuple[Any, Any, Any, Any, Any]:
    """Phase 4: the localisation table (one row per signal and kind, also for a kind without
    responses), the fidelity table and the cost table."""
    import pandas as pd

    names, kinds, n = [sp.name for sp in run.specs], c.kinds, len(c.scored)
    empty = torch.zeros(0, 1, dtype=torch.long)
    mistake = torch.from_numpy(np.stack([mistake_labels(r, sc.T) for r in c.scored])) if n else empty
    fid_lab = torch.from_numpy(np.stack([fidelity_labels(r, sc.T) for r in c.scored])) if n else empty
    loc, loc_per = localisation_table(sc.scores, mistake, sc.reasoning, kinds, top_k=run.s.top_k)
    present = set(kinds)
    blank = {col: float("nan") for col in loc.columns}
    missing = [{**blank, "signal": s_, "kind": k, "n_responses": 0, "n_auroc": 0, "n_positive": 0, "n_negative": 0}
               for s_ in names for k in KINDS if k not in present]
    if missing:  # one row per (signal, kind) even when a kind has no response
        loc = pd.concat([loc, pd.DataFrame(missing, columns=loc.columns)], ignore_index=True)
    rank = loc["signal"].map({s_: i for i, s_ in enumerate(names)}) * len(KINDS) + loc["kind"].map(
        {k: i for i, k in enumerate(KINDS)})
    loc = loc.iloc[np.argsort(rank.to_numpy(), kind="stable")].reset_index(drop=True)
    n_scored = sc.info["n_scored"]
    sec_per = {k: (sc.seconds[k] / n_scored[k] if n_scored.get(k) else float("nan")) for k in sc.seconds}
    fid, fid_per = fidelity_table(sc.scores, fid_lab, sc.reasoning, seconds_per_response=sec_per)
    cost = cost_table(sc.seconds, n_scored, reference=run.s.cost_reference, notes=sc.info["notes"])
    return loc, loc_per, fid, fid_per, cost


def _stability(run: _Run, c: _Collected, sc: _Scored) -> tuple[Any, Any, float]:
    """Phase 5: stochastic signals again with seed + 1; KTAE on a second sampled group per prompt."""
    s = run.s
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, str]] = {}
    t0 = time.perf_counter()
    if s.stability and c.scored:
        assert sc.tens is not None
        stoch = [sp for sp in run.specs if sp.stochastic]
        if stoch:
            again, _, _ = compute_signals(run.model, run.tokenizer, **sc.tens, rows=torch.tensor(sc.rows), signals=stoch,
                                          seed=s.seed + 1, warmup=False, continuations=sc.continuations,
                                          **_signal_kwargs(run))
            for sp in stoch:
                pairs[sp.name] = (sc.scores[sp.name], again[sp.name], seed_kind(sp))
        ktae = [sp for sp in run.specs if sp.kind == "ktae"]
        if ktae and s.n_samples > 1:
            plist = sorted({r.prompt for r in c.scored})
            ro = run.engine.generate([run.prompts[i] for i in plist], n=s.n_samples - 1, temperature=s.temperature,
                                     top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                     seed=derived_seed("oar-attribution-group2", s.seed))
            fresh: dict[int, list[AttributionResponse]] = {}
            for r in run.responses_of(ro, plist):
                fresh.setdefault(r.prompt, []).append(r)
            b2 = _Batch()
            rows2 = [b2.add_group(fresh[r.prompt] + [r])[-1] for r in c.scored]
            k2, _, _ = compute_signals(run.model, run.tokenizer, **b2.tensors(run.pad_id), rows=torch.tensor(rows2),
                                       signals=ktae, seed=s.seed, warmup=False, **_signal_kwargs(run))
            for sp in ktae:
                # both batches hold the same rows right-padded: align the second on the first's width
                b = torch.zeros_like(sc.scores[sp.name])
                w = min(sc.T, k2[sp.name].shape[1])
                b[:, :w] = k2[sp.name][:, :w]
                pairs[sp.name] = (sc.scores[sp.name], b, "sampled group")
    stab, stab_per = stability_table(pairs, sc.reasoning, c.kinds)
    return stab, stab_per, (time.perf_counter() - t0) if s.stability and c.scored else 0.0


def _per_response(run: _Run, c: _Collected, loc_per: Any, fid_per: Any, stab_per: Any) -> Any:
    """Phase 6a: one row per scored response (kind, prompt, texts, metrics)."""
    import pandas as pd

    scored = c.scored
    per = pd.DataFrame({
        "kind": c.kinds,
        "prompt_index": [r.prompt for r in scored],
        "question": [run.records[r.prompt]["question"] for r in scored],
        "gold": [run.records[r.prompt]["answer"] for r in scored],
        "reward": [r.reward for r in scored],
        "mistake_step": [r.check.mistake_step if r.check else -1 for r in scored],
        "n_steps": [len(r.parsed.steps) if r.parsed else 0 for r in scored],
    })
    fid_cols = fid_per[["n_pivotal", "n_filler"]] if scored else pd.DataFrame(columns=["n_pivotal", "n_filler"])
    per = pd.concat([per, loc_per.drop(columns=["kind"]), fid_cols.reset_index(drop=True), stab_per], axis=1)
    per["text"] = [r.text for r in scored]
    per["original_text"] = [r.source.text if r.source is not None else "" for r in scored]
    return per


def _summary(run: _Run, c: _Collected, batch: "_Batch", sc: _Scored, stab_seconds: float, total: float) -> dict:
    """Phase 6b: counts, settings and timings (``summary.json``)."""
    counts = c.counts
    return {
        "n_prompts_sampled": c.n_prompts_used, "n_sampled_responses": sum(len(g) for g in c.groups.values()),
        "status": counts, "n_sampled": len(c.sampled), "n_counterfactual": len(c.edited),
        "counterfactual_still_correct": int(sum(e.reward > 0 for e in c.edited)),
        "sample_accuracy": counts.get("correct", 0) / max(counts.get("correct", 0) + counts.get("wrong", 0), 1),
        "n_batch_rows": len(batch.members),
        "seconds_sampling": c.seconds,
        "seconds_probe": sc.info["probe_seconds"],
        "seconds_signal": sc.seconds,
        "n_scored": sc.info["n_scored"],
        "seconds_stability": stab_seconds,
        "seconds_total": total,
        "settings": run.s.as_summary(run.fillers),
    }


def attribution_from_config(
    config: Mapping[str, Any],
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    repeats: int | None = None,
    progress: bool = True,
) -> AttributionResult:
    """Run the benchmark as the config says (:meth:`AttributionSettings.from_config`) and write its
    outputs. ``attribution.enabled`` is for the workflow: this function always runs.

    Writes (atomically) into ``output_dir``: ``localisation.csv``, ``stability.csv``, ``cost.csv``,
    ``fidelity.csv``, ``per_response.csv``, ``attribution.md`` (the three tables),
    ``localisation.png``, ``fidelity.png``, ``cost_curve.png`` and ``summary.json``.

    Args:
        config: a validated config (:func:`oar.config.load.load_config`).
        model_dir: the policy (loaded with :func:`oar.models.loading.load_policy`).
        output_dir: output folder (created).
        repeats: timing repeats per signal (default ``attribution.timing_repeats``).
        progress: progress bars on stderr (:func:`run_attribution`).

    Returns:
        the :class:`AttributionResult`.
    """
    from datetime import datetime, timezone

    from oar.attribution.report import write_outputs
    from oar.models.loading import load_policy
    from oar.core.device import job_device
    from oar.core.provenance import provenance, with_end_time

    started = datetime.now(timezone.utc)
    settings = AttributionSettings.from_config(config, **({} if repeats is None else {"repeats": int(repeats)}))
    model, tokenizer = load_policy(model_dir)
    model.to(job_device(config))
    result = run_attribution(model, tokenizer, settings, progress=progress)
    result.summary["model_dir"] = str(model_dir)
    result.summary["provenance"] = with_end_time(provenance(device=str(config["device"]), started=started))
    write_outputs(result, Path(output_dir))
    return result
