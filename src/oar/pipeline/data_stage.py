"""The data manifest (``oar data``): every data set a config names, loaded once, checked against the
model and the reward (:mod:`oar.evaluate.prompt_checks`: every prompt fits the model's context with its
generation budget; gold answers the reward cannot read are counted and warned about) and described
(resolved path, sha256 and size of local files; record counts; generator options of synthetic splits).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from oar.core.io import atomic_write_json

__all__ = ["data_manifest", "write_data_manifest"]


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _describe_source(name: str, source: str | None, default_file: str) -> dict[str, Any]:
    if source is None:
        return {"source": None}
    p = Path(source)
    if p.is_dir():
        p = p / default_file
    if p.exists():
        return {"source": str(source), "file": str(p.resolve()), "sha256": _sha256(p), "bytes": p.stat().st_size}
    return {"source": str(source), "hub": True}


def data_manifest(config: Mapping[str, Any]) -> dict[str, Any]:
    """Load every data set the config names, check it against the model and the reward, and describe it
    (provenance and an early failure).

    Returns ``{"train": {...}, "eval": [{...}, ...], "checks": {...}, "warnings": [...]}``: for local
    files the resolved path, sha256 and size; the number of records after filters and the number used
    (``n``); for generated (synthetic) splits the generator options and seed; per set the longest
    prompt in tokens (``prompt_tokens_max``) and, for a benchmark file, how many of its gold answers
    the reward cannot read as math (``unreadable_golds``, with the first few in
    ``unreadable_gold_records``), and ``records_sha256``, the digest of the records themselves
    (:func:`oar.evaluate.evaluation.records_digest`: two machines that generate a split alike give the same).
    ``checks.prompts`` says which model the prompts were checked against,
    or why they were not (``skipped``); ``warnings`` holds one line per set with unreadable golds
    (:mod:`oar.evaluate.prompt_checks`).

    Raises:
        FileNotFoundError / ValueError / HubUnavailableError: from :func:`oar.data.benchmarks.load_benchmark`,
        naming the benchmark and file; ValueError also when the training set or an eval benchmark
        has no records (:func:`oar.data.benchmarks.require_records`), or a prompt does not fit the
        model's context with its generation budget (:func:`oar.evaluate.prompt_checks.check_prompts`).
        oar.models.checks.ModelLoadError: the model's tokenizer does not load.
    """
    from oar.evaluate.evaluation import records_digest

    out: dict[str, Any] = {"name": config["name"]}
    sets = _load_sets(config, out)
    for entry, _, located, _, _ in sets:  # what the records are, also for a generated split
        entry["records_sha256"] = records_digest([rec for _, rec in located])
    out.update(_check_sets(config, sets))
    return out


#: A data set as :func:`data_manifest` checks it: its manifest entry, what it is (for messages), the
#: records it uses with where each was read, the key of its generation budget, and whether its golds
#: come from a file (a generated split's are numbers the generator writes).
_Set = tuple[dict[str, Any], str, list[tuple[str, dict]], str, bool]


def _load_sets(config: Mapping[str, Any], out: dict[str, Any]) -> list[_Set]:
    """Load the training set and every ``eval.benchmarks`` entry into ``out["train"]`` / ``out["eval"]``
    (their descriptions), returning them as :data:`_Set` for the checks."""
    from oar.data.benchmarks import BENCHMARKS, load_benchmark_located, require_records
    from oar.evaluate.prompt_checks import EVAL_BUDGET_KEY, TRAIN_BUDGET_KEY
    from oar.data.records import TRAINING_SET_KEY, training_records_located
    from oar.evaluate.evaluation import load_benchmark_entry_located

    task = config["task"]
    synth = {"options": dict(task.get("synthetic") or {}), "seed": task.get("seed")}
    sets: list[_Set] = []
    train_located = training_records_located(task)
    if task["kind"] == "synthetic":
        out["train"] = {"name": "synthetic-train", "generated": True, "n": task.get("train_size"), **synth}
        sets.append((out["train"], "task (synthetic-train)", train_located, TRAIN_BUDGET_KEY, False))
    else:
        b = task["benchmark"]
        levels = b.get("levels")
        out["train"] = {"name": b["name"], "levels": levels, "records": len(train_located),
                        **_describe_source(b["name"], b.get("source"), BENCHMARKS[b["name"]].default_file)}
        sets.append((out["train"], TRAINING_SET_KEY, train_located, TRAIN_BUDGET_KEY, True))
    evals = []
    for i, b in enumerate(config["eval"]["benchmarks"]):
        name = b["name"]
        if name.startswith("synthetic-"):
            evals.append({"name": name, "generated": True, "n": b.get("n"), **synth})
            located = load_benchmark_entry_located(config["task"], b, key=f"eval.benchmarks.{i}")
            sets.append((evals[-1], f"eval.benchmarks.{i} ({name})", located, EVAL_BUDGET_KEY, False))
            continue
        if name not in BENCHMARKS:
            raise ValueError(f"config: eval.benchmarks.{i}.name: unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)}")
        located = load_benchmark_located(name, b.get("source"), **(b.get("filters") or {}))
        recs = [rec for _, rec in located]
        require_records(recs, name, b.get("source"), key=f"eval.benchmarks.{i}", **(b.get("filters") or {}))
        n = len(recs) if not b.get("n") else min(int(b["n"]), len(recs))
        evals.append({"name": name, "records": len(recs), "n": n, "filters": b.get("filters") or {},
                      "first_ids": [r["id"] for r in recs[: min(3, n)]],
                      **_describe_source(name, b.get("source"), BENCHMARKS[name].default_file)})
        sets.append((evals[-1], f"eval.benchmarks.{i} ({name})", located[:n], EVAL_BUDGET_KEY, True))
    out["eval"] = evals
    return sets


def _check_sets(config: Mapping[str, Any], sets: list[_Set]) -> dict[str, Any]:
    """Check every prompt of ``sets`` against the model (:func:`oar.evaluate.prompt_checks.check_prompts`; adds
    each entry's ``prompt_tokens_max``) and every gold answer of a file against the reward (adds
    ``unreadable_golds``); returns the manifest's ``checks`` and ``warnings``.

    Raises:
        ValueError: a prompt as long as the model's whole context.
    """
    from oar.evaluate.prompt_checks import (EVAL_BUDGET_KEY, RECORDS_SHOWN, TRAIN_BUDGET_KEY, PromptModel, check_prompts,
                                 gold_warning, prompt_model, unreadable_golds)

    template = config["task"]["template"]
    model = prompt_model(config)
    if isinstance(model, PromptModel):
        checks = {"prompts": {"model": model.origin, "max_position_embeddings": model.max_positions,
                              "template": template}}
        budgets = {TRAIN_BUDGET_KEY: int(config["rollout"]["max_new_tokens"]),
                   EVAL_BUDGET_KEY: int(config["eval"]["max_new_tokens"])}
    else:
        checks = {"prompts": {"skipped": model}}
    warnings = []
    if isinstance(model, PromptModel):
        for entry, what, located, key, _ in sets:
            entry["prompt_tokens_max"], tight = check_prompts(located, template=template, model=model,
                                                              budget=budgets[key], budget_key=key, what=what)
            warnings += [tight] if tight else []
    for entry, what, located, _, from_file in sets:
        if not from_file:
            continue  # generated: the generator writes its golds as numbers
        bad = unreadable_golds(located, timeout_s=float(config["reward"]["timeout_s"]))
        entry["unreadable_golds"] = len(bad)
        if bad:
            entry["unreadable_gold_records"] = [f"{where} {gold!r}" for where, gold in bad[:RECORDS_SHOWN]]
            warnings.append(gold_warning(bad, len(located), what))
    return {"checks": checks, "warnings": warnings}


def write_data_manifest(config: Mapping[str, Any], output: str | Path) -> dict[str, Any]:
    """:func:`data_manifest`, written atomically as JSON to ``output``; returns it."""
    manifest = data_manifest(config)
    atomic_write_json(output, manifest)
    return manifest
