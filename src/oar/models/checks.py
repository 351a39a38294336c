"""A model's files checked before anything loads them: the folder (or GGUF file) is whole, its
``config.json`` and tokenizer read, its weights present (safetensors headers), and the tokenizer's
vocabulary fits the model's; every failure one line (:class:`ModelLoadError`) naming the file and
what to do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from oar.models.fetch import HUB_MODEL_ID as _HUB_ID, TOKENIZER_JSON, no_tokenizer_reason
from oar.models.tiny import resolve_source

__all__ = ["ModelLoadError", "check_model_files", "check_vocab"]


class ModelLoadError(ValueError):
    """A local model cannot be loaded: a file is truncated, corrupt, missing, or not the format its
    name says. The message names the file (or the folder, for a missing file) and what to do."""


#: How many of a JSON file's keys a message lists.
_KEYS_SHOWN = 5
#: What to do about a model that cannot be loaded.
_MODEL_HINT = "Put back a complete copy of the model (save_pretrained, or download it again) or give another model."
#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: Bytes of a GGUF header: the magic, a uint32 version, a uint64 tensor count and a uint64 count of
#: metadata entries.
GGUF_HEADER_BYTES = len(GGUF_MAGIC) + 4 + 8 + 8
#: The weights a Hugging Face folder may hold for a PyTorch model, in the order transformers looks
#: for them: one safetensors file, a sharded one (its index), a pickled one, a sharded pickled one.
WEIGHT_FILES: tuple[str, ...] = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                 "pytorch_model.bin.index.json")
#: The file that says which tokenizer class reads a folder's vocabulary files.
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
#: JSON files of a model folder that the loaders read when present; each must be a JSON object.
MODEL_JSON_FILES: tuple[str, ...] = ("config.json", "generation_config.json", TOKENIZER_JSON,
                                     TOKENIZER_CONFIG_JSON, "special_tokens_map.json",
                                     "model.safetensors.index.json", "pytorch_model.bin.index.json")


def model_error(path: str | os.PathLike, reason: str) -> ModelLoadError:
    """The error for the file (or folder) ``path`` of a model that cannot be loaded for ``reason``."""
    return ModelLoadError(f"{path}: cannot load the model: {reason}. {_MODEL_HINT}")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; :class:`ModelLoadError` naming the file when it is anything else."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise model_error(path, "not valid UTF-8 (it should be a JSON file)") from None
    except json.JSONDecodeError as e:
        raise model_error(path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict):
        raise model_error(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def tokenizer_file(folder: Path) -> Path:
    """The file of ``folder`` that its tokenizer is read from, for messages: ``tokenizer.json``, else
    ``tokenizer_config.json``, else the folder itself."""
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG_JSON):
        if (folder / name).is_file():
            return folder / name
    return folder


def _check_tokenizer_json(path: Path, obj: Mapping[str, Any]) -> None:
    """``tokenizer.json`` (``path``, read as ``obj``) has a ``model`` object (the tokenizer itself: its
    type and vocabulary), as the ``tokenizers`` library writes it."""
    if not isinstance(obj.get("model"), dict):
        keys = ", ".join(repr(k) for k in list(obj)[:_KEYS_SHOWN]) or "none"
        raise model_error(path, f"not a tokenizer file: it has no 'model' object (the tokenizer's type and "
                                 f"vocabulary), only the keys {keys}")


def config_vocab_size(config: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of a ``config.json`` (of its ``text_config`` for a multimodal model): the rows of
    the model's input embeddings; None when it does not say."""
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_tokenizer(name_or_path: str, *, gguf_file: str | None, trust_remote_code: bool,
                    local_files_only: bool = False):
    """``AutoTokenizer.from_pretrained`` of a local folder (or a GGUF file in it) or a hub id; for a
    local path whatever the loader raises becomes a :class:`ModelLoadError` naming the tokenizer's file
    (:func:`tokenizer_file`, or the GGUF file). A hub id's errors are left to the caller."""
    from transformers import AutoTokenizer

    kw: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": local_files_only}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    path = Path(name_or_path)
    if not path.exists():
        return AutoTokenizer.from_pretrained(name_or_path, **kw)
    try:
        return AutoTokenizer.from_pretrained(str(path), **kw)
    except Exception as e:
        if isinstance(e, MemoryError):  # the machine's limit, not the files'
            raise
        where = path / gguf_file if gguf_file else tokenizer_file(path)
        raise model_error(where, f"the tokenizer does not load ({type(e).__name__}: "
                                  f"{first_line(e).rstrip('.')})") from e


def check_vocab(tokenizer: Any, rows: int, *, tokenizer_at: str, model_at: str) -> None:
    """That every id ``tokenizer`` can give has a row in the model's input embeddings (``rows``): it has
    at most ``rows`` tokens and no special token's id is ``rows`` or more. A tokenizer with fewer tokens
    than rows is fine (Qwen2.5 pads its embeddings to a multiple of 64).

    Args:
        tokenizer_at: where the tokenizer comes from (its file or folder), for the message.
        model_at: where the model's embedding size comes from (its ``config.json``, GGUF file, ...).

    Raises:
        ModelLoadError: naming both and what to do; otherwise token ids past the embeddings are an
            ``IndexError`` (or a device-side assert) in the first forward of evaluation or SFT.
    """
    n = len(tokenizer)
    special = [int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None]
    top = max([n - 1, *special])
    if top < rows:
        return
    raise ModelLoadError(
        f"{tokenizer_at}: the tokenizer has {n} tokens (ids up to {top}) but the model ({model_at}) has {rows} "
        f"embedding rows, so ids from {rows} up would index past its embeddings: they do not belong together. "
        f"Use the tokenizer saved with this model, or resize the model's embeddings to the tokenizer "
        f"(model.resize_token_embeddings(len(tokenizer)), then save_pretrained both)")


def _check_gguf(path: Path) -> None:
    """A GGUF file that starts with the GGUF magic bytes and holds a whole header."""
    with open(path, "rb") as f:
        head = f.read(GGUF_HEADER_BYTES)
    if not head.startswith(GGUF_MAGIC):
        raise model_error(path, f"not a GGUF file (it does not start with the GGUF magic bytes {GGUF_MAGIC!r})")
    if len(head) < GGUF_HEADER_BYTES:
        raise model_error(path, f"{len(head)} bytes, shorter than a GGUF header ({GGUF_HEADER_BYTES}): truncated")


def _check_weights(folder: Path) -> None:
    """The folder's weights exist, and every safetensors file of them is whole."""
    from oar.core.io import safetensors_problem

    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: give that file itself, or set model.gguf_file)" if ggufs else ""
        raise model_error(folder, f"no weights: none of {', '.join(WEIGHT_FILES)}{hint}")
    name = present[0]
    if name.endswith(".index.json"):
        weight_map = read_json_object(folder / name).get("weight_map")
        if not isinstance(weight_map, dict):
            raise model_error(folder / name, "an index without a 'weight_map'")
        shards = sorted({str(v) for v in weight_map.values()})
    else:
        shards = [name]
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise model_error(path, f"missing (listed in {name})")
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
            if problem is not None:
                raise model_error(path, problem)


def local_model_path(source: str, gguf_file: str | None, *, key: str = "model.source") -> Path | None:
    """The local ``.gguf`` file or model folder ``source`` names; None when it is a hub id.

    Raises:
        FileNotFoundError: ``source`` is neither an existing path nor a hub id ``org/name``, or the
            folder has no ``gguf_file``.
        ValueError: ``source`` is a file but not a ``.gguf``.
    """
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{key}: {path} is a file but not a .gguf; give a model folder or a .gguf file")
        return path
    if path.is_dir():
        if gguf_file and not (path / gguf_file).is_file():
            raise FileNotFoundError(f"model.gguf_file: {path / gguf_file} does not exist")
        return path
    if _HUB_ID.match(source) and not source.startswith((".", "~")):
        return None
    raise FileNotFoundError(f"{key}: {source!r} does not exist (and is not 'tiny' or a hub id 'org/name')")


def check_model_files(spec: Mapping[str, Any] | str | os.PathLike, *, key: str = "model.source") -> None:
    """Check the files of the local model ``spec`` names, without loading its weights (their headers
    only; the tokenizer is loaded, which is cheap).

    - a ``.gguf`` file (or ``gguf_file`` in a folder): the GGUF magic bytes and a whole header;
    - a Hugging Face folder: every JSON file the loaders read (:data:`MODEL_JSON_FILES`, ``config.json``
      required) is a JSON object (``tokenizer.json`` with its ``model`` object), the weights exist
      (:data:`WEIGHT_FILES`; a sharded index's every shard) and every safetensors file among them has
      a whole header and the size it describes, and a tokenizer exists
      (:data:`oar.models.fetch.TOKENIZER_VOCAB_FILES`), loads (without the weights) and gives no id past
      ``config.json``'s ``vocab_size`` (:func:`check_vocab`); the tokenizer is not checked with
      ``trust_remote_code``, whose code may load it from elsewhere.

    ``"tiny"`` and a hub id are left to :func:`load_policy`. ``key``: the config key or option the
    source came from (``model.source``, ``train.init``, ``--init``), for the messages.

    Raises:
        FileNotFoundError: ``source`` is neither an existing path nor a hub id, or ``gguf_file`` is missing.
        ValueError: ``source`` is a file but not a ``.gguf``.
        ModelLoadError: naming the first file that cannot be loaded (the folder, for a missing
            file) and what to do.
    """
    if isinstance(spec, (str, os.PathLike)):
        spec = {"source": os.fspath(spec)}
    source = resolve_source(os.fspath(spec.get("source") or ""))
    if not source or source == "tiny":
        return
    gguf_file = spec.get("gguf_file")
    path = local_model_path(source, gguf_file, key=key)
    if path is None:
        return
    if path.is_file():
        _check_gguf(path)
        return
    if gguf_file:
        _check_gguf(path / gguf_file)
        return
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: give that file itself, or set model.gguf_file)" if ggufs else ""
        raise model_error(path, f"no config.json: not a Hugging Face model folder{hint}")
    read = {name: read_json_object(path / name) for name in MODEL_JSON_FILES if (path / name).is_file()}
    if TOKENIZER_JSON in read:
        _check_tokenizer_json(path / TOKENIZER_JSON, read[TOKENIZER_JSON])
    _check_weights(path)
    if not spec.get("trust_remote_code"):
        reason = no_tokenizer_reason(path)
        if reason is not None:
            raise model_error(path, reason)
        rows = config_vocab_size(read["config.json"])
        tokenizer = read_tokenizer(str(path), gguf_file=None, trust_remote_code=False)
        if rows is not None:
            check_vocab(tokenizer, rows, tokenizer_at=str(tokenizer_file(path)),
                        model_at=f"{path / 'config.json'}, vocab_size {rows}")
