"""What the verl and TRL adapters share: which estimators can be bridged, and their options.

An estimator can be bridged when it reads only the batch's tensors (rewards, groups, masks, token
ids) and, optionally, the tokenizer: not the policy (``needs_model``: OAR-P, OAR-G and the nulls built
on them, ``shuffled`` and ``inverted``) and not continuations sampled from it (``needs_continuations``:
``mc_value``). See :func:`oar.credit.register_estimator` for the flags.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from oar.credit import CreditResult, estimator_spec

__all__ = ["NORM_OPTION", "bridgeable_estimator", "takes_option", "with_norm_by_std"]

#: The estimator option that chooses GRPO's std division (True) or Dr. GRPO's plain centring (False).
NORM_OPTION = "norm_by_std"


def bridgeable_estimator(estimator: str, framework: str) -> Callable[..., CreditResult]:
    """The estimator registered as ``estimator`` (a built-in name, ``module:attr`` or an entry point).

    Args:
        estimator: the name, as a config's ``credit``.
        framework: where it is going (``"verl"``, ``"TRL"``), for the message.

    Raises:
        ValueError: one line, when the estimator needs the policy or continuations sampled from it
            (these cannot run in the framework's advantage step, see the module docstring).
        KeyError: an unknown estimator (:func:`oar.credit.estimator_spec`).
    """
    spec = estimator_spec(estimator)
    if spec.needs_continuations:
        raise ValueError(
            f"oar estimator {estimator!r} samples continuations from the policy (needs_continuations), which the "
            f"{framework} adapter cannot give it; use an estimator without the model (grpo, drgrpo, ktae, oracle_*) "
            "or oar's own trainer (oar train)")
    if spec.needs_model:
        raise ValueError(
            f"oar estimator {estimator!r} calls the policy model inside the advantage step (needs_model), which the "
            f"{framework} adapter cannot give it; use an estimator without the model (grpo, drgrpo, ktae, oracle_*) "
            "or oar's own trainer (oar train)")
    return spec.fn


def takes_option(fn: Callable[..., Any], option: str) -> bool:
    """Whether ``fn`` takes the keyword ``option`` (by name or through ``**options``); a callable
    without a signature takes any."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == option or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def with_norm_by_std(fn: Callable[..., Any], options: Mapping[str, Any], norm_by_std: bool | None) -> dict[str, Any]:
    """``options`` plus the framework's ``norm_by_std`` (verl's ``norm_adv_by_std_in_grpo``, TRL's
    ``scale_rewards``), as oar passes a recipe's: only when ``fn`` takes it, the options do not set
    it and the framework gives one (``norm_by_std`` not None)."""
    out = dict(options)
    if norm_by_std is not None and NORM_OPTION not in out and takes_option(fn, NORM_OPTION):
        out[NORM_OPTION] = bool(norm_by_std)
    return out
