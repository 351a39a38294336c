"""Does a run reproduce a recorded one? The per-seed values of a finished run (``main.csv``'s
per-seed means of every row, metric and benchmark; ``learning_speed.csv``'s per-seed endpoints) saved
as a small reference file, and a fresh run compared with it cell by cell.

Why not to the digit: float results are bit-identical only on the same CPU type with the same
software (another instruction set reorders float sums: the SFT, and from it everything after,
differs in the last bits and then by seed-noise amounts). So each cell is judged by what seed noise
allows: the recorded and the fresh per-seed values are two samples of one method's seed
distribution, and the cell reproduces when the Welch t interval of the difference of their means
contains 0. A cell with one value on a side (the start model, evaluated once) has no seed sample;
it is judged against the seed spread of the trained rows of its benchmark (``|d| <= t * sd * sqrt(2)``).
Beside the values, the provenance of the two runs (commit, CPU, torch, ...) is compared, so a
difference can be read against what changed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from oar.core.markdown import markdown_table
from oar.report.base import per_seed_values

__all__ = ["REFERENCE_FORMAT", "READABLE_FORMATS", "Cell", "run_values", "config_identity", "save_reference",
           "load_reference", "compare_runs", "compare_markdown"]

#: The reference file's format tag (its ``format`` key). Format 2 adds ``config_identity``.
REFERENCE_FORMAT = "oar-reference-2"
#: Formats :func:`load_reference` reads (a format-1 file has no config identity to check).
READABLE_FORMATS = ("oar-reference-1", REFERENCE_FORMAT)

#: Provenance keys compared between the two runs, in the order printed.
PROVENANCE_KEYS = ("git_commit", "git_dirty", "cpu_model", "torch_cpu_capability", "gpu_name", "device",
                   "python", "torch", "transformers", "numpy")


@dataclass(frozen=True)
class Cell:
    """One compared value: ``kind`` (``main`` or ``learning``), the row (method or ``base``), the
    metric and the benchmark (or the learning-speed endpoint), and the per-seed values of each side."""

    kind: str
    row: str
    metric: str
    benchmark: str
    recorded: tuple[float, ...]
    fresh: tuple[float, ...]


def run_values(results: str | Path) -> dict[str, list[float]]:
    """``{"main|row|metric|benchmark": per-seed values, "learning|method|endpoint|": ...}`` of a finished
    run's tables (``R/tables/main.csv``, and ``learning_speed.csv`` when it exists).

    Raises:
        FileNotFoundError: the run has no ``main.csv`` (run the report first), naming the file.
    """
    import pandas as pd

    tables = Path(results) / "tables"
    main = tables / "main.csv"
    if not main.is_file():
        raise FileNotFoundError(f"{main}: no such file; the run's report makes it (snakemake, or oar report)")
    out: dict[str, list[float]] = {}
    for r in pd.read_csv(main).itertuples(index=False):
        out[f"main|{r.row}|{r.metric}|{r.benchmark}"] = per_seed_values(r.per_seed)
    speed = tables / "learning_speed.csv"
    if speed.is_file() and speed.stat().st_size > 1:
        df = pd.read_csv(speed)
        for r in df.itertuples(index=False):
            out[f"learning|{r.method}|held-out AUC (%)|"] = per_seed_values(r.auc_per_seed)
            out[f"learning|{r.method}|steps to threshold|"] = per_seed_values(r.steps_per_seed)
    return out


def _provenance_of(results: Path) -> dict[str, Any]:
    """The provenance the run's outputs recorded (the first evaluation summary that has one), else {}."""
    for summary in sorted(results.glob("*/seed*/eval/summary.json")) + sorted(results.glob("base/eval/summary.json")):
        try:
            prov = json.loads(summary.read_text()).get("provenance")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(prov, Mapping):
            return dict(prov)
    return {}


def config_identity(results: str | Path) -> dict[str, str]:
    """What defines the results of a run's config, section by section (:func:`oar.config.identity.fingerprint`
    of its resolved ``config.yaml``: model, task, sft, rollout, the train keys a run cannot change and
    continue, reward, the evaluated eval keys, recipes, methods and seeds); {} when the run has no
    ``config.yaml``. Two runs compare only when these agree."""
    import yaml

    from oar.config.identity import EVAL_KEYS_NOT_EVALUATED, RESUMABLE_TRAIN_KEYS, fingerprint

    path = Path(results) / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    drop = {"train": RESUMABLE_TRAIN_KEYS, "eval": EVAL_KEYS_NOT_EVALUATED}
    out = {}
    for key in ("model", "task", "sft", "rollout", "train", "reward", "eval", "recipes", "methods", "seeds"):
        value = cfg.get(key)
        if isinstance(value, dict) and key in drop:
            value = {k: v for k, v in value.items() if k not in drop[key]}
        out[key] = fingerprint(value)
    return out


def save_reference(results: str | Path, path: str | Path, *, note: str = "") -> dict[str, Any]:
    """Write the reference file of the finished run ``results`` (per-seed values and provenance) to
    ``path`` (atomically); returns what was written."""
    from oar.core.io import atomic_write_json

    results = Path(results)
    ref = {"format": REFERENCE_FORMAT, "note": note, "results": str(results),
           "config_identity": config_identity(results), "provenance": _provenance_of(results),
           "values": run_values(results)}
    atomic_write_json(path, ref)
    return ref


def load_reference(path: str | Path) -> dict[str, Any]:
    """Read a reference file.

    Raises:
        ValueError: the file is not a reference file of this format (naming it and what to do).
        FileNotFoundError: it does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such reference file")
    try:
        ref = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a reference file ({e}); write one with oar compare --save") from None
    if not isinstance(ref, dict) or ref.get("format") not in READABLE_FORMATS or not isinstance(ref.get("values"), dict):
        raise ValueError(f"{path}: not a reference file of format {REFERENCE_FORMAT}; write one with oar compare --save")
    ref["path"] = str(path)
    return ref


def _verdict(cell: Cell, noise_sd: float, *, confidence: float) -> dict[str, Any]:
    """Difference (fresh - recorded), its interval and the verdict of one cell."""
    from scipy import stats

    a, b = np.asarray(cell.recorded, float), np.asarray(cell.fresh, float)
    rec = {"kind": cell.kind, "row": cell.row, "metric": cell.metric, "benchmark": cell.benchmark,
           "recorded": float(a.mean()) if a.size else math.nan, "fresh": float(b.mean()) if b.size else math.nan,
           "n_recorded": int(a.size), "n_fresh": int(b.size), "low": math.nan, "high": math.nan}
    rec["diff"] = rec["fresh"] - rec["recorded"]
    if not a.size or not b.size or np.isnan(a).any() or np.isnan(b).any():
        rec["verdict"] = "missing" if (not a.size or not b.size) else "not comparable"
        return rec
    if a.size == b.size and np.array_equal(np.round(a, 4), np.round(b, 4)):
        rec["verdict"] = "identical"
        return rec
    if a.size >= 2 and b.size >= 2:
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        if se == 0.0:
            rec["verdict"] = "differs"
            return rec
        dof = (va + vb) ** 2 / ((va ** 2 / (a.size - 1) if a.size > 1 else 0) + (vb ** 2 / (b.size - 1) if b.size > 1 else 0))
        half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * se
        rec["low"], rec["high"] = rec["diff"] - half, rec["diff"] + half
        rec["verdict"] = "within seed noise" if rec["low"] <= 0 <= rec["high"] else "differs"
        return rec
    if math.isnan(noise_sd):
        rec["verdict"] = "not comparable"
        return rec
    half = float(stats.norm.ppf(0.5 + confidence / 2)) * noise_sd * math.sqrt(2)
    rec["low"], rec["high"] = rec["diff"] - half, rec["diff"] + half
    rec["verdict"] = "within seed noise" if abs(rec["diff"]) <= half else "differs"
    return rec


def compare_runs(reference: Mapping[str, Any], results: str | Path, *, confidence: float = 0.95) -> dict[str, Any]:
    """Compare the finished run ``results`` with a reference (:func:`load_reference`).

    Returns:
        ``{"cells": [per-cell records: kind, row, metric, benchmark, recorded, fresh, diff, low, high,
        verdict], "provenance": [(key, recorded, fresh) that differ], "counts": {verdict: n}}``.

    Raises:
        ValueError: the reference records a config identity (:func:`config_identity`) other than the
            run's, naming the sections that differ.
    """
    results = Path(results)
    theirs, ours = reference.get("config_identity") or {}, config_identity(results)
    differ = [k for k in theirs if ours and theirs[k] != ours.get(k)]
    if differ:
        raise ValueError(f"{reference.get('path', 'the reference')}: a run of another config ({results}/config.yaml "
                         f"differs in {', '.join(differ)}); compare a run with a reference of its own config")
    fresh = run_values(results)
    recorded = {k: list(v) for k, v in reference["values"].items()}
    keys = list(dict.fromkeys([*recorded, *fresh]))
    cells = []
    for k in keys:
        kind, row, metric, bench = (k.split("|") + ["", "", "", ""])[:4]
        cells.append(Cell(kind, row, metric, bench, tuple(recorded.get(k, ())), tuple(fresh.get(k, ()))))
    # the seed spread of a benchmark's trained rows: the noise scale of its one-evaluation cells
    spread: dict[tuple[str, str, str], list[float]] = {}
    for c in cells:
        for side in (c.recorded, c.fresh):
            if len(side) >= 2:
                spread.setdefault((c.kind, c.metric, c.benchmark), []).append(float(np.std(side, ddof=1)))
    noise = {k: float(np.median(v)) for k, v in spread.items()}
    recs = [_verdict(c, noise.get((c.kind, c.metric, c.benchmark), math.nan), confidence=confidence) for c in cells]
    prov_rec, prov_new = reference.get("provenance") or {}, _provenance_of(results)
    prov = [(k, prov_rec.get(k), prov_new.get(k)) for k in PROVENANCE_KEYS
            if prov_rec.get(k) != prov_new.get(k)]
    counts: dict[str, int] = {}
    for r in recs:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return {"cells": recs, "provenance": prov, "counts": counts, "confidence": confidence,
            "has_provenance": (bool(prov_rec), bool(prov_new))}


def _fmt(v: float) -> str:
    return "—" if math.isnan(v) else f"{v:.1f}"


def compare_markdown(result: Mapping[str, Any], *, reference_path: str, results: str,
                     rows: Sequence[str] = ("differs", "missing", "not comparable", "within seed noise", "identical")
                     ) -> str:
    """The comparison as markdown: a summary line, the provenance differences, one table row per cell
    (cells that differ first)."""
    counts = result["counts"]
    n = sum(counts.values())
    conf = result["confidence"]
    summary = ", ".join(f"{counts[v]} {v}" for v in rows if counts.get(v))
    verdict = ("REPRODUCED: every cell is identical or within seed noise" if not counts.get("differs")
               and not counts.get("missing") else "DIFFERENT: see the cells marked differs / missing")
    lines = [f"# {results} against {reference_path}", "", f"{verdict} ({n} cells: {summary}).", "",
             f"A cell is the per-seed values of one row, metric and benchmark: within seed noise when the "
             f"{conf:.0%} Welch t interval of fresh - recorded contains 0 (a one-evaluation cell: "
             f"|difference| <= z x sd x sqrt(2), sd the seed spread of the benchmark's trained rows); "
             f"identical: equal to 4 decimals on every seed (same CPU type and software).", ""]
    rec_p, new_p = result.get("has_provenance", (True, True))
    if result["provenance"]:
        lines += ["## Provenance that differs", "",
                  *markdown_table(["key", "recorded", "fresh"], result["provenance"], "lll")]
        lines.append("")
    elif rec_p and new_p:
        lines += ["Provenance: the same commit, CPU, torch capability and package versions.", ""]
    if not (rec_p and new_p):
        lines += [f"Provenance not recorded by the {'reference' if not rec_p else 'fresh run'}.", ""]
    order = {v: i for i, v in enumerate(rows)}
    cells = []
    for r in sorted(result["cells"], key=lambda r: order.get(r["verdict"], 0)):
        name = " / ".join(x for x in (r["row"], r["metric"], r["benchmark"]) if x)
        iv = "" if math.isnan(r["low"]) else f" [{r['low']:+.1f}, {r['high']:+.1f}]"
        diff = "—" if math.isnan(r["diff"]) else f"{r['diff']:+.1f}{iv}"
        cells.append([name, _fmt(r["recorded"]), _fmt(r["fresh"]), diff, r["verdict"]])
    lines += markdown_table(["cell", "recorded", "fresh", "fresh - recorded [interval]", "verdict"], cells, "lrrrl")
    return "\n".join(lines) + "\n"
