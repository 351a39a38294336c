"""The data manifest (``oar data``): every data set a config names, loaded once and described
(resolved path, sha256 and size of local files; record counts; generator options of synthetic splits).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from oar.io import atomic_write_json

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
    """Load every data set the config names and describe it (provenance and an early failure).

    Returns ``{"train": {...}, "eval": [{...}, ...]}``: for local files the resolved path, sha256 and
    size; the number of records after filters and the number used (``n``); for generated
    (synthetic) splits the generator options and seed.

    Raises:
        FileNotFoundError / ValueError / HubUnavailableError: from :func:`oar.data.benchmarks.load_benchmark`,
        naming the benchmark and file; ValueError also when the training set or an eval benchmark
        has no records (:func:`oar.data.benchmarks.require_records`).
    """
    from oar.data.benchmarks import BENCHMARKS, load_benchmark, require_records
    from oar.data.records import training_records

    task = config["task"]
    out: dict[str, Any] = {"name": config["name"]}
    synth = {"options": dict(task.get("synthetic") or {}), "seed": task.get("seed")}
    if task["kind"] == "synthetic":
        out["train"] = {"name": "synthetic-train", "generated": True, "n": task.get("train_size"), **synth}
    else:
        recs = training_records(task)
        b = task["benchmark"]
        levels = b.get("levels")
        out["train"] = {"name": b["name"], "levels": levels, "records": len(recs),
                        **_describe_source(b["name"], b.get("source"), BENCHMARKS[b["name"]].default_file)}
    evals = []
    for i, b in enumerate(config["eval"]["benchmarks"]):
        name = b["name"]
        if name.startswith("synthetic-"):
            evals.append({"name": name, "generated": True, "n": b.get("n"), **synth})
            continue
        if name not in BENCHMARKS:
            raise ValueError(f"config: eval.benchmarks.{i}.name: unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)}")
        recs = load_benchmark(name, b.get("source"), **(b.get("filters") or {}))
        require_records(recs, name, b.get("source"), key=f"eval.benchmarks.{i}", **(b.get("filters") or {}))
        n = len(recs) if not b.get("n") else min(int(b["n"]), len(recs))
        evals.append({"name": name, "records": len(recs), "n": n, "filters": b.get("filters") or {},
                      "first_ids": [r["id"] for r in recs[: min(3, n)]],
                      **_describe_source(name, b.get("source"), BENCHMARKS[name].default_file)})
    out["eval"] = evals
    return out


def write_data_manifest(config: Mapping[str, Any], output: str | Path) -> dict[str, Any]:
    """:func:`data_manifest`, written atomically as JSON to ``output``; returns it."""
    manifest = data_manifest(config)
    atomic_write_json(output, manifest)
    return manifest
