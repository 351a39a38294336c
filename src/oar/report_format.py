"""The old import name of :mod:`oar.report.render` (the rendering of ``main.md`` / ``main.tex``), kept."""

from oar.report.render import (  # noqa: F401
    __all__,
    _fmt_cell,
    _fmt_diff,
    _fmt_seeds,
    main_latex,
    main_markdown,
    metric_title,
    wide,
)
