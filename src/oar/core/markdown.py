"""GitHub markdown tables: the one writer behind every table the reports print (main.md, the
efficiency and learning-speed tables, the regime map, the attribution tables, ``oar compare``).

Callers format their cells (numbers, intervals, bold) and name each column's alignment; this module
only lays the cells out, so every table has the same spacing and separator line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_row", "markdown_table"]

#: The separator cell of a column by its alignment: ``l`` left (the default), ``r`` right.
_SEPARATOR = {"l": "---", "r": "---:"}


def markdown_row(cells: Sequence[object]) -> str:
    """One table line: ``| a | b |``; an empty cell is one space (``| | b |``)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """The lines of a table: ``header``, the separator, then one line per row of ``rows``.

    Args:
        header: the column names.
        rows: the cells of each row, already formatted (``str`` is applied to each).
        align: one letter per column, ``l`` (left) or ``r`` (right), e.g. ``"lrr"``.

    Raises:
        ValueError: ``align`` is not one ``l``/``r`` per column, or a row has another number of cells.
    """
    if len(align) != len(header) or set(align) - set(_SEPARATOR):
        raise ValueError(f"markdown_table: align {align!r} needs one 'l' or 'r' per column ({len(header)})")
    lines = [markdown_row(header), "|" + "|".join(_SEPARATOR[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"markdown_table: a row of {len(row)} cells under {len(header)} columns: {list(row)!r}")
        lines.append(markdown_row(row))
    return lines
