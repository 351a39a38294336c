"""The signals the attribution benchmark scores, as typed specifications: each kind, its options, and
the specs a config's ``attribution.signals`` resolve to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from oar.credit.importance import OarGOptions, OarPOptions, option_names
from oar.credit.mc_value import McValueOptions
from oar.credit.verifier import DEFAULT_THRESHOLD, TRAINED

__all__ = ["SIGNAL_KINDS", "CHANCE_KINDS", "SignalKind", "KtaeSignalOptions", "McValueSignalOptions", "NoOptions", "OracleSignalOptions", "VerifierSignalOptions", "SignalSpec", "signal_specs"]


@dataclass(frozen=True)
class KtaeSignalOptions:
    """Options of a ``ktae`` signal: ``signed`` (``K`` instead of ``|K|``)."""

    signed: bool = False


@dataclass(frozen=True)
class McValueSignalOptions:
    """The benchmark's own options of an ``mc_value`` signal (besides :class:`~oar.credit.mc_value.McValueOptions`'):
    ``refine_weight``, the most a token moves when OAR-G breaks a step's ties (:func:`refine_within_steps`)."""

    refine_weight: float = 1e-3


@dataclass(frozen=True)
class OracleSignalOptions:
    """Options of an ``oracle`` signal: ``localisation``, the probability that the importance stays on the
    first mistake (``oracle_first_mistake``'s option of the same name)."""

    localisation: float = 1.0


@dataclass(frozen=True)
class VerifierSignalOptions:
    """Options of a ``step_verifier`` signal: ``verifier`` (:data:`oar.credit.verifier.TRAINED`: the
    config's) and ``threshold`` (the ``step_verifier`` credit's options of the same names)."""

    verifier: str = TRAINED
    threshold: float = DEFAULT_THRESHOLD


@dataclass(frozen=True)
class NoOptions:
    """The options of a kind without options (``random``, ``uniform``)."""


@dataclass(frozen=True)
class SignalKind:
    """A signal kind's options: its options type, those of its options the benchmark sets itself
    (``set_here``, not a signal's) and the benchmark's own options type of the kind (``extra``)."""

    options: type
    set_here: tuple[str, ...] = ()
    extra: type = NoOptions

    @property
    def names(self) -> tuple[str, ...]:
        """The options a signal of this kind may set."""
        return tuple(n for n in option_names(self.options) if n not in self.set_here) + option_names(self.extra)

    def parse(self, options: Mapping[str, Any]) -> tuple[Any, Any]:
        """``(options type, extra type)`` instances of a signal's options.

        Raises:
            ValueError: an unknown option, or a value the types refuse.
        """
        bad = sorted(set(options) - set(self.names))
        if bad:
            raise ValueError(f"unknown options {bad}; valid: {list(self.names)}")
        extra = set(option_names(self.extra))
        try:
            return (self.options(**{k: v for k, v in options.items() if k not in extra}),
                    self.extra(**{k: v for k, v in options.items() if k in extra}))
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None


#: Signal kinds and their options.
SIGNAL_KINDS: dict[str, SignalKind] = {
    "oar_p": SignalKind(OarPOptions),
    "oar_g": SignalKind(OarGOptions, set_here=("seed", "chunk_tokens")),
    "ktae": SignalKind(KtaeSignalOptions),
    "mc_value": SignalKind(McValueOptions, set_here=("refine_floor", "seq_weight", "alpha"), extra=McValueSignalOptions),
    "oracle": SignalKind(OracleSignalOptions),
    "step_verifier": SignalKind(VerifierSignalOptions),
    "random": SignalKind(NoOptions),
    "uniform": SignalKind(NoOptions),
}
#: The kinds that score at chance level (the baselines of every table), not a signal a credit could use.
CHANCE_KINDS: tuple[str, ...] = ("random", "uniform")
#: The dict spelling of the bare signal names the benchmark once read (for the error that refuses them).
BARE_NAMES: dict[str, dict[str, Any]] = {
    "oar_p": {"kind": "oar_p", "mode": "last"},
    "oar_p_answer_mean": {"kind": "oar_p", "mode": "answer_mean"},
    "oar_g": {"kind": "oar_g", "mode": "answer_mean"},
    "ktae": {"kind": "ktae"},
    "ktae_signed": {"kind": "ktae", "signed": True},
    "random": {"kind": "random"},
    "uniform": {"kind": "uniform"},
}


def signal_flow(name: str, spelling: Mapping[str, Any]) -> str:
    """``{name: oar_p_answer_mean, kind: oar_p, mode: answer_mean}`` (YAML flow style)."""
    items = {"name": name, **spelling}
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in items.items()) + "}"


@dataclass(frozen=True)
class SignalSpec:
    """A named signal: ``kind`` from :data:`SIGNAL_KINDS` with its ``options`` (as configured)."""

    name: str
    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def typed(self) -> tuple[Any, Any]:
        """The signal's options as its kind's types (:meth:`SignalKind.parse`).

        Raises:
            ValueError: naming the signal, for an unknown kind or option or an invalid value.
        """
        kind = SIGNAL_KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"oar.attribution: signal {self.name!r}: unknown kind {self.kind!r}; "
                             f"valid: {list(SIGNAL_KINDS)}")
        try:
            return kind.parse(self.options)
        except ValueError as e:
            raise ValueError(f"oar.attribution: signal {self.name!r} ({self.kind}): {e}") from None

    @property
    def stochastic(self) -> bool:
        """True when the scores depend on a seed (OAR-G's noise, the random baseline, a degraded oracle)."""
        if self.kind == "mc_value":
            o, _ = self.typed()
            return not o.greedy or o.refine is not None
        if self.kind == "oracle":
            return self.typed()[0].localisation < 1.0
        return self.kind in ("oar_g", "random")


def signal_specs(signals: Sequence[Mapping[str, Any] | SignalSpec]) -> list[SignalSpec]:
    """Resolve signals given as config dicts (``name``, ``kind`` and the kind's options) or
    :class:`SignalSpec`; names must be unique.

    Raises:
        ValueError naming the signal for an unknown kind or option, an invalid value or a bare name
        (with its spelling as a dict, e.g. ``{name: oar_p_answer_mean, kind: oar_p, mode: answer_mean}``).
    """
    out: list[SignalSpec] = []
    for s in signals:
        if isinstance(s, SignalSpec):
            spec = s
        elif isinstance(s, str):
            if s in BARE_NAMES:
                raise ValueError(f"oar.attribution: signal {s!r} is a bare name; a signal is a dict of its name, "
                                 f"kind and options: write {signal_flow(s, BARE_NAMES[s])}")
            raise ValueError(f"oar.attribution: unknown signal {s!r}: a signal is a dict {{name, kind, **options}} "
                             f"with kind one of {list(SIGNAL_KINDS)}")
        elif isinstance(s, Mapping):
            d = dict(s)
            name, kind = d.pop("name", None), d.pop("kind", None)
            if not isinstance(name, str) or not name:
                raise ValueError(f"oar.attribution: signal {s!r} needs a name")
            spec = SignalSpec(name, str(kind), d)
        else:
            raise ValueError(f"oar.attribution: cannot read signal {s!r}")
        o, _ = spec.typed()
        if spec.kind == "mc_value" and o.refine is not None:
            g = SIGNAL_KINDS["oar_g"].names
            if not isinstance(o.refine, Mapping) or set(o.refine) - set(g):
                raise ValueError(f"oar.attribution: signal {spec.name!r}: refine must be a mapping of oar_g options "
                                 f"{list(g)} ({{}} for their defaults), got {o.refine!r}")
            SignalSpec(f"{spec.name}.refine", "oar_g", dict(o.refine)).typed()
        out.append(spec)
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"oar.attribution: duplicate signal names {dup}")
    return out
