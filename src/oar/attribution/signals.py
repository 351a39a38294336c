"""Credit signals of the attribution benchmark: named, configurable scorers of response tokens.

A signal is a :class:`SignalSpec` ``(name, kind, options)``; config ``attribution.signals`` lists
them as dicts, e.g. ``{name: oar_g_joint_k4, kind: oar_g, mode: answer_joint, draws: 4}``. A kind's
options are those of its options type, where their defaults are written once (the trainer's
estimators read the same types); scores are response-aligned ``(n, T)``, larger = more important:

- ``oar_p``: ``|OAR-P|`` (:func:`oar.credit.importance.oar_p_scores`); options
  :class:`oar.credit.importance.OarPOptions` (``mode``, ``chunk_size``, ``conclude``, ``tie``). The KL
  modes are non-negative already; in mode ``answer_joint`` the signed ``phi_orig - phi_masked`` is
  taken in absolute value (as the ``oar_p`` estimator's reshaping does). ``tie: values``: the
  copy-aware perturbation (a number masked with its later restatements,
  :func:`oar.credit.importance.value_tie_ids`).
- ``oar_g``: OAR-G (:func:`oar.credit.importance.oar_g_scores`, ``|grad . x|``); options
  :class:`oar.credit.importance.OarGOptions` but ``seed`` and ``chunk_tokens``, which the benchmark
  sets itself: the noise is seeded with the benchmark's seed (per response), and all of a signal's
  rows run in one batched call (``chunk_size`` splits them).
- ``mc_value``: the drop in Monte-Carlo value over each step, ``V(before) - V(after)``
  (:func:`oar.credit.mc_value.mc_step_credit`, the ``mc_value`` estimator's step credit with its
  sign flipped, so blame ranks first: every token of a step gets its step's score); options
  :class:`oar.credit.mc_value.McValueOptions` that set the step values (not ``refine_floor``,
  ``seq_weight``, ``alpha``: how training turns them into advantages), with ``refine`` a mapping of
  ``oar_g`` signal options (``{}`` for their defaults: ties inside a step broken by OAR-G,
  ``blame + refine_weight * g / max g`` per response, so the step ranking stays the value's and the
  result tokens of a blamed step rank above its fillers and separators), plus the benchmark's
  :class:`McValueSignalOptions` (``refine_weight``: below any gap between two step values,
  ``1 / (k * group size)``). Needs ``continuations`` (the engine, each row's prompt and gold answer,
  the reward); the continuations are seeded with the benchmark's seed.
- ``ktae``: ``|K|`` of the KTAE key-token score (:func:`oar.credit.ktae.ktae_scores_batch`, group
  statistics over the responses of each group); options :class:`KtaeSignalOptions` (``signed``:
  ``K`` instead of ``|K|``). The magnitude is the importance: ``K > 0`` marks a token id associated
  with correct responses, ``K < 0`` one associated with wrong ones, and a wrong result is as pivotal
  as a right one.
- ``oracle``: ``oracle_first_mistake``'s importance (:func:`oar.credit.controls.oracle_importance`, 1 on
  the first mistake's result tokens), moved to another step of the response with probability
  ``1 - localisation`` (seeded with the benchmark's seed): the degraded oracles' place on the
  localisation axis, the calibration of the practical signals; options :class:`OracleSignalOptions`.
- ``step_verifier``: each step's result tokens scored by the step verifier's probability that the step
  is wrong (:func:`oar.credit.verifier.step_probabilities`), the located first mistake's (the first
  at or above ``threshold``, where the ``step_verifier`` credit puts its importance) raised by 1;
  options :class:`VerifierSignalOptions` (``verifier: trained``: the config's, which ``oar
  attribution`` locates).
- ``random``: uniform noise in ``[0, 1)`` from a generator seeded with the benchmark's seed.
- ``uniform``: a constant; with ties broken at random it is the exact chance level of every
  metric (top-k hit, AUROC 0.5).

``conclude`` (None) is the benchmark's (config ``attribution.conclude``). Signals are dicts only: a
bare name (``oar_p``, ``ktae_signed``, ...) is refused with its spelling as a dict
(:func:`signal_specs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from oar.attribution.specs import McValueSignalOptions, SIGNAL_KINDS, SignalSpec, signal_specs
from oar.credit import CreditBatch
from oar.credit.importance import OarGOptions, OarPOptions, oar_g_scores, oar_p_scores, oar_p_tie_ids

__all__ = ["compute_signals", "refine_within_steps"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mc_value_blame(ctx: Any, tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor,
                    rewards: torch.Tensor, group_ids: torch.Tensor, rows: torch.Tensor, spec: SignalSpec,
                    seed: int) -> torch.Tensor:
    """``(n, T)`` ``V(before) - V(after)`` of each step of the responses ``rows`` (an ``mc_value`` spec)."""
    from dataclasses import replace

    from oar.credit.mc_value import group_stats, mc_step_credit

    if ctx is None:
        raise ValueError(f"oar.attribution: signal {spec.name!r} (mc_value) needs continuations (the rollout engine, "
                         "prompts and gold answers of the responses)")
    idx = rows.tolist()
    sub = replace(ctx, prompts=[ctx.prompts[i] for i in idx], golds=[ctx.golds[i] for i in idx], seed=int(seed))
    mean, std = group_stats(rewards, group_ids)
    o, _ = spec.typed()
    delta, _, _ = mc_step_credit(sub, tokenizer, response_ids[rows], response_mask[rows], rewards[rows],
                                 group_ids[rows], k=o.k, step_split=o.step_split, max_steps=o.max_steps,
                                 reasoning_only=o.reasoning_only, norm_by_std=False, greedy=o.greedy, root=o.root,
                                 group_moments=(mean[rows], std[rows]))
    return -delta.float().cpu()


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
    signals: Sequence[Mapping[str, Any] | SignalSpec],
    conclude: str | None = None,
    ktae_options: Mapping[str, Any] | None = None,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
    continuations: Any = None,
    task: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, Any]]:
    """Score the responses ``rows`` with each signal, aligned with response positions.

    OAR signals run on the probe of the ``rows`` only; KTAE needs whole groups, so it runs on all
    ``B`` responses (its statistics use every response of a group) and its scores are then taken at
    ``rows``.

    Args:
        model, tokenizer: the policy.
        prompt_ids, prompt_mask: ``(B, P)`` left-padded prompts of every response.
        response_ids, response_mask: ``(B, T)`` right-padded responses.
        rewards: ``(B,)`` outcome rewards (correct when ``> 0``).
        group_ids: ``(B,)`` group of each response (KTAE groups).
        rows: ``(n,)`` long indices of the responses to score.
        signals: config dicts or :class:`SignalSpec` (:func:`signal_specs`).
        conclude: probe conclude string (default :data:`oar.credit.probe.DEFAULT_CONCLUDE`); a
            signal's own ``conclude`` option wins.
        ktae_options: keywords of :func:`oar.credit.ktae.ktae_scores_batch` (default ignores eos).
        seed: seed of the OAR-G noise and the random baseline.
        warmup: run each OAR signal once on one response before timing (first-call overheads).
        repeats: run each signal's batch call this many times and report the fastest (the scores
            of every repeat are identical, the first is kept).
        continuations: an :class:`oar.credit.mc_value.ContinuationContext` row-aligned with the
            ``B`` responses (needed by ``mc_value`` signals only).
        task: the config's ``task`` section, whose steps ``oracle`` and ``step_verifier`` signals parse
            (default: the synthetic task with the generator's fillers).
        progress: a progress bar on stderr over the signals.

    Returns:
        ``scores`` (name -> ``(n, T)`` float32 on CPU), ``seconds`` (name -> wall seconds of the
        signal's batch call) and ``info``: ``probe_seconds``, ``n_scored`` per signal (``n`` for OAR
        and baselines, ``B`` for KTAE), ``notes`` per signal (its options), ``reasoning_mask`` ``(n, T)`` bool
        (the probe's reasoning tokens: response tokens before the token that starts the last
        ``\\boxed{``), ``has_answer`` ``(n,)``.
    """
    specs = signal_specs(signals)
    if repeats < 1:
        raise ValueError(f"oar.attribution.compute_signals: repeats must be >= 1, got {repeats}")
    run = _SignalRun(model=model, tokenizer=tokenizer, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                     response_ids=response_ids, response_mask=response_mask, rewards=rewards, group_ids=group_ids,
                     rows=torch.as_tensor(rows, dtype=torch.long), conclude=conclude, ktae_options=ktae_options, seed=seed, warmup=warmup, repeats=repeats,
                     continuations=continuations, task=dict(task or {"kind": "synthetic"}))
    base, _ = run.probe_for(run.default_conclude)
    info: dict[str, Any] = {
        "reasoning_mask": (base.to_response(base.reasoning_mask.float(), run.T) > 0).cpu(),
        "has_answer": base.has_answer.cpu(),
        "n_scored": {},
        "notes": {},
    }
    scores: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    from tqdm.auto import tqdm

    for spec in tqdm(specs, desc="attribution: signals", unit="signal", disable=not progress, dynamic_ncols=True):
        note = ", ".join(f"{k}={v}" for k, v in spec.options.items() if k != "conclude")
        scores[spec.name], seconds[spec.name], info["n_scored"][spec.name], extra = _SCORERS[spec.kind](run, spec)
        info["notes"][spec.name] = ", ".join(x for x in (note, extra) if x)
    info["probe_seconds"] = run.probe_seconds
    return scores, seconds, info


@dataclass
class _SignalRun:
    """What every scorer of :func:`compute_signals` reads, with the probes (one per conclude string)
    and the timing shared by all of them."""

    model: torch.nn.Module
    tokenizer: Any
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    rows: torch.Tensor
    conclude: str | None
    ktae_options: Mapping[str, Any] | None
    seed: int
    warmup: bool
    repeats: int
    continuations: Any
    task: Mapping[str, Any]
    probes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # conclude -> (cpu probe, device probe)
    probe_seconds: float = 0.0
    ktae: tuple[torch.Tensor, float] | None = None  # |K| of the whole batch, computed once

    @property
    def n(self) -> int:
        return int(self.rows.numel())

    @property
    def T(self) -> int:
        return int(self.response_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def default_conclude(self) -> str:
        from oar.credit.probe import DEFAULT_CONCLUDE

        return DEFAULT_CONCLUDE if self.conclude is None else self.conclude

    def probe_for(self, c: str) -> tuple[Any, Any]:
        """The outcome probe of the scored rows with conclude string ``c`` (built once)."""
        from oar.credit.probe import build_probe

        if c not in self.probes:
            t0 = time.perf_counter()
            r = self.rows
            p = build_probe(self.tokenizer, self.prompt_ids[r], self.response_ids[r], conclude=c,
                            prompt_mask=self.prompt_mask[r], response_mask=self.response_mask[r])
            self.probe_seconds += time.perf_counter() - t0
            self.probes[c] = (p, p.to(self.device))
        return self.probes[c]

    def timed(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """``fn()`` run ``repeats`` times: the first result and the fastest wall time."""
        best, first = float("inf"), None
        for _ in range(self.repeats):
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn()
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
            first = out if first is None else first
        assert first is not None
        return first, best

    def credit_batch(self) -> CreditBatch:
        """The scored rows as a :class:`oar.credit.CreditBatch` (the credit layer's importances read it)."""
        r = self.rows
        return CreditBatch(response_ids=self.response_ids[r], response_mask=self.response_mask[r],
                           rewards=self.rewards[r].float(), group_ids=self.group_ids[r], prompt_ids=self.prompt_ids[r],
                           prompt_mask=self.prompt_mask[r], model=None, tokenizer=self.tokenizer,
                           task=self.task, seed=self.seed, step=0)

    def conclude_of(self, options: OarPOptions | OarGOptions) -> str:
        """The probe conclude string of an OAR signal: its own, else the benchmark's."""
        return self.default_conclude if options.conclude is None else str(options.conclude)


#: A scorer: ``(run, spec) -> (scores (n, T) float on CPU, seconds, responses scored, note)``.
Scorer = Callable[[_SignalRun, SignalSpec], tuple[torch.Tensor, float, int, str]]


def _probe_scorer(run: _SignalRun, options: OarPOptions | OarGOptions,
                  fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, float, int, str]:
    """OAR-P / OAR-G: ``fn(probe, rows)`` on the probe of the signal's conclude string (warmed up once)."""
    cpu_probe, dev_probe = run.probe_for(run.conclude_of(options))
    answered = cpu_probe.has_answer.nonzero().flatten()
    if run.warmup and answered.numel():
        fn(dev_probe.select(answered[:1]), answered[:1])
    s, dt = run.timed(lambda: fn(dev_probe, None))
    return cpu_probe.to_response(s.float().cpu(), run.T), dt, run.n, ""


def _score_oar_p(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    o, _ = spec.typed()
    cpu_probe, _ = run.probe_for(run.conclude_of(o))
    ties = oar_p_tie_ids(run.tokenizer, cpu_probe, run.response_ids[run.rows], run.response_mask[run.rows], o)

    def fn(p: Any, sel: Any) -> torch.Tensor:
        t = None if ties is None else (ties if sel is None else ties[sel])
        return oar_p_scores(run.model, p, o, tie_ids=t).abs()

    return _probe_scorer(run, o, fn)


def _score_oar_g(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    """OAR-G seeded with the benchmark's seed, all rows in one call (``chunk_size`` splits them)."""
    o, _ = spec.typed()
    o = replace(o, seed=int(run.seed), chunk_tokens=None)
    return _probe_scorer(run, o, lambda p, sel: oar_g_scores(run.model, p, o))


def _score_ktae(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    """KTAE over every response of the batch (its statistics use whole groups), taken at the rows."""
    from oar.credit.ktae import ktae_scores_batch

    if run.ktae is None:
        opts = dict(run.ktae_options or {})
        eos = getattr(run.tokenizer, "eos_token_id", None)
        if "ignore_token_ids" not in opts and eos is not None:
            opts["ignore_token_ids"] = (int(eos),)
        run.ktae = run.timed(lambda: ktae_scores_batch(run.response_ids, run.response_mask, run.rewards.float(),
                                                       run.group_ids.long(), **opts))
    k, dt = run.ktae
    k = k.float().cpu()[run.rows]
    o, _ = spec.typed()
    return (k if o.signed else k.abs()), dt, int(run.response_ids.shape[0]), "per group member"


def _score_mc_value(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: _mc_value_blame(run.continuations, run.tokenizer, run.response_ids, run.response_mask,
                                              run.rewards, run.group_ids, run.rows, spec, run.seed))
    o, extra = spec.typed()
    if o.refine is None:
        return s, dt, run.n, ""
    (g_spec,) = signal_specs([{"name": f"{spec.name}.refine", "kind": "oar_g", **o.refine}])
    g, dt_g, _, _ = _score_oar_g(run, g_spec)
    return refine_within_steps(s, g, float(extra.refine_weight)), dt + dt_g, run.n, "refined by OAR-G"


def refine_within_steps(blame: torch.Tensor, g: torch.Tensor,
                        weight: float = McValueSignalOptions.refine_weight) -> torch.Tensor:
    """Break the ties of a step-level score with a token-level one: ``blame + weight * g / max_t g``.

    Args:
        blame: ``(n, T)`` step-level scores (every token of a step equal, e.g. ``mc_value``'s blame).
        g: ``(n, T)`` non-negative token scores (OAR-G's ``|grad . x|``), 0 outside the response.
        weight: the largest a token can move; below the smallest gap between two step scores the
            order of steps is the blame's and only the order inside a step is ``g``'s.

    Returns:
        ``(n, T)`` float32.

    >>> [round(v, 4) for v in refine_within_steps(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[0.2, 0.4, 4.0]]), 0.01)[0].tolist()]
    [1.0005, 1.001, 0.01]
    """
    if not weight > 0:
        raise ValueError(f"oar.attribution: refine_weight must be > 0, got {weight!r}")
    top = g.float().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return blame.float() + float(weight) * g.float() / top


def _score_oracle(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    from oar.credit.controls import oracle_importance

    o, _ = spec.typed()
    batch = run.credit_batch()
    s, dt = run.timed(lambda: oracle_importance(batch, localisation=float(o.localisation))[0])
    return s.float().cpu(), dt, run.n, ""


def _score_step_verifier(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    from oar.credit.verifier import first_wrong_step, step_probabilities

    o, _ = spec.typed()
    batch = run.credit_batch()

    def fn() -> torch.Tensor:
        probs, labels = step_probabilities(batch, o.verifier)
        s = torch.zeros_like(labels.results)
        for b, row in enumerate(probs):
            first = first_wrong_step(row, float(o.threshold))
            for k, p in enumerate(row):
                s[b][labels.result_step[b] == k + 1] = p + (1.0 if k == first else 0.0)
        return s

    s, dt = run.timed(fn)
    return s.float().cpu(), dt, run.n, ""


def _score_random(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: torch.rand((run.n, run.T), generator=torch.Generator().manual_seed(int(run.seed)))
                      * run.response_mask[run.rows].cpu().float())
    return s, dt, run.n, ""


def _score_uniform(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: run.response_mask[run.rows].cpu().float().clone())
    return s, dt, run.n, ""


#: The scorer of each signal kind (a new kind is one function here and its options in SIGNAL_KINDS).
_SCORERS: dict[str, Scorer] = {
    "oar_p": _score_oar_p,
    "oar_g": _score_oar_g,
    "ktae": _score_ktae,
    "mc_value": _score_mc_value,
    "oracle": _score_oracle,
    "step_verifier": _score_step_verifier,
    "random": _score_random,
    "uniform": _score_uniform,
}
assert set(_SCORERS) == set(SIGNAL_KINDS), "every signal kind needs a scorer and its options"
