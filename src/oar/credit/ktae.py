"""KTAE: Key-token Advantage Estimation (docs/methods.md, 3 KTAE; code: github xiaolizh1/KTAE).

Per group of responses to one prompt, every token id ``v`` that occurs (inside the mask) gets a
score ``K(v)`` in ``[-top, top]`` from a 2x2 contingency table of presence in correct / wrong
responses, and the token advantage is ``A_{i,t} = (A_i + K(o_{i,t})) * m_{i,t}``.

Table for token ``v`` in one group (presence, not counts)::

                 correct   wrong
    contains v      a        b
    lacks v         c        d        c = n_T - a, d = n_F - b, n = n_T + n_F

- ``F = exp(-2p)`` with ``p`` the two-sided Fisher exact p-value (``F = 0`` when ``p`` is within
  ``p_one_tol`` of 1);
- ``IG = H(Y) - [(a+b)/n H(a/(a+b)) + (c+d)/n H(c/(c+d))]`` in bits;
- ``h = asin(sqrt(pT)) - asin(sqrt(pF))``, ``pT = a/(a+c+1e-10)``, ``pF = b/(b+d+1e-10)``;
- BM25-style frequency term ``tf_C = (f_C/N_C)(k1+1) / (f_C/N_C + k1(1 - b + b N_C/avg))`` with
  ``f_C`` the occurrences of ``v`` in class-``C`` responses, ``N_C`` the valid tokens of class ``C``,
  ``avg = (N_T + N_F)/2``; ``x = h + gamma (tf_T/(tf_F+1e-5) - tf_F/(tf_T+1e-5))``;
- ``K_raw = (alpha F + beta IG) x / (alpha + beta)``, ``K = top (2 sigmoid(K_raw) - 1)``
  (computed as ``top * tanh(K_raw / 2)``, the same function with better rounding near 0).

Differences from the released code, on purpose (docs/methods.md wins): ``gamma`` scales the frequency
term (the release only switches it on/off); the Fisher p-value counts tables whose probability is
``<= p_obs * (1 + 1e-7)`` like scipy (the release uses exact ``<=``); ``F`` is 0 when ``p`` is within
1e-6 of 1 (the release compares ``p != 1`` exactly); ``N_C = 0`` gives ``tf_C = 0`` (the release
divides by zero). Tokens a token stream contains only in one class make ``tf_F = 0`` and so
``x ~ 1e5 tf_T``: ``K`` saturates to exactly ``+-top`` in floating point, as in the release.

Statistics are computed only over the token ids that occur, never a dense ``(vocab,)`` array, and
vectorized across groups: one sort of packed ``(group, token, response)`` int64 keys gives the
distinct ``(group, token)`` keys with inverse indices (like ``torch.unique(return_inverse=True)``)
and, from its runs, the presence counts ``a``, ``b`` and occurrence counts ``f_T``, ``f_F`` (via
``bincount``). The table-only terms (Fisher, IG, direction) are computed once per distinct table
``(a, b, n_T, n_F)``, of which there are at most a few hundred.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.advantages import broadcast_seq, check_options, group_index, grpo_advantages

__all__ = [
    "fisher_exact_two_sided",
    "information_gain_bits",
    "key_token_scores",
    "ktae_scores_batch",
    "ktae_token_advantages",
    "ktae_estimator",
]


def _log_factorial_table(nmax: int, device: torch.device) -> torch.Tensor:
    return torch.lgamma(torch.arange(nmax + 1, dtype=torch.float64, device=device) + 1.0)


def fisher_exact_two_sided(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    *,
    rel_tol: float = 1e-7,
) -> torch.Tensor:
    """Two-sided Fisher exact test p-values for 2x2 tables ``[[a, b], [c, d]]``, vectorized.

    Like ``scipy.stats.fisher_exact(..., alternative="two-sided")``: with row sum ``R1 = a + b``,
    column sum ``C1 = a + c`` and ``n = a + b + c + d``, the top-left cell is hypergeometric
    ``pmf(k) = C(C1, k) C(n - C1, R1 - k) / C(n, R1)`` on ``max(0, R1 + C1 - n) <= k <= min(R1, C1)``;
    the p-value sums ``pmf(k)`` over all ``k`` with ``pmf(k) <= pmf(a) * (1 + rel_tol)``, clipped to
    at most 1. Log-factorials come from one ``lgamma`` table; everything is float64.

    Args:
        a, b, c, d: non-negative integer-valued tensors of one broadcastable shape ``S``.
        rel_tol: relative tolerance for "as extreme as the observed table".

    Returns:
        float64 tensor of shape ``S`` with the p-values (1.0 for tables with an empty row or column).
    """
    a, b, c, d = torch.broadcast_tensors(*(torch.as_tensor(x) for x in (a, b, c, d)))
    shape = a.shape
    device = a.device
    cells = [x.reshape(-1).to(torch.float64) for x in (a, b, c, d)]
    a64, b64, c64, d64 = cells
    for name, x in zip("abcd", cells):
        if x.numel() and (bool((x < 0).any()) or bool((x != x.round()).any())):
            raise ValueError(f"oar.credit.ktae.fisher_exact_two_sided: cell {name} must hold non-negative integers")
    if a64.numel() == 0:
        return torch.zeros(shape, dtype=torch.float64, device=device)
    ai, bi, ci, di = (x.long() for x in cells)
    r1 = ai + bi
    c1 = ai + ci
    n = r1 + ci + di
    lf = _log_factorial_table(int(n.max()), device)
    k_lo = (r1 + c1 - n).clamp(min=0)
    k_hi = torch.minimum(r1, c1)
    width = int((k_hi - k_lo).max()) + 1
    k = k_lo[:, None] + torch.arange(width, device=device)[None, :]  # (N, W)
    valid = k <= k_hi[:, None]
    k = torch.minimum(k, k_hi[:, None])

    def log_pmf(kk: torch.Tensor, rr1: torch.Tensor, cc1: torch.Tensor, nn: torch.Tensor) -> torch.Tensor:
        # log C(C1, k) + log C(n - C1, R1 - k) - log C(n, R1)
        return (
            lf[cc1] - lf[kk] - lf[cc1 - kk]
            + lf[nn - cc1] - lf[rr1 - kk] - lf[nn - cc1 - rr1 + kk]
            - lf[nn] + lf[rr1] + lf[nn - rr1]
        )

    lp = log_pmf(k, r1[:, None], c1[:, None], n[:, None])
    lp_obs = log_pmf(ai, r1, c1, n)
    pmf = torch.exp(lp)
    p_obs = torch.exp(lp_obs)
    keep = valid & (pmf <= p_obs[:, None] * (1.0 + rel_tol))
    p = torch.where(keep, pmf, torch.zeros_like(pmf)).sum(dim=1).clamp(max=1.0)
    return p.reshape(shape)


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """Binary entropy ``H(p)`` in bits, 0 at ``p in {0, 1}``."""
    q = 1.0 - p
    t1 = torch.where(p > 0, -p * torch.log2(p.clamp(min=1e-300)), torch.zeros_like(p))
    t2 = torch.where(q > 0, -q * torch.log2(q.clamp(min=1e-300)), torch.zeros_like(q))
    return t1 + t2


def information_gain_bits(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Information gain (bits) of token presence about correctness for tables ``[[a, b], [c, d]]``.

    ``IG = H(Y) - [(a+b)/n H(a/(a+b)) + (c+d)/n H(c/(c+d))]`` with ``Y`` = correctness,
    ``H`` the binary entropy; a side with no responses counts 0; ``n = 0`` gives 0. Float64.
    """
    a, b, c, d = (torch.as_tensor(x).to(torch.float64) for x in (a, b, c, d))
    n = a + b + c + d
    safe_n = n.clamp(min=1)
    hy = _entropy_bits((a + c) / safe_n)
    r1 = a + b
    r2 = c + d
    h1 = torch.where(r1 > 0, _entropy_bits(a / r1.clamp(min=1)), torch.zeros_like(r1))
    h2 = torch.where(r2 > 0, _entropy_bits(c / r2.clamp(min=1)), torch.zeros_like(r2))
    ig = hy - (r1 / safe_n * h1 + r2 / safe_n * h2)
    return torch.where(n > 0, ig, torch.zeros_like(ig))


def _bm25_tf(f: torch.Tensor, n_c: torch.Tensor, avg: torch.Tensor, k1: float, b: float) -> torch.Tensor:
    """``tf = (f/N)(k1+1) / (f/N + k1(1 - b + b N/avg))``; 0 where ``N == 0``."""
    rel = f / n_c.clamp(min=1)
    norm = k1 * (1.0 - b + b * n_c / avg.clamp(min=1e-300))
    tf = rel * (k1 + 1.0) / (rel + norm)
    return torch.where(n_c > 0, tf, torch.zeros_like(tf))


def _validate_ktae(alpha: float, beta: float, gamma: float, top: float, bm25_k1: float, bm25_b: float) -> None:
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma), ("top", top), ("bm25_k1", bm25_k1)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"oar.credit.ktae: {name} must be finite and >= 0, got {v!r}")
    if alpha + beta <= 0:
        raise ValueError(f"oar.credit.ktae: alpha + beta must be > 0, got alpha={alpha!r}, beta={beta!r}")
    if not 0.0 <= bm25_b <= 1.0:
        raise ValueError(f"oar.credit.ktae: bm25_b must be in [0, 1], got {bm25_b!r}")


def ktae_scores_batch(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    top: float = 1.0,
    ignore_token_ids: Iterable[int] = (),
    bm25_k1: float = 2.0,
    bm25_b: float = 0.5,
    eps_direction: float = 1e-10,
    eps_tf: float = 1e-5,
    p_one_tol: float = 1e-6,
    fisher_rel_tol: float = 1e-7,
) -> torch.Tensor:
    """Key-token scores ``K(o_{i,t})`` for a batch of groups, vectorized across groups.

    Args:
        token_ids: ``(B, T)`` long token ids (ids outside the mask are ignored).
        mask: ``(B, T)`` response mask (nonzero = real token).
        rewards: ``(B,)`` rewards; a response is correct when ``r > 0``.
        group_ids: ``(B,)`` integer group ids (arbitrary values).
        alpha, beta, gamma, top: weights of the Fisher term, the information gain, the frequency
            term, and the score range (docs/methods.md, 3 KTAE; all 1 by default).
        ignore_token_ids: ids whose score is forced to 0 (e.g. the end-of-text id). They still count
            in ``N_C`` (valid tokens per class), as in the released code.
        bm25_k1, bm25_b: BM25 constants of the frequency term.
        eps_direction, eps_tf: the small constants in ``pT``/``pF`` and in the tf ratios.
        p_one_tol: ``F = 0`` when ``p >= 1 - p_one_tol``.
        fisher_rel_tol: see :func:`fisher_exact_two_sided`.

    Returns:
        ``(B, T)`` float32 (or ``rewards``' float64) scores, 0 outside the mask, at ignored ids
        and in degenerate groups (all correct or all wrong).
    """
    _validate_ktae(alpha, beta, gamma, top, bm25_k1, bm25_b)
    _check_ktae_shapes(token_ids, mask, rewards, group_ids)
    bsz, _ = token_ids.shape
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    device = token_ids.device
    out = torch.zeros(token_ids.shape, dtype=out_dtype, device=device)
    m = mask.bool()
    if bsz == 0 or not bool(m.any()):
        return out

    gidx, ng = group_index(group_ids)
    correct = rewards > 0
    n_t, n_f, tok_t, tok_f = _class_totals(gidx, ng, correct, m, device)
    keys = _group_token_keys(token_ids, m, gidx, ng, correct)
    nt_k = n_t[keys.group]
    nf_k = n_f[keys.group]
    side = int(max(n_t.max(), n_f.max())) + 1
    table_weight, x = _table_terms(keys.a, keys.b, nt_k, nf_k, side, alpha=alpha, beta=beta,
                                   eps_direction=eps_direction, p_one_tol=p_one_tol, fisher_rel_tol=fisher_rel_tol)
    if gamma > 0:
        avg = ((tok_t + tok_f) / 2.0)[keys.group]
        tf_t = _bm25_tf(keys.f_t, tok_t[keys.group], avg, bm25_k1, bm25_b)
        tf_f = _bm25_tf(keys.f_f, tok_f[keys.group], avg, bm25_k1, bm25_b)
        x = x + gamma * (tf_t / (tf_f + eps_tf) - tf_f / (tf_t + eps_tf))

    k_raw = table_weight * x / (alpha + beta)
    k = top * torch.tanh(k_raw / 2.0)
    degenerate = (nt_k == 0) | (nf_k == 0)
    k = torch.where(degenerate, torch.zeros_like(k), k)
    ignore = sorted({int(i) for i in ignore_token_ids})
    if ignore:
        ign = torch.isin(keys.token, torch.tensor(ignore, dtype=keys.token.dtype, device=device))
        k = torch.where(ign, torch.zeros_like(k), k)

    vals = torch.empty(keys.order.numel(), dtype=out_dtype, device=device)
    vals[keys.order] = k.to(out_dtype)[keys.key_id]
    out.masked_scatter_(m, vals)
    return out


def _check_ktae_shapes(token_ids: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
                       group_ids: torch.Tensor) -> None:
    """Raise ValueError unless ``token_ids`` and ``mask`` are ``(B, T)``, ``rewards`` and ``group_ids``
    are ``(B,)``, and ``token_ids`` is an integer tensor."""
    if token_ids.dim() != 2 or mask.shape != token_ids.shape:
        raise ValueError(
            f"oar.credit.ktae: token_ids and mask must both be (B, T), got {tuple(token_ids.shape)} "
            f"and {tuple(mask.shape)}"
        )
    bsz, _ = token_ids.shape
    if rewards.shape != (bsz,) or group_ids.shape != (bsz,):
        raise ValueError(
            f"oar.credit.ktae: rewards and group_ids must be (B,) = ({bsz},), got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"oar.credit.ktae: token_ids must be an integer tensor, got {token_ids.dtype}")


def _class_totals(gidx: torch.Tensor, ng: int, correct: torch.Tensor, m: torch.Tensor,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, from ``(B,)`` group indices ``gidx`` (``0 .. ng-1``), ``(B,)`` bool ``correct`` and
    the ``(B, T)`` bool mask ``m``: ``(n_T, n_F, N_T, N_F)``, ``(ng,)`` float64 each -- the correct and
    wrong responses and the valid tokens of each class (on ``device``)."""
    ones = torch.ones(m.shape[0], dtype=torch.float64, device=device)
    n_t = torch.zeros(ng, dtype=torch.float64, device=device).index_add_(0, gidx, correct.double())
    n_f = torch.zeros(ng, dtype=torch.float64, device=device).index_add_(0, gidx, ones) - n_t
    lens = m.sum(dim=1).double()
    tok_t = torch.zeros(ng, dtype=torch.float64, device=device).index_add_(0, gidx, lens * correct.double())
    tok_f = torch.zeros(ng, dtype=torch.float64, device=device).index_add_(0, gidx, lens) - tok_t
    return n_t, n_f, tok_t, tok_f


class _GroupTokenKeys(NamedTuple):
    """The distinct ``(group, token)`` keys of a batch's masked positions (``K`` keys, ``N`` positions).

    Attributes:
        order: ``(N,)`` long, the sort order of the positions (row-major masked order -> sorted).
        key_id: ``(N,)`` long, the key of each sorted position (``0 .. K-1``).
        group, token: ``(K,)`` long, each key's group index and token id.
        a, b: ``(K,)`` float64, the correct / wrong responses that contain the token.
        f_t, f_f: ``(K,)`` float64, its occurrences in correct / wrong responses.
    """

    order: torch.Tensor
    key_id: torch.Tensor
    group: torch.Tensor
    token: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    f_t: torch.Tensor
    f_f: torch.Tensor


def _group_token_keys(token_ids: torch.Tensor, m: torch.Tensor, gidx: torch.Tensor, ng: int,
                      correct: torch.Tensor) -> _GroupTokenKeys:
    """One sort of the masked positions of ``(B, T)`` ``token_ids`` (``m``: ``(B, T)`` bool) by
    ``(group, token, response)`` packed into an int64 (``gidx``: ``(B,)`` group indices of ``ng``
    groups; ``correct``: ``(B,)`` bool): runs of equal ``(group, token)`` are the keys, and a new
    ``(group, token, response)`` inside a run is one more response that contains the token.

    Raises:
        ValueError: a negative token id inside the mask, or keys too large for int64.
    """
    bsz = token_ids.shape[0]
    device = token_ids.device
    # Masked positions in row-major order (masked_select / masked_scatter order).
    toks = token_ids.masked_select(m).long()
    rows = torch.repeat_interleave(torch.arange(bsz, device=device), m.sum(dim=1))
    if bool((toks < 0).any()):
        raise ValueError("oar.credit.ktae: token_ids inside the mask must be >= 0")
    vocab_bits = max(int(toks.max()).bit_length(), 1)
    row_bits = max((bsz - 1).bit_length(), 1)
    if max(ng - 1, 1).bit_length() + vocab_bits + row_bits > 62:
        raise ValueError("oar.credit.ktae: groups x vocabulary x batch too large for int64 sort keys")

    n_pos = rows.numel()
    gt_key = (gidx[rows] << vocab_bits) | toks
    skey, order = torch.sort((gt_key << row_bits) | rows)
    srow = skey & ((1 << row_bits) - 1)
    sgt = skey >> row_bits
    new_key = torch.ones(n_pos, dtype=torch.bool, device=device)
    torch.ne(sgt[1:], sgt[:-1], out=new_key[1:])
    new_pair = torch.ones(n_pos, dtype=torch.bool, device=device)
    torch.ne(skey[1:], skey[:-1], out=new_pair[1:])
    key_id = torch.cumsum(new_key, dim=0) - 1
    grp_key = sgt[new_key]
    n_keys = grp_key.numel()

    pos_correct = correct[srow]
    a = torch.bincount(key_id, weights=(new_pair & pos_correct).double(), minlength=n_keys)
    b = torch.bincount(key_id, weights=new_pair.double(), minlength=n_keys) - a
    f_t = torch.bincount(key_id, weights=pos_correct.double(), minlength=n_keys)
    f_f = torch.bincount(key_id, minlength=n_keys).double() - f_t
    return _GroupTokenKeys(order=order, key_id=key_id, group=grp_key >> vocab_bits,
                           token=grp_key & ((1 << vocab_bits) - 1), a=a, b=b, f_t=f_t, f_f=f_f)


def _table_terms(
    a: torch.Tensor,
    b: torch.Tensor,
    nt_k: torch.Tensor,
    nf_k: torch.Tensor,
    side: int,
    *,
    alpha: float,
    beta: float,
    eps_direction: float,
    p_one_tol: float,
    fisher_rel_tol: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table-only terms of each key, computed once per distinct table ``(a, b, n_T, n_F)``.

    Args:
        a, b, nt_k, nf_k: ``(K,)`` float64 integer-valued cells and class sizes of each key's table.
        side: one more than the largest class size (the base the tables are packed in).

    Returns:
        ``(alpha F + beta IG, h)``, ``(K,)`` float64 each: the Fisher and information-gain weight and
        the direction ``asin(sqrt(pT)) - asin(sqrt(pF))`` (see the module docstring).
    """
    code = ((a.long() * side + b.long()) * side + nt_k.long()) * side + nf_k.long()
    if side**4 <= 4 * a.numel() + 2**20:  # small table space: find the present tables without a sort
        present = torch.bincount(code, minlength=side**4) > 0
        ucode = present.nonzero().squeeze(1)
        code_inv = (torch.cumsum(present, dim=0) - 1)[code]
    else:
        ucode, code_inv = torch.unique(code, return_inverse=True)
    ua = torch.div(ucode, side**3, rounding_mode="floor")
    ub = torch.div(ucode, side**2, rounding_mode="floor") % side
    unt = torch.div(ucode, side, rounding_mode="floor") % side
    unf = ucode % side
    uc = unt - ua
    ud = unf - ub
    if alpha > 0:
        p = fisher_exact_two_sided(ua, ub, uc, ud, rel_tol=fisher_rel_tol)
        fisher = torch.where(p >= 1.0 - p_one_tol, torch.zeros_like(p), torch.exp(-2.0 * p))
    else:
        fisher = torch.zeros(ucode.shape, dtype=torch.float64, device=a.device)
    ig = information_gain_bits(ua, ub, uc, ud) if beta > 0 else torch.zeros_like(fisher)
    fa, fb, fc, fd = (t.to(torch.float64) for t in (ua, ub, uc, ud))
    pt = (fa / (fa + fc + eps_direction)).clamp(0.0, 1.0)
    pf = (fb / (fb + fd + eps_direction)).clamp(0.0, 1.0)
    h = torch.asin(pt.sqrt()) - torch.asin(pf.sqrt())
    return (alpha * fisher + beta * ig)[code_inv], h[code_inv]


def key_token_scores(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    top: float = 1.0,
    ignore_token_ids: Iterable[int] = (),
    **kwargs: Any,
) -> torch.Tensor:
    """KTAE key-token scores for ONE group of ``G`` responses (docs/methods.md, 3 KTAE).

    Args:
        token_ids: ``(G, T)`` long token ids.
        mask: ``(G, T)`` response mask.
        rewards: ``(G,)`` rewards (correct = ``r > 0``).
        alpha, beta, gamma, top, ignore_token_ids: see :func:`ktae_scores_batch`; further keywords
            (``bm25_k1``, ``bm25_b``, ...) are passed on to it.

    Returns:
        ``(G, T)`` scores ``K(o_{i,t})`` in ``[-top, top]``; 0 outside the mask, at ignored ids and
        when the group is degenerate (all correct or all wrong).
    """
    if token_ids.dim() != 2:
        raise ValueError(f"oar.credit.ktae.key_token_scores: token_ids must be (G, T), got {tuple(token_ids.shape)}")
    gids = torch.zeros(token_ids.shape[0], dtype=torch.long, device=token_ids.device)
    return ktae_scores_batch(
        token_ids, mask, rewards, gids,
        alpha=alpha, beta=beta, gamma=gamma, top=top, ignore_token_ids=ignore_token_ids, **kwargs,
    )


def ktae_token_advantages(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    **kw: Any,
) -> torch.Tensor:
    """KTAE token advantages ``A_{i,t} = (A_i + K(o_{i,t})) * m_{i,t}`` for a batch of groups.

    Args:
        token_ids: ``(B, T)`` long; mask: ``(B, T)``; rewards: ``(B,)``; group_ids: ``(B,)``.
        norm_by_std, eps: options of the GRPO advantage ``A_i`` (:func:`grpo_advantages`).
        **kw: key-token options of :func:`ktae_scores_batch` (alpha, beta, gamma, top, ...).

    Returns:
        ``(B, T)`` float token advantages, exactly 0 outside the mask.
    """
    seq = grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std, eps=eps)
    k = ktae_scores_batch(token_ids, mask, rewards, group_ids, **kw)
    return broadcast_seq(seq.to(k.dtype), mask) + k


_KTAE_OPTIONS = ("norm_by_std", "eps", "alpha", "beta", "gamma", "top", "ignore_token_ids", "bm25_k1", "bm25_b")


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        return ()
    if isinstance(eos, Sequence):
        return tuple(int(e) for e in eos)
    return (int(eos),)


@register_estimator("ktae")
def ktae_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """KTAE estimator. Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``alpha``, ``beta``,
    ``gamma``, ``top`` (all 1.0), ``bm25_k1`` (2.0), ``bm25_b`` (0.5), ``ignore_token_ids``
    (default: the tokenizer's eos id when ``batch.tokenizer`` is set, else none)."""
    check_options("ktae", options, _KTAE_OPTIONS)
    opts = dict(options)
    norm = bool(opts.pop("norm_by_std", True))
    eps = float(opts.pop("eps", 1e-6))
    ignore = opts.pop("ignore_token_ids", None)
    if ignore is None:
        ignore = _eos_ids(batch.tokenizer)
    seq = grpo_advantages(batch.rewards, batch.group_ids, norm_by_std=norm, eps=eps)
    k = ktae_scores_batch(
        batch.response_ids, batch.response_mask, batch.rewards, batch.group_ids, ignore_token_ids=ignore, **opts
    )
    tok = broadcast_seq(seq.to(k.dtype), batch.response_mask) + k
    m = batch.response_mask.bool()
    stats = {
        "ktae/k_abs_mean": float(k.abs()[m].mean()) if bool(m.any()) else 0.0,
    }
    return CreditResult(token_advantages=tok, seq_advantages=seq, weights=None, stats=stats)
