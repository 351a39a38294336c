"""Credit signals of the attribution benchmark: named, configurable scorers of response tokens.

A signal is a :class:`SignalSpec` ``(name, kind, options)``; config ``attribution.signals`` lists
them as dicts, e.g. ``{name: oar_g_joint_k4, kind: oar_g, mode: answer_joint, draws: 4}``. Kinds
and their options (scores are response-aligned ``(n, T)``, larger = more important):

- ``oar_p``: ``|OAR-P|`` (:func:`oar.credit.importance.perturbation_importance`); options ``mode``
  (``last``), ``chunk_size`` (128), ``conclude``. The KL modes are non-negative already; in mode
  ``answer_joint`` the signed ``phi_orig - phi_masked`` is taken in absolute value (as the
  ``oar_p`` estimator's reshaping does). ``tie: values``: the copy-aware perturbation (a number
  masked with its later restatements, :func:`oar.credit.importance.value_tie_ids`).
- ``mc_value``: the drop in Monte-Carlo value over each step, ``V(before) - V(after)``
  (:func:`oar.credit.mc_value.mc_step_credit`, the ``mc_value`` estimator's step credit with its
  sign flipped, so blame ranks first: every token of a step gets its step's score); options ``k``
  (1), ``step_split`` (``synthetic``), ``max_steps`` (8), ``root`` (``group``: the start value is
  the group's mean reward; ``continuation``: continuations of the bare prompt, as every other
  value), ``refine`` (None: every token of a step
  ties; a mapping of ``oar_g`` options, ``{}`` for its defaults: ties inside a step broken by OAR-G,
  ``blame + refine_weight * g / max g`` per response, so the step ranking stays the value's and the
  result tokens of a blamed step rank above its fillers and separators), ``refine_weight`` (1e-3:
  below any gap between two step values, ``1 / (k * group size)``). Needs ``continuations`` (the
  engine, each row's prompt and gold answer, the reward); the continuations are seeded with the
  benchmark's seed.
- ``oar_g``: OAR-G (:func:`oar.credit.importance.gradient_importance`, which returns
  ``|grad . x|``); options ``mode`` (``answer_mean``), ``noise_std`` (1e-3), ``draws`` (1: rows
  per response, one noise draw or path point each, in one batched pass), ``baseline`` (None;
  ``pad`` / ``zero``: integrated gradients from that baseline), ``chunk_size`` (None),
  ``conclude``. The noise is seeded with the benchmark's seed (per response).
- ``ktae``: ``|K|`` of the KTAE key-token score (:func:`oar.credit.ktae.ktae_scores_batch`, group
  statistics over the responses of each group); option ``signed`` (False: ``|K|``; True: ``K``).
  The magnitude is the importance: ``K > 0`` marks a token id associated with correct responses,
  ``K < 0`` one associated with wrong ones, and a wrong result is as pivotal as a right one.
- ``random``: uniform noise in ``[0, 1)`` from a generator seeded with the benchmark's seed.
- ``uniform``: a constant; with ties broken at random it is the exact chance level of every
  metric (top-k hit, AUROC 0.5).

``conclude`` defaults to the benchmark's (config ``attribution.conclude``).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = [
    "SIGNAL_KINDS",
    "SIGNAL_OPTIONS",
    "LEGACY_SIGNALS",
    "SIGNALS",
    "DEFAULT_SIGNALS",
    "SignalSpec",
    "signal_specs",
    "compute_signals",
    "refine_within_steps",
]

#: Signal kinds and the options each accepts.
SIGNAL_OPTIONS: dict[str, tuple[str, ...]] = {
    "oar_p": ("mode", "chunk_size", "conclude", "tie"),
    "oar_g": ("mode", "noise_std", "draws", "baseline", "chunk_size", "conclude"),
    "ktae": ("signed",),
    "mc_value": ("k", "greedy", "step_split", "max_steps", "root", "refine", "refine_weight"),
    "random": (),
    "uniform": (),
}
SIGNAL_KINDS: tuple[str, ...] = tuple(SIGNAL_OPTIONS)


@dataclass(frozen=True)
class SignalSpec:
    """A named signal: ``kind`` from :data:`SIGNAL_KINDS` with its ``options``."""

    name: str
    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def stochastic(self) -> bool:
        """True when the scores depend on a seed (OAR-G's noise, the random baseline)."""
        if self.kind == "mc_value":
            return not self.options.get("greedy", False) or self.options.get("refine") is not None
        return self.kind in ("oar_g", "random")


#: Signals known by name (the benchmark's historical set plus ``uniform``).
LEGACY_SIGNALS: dict[str, SignalSpec] = {
    "oar_p": SignalSpec("oar_p", "oar_p", {"mode": "last"}),
    "oar_p_answer_mean": SignalSpec("oar_p_answer_mean", "oar_p", {"mode": "answer_mean"}),
    "oar_g": SignalSpec("oar_g", "oar_g", {"mode": "answer_mean"}),
    "ktae": SignalSpec("ktae", "ktae", {}),
    "ktae_signed": SignalSpec("ktae_signed", "ktae", {"signed": True}),
    "random": SignalSpec("random", "random", {}),
    "uniform": SignalSpec("uniform", "uniform", {}),
}
#: Names :func:`signal_specs` resolves.
SIGNALS: tuple[str, ...] = tuple(LEGACY_SIGNALS)
#: Signals :func:`compute_signals` computes when none are given.
DEFAULT_SIGNALS: tuple[str, ...] = ("oar_p", "oar_p_answer_mean", "oar_g", "ktae", "ktae_signed", "random")


def signal_specs(signals: Sequence[str | Mapping[str, Any] | SignalSpec]) -> list[SignalSpec]:
    """Resolve signals given as names (:data:`SIGNALS`), config dicts (``name``, ``kind`` and the
    kind's options) or :class:`SignalSpec`; names must be unique.

    Raises:
        ValueError naming the signal for an unknown name, kind or option.
    """
    out: list[SignalSpec] = []
    for s in signals:
        if isinstance(s, SignalSpec):
            spec = s
        elif isinstance(s, str):
            if s not in LEGACY_SIGNALS:
                raise ValueError(f"oar.attribution: unknown signals [{s!r}]; valid names: {list(SIGNALS)} "
                                 f"(or a dict with name and kind)")
            spec = LEGACY_SIGNALS[s]
        elif isinstance(s, Mapping):
            d = dict(s)
            name, kind = d.pop("name", None), d.pop("kind", None)
            if not isinstance(name, str) or not name:
                raise ValueError(f"oar.attribution: signal {s!r} needs a name")
            spec = SignalSpec(name, str(kind), d)
        else:
            raise ValueError(f"oar.attribution: cannot read signal {s!r}")
        if spec.kind not in SIGNAL_OPTIONS:
            raise ValueError(f"oar.attribution: signal {spec.name!r}: unknown kind {spec.kind!r}; valid: {list(SIGNAL_KINDS)}")
        bad = sorted(set(spec.options) - set(SIGNAL_OPTIONS[spec.kind]))
        if bad:
            raise ValueError(f"oar.attribution: signal {spec.name!r} ({spec.kind}): unknown options {bad}; "
                             f"valid: {list(SIGNAL_OPTIONS[spec.kind])}")
        refine = spec.options.get("refine")
        if refine is not None and (not isinstance(refine, Mapping) or set(refine) - set(SIGNAL_OPTIONS["oar_g"])):
            raise ValueError(f"oar.attribution: signal {spec.name!r}: refine must be a mapping of oar_g options "
                             f"{list(SIGNAL_OPTIONS['oar_g'])} ({{}} for their defaults), got {refine!r}")
        draws = spec.options.get("draws", 1)
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"oar.attribution: signal {spec.name!r}: draws must be an int >= 1, got {draws!r}")
        out.append(spec)
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"oar.attribution: duplicate signal names {dup}")
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _oar_g_fn(
    model: torch.nn.Module, spec: SignalSpec, *, noise_std: float, seed: int, device: torch.device
) -> Callable[[Any], torch.Tensor]:
    """A scorer ``probe -> (B, L)`` for an ``oar_g`` spec.

    The noise is seeded with ``seed``: passed as ``seed`` (per-response noise keyed by the probe
    row) when :func:`~oar.credit.importance.gradient_importance` accepts it, else through a fresh
    generator. ``draws`` and ``baseline`` are passed only when set, and must be accepted.
    """
    from oar.credit.importance import gradient_importance

    o = spec.options
    accepted = set(inspect.signature(gradient_importance).parameters)
    kw: dict[str, Any] = {
        "mode": o.get("mode", "answer_mean"),
        "noise_std": float(o.get("noise_std", noise_std)),
        "chunk_size": None if o.get("chunk_size") is None else int(o["chunk_size"]),
    }
    for key, default in (("draws", 1), ("baseline", None)):
        if o.get(key, default) != default:
            if key not in accepted:
                raise ValueError(f"oar.attribution: signal {spec.name!r}: this gradient_importance has no {key!r} option")
            kw[key] = o[key]
    by_seed = "seed" in accepted

    def fn(p: Any) -> torch.Tensor:
        if by_seed:
            return gradient_importance(model, p, seed=int(seed), **kw)
        return gradient_importance(model, p, generator=torch.Generator(device=device).manual_seed(int(seed)), **kw)

    return fn


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
    o = spec.options
    delta, _, _ = mc_step_credit(sub, tokenizer, response_ids[rows], response_mask[rows], rewards[rows],
                                 group_ids[rows], k=int(o.get("k", 1)), step_split=str(o.get("step_split", "synthetic")),
                                 max_steps=int(o.get("max_steps", 8)), norm_by_std=False,
                                 greedy=bool(o.get("greedy", False)), root=str(o.get("root", "group")),
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
    signals: Sequence[str | Mapping[str, Any] | SignalSpec] = DEFAULT_SIGNALS,
    conclude: str | None = None,
    oar_p_chunk_size: int = 128,
    noise_std: float = 1e-3,
    ktae_options: Mapping[str, Any] | None = None,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
    continuations: Any = None,
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
        signals: names, config dicts or :class:`SignalSpec` (:func:`signal_specs`).
        conclude: probe conclude string (default :data:`oar.credit.probe.DEFAULT_CONCLUDE`); a
            signal's own ``conclude`` option wins.
        oar_p_chunk_size: sequences per OAR-P forward (when the signal sets no ``chunk_size``).
        noise_std: OAR-G embedding noise (when the signal sets no ``noise_std``).
        ktae_options: keywords of :func:`oar.credit.ktae.ktae_scores_batch` (default ignores eos).
        seed: seed of the OAR-G noise and the random baseline.
        warmup: run each OAR signal once on one response before timing (first-call overheads).
        repeats: run each signal's batch call this many times and report the fastest (the scores
            of every repeat are identical, the first is kept).
        continuations: an :class:`oar.credit.mc_value.ContinuationContext` row-aligned with the
            ``B`` responses (needed by ``mc_value`` signals only).

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
                     rows=torch.as_tensor(rows, dtype=torch.long), conclude=conclude, oar_p_chunk_size=oar_p_chunk_size,
                     noise_std=noise_std, ktae_options=ktae_options, seed=seed, warmup=warmup, repeats=repeats,
                     continuations=continuations)
    base, _ = run.probe_for(run.default_conclude)
    info: dict[str, Any] = {
        "reasoning_mask": (base.to_response(base.reasoning_mask.float(), run.T) > 0).cpu(),
        "has_answer": base.has_answer.cpu(),
        "n_scored": {},
        "notes": {},
    }
    scores: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for spec in specs:
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
    oar_p_chunk_size: int
    noise_std: float
    ktae_options: Mapping[str, Any] | None
    seed: int
    warmup: bool
    repeats: int
    continuations: Any
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


#: A scorer: ``(run, spec) -> (scores (n, T) float on CPU, seconds, responses scored, note)``.
Scorer = Callable[[_SignalRun, SignalSpec], tuple[torch.Tensor, float, int, str]]


def _probe_scorer(run: _SignalRun, spec: SignalSpec, fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, float, int, str]:
    """OAR-P / OAR-G: ``fn(probe, rows)`` on the probe of the spec's conclude string (warmed up once)."""
    cpu_probe, dev_probe = run.probe_for(str(spec.options.get("conclude", run.default_conclude)))
    answered = cpu_probe.has_answer.nonzero().flatten()
    if run.warmup and answered.numel():
        fn(dev_probe.select(answered[:1]), answered[:1])
    s, dt = run.timed(lambda: fn(dev_probe, None))
    return cpu_probe.to_response(s.float().cpu(), run.T), dt, run.n, ""


def _score_oar_p(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    from oar.credit.importance import perturbation_importance, value_tie_ids

    o = spec.options
    mode, cs = o.get("mode", "last"), int(o.get("chunk_size", run.oar_p_chunk_size))
    ties = None
    if o.get("tie", "none") == "values":
        cpu_probe, _ = run.probe_for(str(o.get("conclude", run.default_conclude)))
        ties = value_tie_ids(run.tokenizer, cpu_probe, run.response_ids[run.rows], run.response_mask[run.rows])

    def fn(p: Any, sel: Any) -> torch.Tensor:
        t = None if ties is None else (ties if sel is None else ties[sel])
        t = None if t is None else t.to(p.input_ids.device)[:, t.shape[1] - p.input_ids.shape[1]:]
        return perturbation_importance(run.model, p, mode=mode, chunk_size=cs, tie_ids=t).abs()

    return _probe_scorer(run, spec, fn)


def _score_oar_g(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    g = _oar_g_fn(run.model, spec, noise_std=run.noise_std, seed=run.seed, device=run.device)
    return _probe_scorer(run, spec, lambda p, sel: g(p))


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
    return (k if spec.options.get("signed", False) else k.abs()), dt, int(run.response_ids.shape[0]), "per group member"


def _score_mc_value(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: _mc_value_blame(run.continuations, run.tokenizer, run.response_ids, run.response_mask,
                                              run.rewards, run.group_ids, run.rows, spec, run.seed))
    refine = spec.options.get("refine")
    if refine is None:
        return s, dt, run.n, ""
    (g_spec,) = signal_specs([{"name": f"{spec.name}.refine", "kind": "oar_g", **refine}])
    g, dt_g, _, _ = _score_oar_g(run, g_spec)
    return refine_within_steps(s, g, float(spec.options.get("refine_weight", 1e-3))), dt + dt_g, run.n, "refined by OAR-G"


def refine_within_steps(blame: torch.Tensor, g: torch.Tensor, weight: float = 1e-3) -> torch.Tensor:
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


def _score_random(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: torch.rand((run.n, run.T), generator=torch.Generator().manual_seed(int(run.seed)))
                      * run.response_mask[run.rows].cpu().float())
    return s, dt, run.n, ""


def _score_uniform(run: _SignalRun, spec: SignalSpec) -> tuple[torch.Tensor, float, int, str]:
    s, dt = run.timed(lambda: run.response_mask[run.rows].cpu().float().clone())
    return s, dt, run.n, ""


#: The scorer of each signal kind (a new kind is one function here and its options in SIGNAL_OPTIONS).
_SCORERS: dict[str, Scorer] = {
    "oar_p": _score_oar_p,
    "oar_g": _score_oar_g,
    "ktae": _score_ktae,
    "mc_value": _score_mc_value,
    "random": _score_random,
    "uniform": _score_uniform,
}
assert set(_SCORERS) == set(SIGNAL_OPTIONS), "every signal kind needs a scorer and its options"
