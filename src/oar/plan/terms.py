"""The units of a memory plan: a term (what holds bytes, in which phase), the plan's result, and the
bytes one layer's activations take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oar.plan.settings import PlanSettings
from oar.plan.shape import ModelShape

__all__ = ["GiB", "MEMORY_PHASES", "Term", "PlanResult", "gib", "layer_activation_bytes"]


GiB = 1024**3
#: Phases whose live memory is summed separately; the largest is the peak. ``credit``: the credit
#: estimators' own passes through the gathered policy, after the rollout (the engine asleep, unless
#: the estimator samples continuations through it).
MEMORY_PHASES = ("forward", "logits", "backward", "backward end", "step", "rollout", "credit")


def gib(n: int | float) -> str:
    """``n`` bytes in GiB, two decimals (how the plan prints every size)."""
    return f"{n / GiB:.2f}"


@dataclass(frozen=True)
class Term:
    """One row of the plan: ``bytes`` per GPU, alive in ``phases``; ``cpu_bytes`` kept in CPU memory."""

    name: str
    bytes: int
    phases: tuple[str, ...]
    note: str = ""
    hint: str = ""  # the config keys that shrink it
    cpu_bytes: int = 0
    # a credit pass (:func:`credit_terms`): one method's alternative, never alive beside another's;
    # ``engine``: the vLLM engine is awake during it (it samples continuations)
    credit_pass: bool = False
    engine: bool = False


@dataclass
class PlanResult:
    """A config's plan: terms, per-phase totals, the verdict and (when it does not fit) the message.

    ``padded``: planned with a padding mask (:func:`layer_activation_bytes`); ``credit``: the
    passes of :data:`CREDIT_PASSES` the config's methods run (:func:`credit_terms`), each with the
    credit phase's total when it runs (``credit_totals``, by term name)."""

    shape: ModelShape
    world_size: int
    gpu_bytes: int
    headroom_bytes: int
    terms: list[Term]
    engine: list[Term]
    phase_totals: dict[str, int]
    peak_phase: str
    fits: bool
    breaker: str | None
    message: str
    settings: PlanSettings
    padded: bool = True
    credit: list[Term] = field(default_factory=list)
    credit_totals: dict[str, int] = field(default_factory=dict)

    def engine_in(self, phase: str) -> bool:
        """Whether the vLLM engine's share counts in ``phase``'s total (in the credit phase: for its
        largest pass)."""
        share = next((t for t in self.engine if t.name == "vLLM share"), None)
        if share is None:
            return False
        if phase != "credit":
            return phase in share.phases
        worst = max(self.credit, key=lambda t: self.credit_totals[t.name], default=None)
        return "credit" in share.phases or (worst is not None and worst.engine)

    @property
    def peak_bytes(self) -> int:
        return self.phase_totals[self.peak_phase]


def layer_activation_bytes(shape: ModelShape, *, act_bytes: int, seq: int, autocast: bool = False,
                           padded: bool = True) -> int:
    """Bytes one decoder layer saves for its backward, per token (see the module doc).

    Args:
        act_bytes: bytes of the compute dtype.
        seq: sequence length (the float attention mask SDPA builds from a padding mask is ``seq`` wide).
        autocast: float32 weights under ``torch.autocast`` (ddp with a 16-bit compute dtype).
        padded: a padding mask is present (real micro-batches): SDPA then gets k and v repeated to the
            query heads and a float mask; without one (every sequence full) it runs GQA natively.
    """
    h, q, i, c = shape.hidden_size, shape.q_dim, shape.intermediate_size, act_bytes
    kv = q if (padded and shape.num_kv_heads != shape.num_heads) else shape.kv_dim
    if autocast:  # float32 stream and norms; each projection casts the norm output for itself
        norms = 2 * (4 * h + 4 * h) + 5 * c * h
    else:
        norms = 2 * (4 * h + 2 * c * h)
    attention = c * (3 * q + 2 * kv) + 4 * shape.num_heads + (c * seq if padded else 0)
    mlp = 4 * c * i
    return norms + attention + mlp
