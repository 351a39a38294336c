"""The results tree: every path a config's results live at, defined once.

The workflow's rules, the reports and the commands ask a :class:`ResultsTree` for paths instead of
spelling them. A config's results are ``<results_dir>/<name>/`` (its *view*); what costs compute lives
once in ``<results_dir>/store/<kind>/<key>/`` and the view's entries link into it
(:mod:`oar.pipeline.store` makes the links; :func:`store_location` reads them back)::

    <results_dir>/<name>/
        config.yaml                  the resolved config the jobs read
        plan.txt                     the memory plan (GPU training)
        data/manifest.json           the data stage
        sft/model/                   the warm-start SFT (save_pretrained, sft_summary.json)
        verifier/model/              the step verifier (verifier_summary.json)
        base/eval/, base/transfer/   the start model's evaluations (summary.json, <benchmark>.json[l])
        <method>/seed<N>/            a training run: checkpoint/, model/, metrics.jsonl, train_summary.json,
                                     run.json, checkpoints/step_<k>/, eval/, transfer/
        attribution/[<method>_seed<N>/]   the attribution benchmark
        tables/, figures/            the report
        logs/, benchmarks/           each job's log and Snakemake's benchmark file

Paths are strings (Snakemake's rules take them, with wildcards such as ``"{method}"`` passed in
place of a name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "STORE_DIR", "STORE_KINDS", "VERIFIER_VIEW", "RESERVED_NAMES",
    "CHECKPOINT_DIR", "ARCHIVE_DIR", "FINAL_DIR", "STATE_FILE", "METRICS_FILE", "SUMMARY_FILE", "RUN_FILE",
    "MANIFEST_FILE", "EVAL_FOLDER", "TRANSFER_FOLDER", "EVAL_SUMMARY", "BASE_ROW", "SFT_SUMMARY_FILE",
    "VERIFIER_SUMMARY_FILE", "ResultsTree", "StoreLocation", "store_location",
]

#: The store's folder inside ``results_dir`` (so no config may be named so).
STORE_DIR = "store"
#: The kinds of entries of the store, its first level of folders.
STORE_KINDS: tuple[str, ...] = ("data", "sft", "base", "verifier", "runs")
#: The entry of a config's view that holds the step verifier it trains (``<view>/model``).
VERIFIER_VIEW = "verifier"
#: The first-level folders of a config's view the workflow uses itself (no method may take the name).
RESERVED_NAMES: frozenset[str] = frozenset({"base", "sft", "data", "attribution", "tables", "figures", "logs",
                                            "benchmarks", "config", VERIFIER_VIEW})

# a training run's folder (oar train, oar.trainer.runs.RunFolder)
#: The latest checkpoint (resumed from).
CHECKPOINT_DIR = "checkpoint"
#: Kept earlier checkpoints (``train.keep_checkpoints``), ``step_<k>/`` each.
ARCHIVE_DIR = "checkpoints"
#: The final model (``save_pretrained``).
FINAL_DIR = "model"
#: Optimizer, scheduler, RNG and loop state inside a checkpoint.
STATE_FILE = "trainer_state.pt"
#: One JSON row per step (and per held-out evaluation).
METRICS_FILE = "metrics.jsonl"
#: What a finished run writes last.
SUMMARY_FILE = "train_summary.json"
#: The MLflow run a run folder logs to (resumed runs continue it).
RUN_FILE = "run.json"
#: A checkpoint's file list with sizes (checked before resuming).
MANIFEST_FILE = "checkpoint.json"
#: An evaluation's folder under a run (or ``base``) and the transfer evaluation's.
EVAL_FOLDER = "eval"
TRANSFER_FOLDER = "transfer"
#: The file an evaluation writes last.
EVAL_SUMMARY = "summary.json"
#: The report's row (and the view's entry) of the start model.
BASE_ROW = "base"
#: The files the SFT and the step verifier write beside their model.
SFT_SUMMARY_FILE = "sft_summary.json"
VERIFIER_SUMMARY_FILE = "verifier_summary.json"


@dataclass(frozen=True)
class ResultsTree:
    """The paths of one config's results: ``<results_dir>/<name>/...`` (see the module docstring)."""

    results_dir: str
    name: str

    @classmethod
    def at(cls, root: str | os.PathLike) -> "ResultsTree":
        """The tree whose root is the folder ``root`` (``oar report --results``: any folder)."""
        path = Path(root)
        return cls(str(path.parent), path.name)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> "ResultsTree":
        """The tree of a validated config (its ``results_dir`` and ``name``)."""
        return cls(str(config["results_dir"]), str(config["name"]))

    @property
    def root(self) -> str:
        return f"{self.results_dir}/{self.name}"

    @property
    def store(self) -> str:
        return f"{self.results_dir}/{STORE_DIR}"

    def path(self, *parts: object) -> str:
        """``<root>/<parts...>``."""
        return "/".join([self.root, *map(str, parts)])

    # the config's own files and the stages before training
    @property
    def config_file(self) -> str:
        return self.path("config.yaml")

    @property
    def plan_file(self) -> str:
        return self.path("plan.txt")

    @property
    def manifest(self) -> str:
        return self.path("data", "manifest.json")

    @property
    def sft_model(self) -> str:
        return self.path("sft", FINAL_DIR)

    @property
    def sft_summary(self) -> str:
        return f"{self.sft_model}/{SFT_SUMMARY_FILE}"

    @property
    def verifier_model(self) -> str:
        return self.path(VERIFIER_VIEW, FINAL_DIR)

    @property
    def verifier_summary(self) -> str:
        return f"{self.verifier_model}/{VERIFIER_SUMMARY_FILE}"

    # training runs and evaluations
    def run_dir(self, method: object, seed: object) -> str:
        return self.path(method, f"seed{seed}")

    def run_summary(self, method: object, seed: object) -> str:
        return f"{self.run_dir(method, seed)}/{SUMMARY_FILE}"

    def run_metrics(self, method: object, seed: object) -> str:
        return f"{self.run_dir(method, seed)}/{METRICS_FILE}"

    def eval_dir(self, method: object, seed: object = None, *, folder: str = EVAL_FOLDER) -> str:
        """A run's evaluation folder (``folder``: ``eval`` or ``transfer``); the start model's with
        ``method`` :data:`BASE_ROW` and no seed."""
        if method == BASE_ROW and seed is None:
            return self.path(BASE_ROW, folder)
        return f"{self.run_dir(method, seed)}/{folder}"

    def eval_summary(self, method: object, seed: object = None, *, folder: str = EVAL_FOLDER) -> str:
        return f"{self.eval_dir(method, seed, folder=folder)}/{EVAL_SUMMARY}"

    # the attribution benchmark and the report
    def attribution_dir(self, method: object = None, seed: object = None) -> str:
        """The benchmark on the start model (no method) or on a trained policy."""
        return self.path("attribution") if method is None else self.path("attribution", f"{method}_seed{seed}")

    def table(self, file: str) -> str:
        return self.path("tables", file)

    def figure(self, file: str) -> str:
        return self.path("figures", file)

    def log(self, *parts: object) -> str:
        """``logs/<parts>.log``."""
        return self.path("logs", *parts[:-1], f"{parts[-1]}.log")

    def benchmark(self, *parts: object) -> str:
        """Snakemake's ``benchmark:`` file, ``benchmarks/<parts>.tsv``."""
        return self.path("benchmarks", *parts[:-1], f"{parts[-1]}.tsv")


@dataclass(frozen=True)
class StoreLocation:
    """Where a path lies in the store: ``<results_dir>/store/<kind>/<key>/<rest>``.

    Attributes:
        kind: one of :data:`STORE_KINDS`.
        key: the entry's folder name (``runs``: ``<method>-<run_key>``; others: the key itself).
        rest: the path inside the entry (``seed0/eval``; ``""`` for the entry itself).
    """

    kind: str
    key: str
    rest: str


def store_location(path: str | os.PathLike) -> StoreLocation | None:
    """Where ``path`` (a config's view such as ``results/smoke/grpo/seed0/eval``, or a store path)
    lies in the results store once its links are resolved, or None when it lies outside the store
    (a folder given to ``oar`` by hand, a results tree from before the store)."""
    parts = Path(path).resolve().parts
    for i in range(len(parts) - 3, -1, -1):  # the innermost store/<kind>/<key> of the path
        if parts[i] == STORE_DIR and parts[i + 1] in STORE_KINDS:
            return StoreLocation(parts[i + 1], parts[i + 2], "/".join(parts[i + 3:]))
    return None
