"""The training records of a config's task: the one loader that RL training, SFT and ``oar data`` share.

``task.kind: synthetic`` generates the ``train`` split (``task.train_size`` problems from
``task.seed`` and ``task.synthetic``'s options); ``task.kind: benchmark`` reads every record of
``task.benchmark`` (``name``; ``source``, a local file or folder, else the hub; optional ``levels``) and refuses an empty set, naming the
file and the filters, so that ``oar data`` fails before any training does. SFT takes its own
held-out slice off the end of a benchmark's records (:func:`oar.trainer.sft_stage.sft_data`); the evaluation
benchmarks have their own entries (:func:`oar.evaluate.evaluation.load_benchmark_entry`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TRAINING_SET_KEY", "training_records", "training_records_located"]

#: The config key an empty or unreadable training set is reported under.
TRAINING_SET_KEY = "task.benchmark (training set)"


def training_records(task: Mapping[str, Any]) -> list[dict]:
    """The training records of the ``task`` section of a validated config
    (:func:`training_records_located` without the places)."""
    return [rec for _, rec in training_records_located(task)]


def training_records_located(task: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """The training records of the ``task`` section of a validated config, each with where it was read
    (``<file>:<line>``: :func:`oar.data.benchmarks.load_benchmark_located`).

    Returns:
        The synthetic ``train`` split, or the benchmark's records (after ``levels``), in file order.

    Raises:
        ValueError: ``task.benchmark`` lacks ``name`` when ``task.kind`` is ``benchmark``; the
            benchmark has no records (after its filters).
        FileNotFoundError / HubUnavailableError: from :func:`oar.data.benchmarks.load_benchmark`.
    """
    if task["kind"] == "synthetic":
        from oar.data.synthetic import generate

        return [(f"synthetic-train record {i} (generated)", rec)
                for i, rec in enumerate(generate("train", task["train_size"], seed=task["seed"], **task["synthetic"]))]
    from oar.data.benchmarks import load_benchmark_located, require_records

    bench = task.get("benchmark") or {}
    if "name" not in bench:
        raise ValueError("config: task.benchmark.name is required when task.kind is 'benchmark'")
    levels = bench.get("levels") or None
    filters = {"levels": levels} if levels else {}
    located = load_benchmark_located(bench["name"], bench.get("source"), **filters)
    # an empty training set: a clear error here, not a ZeroDivisionError in the prompt stream
    require_records([rec for _, rec in located], bench["name"], bench.get("source"), key=TRAINING_SET_KEY,
                    levels=levels)
    return located
