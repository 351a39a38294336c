"""Helpers shared by OAR-P and OAR-G (:mod:`oar.credit.importance`): model calls on the tail of
a probe, the outcome of a probe row (docs/methods.md, 4.1 The outcome probe), its divergence, and the prefix KV cache.

All model calls use explicit ``position_ids = cumsum(attention_mask) - 1`` (so left padding does
not shift positions) and only compute logits for the tail of the sequence that holds the answer
(``logits_to_keep``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Iterator, Mapping, TypeVar

import torch
import torch.nn.functional as F

from oar.credit.probe import Probe
from oar.models.loading import cache_argument

#: Outcome modes understood by the importance functions.
MODES: tuple[str, ...] = ("last", "answer_mean", "answer_joint")


def check_mode(mode: str, where: str) -> None:
    if mode not in MODES:
        raise ValueError(f"oar.credit.importance.{where}: unknown mode {mode!r}; use one of {list(MODES)}")


_O = TypeVar("_O")


def option_names(cls: type) -> tuple[str, ...]:
    """The option names of an options type (a frozen dataclass: its fields, in order)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def option_defaults(cls: type) -> dict[str, Any]:
    """The default of every option of an options type (the one place each is written)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def options_from(cls: type[_O], options: Mapping[str, Any], where: str) -> _O:
    """An options type's instance from a mapping of some of its options (the rest take their defaults).

    Raises:
        ValueError: naming ``where`` and the unknown keys, or an invalid value (the type's checks).
    """
    names = option_names(cls)
    bad = sorted(set(options) - set(names))
    if bad:
        raise ValueError(f"{where}: unknown options {bad}; valid: {list(names)}")
    return cls(**options)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode (no dropout) and restore its previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _forward_params(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def logits_tail(
    model: torch.nn.Module,
    keep: int,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    use_cache: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Run the model and return the float32 logits of the last ``keep`` query positions, plus the
    returned cache (or None)."""
    params = _forward_params(model)
    kw: dict[str, Any] = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)
    if input_ids is not None:
        kw["input_ids"] = input_ids
    else:
        kw["inputs_embeds"] = inputs_embeds
    if cache is not None:
        kw[cache_argument(model)] = cache
    if "logits_to_keep" in params:
        kw["logits_to_keep"] = keep
    out = model(**kw)
    logits = out.logits[:, -keep:].float()
    new_cache = None
    if use_cache:
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
    return logits, new_cache


def outcome(
    logits_tail: torch.Tensor,
    tail_start: int,
    input_ids: torch.Tensor,
    answer_mask: torch.Tensor,
    last_index: torch.Tensor,
    mode: str,
) -> torch.Tensor:
    """The outcome of each row from the logits of the sequence tail.

    Args:
        logits_tail: ``(N, K, V)`` logits of absolute positions ``tail_start .. tail_start+K-1``
            (``tail_start + K == L``).
        tail_start: first absolute position covered by ``logits_tail``.
        input_ids: ``(N, L)`` probe ids (targets of ``answer_joint``).
        answer_mask: ``(N, L)`` bool, answer positions (answer-predicting positions are the ones
            just before them; they must all be ``>= tail_start``).
        last_index: ``(N,)`` long, position predicting the first answer token (mode ``last``).
        mode: ``last`` | ``answer_mean`` | ``answer_joint``.

    Returns:
        ``(N, V)`` log-probabilities (``last``, ``answer_mean``) or ``(N,)`` ``phi`` (``answer_joint``).
    """
    N, K, _ = logits_tail.shape
    if mode == "last":
        idx = (last_index - tail_start).to(logits_tail.device)
        if bool((idx < 0).any()) or bool((idx >= K).any()):
            raise ValueError("oar.credit.importance.outcome: last_index outside the kept logits")
        return F.log_softmax(logits_tail[torch.arange(N, device=logits_tail.device), idx], dim=-1)
    # pred[:, j] is True when position j predicts an answer token (answer at j + 1).
    pred = torch.zeros_like(answer_mask)
    pred[:, :-1] = answer_mask[:, 1:]
    pred_tail = pred[:, tail_start:].to(logits_tail.device)
    n = pred_tail.sum(-1).clamp(min=1)
    if mode == "answer_mean":
        mean_logits = torch.einsum("nk,nkv->nv", pred_tail.to(logits_tail.dtype), logits_tail) / n.unsqueeze(-1)
        return F.log_softmax(mean_logits, dim=-1)
    if mode == "answer_joint":
        lg = logits_tail[:, :-1]
        targets = input_ids[:, tail_start + 1 :].to(logits_tail.device)
        lp = lg.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1)
        return (lp * pred_tail[:, :-1]).sum(-1) / n
    raise ValueError(f"oar.credit.importance.outcome: unknown mode {mode!r}; use one of {list(MODES)}")


def divergence(orig: torch.Tensor, new: torch.Tensor, mode: str) -> torch.Tensor:
    """``KL(P_orig || P_new)`` per row from log-probs, or ``phi_orig - phi_new`` (answer_joint)."""
    if mode == "answer_joint":
        return orig - new
    return (orig.exp() * (orig - new)).sum(-1)


def logits_to_keep(probe: Probe) -> int:
    """Number of tail logits covering every answer-predicting position of the probe."""
    return int(probe.answer_length.max()) + 1 if probe.answer_length.numel() else 1


def answered(probe: Probe) -> tuple[torch.Tensor, Probe]:
    rows = probe.has_answer.nonzero().flatten()
    return rows, probe.select(rows)


def plain_cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``[(keys, values)]`` per layer of a full-attention DynamicCache, None if not that kind."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - very old transformers
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def warn_naive_fallback(where: str, stacklevel: int) -> None:
    """Warn that ``where`` falls back to its naive path (the model's cache cannot be reused)."""
    warnings.warn(
        f"oar.credit.importance.{where}: the model's cache is not a plain full-attention DynamicCache; "
        "using the naive (no prefix cache) path",
        stacklevel=stacklevel + 1,
    )


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


