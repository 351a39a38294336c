"""Tests for the prompt templates (oar.data.prompts)."""

from __future__ import annotations

import pytest

from oar.data.prompts import BOXED_INSTRUCTION, TEMPLATES, render_prompt

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = chat_template
    return tok


def test_templates_listed():
    assert set(TEMPLATES) == {"qwen_boxed", "plain", "tiny"}


def test_tiny():
    assert render_prompt("tiny", "Compute 47+18-25.") == "Compute 47+18-25.\n"


def test_plain():
    assert render_prompt("plain", "What is 1+1?") == "Question: What is 1+1?\nAnswer: "


def test_qwen_boxed_with_chat_template():
    out = render_prompt("qwen_boxed", "What is 1+1?", _tokenizer(CHATML))
    assert out == (
        "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen_boxed_without_chat_template_is_plain_text():
    expected = "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.\n"
    assert BOXED_INSTRUCTION == "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert render_prompt("qwen_boxed", "What is 1+1?") == expected
    assert render_prompt("qwen_boxed", "What is 1+1?", _tokenizer(None)) == expected


def test_unknown_template_lists_valid_names():
    with pytest.raises(ValueError) as e:
        render_prompt("chatml", "q")
    assert all(name in str(e.value) for name in TEMPLATES)
    with pytest.raises(TypeError):
        render_prompt("tiny", None)  # type: ignore[arg-type]
