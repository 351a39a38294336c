"""Attribution benchmark (``oar attribution``): does a token-credit signal blame the mistake of a
wrong response, does it hold still, and what does it cost?

Modules:

- :mod:`~oar.attribution.stats`: rank statistics (AUROC, Spearman, top-k hit with random
  tie-breaking, median / IQR);
- :mod:`oar.task.parsing` and :mod:`oar.task.grammar` (the task layer below credit; their names
  are re-exported here): the task grammar parse of a response, token character spans, pivotal /
  filler token labels; the first arithmetic mistake of a response and exact counterfactual edits;
- :mod:`~oar.attribution.signals`: the credit signals (OAR-P, OAR-G variants, KTAE, random,
  uniform) as configurable specs;
- :mod:`~oar.attribution.metrics`: error localisation, stability, cost and pivotal-vs-filler
  fidelity tables;
- :mod:`~oar.attribution.benchmark`: the run (:func:`run_attribution`,
  :func:`attribution_from_config`);
- :mod:`~oar.attribution.report`: printed and markdown tables, figures, files.
"""

from oar.attribution.benchmark import attribution_from_config, run_attribution
from oar.attribution.settings import AttributionSettings, KINDS, AttributionResult
from oar.task.grammar import (
    STEP_STATUSES,
    Counterfactual,
    StepCheck,
    apply_op,
    check_steps,
    counterfactual_edit,
    draw_counterfactual,
    mistake_spans,
    question_terms,
)
from oar.attribution.metrics import (
    COST_COLUMNS,
    FIDELITY_COLUMNS,
    LOCALISATION_COLUMNS,
    STABILITY_COLUMNS,
    cost_table,
    fidelity_table,
    localisation_columns,
    localisation_table,
    stability_table,
)
from oar.task.parsing import (
    FILLER,
    PIVOTAL,
    UNLABELED,
    ParsedResponse,
    label_responses,
    parse_response,
    token_char_spans,
    token_labels,
)
from oar.attribution.report import (
    format_tables,
    frame_markdown,
    plot_cost_curve,
    plot_fidelity,
    plot_localisation,
    write_outputs,
)
from oar.attribution.signals import compute_signals
from oar.attribution.specs import SIGNAL_KINDS, SignalSpec, signal_specs
from oar.attribution.stats import auroc, average_ranks, spearman, summarize, topk_hit

__all__ = [
    "AttributionResult",
    "COST_COLUMNS",
    "Counterfactual",
    "AttributionSettings",
    "FIDELITY_COLUMNS",
    "FILLER",
    "KINDS",
    "LOCALISATION_COLUMNS",
    "PIVOTAL",
    "ParsedResponse",
    "SIGNAL_KINDS",
    "STABILITY_COLUMNS",
    "STEP_STATUSES",
    "SignalSpec",
    "StepCheck",
    "UNLABELED",
    "apply_op",
    "attribution_from_config",
    "auroc",
    "average_ranks",
    "check_steps",
    "compute_signals",
    "cost_table",
    "counterfactual_edit",
    "draw_counterfactual",
    "fidelity_table",
    "format_tables",
    "label_responses",
    "localisation_columns",
    "localisation_table",
    "frame_markdown",
    "mistake_spans",
    "parse_response",
    "plot_fidelity",
    "plot_localisation",
    "plot_cost_curve",
    "question_terms",
    "run_attribution",
    "signal_specs",
    "spearman",
    "stability_table",
    "summarize",
    "token_char_spans",
    "token_labels",
    "topk_hit",
    "write_outputs",
]
