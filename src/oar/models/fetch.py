"""A hub model fetched once, before any job reads it (the workflow's rule ``fetch_model``).

A ``model.source`` that is a Hugging Face hub id (``org/name``, not an existing local folder or
file) would otherwise be downloaded by every job that loads the model, on compute nodes that often
cannot reach the hub. The workflow instead runs :func:`fetch_model` once, on the submitting host,
into ``<models_dir>/<org>--<name>/`` (``models_dir`` null: ``<results_dir>/models``; see
:func:`hub_model`), and every job reads that folder.

The download is atomic and resumable: files go into ``.<org>--<name>.partial`` beside the folder
(``huggingface_hub.snapshot_download`` with ``local_dir``, which resumes an interrupted download),
then :data:`MARKER` is written into it and it is renamed onto the folder (:func:`oar.core.io.commit_path`),
so the folder is complete or absent. When the hub cannot be reached, a complete copy in the local
Hugging Face cache is used (hard-linked where possible); otherwise :class:`ModelFetchError` says,
in one line, what to do.

Nothing here imports torch: the workflow calls :func:`hub_model` while it loads.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "HUB_MODEL_ID",
    "SYMBOLIC_SOURCES",
    "MARKER",
    "MODELS_SUBDIR",
    "ModelFetchError",
    "HubModel",
    "TOKENIZER_JSON",
    "TOKENIZER_VOCAB_FILES",
    "is_hub_model_id",
    "no_tokenizer_reason",
    "models_dir",
    "hub_model",
    "with_fetched_model",
    "fetch_model",
]

#: A hub model id, ``org/name`` (what :func:`oar.models.loading.load_policy` downloads).
HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
#: ``model.source`` values that name a builder or a packaged file (:func:`oar.models.tiny.resolve_source`).
SYMBOLIC_SOURCES: tuple[str, ...] = ("tiny", "smollm2")
#: The fast tokenizer's file (the ``tokenizers`` library's JSON).
TOKENIZER_JSON = "tokenizer.json"
#: Files of which a model folder's tokenizer needs one (``fnmatch`` globs): the fast tokenizer's
#: ``tokenizer.json``, a sentencepiece ``*.model``, a BPE/WordPiece vocabulary, a tiktoken file (each
#: beside ``tokenizer_config.json``, which says which tokenizer reads it). A GGUF file carries its own.
TOKENIZER_VOCAB_FILES: tuple[str, ...] = (TOKENIZER_JSON, "*.model", "vocab.json", "vocab.txt", "*.tiktoken")
#: The file that marks a fetched folder complete (the workflow's output of rule fetch_model).
MARKER = "oar_fetch.json"
#: The folder under ``results_dir`` that fetched models go to when ``models_dir`` is null.
MODELS_SUBDIR = "models"


class ModelFetchError(FileNotFoundError):
    """A hub model cannot be fetched here; the one-line message names ``model.source`` and what to do."""


def is_hub_model_id(source: str) -> bool:
    """Whether ``source`` reads as a hub id ``org/name`` rather than a path (``./x/y``, ``~/x``)."""
    return bool(HUB_MODEL_ID.match(source)) and not source.startswith((".", "~"))


def no_tokenizer_reason(folder: str | os.PathLike) -> str | None:
    """Why the Hugging Face model folder ``folder`` has no tokenizer to load (none of
    :data:`TOKENIZER_VOCAB_FILES` in it) and what to do; None when it has one. The one rule that
    :func:`oar.models.checks.check_model_files` and the pre-flight (:mod:`oar.pipeline.preflight`) apply."""
    import fnmatch

    names = [p.name for p in Path(folder).iterdir() if p.is_file()]
    if any(fnmatch.fnmatch(n, g) for n in names for g in TOKENIZER_VOCAB_FILES):
        return None
    return (f"no tokenizer: none of {', '.join(TOKENIZER_VOCAB_FILES)} (save the tokenizer beside the model: "
            f"tokenizer.save_pretrained)")


@dataclass(frozen=True)
class HubModel:
    """A hub ``model.source`` and the local folder it is fetched into.

    Attributes:
        repo_id: the hub id (``Qwen/Qwen2.5-Math-7B``).
        folder: ``<models_dir>/<org>--<name>`` (as the config names it: relative or absolute).
        gguf_file: ``model.gguf_file``: only that file of the repository is fetched.
    """

    repo_id: str
    folder: str
    gguf_file: str | None = None

    @property
    def marker(self) -> str:
        """The file written last, inside the folder (the workflow's output of rule fetch_model)."""
        return f"{self.folder}/{MARKER}"

    @property
    def source(self) -> str:
        """What a job loads instead of the hub id: the folder, or its GGUF file."""
        return f"{self.folder}/{self.gguf_file}" if self.gguf_file else self.folder


def models_dir(config: Mapping[str, Any]) -> str:
    """``models_dir``, or ``<results_dir>/models`` when it is null (a validated config)."""
    return config["models_dir"] or f"{config['results_dir']}/{MODELS_SUBDIR}"


def hub_model(config: Mapping[str, Any]) -> HubModel | None:
    """The :class:`HubModel` of ``config``'s ``model.source`` when it is a hub id; None for
    ``tiny``/``smollm2``, an existing local folder or file, or anything else that is not a hub id
    (a missing local path is :mod:`oar.pipeline.preflight`'s to report)."""
    m = config["model"]
    source = str(m["source"])
    if source in SYMBOLIC_SOURCES or Path(source).expanduser().exists() or not is_hub_model_id(source):
        return None
    return HubModel(repo_id=source, folder=f"{models_dir(config)}/{source.replace('/', '--')}",
                    gguf_file=m["gguf_file"] or None)


def with_fetched_model(config: dict) -> dict:
    """``config`` with ``model.source`` (and ``model.gguf_file``) pointing at the fetched copy of a hub
    ``model.source`` when that copy is complete (its :data:`MARKER` exists); else ``config`` unchanged.

    For ``oar sft``, whose workflow rule waits for the fetch but passes no model path (a changed
    command would rerun every finished SFT); the other rules pass the folder itself.
    """
    hub = hub_model(config)
    if hub is None or not Path(hub.marker).is_file():
        return config
    return dict(config, model=dict(config["model"], source=hub.source, gguf_file=None))


# ------------------------------------------------------------------------------------ fetching


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _offline_reason(e: BaseException) -> str:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return f"{var}={os.environ[var]} is set"
    return _first_line(e)


def _refused(e: BaseException) -> bool:
    """The hub answered and refused (no such repository, gated, no access), rather than being unreachable."""
    try:
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # older huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    status = getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(e, HfHubHTTPError) and status is not None and int(status) < 500


def _link_or_copy(src: str, dst: str) -> str:
    """Hard-link ``src`` (resolved: the cache's files are links to its blobs) to ``dst``, else copy it."""
    real = os.path.realpath(src)
    if os.path.lexists(dst):  # a file of an earlier fetch
        if os.path.exists(dst) and os.path.samefile(real, dst):
            return dst
        os.unlink(dst)
    try:
        os.link(real, dst)
    except OSError:
        shutil.copy2(real, dst)
    return dst


def _from_cache(repo_id: str, partial: Path, patterns: list[str] | None) -> str | None:
    """Copy a complete snapshot of ``repo_id`` in the local Hugging Face cache into ``partial``;
    return its commit, or None when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns)
    except Exception:  # not cached (LocalEntryNotFoundError), or cached incompletely
        return None
    shutil.copytree(snapshot, partial, copy_function=_link_or_copy, dirs_exist_ok=True)
    return Path(snapshot).name


def _listing(folder: Path) -> dict[str, int]:
    """Every file below ``folder`` but the hub client's own metadata, with its size in bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not rel.startswith(".cache/") and rel != MARKER:
            out[rel] = p.stat().st_size
    return out


def fetch_model(repo_id: str, folder: str | os.PathLike, *, gguf_file: str | None = None,
                key: str = "model.source") -> dict[str, Any]:
    """Download the hub model ``repo_id`` (or only its ``gguf_file``) into ``folder``, atomically.

    From the hub when it answers (resuming a partial download beside ``folder``), else from a
    complete copy in the local Hugging Face cache. A ``folder`` left by an earlier fetch is the
    starting point (only what changed is downloaded again). :data:`MARKER` is written last:
    ``{"repo_id", "commit", "gguf_file", "origin": "hub" | "cache", "files": {path: bytes}}``
    (no time stamp: a refetch of the same commit writes the same marker).

    Returns:
        The marker's content.

    Raises:
        ModelFetchError: one line naming ``key`` and ``repo_id`` and what to do: the hub refused
            (no such repository, gated), it cannot be reached and the cache has no copy, or the
            download broke off (rerun to resume).
    """
    from huggingface_hub import HfApi, snapshot_download

    from oar.core.io import atomic_write_json, commit_path, recover_atomic_dir

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_atomic_dir(folder)
    partial = folder.with_name(f".{folder.name}.partial")
    if folder.is_dir() and any(folder.iterdir()):
        if partial.exists():
            shutil.rmtree(partial)
        os.replace(folder, partial)  # an earlier fetch: resume from it
    patterns = [gguf_file] if gguf_file else None
    what = f"{key} {repo_id!r}" + (f" (model.gguf_file {gguf_file!r})" if gguf_file else "")
    try:
        commit = HfApi().model_info(repo_id).sha
    except Exception as e:  # the hub client raises many types offline (OfflineModeIsEnabled, httpx errors, ...)
        if _refused(e):
            raise ModelFetchError(f"{what}: the Hugging Face hub refused it ({_first_line(e)}); check the id "
                                  f"(and HF_TOKEN for a gated model), or point {key} at a local model folder") from None
        commit = _from_cache(repo_id, partial, patterns)
        if commit is None:
            raise ModelFetchError(
                f"{what}: cannot download it: the Hugging Face hub cannot be reached ({_offline_reason(e)}) and the "
                f"local Hugging Face cache has no copy; download it where the hub is reachable (hf download "
                f"{repo_id} --local-dir <folder>) and point {key} at that folder, or run the workflow where the "
                f"hub is reachable") from None
        origin = "cache"
    else:
        try:
            snapshot_download(repo_id, revision=commit, local_dir=str(partial), allow_patterns=patterns)
        except Exception as e:
            raise ModelFetchError(f"{what}: the download into {partial} broke off ({_first_line(e)}); rerun to "
                                  f"resume it, or point {key} at a local model folder") from None
        origin = "hub"
    files = _listing(partial)
    if not files:
        raise ModelFetchError(f"{what}: the hub gave no files" + (f" matching {gguf_file!r}" if gguf_file else "")
                              + f"; check {'model.gguf_file' if gguf_file else key}")
    marker = {"repo_id": repo_id, "commit": commit, "gguf_file": gguf_file, "origin": origin, "files": files}
    atomic_write_json(partial / MARKER, marker)
    commit_path(partial, folder)
    return marker
