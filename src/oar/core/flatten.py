"""Nested settings as flat ``{"a.b.c": "value"}`` strings, whole: what identifies a run
(:func:`oar.config.identity.run_identity`) and the settings a run changed. MLflow's limit on a
parameter's length is applied where MLflow is written (:meth:`oar.tracking.client.Tracker.log_params`),
not here, so two settings that differ only past that limit stay different."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["flatten"]


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested mapping to ``{"a.b.c": "value"}`` strings (``str`` of every leaf, untruncated).

    >>> flatten({"train": {"lr": 1e-05, "betas": [0.9, 0.98]}, "seed": 0})
    {'train.lr': '1e-05', 'train.betas': '[0.9, 0.98]', 'seed': '0'}
    """
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out
