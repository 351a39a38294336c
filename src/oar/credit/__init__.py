"""Token credit assignment: a registry of advantage estimators chosen by name from config.

Every estimator is one function ``fn(batch: CreditBatch, **options) -> CreditResult`` registered
with :func:`register_estimator`. Options come from the method's config entry (for example
``quantile`` or ``alpha``); the trainer passes them through unchanged, so a new estimator is one
function plus one config entry. An estimator in the user's own code is named ``module:attr`` in the
config (or by an ``oar.estimators`` entry point) and registered under that name when the config is
resolved (:mod:`oar.credit.user`).

Shapes follow verl's ``core_algos.py``: ``B`` responses in the batch, ``T`` response tokens
(right-padded), ``P`` prompt tokens (left-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:  # the registry imports without torch (Snakemake's own process reads user estimators)
    import torch

__all__ = [
    "CreditBatch",
    "CreditResult",
    "Estimator",
    "EstimatorSpec",
    "register_estimator",
    "register_spec",
    "spec_of",
    "estimator_spec",
    "get_estimator",
    "list_estimators",
    "estimator_needs_model",
    "estimator_needs_continuations",
    "estimator_flags",
]


@dataclass
class CreditBatch:
    """Everything an estimator may look at for one training batch.

    Attributes:
        response_ids: ``(B, T)`` long, sampled response tokens, right-padded.
        response_mask: ``(B, T)`` float/bool, 1 on real response tokens.
        rewards: ``(B,)`` float, scalar outcome reward of each response.
        group_ids: ``(B,)`` long, responses with the same id were sampled from the same prompt.
        prompt_ids: ``(B, P)`` long, left-padded prompts (needed by the OAR probe), or None.
        prompt_mask: ``(B, P)`` attention mask of the prompts, or None.
        model: the current policy (needed by OAR-P / OAR-G), or None.
        tokenizer: the policy's tokenizer (needed by the OAR probe), or None.
        old_logprobs: ``(B, T)`` the rollout's log-probs of the response tokens, or None.
        step: the training step (seeds of per-step randomness are mixed with it), or None.
        seed: the run seed (the default seed of an estimator's own randomness), or None.
        task: the config's task section (the synthetic task's controls read its grammar), or None.
        continuations: what an estimator registered with ``needs_continuations`` samples from
            (``oar.credit.mc_value.ContinuationContext``; the trainer builds it only for those), or None.
        extras: free-form values a user's estimator may need beyond these.
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    model: Any = None
    tokenizer: Any = None
    old_logprobs: torch.Tensor | None = None
    step: int | None = None
    seed: int | None = None
    task: Mapping[str, Any] | None = None
    continuations: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class CreditResult:
    """What an estimator returns.

    Attributes:
        token_advantages: ``(B, T)`` float, per-token advantage, 0 outside ``response_mask``.
        seq_advantages: ``(B,)`` float, the sequence-level (GRPO-style) advantage ``A_i``.
        weights: ``(B, T)`` float token weights (1 = plain GRPO), or None when the method has
            no multiplicative weights (GRPO, KTAE). Used for the ESS-ratio metric.
        stats: scalar diagnostics (floats) for logging, e.g. seconds spent on importance.
    """

    token_advantages: torch.Tensor
    seq_advantages: torch.Tensor
    weights: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


class Estimator(Protocol):
    def __call__(self, batch: CreditBatch, **options: Any) -> CreditResult: ...


@dataclass(frozen=True)
class EstimatorSpec:
    """One registered estimator: the function and what the trainer must build before calling it.

    Attributes:
        fn: the estimator, ``fn(batch, **options) -> CreditResult``.
        needs_model: it calls ``CreditBatch.model`` (OAR-P, OAR-G and the nulls built on them); the
            trainer gathers a sharded policy for it.
        needs_continuations: it samples continuations of the responses (``mc_value``) and reads
            ``CreditBatch.continuations``, which the trainer builds only for it.
    """

    fn: Callable[..., CreditResult]
    needs_model: bool = False
    needs_continuations: bool = False


#: The one registry: name (what configs write as ``credit: <name>``) -> its spec.
_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(
    name: str, *, needs_model: bool = False, needs_continuations: bool = False
) -> Callable[[Callable[..., CreditResult]], Callable[..., CreditResult]]:
    """Decorator: register ``fn`` as the estimator called ``name`` (:class:`EstimatorSpec` gives the
    flags' meaning).

    A user estimator named ``module:attr`` in a config (:mod:`oar.credit.user`) that is decorated
    with this keeps its flags under the ``module:attr`` name too (:func:`spec_of`).

    Raises:
        ValueError: if ``name`` is already registered to a different function.
    """

    def deco(fn: Callable[..., CreditResult]) -> Callable[..., CreditResult]:
        old = _REGISTRY.get(name)
        if old is not None and old.fn is not fn and old.fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"estimator {name!r} is already registered to {old.fn.__module__}.{old.fn.__qualname__}")
        register_spec(name, EstimatorSpec(fn, needs_model=needs_model, needs_continuations=needs_continuations))
        return fn

    return deco


def register_spec(name: str, spec: EstimatorSpec) -> None:
    """Put ``spec`` in the registry as ``name`` (replacing any previous entry)."""
    _REGISTRY[name] = spec


def spec_of(fn: Callable[..., Any]) -> EstimatorSpec:
    """The spec :func:`register_estimator` gave ``fn`` under any name (a plain function: no flags)."""
    return next((spec for spec in _REGISTRY.values() if spec.fn is fn), EstimatorSpec(fn))


def _load_builtin() -> None:
    """Import the built-in estimator modules (importing registers their estimators). A module that
    fails to import raises here, in the config's resolution (:func:`oar.config.methods.resolve_method`), not
    as an unknown estimator inside a training job."""
    from oar.credit import advantages, controls, importance, ktae, mc_value, nulls, prm, verifier  # noqa: F401


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec registered as ``name``; a user estimator (``module:attr``, or an entry point of
    ``oar.estimators``) not registered yet is loaded and registered (:func:`oar.credit.user.user_estimator`).

    Raises:
        KeyError: naming the unknown estimator and the registered ones.
        oar.credit.user.EstimatorSpecError: a user estimator that cannot be loaded (why, in one line).
    """
    _load_builtin()
    if name not in _REGISTRY:
        from oar.credit.user import UnknownEstimatorError, user_estimator

        try:
            user_estimator(name)
        except UnknownEstimatorError:
            raise KeyError(f"unknown estimator {name!r}; registered: {sorted(_REGISTRY)}") from None
    return _REGISTRY[name]


def get_estimator(name: str) -> Callable[..., CreditResult]:
    """The estimator function registered as ``name`` (:func:`estimator_spec`)."""
    return estimator_spec(name).fn


def list_estimators() -> list[str]:
    """Names of all registered estimators, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def estimator_needs_model(name: str) -> bool:
    """Whether the estimator ``name`` calls the policy (:class:`EstimatorSpec`)."""
    return estimator_spec(name).needs_model


def estimator_needs_continuations(name: str) -> bool:
    """Whether the estimator ``name`` reads ``CreditBatch.continuations`` (:class:`EstimatorSpec`)."""
    return estimator_spec(name).needs_continuations
