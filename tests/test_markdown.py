"""The markdown-table writer (oar.core.markdown): hand-written expected lines."""

from __future__ import annotations

import pytest

from oar.core.markdown import markdown_row, markdown_table


def test_markdown_table_lines():
    lines = markdown_table(["Method", "avg@8", "note"], [["GRPO", 23.3, "x"], ["oracle", "+0.7 [-2.3, +3.6]", ""]], "lrl")
    assert lines == [
        "| Method | avg@8 | note |",
        "|---|---:|---|",
        "| GRPO | 23.3 | x |",
        "| oracle | +0.7 [-2.3, +3.6] | |",
    ]


def test_markdown_row_empty_cells_are_one_space():
    assert markdown_row(["", "a", ""]) == "| | a | |"
    assert markdown_row([]) == "||"


@pytest.mark.parametrize("align", ["lr", "lrx", "lrrr"])
def test_markdown_table_refuses_a_wrong_alignment(align):
    with pytest.raises(ValueError, match="one 'l' or 'r' per column"):
        markdown_table(["a", "b", "c"], [], align)


def test_markdown_table_refuses_a_short_row():
    with pytest.raises(ValueError, match="a row of 2 cells under 3 columns"):
        markdown_table(["a", "b", "c"], [["1", "2"]], "lrr")
