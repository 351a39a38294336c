"""Math benchmarks in one schema, from local files or the Hugging Face Hub.

:func:`load_benchmark` returns records ``{id, question, answer, source}`` (all str; ``source`` is the
benchmark name) plus a few benchmark-specific extra keys. Gold answers per benchmark (field names as
in /work/shared/data/SOURCES.md):

==============  ===================  ===================================================================
name            question field       gold answer
==============  ===================  ===================================================================
aime24          ``problem``          ``answer`` (str)
amc23           ``problem``          ``answer`` (a float such as 27.0, written "27"; non-integers as
                                     Python's shortest float repr)
math500         ``problem``          ``answer`` (str)
minerva_math    ``problem``          the last ``\\boxed{}`` of ``solution`` (:func:`oar.reward.answer.extract_boxed`)
olympiadbench   ``question``         ``final_answer`` (a list): its items joined with ", "; the list is
                                     kept in the extra key ``answers``. Items are kept as written
                                     (often ``$...$``-wrapped LaTeX).
gsm8k           ``question``         the number after the last ``####`` of ``answer``, commas removed;
                                     the reference solution, rewritten to end in ``\\boxed{answer}``
                                     (:func:`gsm8k_solution`), in the extra key ``solution`` (the target
                                     of a format warm-up SFT)
math_train      ``problem``          ``answer`` (str). Filter ``levels`` (e.g. ``[3, 4, 5]``) keeps records
                                     whose float ``difficulty`` is one of them (extra key ``level``,
                                     an int). Records with an empty or null answer are DROPPED (4 in
                                     the DeepScaleR file, all at levels 3 and 5).
==============  ===================  ===================================================================

Where ``problem`` is named, ``question`` is accepted as a fallback (aime24 and amc23 carry both).
``id`` is ``"<name>-<own id>"`` using the file's own id (aime24/amc23/olympiadbench ``id``,
math500 ``unique_id``, minerva_math ``idx``) or ``"<name>-<index>"`` with the 0-based position in
the file (gsm8k, math_train; positions count every record, so filtering leaves ids unchanged).

Sources: a local ``.jsonl``, ``.json`` (an array of records, or an object whose values are records)
or ``.parquet`` file; a folder holding the benchmark's default file (``test.jsonl``, or
``train.jsonl`` for math_train), as in /work/shared/data/<name>/; or a Hugging Face dataset id
(``owner/name``), loaded with ``datasets.load_dataset`` only when ``datasets`` is importable, the hub
is not switched off (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) and a quick connection to the hub
succeeds. Otherwise the hub id fails at once with a message asking for a local path in the config.

The synthetic splits are registered too (``synthetic-train``, ``synthetic-test``,
``synthetic-ood``): ``load_benchmark("synthetic-test", None, n=200, seed=0, **task_options)`` calls
:func:`oar.data.synthetic.generate`, so evaluation has one entry point for every benchmark.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlparse

from oar.reward.answer import extract_boxed
from oar.data import synthetic
from oar.core.io import read_jsonl

__all__ = [
    "BENCHMARKS",
    "SYNTHETIC_BENCHMARKS",
    "BENCHMARK_NAMES",
    "HubUnavailableError",
    "load_benchmark",
    "load_benchmark_located",
    "require_records",
]


class HubUnavailableError(RuntimeError):
    """A benchmark source is a hub id but the Hugging Face Hub cannot be used here."""


@dataclass(frozen=True)
class _Spec:
    question_keys: tuple[str, ...]
    answer: Callable[[dict, str], tuple[str | None, dict]]  # (record, where) -> (answer or None to drop, extras)
    id_key: str | None
    default_file: str
    hub_split: str
    hub_subset: str | None = None
    filters: tuple[str, ...] = ()


def _require(rec: dict, key: str, where: str) -> Any:
    if key not in rec:
        raise ValueError(f"{where}: record has no {key!r} field")
    return rec[key]


def _scalar_str(value: Any, key: str, where: str) -> str:
    """A gold value as text: str stripped; int as is; integral float without '.0'."""
    if isinstance(value, str):
        out = value.strip()
    elif isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: field {key!r} is {value!r}, expected a string or number")
    elif isinstance(value, int):
        out = str(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: field {key!r} is {value!r}")
        out = str(int(value)) if value.is_integer() else repr(value)
    elif hasattr(value, "item"):  # numpy scalar from parquet
        return _scalar_str(value.item(), key, where)
    else:
        raise ValueError(f"{where}: field {key!r} has type {type(value).__name__}, expected a string or number")
    if not out:
        raise ValueError(f"{where}: field {key!r} is empty")
    return out


def _plain_answer(rec: dict, where: str) -> tuple[str | None, dict]:
    return _scalar_str(_require(rec, "answer", where), "answer", where), {}


def _minerva_answer(rec: dict, where: str) -> tuple[str | None, dict]:
    sol = _require(rec, "solution", where)
    ans = extract_boxed(sol) if isinstance(sol, str) else None
    if not ans:
        raise ValueError(f"{where}: field 'solution' has no non-empty \\boxed{{}} answer")
    return ans, {}


def _olympiad_answer(rec: dict, where: str) -> tuple[str | None, dict]:
    raw = _require(rec, "final_answer", where)
    if hasattr(raw, "tolist"):
        raw = raw.tolist()
    items = [raw] if isinstance(raw, str) else list(raw) if isinstance(raw, (list, tuple)) else None
    if items is None:
        raise ValueError(f"{where}: field 'final_answer' has type {type(raw).__name__}, expected a list of str")
    answers = [_scalar_str(x, "final_answer", where) for x in items]
    if not answers:
        raise ValueError(f"{where}: field 'final_answer' is an empty list")
    return ", ".join(answers), {"answers": answers}


_GSM8K_MARK = "####"


#: GSM8K's calculator annotations, ``<<48/2=24>>``, removed from its solutions.
_GSM8K_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k_solution(text: str, answer: str) -> str:
    """GSM8K's reference ``answer`` field as a solution that ends the way the reward reads it.

    The calculator annotations (``<<48/2=24>>``) are removed and the final ``#### N`` line is replaced
    by ``The final answer is $\\boxed{N}$.``, so a model fine-tuned on it boxes its answer.

    >>> gsm8k_solution("She sold 48/2 = <<48/2=24>>24 clips.\\n#### 24", "24")
    'She sold 48/2 = 24 clips.\\nThe final answer is $\\\\boxed{24}$.'
    """
    body = _GSM8K_CALC.sub("", text.rsplit(_GSM8K_MARK, 1)[0]).strip()
    final = f"The final answer is $\\boxed{{{answer}}}$."
    return f"{body}\n{final}" if body else final


def _gsm8k_answer(rec: dict, where: str) -> tuple[str | None, dict]:
    text = _require(rec, "answer", where)
    if not isinstance(text, str) or _GSM8K_MARK not in text:
        raise ValueError(f"{where}: field 'answer' has no {_GSM8K_MARK!r} final answer")
    ans = text.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
    if not ans:
        raise ValueError(f"{where}: field 'answer' is empty after {_GSM8K_MARK!r}")
    return ans, {"solution": gsm8k_solution(text, ans)}


def _math_train_answer(rec: dict, where: str) -> tuple[str | None, dict]:
    raw = _require(rec, "answer", where)
    diff = _require(rec, "difficulty", where)
    if isinstance(diff, bool) or not isinstance(diff, (int, float)) or not float(diff).is_integer():
        raise ValueError(f"{where}: field 'difficulty' is {diff!r}, expected an integral number")
    extras = {"level": int(diff)}
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None, extras  # dropped: no gold answer to reward against
    return _scalar_str(raw, "answer", where), extras


#: The real benchmarks and how their records are read.
BENCHMARKS: dict[str, _Spec] = {
    "aime24": _Spec(("problem", "question"), _plain_answer, "id", "test.jsonl", "train"),
    "amc23": _Spec(("problem", "question"), _plain_answer, "id", "test.jsonl", "train"),
    "math500": _Spec(("problem",), _plain_answer, "unique_id", "test.jsonl", "test"),
    "minerva_math": _Spec(("problem",), _minerva_answer, "idx", "test.jsonl", "test"),
    "olympiadbench": _Spec(("question",), _olympiad_answer, "id", "test.jsonl", "train"),
    "gsm8k": _Spec(("question",), _gsm8k_answer, None, "test.jsonl", "test", "main"),
    "math_train": _Spec(("problem",), _math_train_answer, None, "train.jsonl", "train", None, ("levels",)),
}
#: Synthetic splits, generated by :func:`oar.data.synthetic.generate`.
SYNTHETIC_BENCHMARKS: tuple[str, ...] = tuple(f"synthetic-{s}" for s in synthetic.SPLITS)
#: Every name :func:`load_benchmark` accepts.
BENCHMARK_NAMES: tuple[str, ...] = tuple(BENCHMARKS) + SYNTHETIC_BENCHMARKS

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_hub_id(source: str) -> bool:
    return bool(_HUB_ID_RE.match(source)) and not source.lower().endswith(LOCAL_SUFFIXES)


def _hub_offline_reason(connect_timeout_s: float) -> str | None:
    """Why the hub cannot be used now (None if it can): env switch, no ``datasets``, no connection."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]} is set"
    try:
        import datasets  # noqa: F401
    except ImportError:
        return "the 'datasets' package is not installed"
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=connect_timeout_s).close()
    except OSError as e:
        return f"cannot reach {host}:443 ({e.__class__.__name__}: {e})"
    return None


def _local_records(path: Path) -> Iterable[tuple[int, str, dict]]:
    """Yield ``(index, where, record)`` from a local file; ``where`` names file and line/record."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = read_jsonl(path)  # malformed or non-UTF-8 lines raise ValueError "<file>:<line>: ..."
        with open(path, encoding="utf-8") as f:
            linenos = [i for i, line in enumerate(f, 1) if line.strip()]
        for idx, (lineno, rec) in enumerate(zip(linenos, records)):
            yield idx, f"{path}:{lineno}", rec
    elif suffix == ".json":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = raw.count(b"\n", 0, e.start) + 1
            column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
            raise ValueError(
                f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte {column} of the line); "
                f"re-encode the file as UTF-8"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
        if isinstance(data, dict):
            items = [(f"{path}: record {k!r}", v) for k, v in data.items()]
        elif isinstance(data, list):
            items = [(f"{path}: record {i}", v) for i, v in enumerate(data)]
        else:
            raise ValueError(f"{path}: expected a JSON array or object of records, got {type(data).__name__}")
        for idx, (where, rec) in enumerate(items):
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            yield idx, where, rec
    elif suffix == ".parquet":
        import pandas as pd

        for idx, rec in enumerate(pd.read_parquet(path).to_dict("records")):
            yield idx, f"{path}: row {idx}", rec
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {list(LOCAL_SUFFIXES)}")


def _hub_records(name: str, source: str, split: str, subset: str | None) -> Iterable[tuple[int, str, dict]]:
    import datasets

    ds = datasets.load_dataset(source, subset, split=split)
    for idx, rec in enumerate(ds):
        yield idx, f"{source}[{split}] record {idx}", dict(rec)


def _convert(name: str, spec: _Spec, rows: Iterable[tuple[int, str, dict]],
             levels: set[int] | None) -> list[tuple[str, dict]]:
    """The records of ``rows`` (``(index, where, raw record)``) in the one schema, each with its ``where``."""
    out = []
    for idx, where, rec in rows:
        qkey = next((k for k in spec.question_keys if k in rec), None)
        if qkey is None:
            raise ValueError(f"{where}: record has no {spec.question_keys[0]!r} field")
        question = rec[qkey]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: field {qkey!r} is empty or not a string")
        answer, extras = spec.answer(rec, where)
        if levels is not None and extras.get("level") not in levels:
            continue
        if answer is None:
            continue
        own = rec.get(spec.id_key) if spec.id_key else None
        if hasattr(own, "item"):
            own = own.item()
        rid = f"{name}-{own if own is not None and own != '' else idx}"
        out.append((where, {"id": rid, "question": question, "answer": answer, "source": name, **extras}))
    return out


def load_benchmark(
    name: str,
    source: str | os.PathLike | None,
    *,
    split: str | None = None,
    subset: str | None = None,
    connect_timeout_s: float = 3.0,
    **options: Any,
) -> list[dict]:
    """Load benchmark ``name`` from ``source`` as records ``{id, question, answer, source, ...}``
    (:func:`load_benchmark_located` without the places)."""
    return [rec for _, rec in load_benchmark_located(name, source, split=split, subset=subset,
                                                     connect_timeout_s=connect_timeout_s, **options)]


def load_benchmark_located(
    name: str,
    source: str | os.PathLike | None,
    *,
    split: str | None = None,
    subset: str | None = None,
    connect_timeout_s: float = 3.0,
    **options: Any,
) -> list[tuple[str, dict]]:
    """Load benchmark ``name`` from ``source`` as ``(where, record)`` pairs, in file order: the records
    ``{id, question, answer, source, ...}`` and where each was read, for messages about one record:
    ``<file>:<line>`` (.jsonl), ``<file>: record <key or index>`` (.json), ``<file>: row <i>``
    (.parquet), ``<id>[<split>] record <i>`` (hub), ``<name> record <i> (generated)`` (synthetic).

    Args:
        name: one of :data:`BENCHMARK_NAMES`.
        source: a local file or folder, or a Hugging Face dataset id (see the module docstring);
            None for the synthetic splits.
        split, subset: hub split and config name (defaults per benchmark, e.g. gsm8k "main"/"test");
            ignored for local files.
        connect_timeout_s: timeout of the quick connection check before using the hub.
        **options: ``levels`` (math_train: keep these MATH levels, e.g. ``[3, 4, 5]``); for the
            synthetic splits ``n``, ``seed`` and the task options of :func:`oar.data.synthetic.generate`.

    Raises:
        ValueError: unknown name (lists the valid ones), malformed file line or record (names file
            and line, and the missing key).
        TypeError: an option the benchmark does not take.
        FileNotFoundError: ``source`` does not exist and is not a hub id.
        HubUnavailableError: ``source`` is a hub id but the hub cannot be used (offline).
    """
    if name in SYNTHETIC_BENCHMARKS:
        if source is not None:
            raise ValueError(f"benchmark {name!r} is generated, its source must be None, got {source!r}")
        if split is not None or subset is not None:
            raise TypeError(f"benchmark {name!r} is generated; 'split'/'subset' do not apply (the name picks the split)")
        if "n" not in options or "seed" not in options:
            raise TypeError(f"benchmark {name!r} needs the options 'n' and 'seed'")
        n, seed = options.pop("n"), options.pop("seed")
        return [(f"{name} record {i} (generated)", rec)
                for i, rec in enumerate(synthetic.generate(name.split("-", 1)[1], n, seed=seed, **options))]
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {list(BENCHMARK_NAMES)}")
    spec = BENCHMARKS[name]
    unknown = sorted(set(options) - set(spec.filters))
    if unknown:
        raise TypeError(f"benchmark {name!r} got unknown option(s) {unknown}; it takes {list(spec.filters)}")
    levels: set[int] | None = None
    if options.get("levels") is not None:
        lv: Sequence[Any] = options["levels"]
        if isinstance(lv, (str, bytes)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lv):
            raise ValueError(f"levels: expected a list of ints, got {lv!r}")
        levels = set(lv)
    if source is None:
        raise ValueError(f"benchmark {name!r}: no source given; set a local path for {name} in the config")

    path = Path(source)
    if path.is_dir():
        path = path / spec.default_file
        if not path.exists():
            raise FileNotFoundError(f"benchmark {name!r}: folder {source} has no {spec.default_file}")
    if path.exists():
        return _convert(name, spec, _local_records(path), levels)
    src = str(source)
    if not looks_like_hub_id(src):
        raise FileNotFoundError(f"benchmark {name!r}: source not found: {src}")
    reason = _hub_offline_reason(connect_timeout_s)
    if reason is not None:
        raise HubUnavailableError(
            f"benchmark {name!r}: {src!r} is not a local path and looks like a Hugging Face dataset id, "
            f"but the hub cannot be used ({reason}); set a local path (.jsonl/.json/.parquet file or folder) "
            f"for benchmark {name!r} in the config"
        )
    return _convert(name, spec, _hub_records(name, src, split or spec.hub_split, subset or spec.hub_subset), levels)


def require_records(records: list[dict], name: str, source: str | os.PathLike | None, *, key: str,
                    **options: Any) -> list[dict]:
    """``records`` when there is at least one; else ValueError naming the config ``key``, the
    benchmark, its file (a folder source resolved to its default file) and the filters applied.

    For callers that cannot use an empty set (training, evaluation), so that ``oar data`` fails
    before any training instead of the evaluation failing after it.
    """
    if records:
        return records
    where = "" if source is None else str(source)
    spec = BENCHMARKS.get(name)
    if source is not None and spec is not None and Path(source).is_dir():
        where = str(Path(source) / spec.default_file)
    filters = {k: v for k, v in options.items() if v is not None}
    after = f" after filters {filters}" if filters else ""
    raise ValueError(f"{key}: benchmark {name!r} has no records{after}" + (f" in {where}" if where else "")
                     + "; it needs at least one")
