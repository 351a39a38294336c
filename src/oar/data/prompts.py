"""Prompt templates: turn a question into the text the policy is conditioned on.

- ``qwen_boxed``: the question followed by :data:`BOXED_INSTRUCTION` (the Qwen2.5-Math eval
  instruction), put inside the tokenizer's chat template as one user turn with
  ``apply_chat_template(..., tokenize=False, add_generation_prompt=True)`` when the tokenizer has a
  ``chat_template``; otherwise the plain text ``question + instruction + "\\n"``.
- ``plain``: ``"Question: <question>\\nAnswer: "`` (base models without a chat template).
- ``tiny``: ``"<question>\\n"`` for the character-level tiny model trained on the synthetic task
  (e.g. ``"Compute 47+18-25.\\n"``); the response (the solution) follows the newline.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TEMPLATES", "BOXED_INSTRUCTION", "render_prompt"]

#: Instruction appended to the question by the ``qwen_boxed`` template.
BOXED_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."

#: Names accepted by :func:`render_prompt`.
TEMPLATES: tuple[str, ...] = ("qwen_boxed", "plain", "tiny")


def render_prompt(template: str, question: str, tokenizer: Any = None) -> str:
    """Render ``question`` with the named ``template`` (see the module docstring).

    Args:
        template: one of :data:`TEMPLATES`.
        question: the problem text.
        tokenizer: a Hugging Face tokenizer; only ``qwen_boxed`` uses it, and only when its
            ``chat_template`` is set.

    Raises:
        ValueError: unknown template name (the message lists the valid ones).
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {list(TEMPLATES)}")
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    if template == "tiny":
        return question + "\n"
    if template == "plain":
        return f"Question: {question}\nAnswer: "
    content = question + BOXED_INSTRUCTION
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return content + "\n"
