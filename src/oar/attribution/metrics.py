"""Metrics of the attribution benchmark.

- :func:`fidelity_table`: pivotal result digits vs filler words (AUROC, Spearman with OAR-P).
- :func:`localisation_table`: error localisation. Candidates are the **reasoning tokens** of a
  response (the response tokens before the token that starts its last ``\\boxed{``: the OAR
  probe's ``reasoning_mask``; separators, fillers and every step, the answer excluded). Positives
  are the tokens of the located mistake's result (sign included); negatives the tokens of the
  response's other steps (all arithmetically right given the values written before them).
  ``top{k}``: :func:`oar.attribution.stats.topk_hit` of the positives among the candidates (ties
  broken at random, in expectation); ``auroc_mean``: AUROC of positives vs negatives per response,
  averaged over responses with both; ``auroc_pooled``: the same over all responses' tokens at once.
- :func:`stability_table`: per-response Spearman correlation over the reasoning tokens between two
  computations of a signal (two noise seeds, two sampled groups): median and inter-quartile range.
- :func:`cost_table`: seconds per response of each signal and the ratio to a reference signal.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from oar.task.parsing import FILLER, PIVOTAL
from oar.attribution.stats import auroc, spearman, summarize, topk_hit

__all__ = [
    "FIDELITY_COLUMNS",
    "LOCALISATION_COLUMNS",
    "STABILITY_COLUMNS",
    "COST_COLUMNS",
    "localisation_columns",
    "fidelity_table",
    "localisation_table",
    "stability_table",
    "cost_table",
]

#: Columns of ``fidelity.csv`` (in order).
FIDELITY_COLUMNS: tuple[str, ...] = (
    "signal",
    "auroc_pooled",
    "auroc_mean_per_response",
    "n_responses",
    "n_pivotal",
    "n_filler",
    "seconds_per_response",
    "spearman_vs_oar_p",
    "spearman_vs_oar_p_median",
    "n_responses_both_classes",
    "n_responses_spearman",
)
#: Columns of ``stability.csv`` (in order).
STABILITY_COLUMNS: tuple[str, ...] = ("signal", "kind", "comparison", "n", "median", "q25", "q75", "iqr", "mean")
#: Columns of ``cost.csv`` (in order).
COST_COLUMNS: tuple[str, ...] = ("signal", "seconds_per_response", "ratio_to_reference", "reference", "n_scored", "note")


def localisation_columns(top_k: Sequence[int]) -> tuple[str, ...]:
    """Columns of ``localisation.csv`` for the given ``k`` values."""
    return ("signal", "kind", "n_responses", *[f"top{k}" for k in top_k], "auroc_mean", "auroc_pooled",
            "n_auroc", "n_positive", "n_negative")


#: Columns of ``localisation.csv`` with the default ``k`` values (1, 3).
LOCALISATION_COLUMNS: tuple[str, ...] = localisation_columns((1, 3))


def fidelity_table(
    scores: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    reasoning_mask: torch.Tensor,
    *,
    seconds_per_response: Mapping[str, float] | None = None,
    reference: str = "oar_p",
) -> tuple["Any", "Any"]:
    """Fidelity metrics of each signal.

    Args:
        scores: signal name -> ``(n, T)`` scores aligned with ``labels``.
        labels: ``(n, T)`` long, 1 pivotal, 0 filler, -1 unlabeled (:func:`label_responses`).
        reasoning_mask: ``(n, T)`` bool, tokens over which signals are correlated with ``reference``.
        seconds_per_response: signal -> seconds per response (NaN when absent).
        reference: the signal the Spearman correlations are taken against (NaN when absent).

    Returns:
        ``(fidelity, per_response)`` DataFrames: one row per signal with :data:`FIDELITY_COLUMNS`,
        and one row per response with ``n_reasoning``, ``n_pivotal``, ``n_filler`` and
        ``auroc_<signal>`` / ``spearman_<signal>`` (vs ``reference``) columns.
    """
    import pandas as pd

    lab = labels.detach().cpu().numpy()
    rmask = reasoning_mask.detach().cpu().numpy().astype(bool)
    n = lab.shape[0]
    labeled = lab >= 0
    if labeled.any() and not rmask[labeled].all():
        raise ValueError(
            "oar.attribution.fidelity_table: a labeled token lies outside the probe's reasoning "
            "tokens (the ground-truth parse and the probe disagree on where the answer starts)"
        )
    ref = scores[reference].detach().cpu().numpy() if reference in scores else None
    seconds_per_response = dict(seconds_per_response or {})
    per: dict[str, Any] = {
        "n_reasoning": rmask.sum(1),
        "n_pivotal": (lab == PIVOTAL).sum(1),
        "n_filler": (lab == FILLER).sum(1),
    }
    rows = []
    for name, sc in scores.items():
        s = sc.detach().cpu().numpy().astype(np.float64)
        if s.shape != lab.shape:
            raise ValueError(f"oar.attribution.fidelity_table: scores[{name!r}] shape {s.shape} != labels {lab.shape}")
        pooled = auroc(s[labeled], lab[labeled] == PIVOTAL)
        per_auc = np.array([auroc(s[i][labeled[i]], lab[i][labeled[i]] == PIVOTAL) for i in range(n)])
        per[f"auroc_{name}"] = per_auc
        if ref is not None:
            rho = np.array([spearman(s[i][rmask[i]], ref[i][rmask[i]]) for i in range(n)])
        else:
            rho = np.full(n, np.nan)
        per[f"spearman_{name}"] = rho
        ok_auc = per_auc[~np.isnan(per_auc)]
        ok_rho = rho[~np.isnan(rho)]
        rows.append(
            {
                "signal": name,
                "auroc_pooled": pooled,
                "auroc_mean_per_response": float(ok_auc.mean()) if ok_auc.size else float("nan"),
                "n_responses": n,
                "n_pivotal": int((lab == PIVOTAL).sum()),
                "n_filler": int((lab == FILLER).sum()),
                "seconds_per_response": float(seconds_per_response.get(name, float("nan"))),
                "spearman_vs_oar_p": float(ok_rho.mean()) if ok_rho.size else float("nan"),
                "spearman_vs_oar_p_median": float(np.median(ok_rho)) if ok_rho.size else float("nan"),
                "n_responses_both_classes": int(ok_auc.size),
                "n_responses_spearman": int(ok_rho.size),
            }
        )
    fidelity = pd.DataFrame(rows, columns=list(FIDELITY_COLUMNS))
    per_response = pd.DataFrame(per)
    return fidelity, per_response


def localisation_table(
    scores: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    reasoning_mask: torch.Tensor,
    kinds: Sequence[str],
    *,
    top_k: Sequence[int] = (1, 3),
) -> tuple[Any, Any]:
    """Error-localisation metrics of each signal, per kind of response.

    Args:
        scores: signal name -> ``(n, T)`` scores.
        labels: ``(n, T)`` long: 1 on the mistake's result tokens, 0 on the tokens of the other
            steps, -1 elsewhere; every labeled token must be a reasoning token.
        reasoning_mask: ``(n, T)`` bool, the candidate tokens of the top-k hit.
        kinds: ``(n,)`` kind of each response (e.g. ``sampled``, ``counterfactual``).
        top_k: the ``k`` of the top-k hit rates.

    Returns:
        ``(table, per_response)`` DataFrames: one row per (signal, kind) with
        :func:`localisation_columns`, kinds in first-seen order; and one row per response with
        ``kind``, ``n_reasoning``, ``n_positive``, ``n_negative`` and ``top{k}_<signal>`` /
        ``auroc_<signal>`` columns.
    """
    import pandas as pd

    lab = labels.detach().cpu().numpy()
    rmask = reasoning_mask.detach().cpu().numpy().astype(bool)
    n = lab.shape[0]
    kinds = [str(k) for k in kinds]
    if len(kinds) != n:
        raise ValueError(f"oar.attribution.localisation_table: {len(kinds)} kinds for {n} responses")
    if (lab >= 0).any() and not rmask[lab >= 0].all():
        raise ValueError("oar.attribution.localisation_table: a labeled token lies outside the reasoning tokens")
    pos, neg = lab == 1, lab == 0
    per: dict[str, Any] = {"kind": kinds, "n_reasoning": rmask.sum(1), "n_positive": pos.sum(1), "n_negative": neg.sum(1)}
    rows = []
    kind_order = list(dict.fromkeys(kinds))
    karr = np.asarray(kinds, dtype=object)
    for name, sc in scores.items():
        s = sc.detach().cpu().numpy().astype(np.float64)
        if s.shape != lab.shape:
            raise ValueError(f"oar.attribution.localisation_table: scores[{name!r}] shape {s.shape} != labels {lab.shape}")
        hits = {k: np.array([topk_hit(s[i][rmask[i]], pos[i][rmask[i]], k) for i in range(n)]) for k in top_k}
        aucs = np.array([auroc(s[i][pos[i] | neg[i]], pos[i][pos[i] | neg[i]]) for i in range(n)])
        for k in top_k:
            per[f"top{k}_{name}"] = hits[k]
        per[f"auroc_{name}"] = aucs
        for kind in kind_order:
            sel = karr == kind
            both = pos[sel] | neg[sel]
            row = {"signal": name, "kind": kind, "n_responses": int(sel.sum())}
            for k in top_k:
                row[f"top{k}"] = summarize(hits[k][sel])["mean"]
            row["auroc_mean"] = summarize(aucs[sel])["mean"]
            row["auroc_pooled"] = auroc(s[sel][both], pos[sel][both]) if both.any() else float("nan")
            row["n_auroc"] = summarize(aucs[sel])["n"]
            row["n_positive"] = int(pos[sel].sum())
            row["n_negative"] = int(neg[sel].sum())
            rows.append(row)
    table = pd.DataFrame(rows, columns=list(localisation_columns(top_k)))
    return table, pd.DataFrame(per)


def stability_table(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor, str]],
    reasoning_mask: torch.Tensor,
    kinds: Sequence[str],
) -> tuple[Any, Any]:
    """Stability of each signal: Spearman correlation, per response over its reasoning tokens,
    between two computations (NaN for a response where either is constant, left out of the
    summary).

    Args:
        pairs: signal name -> ``(scores_a, scores_b, comparison)``, ``(n, T)`` each; ``comparison``
            says what differs (e.g. ``noise seed``, ``sampled group``).
        reasoning_mask: ``(n, T)`` bool.
        kinds: ``(n,)`` kind of each response.

    Returns:
        ``(table, per_response)``: one row per (signal, kind) plus kind ``all`` with
        :data:`STABILITY_COLUMNS`; and ``spearman_<signal>`` per response.
    """
    import pandas as pd

    rmask = reasoning_mask.detach().cpu().numpy().astype(bool)
    n = rmask.shape[0]
    karr = np.asarray([str(k) for k in kinds], dtype=object)
    kind_order = list(dict.fromkeys(karr.tolist())) + ["all"]
    per: dict[str, Any] = {}
    rows = []
    for name, (a, b, comparison) in pairs.items():
        sa, sb = (x.detach().cpu().numpy().astype(np.float64) for x in (a, b))
        rho = np.array([spearman(sa[i][rmask[i]], sb[i][rmask[i]]) for i in range(n)])
        per[f"spearman_{name}"] = rho
        for kind in kind_order:
            sel = np.ones(n, dtype=bool) if kind == "all" else karr == kind
            st = summarize(rho[sel])
            rows.append({"signal": name, "kind": kind, "comparison": comparison, **{k: st[k] for k in STABILITY_COLUMNS[3:]}})
    return pd.DataFrame(rows, columns=list(STABILITY_COLUMNS)), pd.DataFrame(per)


def cost_table(
    seconds: Mapping[str, float],
    n_scored: Mapping[str, int],
    *,
    reference: str = "oar_g",
    notes: Mapping[str, str] | None = None,
) -> Any:
    """Seconds per response of each signal (batch wall time / responses the call scored) and the
    ratio to ``reference`` (NaN when ``reference`` is absent)."""
    import pandas as pd

    per = {k: (seconds[k] / n_scored[k] if n_scored.get(k) else float("nan")) for k in seconds}
    ref = per.get(reference, float("nan"))
    rows = [
        {
            "signal": k,
            "seconds_per_response": v,
            "ratio_to_reference": v / ref if ref and np.isfinite(ref) and ref > 0 else float("nan"),
            "reference": reference,
            "n_scored": int(n_scored.get(k, 0)),
            "note": (notes or {}).get(k, ""),
        }
        for k, v in per.items()
    ]
    return pd.DataFrame(rows, columns=list(COST_COLUMNS))


def localisation_by_position(per_response: Any, signals: Sequence[str], *, top_k: Sequence[int] = (1, 3)) -> Any:
    """Top-k hit of each signal split by where the mistake sits: the ``last`` step or an ``earlier`` one.

    An earlier step's result is restated as an operand of the next step, so the answer depends on it
    only through that copy; an outcome-sensitivity signal (OAR) scores the copy's step rather than the
    mistake, and this table shows by how much.

    Args:
        per_response: the per-response frame of :func:`localisation_table` with ``mistake_step`` and
            ``n_steps`` columns added (``mistake_step`` -1: none).
        signals: signal names (their ``top{k}_<signal>`` columns).
    Returns:
        One row per (kind, position) with ``n_responses`` and ``top{k}_<signal>`` means.
    """
    import pandas as pd

    df = per_response[per_response["mistake_step"] >= 0]
    position = np.where(df["mistake_step"] == df["n_steps"] - 1, "last", "earlier")
    rows = []
    for (kind, pos), grp in df.groupby([df["kind"], position], sort=False):
        row: dict[str, Any] = {"kind": kind, "position": pos, "n_responses": len(grp)}
        for name in signals:
            for k in top_k:
                row[f"top{k}_{name}"] = float(grp[f"top{k}_{name}"].mean())
        rows.append(row)
    return pd.DataFrame(rows).sort_values(["kind", "position"], ascending=[False, False]).reset_index(drop=True) if rows else pd.DataFrame(rows)
