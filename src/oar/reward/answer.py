"""Locating final answers in model outputs and reference solutions.

Model outputs are untrusted: these functions never raise on odd text, they return None.
"""

from __future__ import annotations

__all__ = ["BOXED_MARKERS", "last_boxed_span", "extract_boxed"]

#: Markers that open a boxed answer; the content runs to the matching closing brace.
BOXED_MARKERS: tuple[str, ...] = ("\\boxed{", "\\fbox{")


def last_boxed_span(text: str, markers: tuple[str, ...] = BOXED_MARKERS) -> tuple[int, int] | None:
    """Character span ``(start, end)`` of the content of the last ``\\boxed{...}`` in ``text``.

    ``text[start:end]`` is the content between the braces (nested braces are matched). Returns
    None when there is no marker or its closing brace is missing (a truncated response).

    >>> t = r"so \\boxed{\\frac{1}{2}}."
    >>> s, e = last_boxed_span(t); t[s:e]
    '\\\\frac{1}{2}'
    """
    best = -1
    marker = ""
    for m in markers:
        i = text.rfind(m)
        if i > best:
            best, marker = i, m
    if best < 0:
        return None
    start = best + len(marker)
    depth = 1
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return start, j
    return None


def extract_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` of ``text``, stripped; None if there is none."""
    if not text:
        return None
    span = last_boxed_span(text)
    if span is None:
        return None
    return text[span[0] : span[1]].strip()
