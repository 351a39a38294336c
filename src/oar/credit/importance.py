"""Token importance for OAR (METHODS.md sections 4.2-4.4): OAR-P and OAR-G.

Both score the reasoning positions of an outcome probe (:mod:`oar.credit.probe`) by how much they
move the model's distribution over its own final answer ("outcome"). Three outcome modes:

- ``last``: the next-token distribution at ``probe.last_index`` (end of prompt + reasoning +
  conclude);
- ``answer_mean``: the logits averaged over the positions that predict answer tokens, then softmax;
- ``answer_joint``: the scalar ``phi`` = mean log-prob of the answer tokens.

Importance is ``KL(P_orig || P_changed)`` for the first two and ``phi_orig - phi_changed`` for
``answer_joint`` (a signed difference, as in the method description).

:func:`perturbation_importance` (OAR-P) replaces one reasoning token at a time by a neutral
token. Since a causal model's positions before ``t`` do not see token ``t``, the default path runs
the unperturbed probe once with a KV cache and, for each chunk of perturbed copies (sorted by
``t``), reuses the cached keys/values of positions ``< t0`` (``t0`` = smallest ``t`` in the
chunk) and runs only positions ``>= t0``. ``naive=True`` runs every perturbed copy in full
(reference implementation; the two agree to float rounding).

:func:`gradient_importance` (OAR-G) takes gradient x input saliency of the outcome divergence
with respect to the input embeddings after a small Gaussian perturbation of the reasoning
embeddings (one clean forward, one noisy forward, one backward). Positions before the first
reasoning position of a chunk get no noise and no score, so by default their keys/values are
computed once per prompt (the ``n`` responses of a prompt share them) and the clean forward, the
noisy forward and the backward run only from that position on (``naive=True``: full forwards; the
two agree to float rounding).

All model calls use explicit ``position_ids = cumsum(attention_mask) - 1`` (so left padding does
not shift positions), run in eval mode (the model's train/eval mode is restored afterwards) and
only compute logits for the tail of the sequence that holds the answer (``logits_to_keep``).

The registered estimators ``oar_p`` and ``oar_g`` turn scores into bi-level weights
(:func:`oar.credit.reshape.bilevel_weights`) and token advantages ``A_i * w_{i,t}``.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from oar.credit import CreditBatch, CreditResult, register_estimator
from oar.credit.probe import DEFAULT_CONCLUDE, Probe, build_probe

__all__ = [
    "MODES",
    "outcome",
    "perturbation_importance",
    "gradient_importance",
    "oar_p_estimator",
    "oar_g_estimator",
]

#: Outcome modes understood by the importance functions.
MODES: tuple[str, ...] = ("last", "answer_mean", "answer_joint")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _check_mode(mode: str, where: str) -> None:
    if mode not in MODES:
        raise ValueError(f"oar.credit.importance.{where}: unknown mode {mode!r}; use one of {list(MODES)}")


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode (no dropout) and restore its previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _forward_params(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _logits_tail(
    model: torch.nn.Module,
    keep: int,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    use_cache: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Run the model and return the float32 logits of the last ``keep`` query positions, plus the
    returned cache (or None)."""
    params = _forward_params(model)
    kw: dict[str, Any] = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)
    if input_ids is not None:
        kw["input_ids"] = input_ids
    else:
        kw["inputs_embeds"] = inputs_embeds
    if cache is not None:
        kw["cache" if "cache" in params else "past_key_values"] = cache
    if "logits_to_keep" in params:
        kw["logits_to_keep"] = keep
    out = model(**kw)
    logits = out.logits[:, -keep:].float()
    new_cache = None
    if use_cache:
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
    return logits, new_cache


def outcome(
    logits_tail: torch.Tensor,
    tail_start: int,
    input_ids: torch.Tensor,
    answer_mask: torch.Tensor,
    last_index: torch.Tensor,
    mode: str,
) -> torch.Tensor:
    """The outcome of each row from the logits of the sequence tail.

    Args:
        logits_tail: ``(N, K, V)`` logits of absolute positions ``tail_start .. tail_start+K-1``
            (``tail_start + K == L``).
        tail_start: first absolute position covered by ``logits_tail``.
        input_ids: ``(N, L)`` probe ids (targets of ``answer_joint``).
        answer_mask: ``(N, L)`` bool, answer positions (answer-predicting positions are the ones
            just before them; they must all be ``>= tail_start``).
        last_index: ``(N,)`` long, position predicting the first answer token (mode ``last``).
        mode: ``last`` | ``answer_mean`` | ``answer_joint``.

    Returns:
        ``(N, V)`` log-probabilities (``last``, ``answer_mean``) or ``(N,)`` ``phi`` (``answer_joint``).
    """
    N, K, _ = logits_tail.shape
    if mode == "last":
        idx = (last_index - tail_start).to(logits_tail.device)
        if bool((idx < 0).any()) or bool((idx >= K).any()):
            raise ValueError("oar.credit.importance.outcome: last_index outside the kept logits")
        return F.log_softmax(logits_tail[torch.arange(N, device=logits_tail.device), idx], dim=-1)
    # pred[:, j] is True when position j predicts an answer token (answer at j + 1).
    pred = torch.zeros_like(answer_mask)
    pred[:, :-1] = answer_mask[:, 1:]
    pred_tail = pred[:, tail_start:].to(logits_tail.device)
    n = pred_tail.sum(-1).clamp(min=1)
    if mode == "answer_mean":
        mean_logits = torch.einsum("nk,nkv->nv", pred_tail.to(logits_tail.dtype), logits_tail) / n.unsqueeze(-1)
        return F.log_softmax(mean_logits, dim=-1)
    if mode == "answer_joint":
        lg = logits_tail[:, :-1]
        targets = input_ids[:, tail_start + 1 :].to(logits_tail.device)
        lp = lg.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1)
        return (lp * pred_tail[:, :-1]).sum(-1) / n
    raise ValueError(f"oar.credit.importance.outcome: unknown mode {mode!r}; use one of {list(MODES)}")


def _divergence(orig: torch.Tensor, new: torch.Tensor, mode: str) -> torch.Tensor:
    """``KL(P_orig || P_new)`` per row from log-probs, or ``phi_orig - phi_new`` (answer_joint)."""
    if mode == "answer_joint":
        return orig - new
    return (orig.exp() * (orig - new)).sum(-1)


def _keep(probe: Probe) -> int:
    """Number of tail logits covering every answer-predicting position of the probe."""
    return int(probe.answer_length.max()) + 1 if probe.answer_length.numel() else 1


def _answered(probe: Probe) -> tuple[torch.Tensor, Probe]:
    rows = probe.has_answer.nonzero().flatten()
    return rows, probe.select(rows)


def _plain_cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``[(keys, values)]`` per layer of a full-attention DynamicCache, None if not that kind."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - very old transformers
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def _warn_naive_fallback(where: str, stacklevel: int) -> None:
    """Warn that ``where`` falls back to its naive path (the model's cache cannot be reused)."""
    warnings.warn(
        f"oar.credit.importance.{where}: the model's cache is not a plain full-attention DynamicCache; "
        "using the naive (no prefix cache) path",
        stacklevel=stacklevel + 1,
    )


def _make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


# --------------------------------------------------------------------------------------------
# OAR-P
# --------------------------------------------------------------------------------------------


def perturbation_importance(
    model: torch.nn.Module,
    probe: Probe,
    *,
    mode: str = "last",
    mask_token_id: int | None = None,
    chunk_size: int = 128,
    naive: bool = False,
) -> torch.Tensor:
    """OAR-P: ``I_t = KL(P_orig || P_masked_t)`` (or ``phi_orig - phi_masked_t``) per reasoning token.

    For every reasoning position ``t`` of every answered row, a copy of the probe with token ``t``
    replaced by ``mask_token_id`` is run under ``torch.no_grad``. Rows are processed in groups of
    at most ``chunk_size`` (their unperturbed forward and KV cache), perturbed copies in chunks of
    at most ``chunk_size`` sequences, so memory is bounded by ``chunk_size`` sequences of length
    ``L`` (plus the group's cache).

    Args:
        model: causal LM (Hugging Face interface: ``attention_mask``, ``position_ids``, cache).
        probe: the outcome probe (rows without an answer get zeros and cost nothing).
        mode: ``last`` (default) | ``answer_mean`` | ``answer_joint``.
        mask_token_id: the neutral token; default ``probe.pad_token_id``.
        chunk_size: maximum number of sequences per forward.
        naive: run each perturbed copy in full instead of reusing the prefix KV cache. The cached
            path needs a plain full-attention ``DynamicCache`` (Llama/Qwen2-like models); for
            other caches it warns and falls back to the naive path.

    Returns:
        ``(B, L)`` float32 scores on the probe's device, 0 where ``probe.reasoning_mask`` is 0.
    """
    _check_mode(mode, "perturbation_importance")
    if chunk_size < 1:
        raise ValueError(f"oar.credit.importance.perturbation_importance: chunk_size must be >= 1, got {chunk_size}")
    mask_id = probe.pad_token_id if mask_token_id is None else int(mask_token_id)
    scores = torch.zeros(probe.input_ids.shape, dtype=torch.float32, device=probe.input_ids.device)
    rows_all, sub_all = _answered(probe)
    if rows_all.numel() == 0 or not bool(sub_all.reasoning_mask.any()):
        return scores
    dev = _model_device(model)
    with _eval_mode(model), torch.no_grad():
        for g0 in range(0, rows_all.numel(), chunk_size):
            rows = rows_all[g0 : g0 + chunk_size]
            sub = probe.select(rows).to(dev)
            sc = _oar_p_group(model, sub, mode=mode, mask_id=mask_id, chunk_size=chunk_size, naive=naive)
            # the group's probe may have dropped leading pad columns: align on the right
            scores[rows, scores.shape[1] - sc.shape[1] :] = sc.to(scores.device)
    return scores * probe.reasoning_mask


def _oar_p_group(
    model: torch.nn.Module, sub: Probe, *, mode: str, mask_id: int, chunk_size: int, naive: bool
) -> torch.Tensor:
    """OAR-P scores ``(N, L)`` of a probe whose rows all have an answer (on the model device)."""
    N, L = sub.input_ids.shape
    pos = sub.position_ids
    keep = _keep(sub)
    tail = L - keep
    logits, cache = _logits_tail(
        model,
        keep,
        input_ids=sub.input_ids,
        attention_mask=sub.attention_mask,
        position_ids=pos,
        use_cache=not naive,
    )
    orig = outcome(logits, tail, sub.input_ids, sub.answer_mask, sub.last_index, mode)
    kv = None
    if not naive:
        kv = _plain_cache_layers(cache)
        if kv is None:
            _warn_naive_fallback("perturbation_importance", stacklevel=3)
    del cache

    r_idx, t_idx = sub.reasoning_mask.nonzero(as_tuple=True)
    order = torch.argsort(t_idx, stable=True)
    r_idx, t_idx = r_idx[order], t_idx[order]
    out = torch.zeros((N, L), dtype=torch.float32, device=sub.input_ids.device)
    for c0 in range(0, r_idx.numel(), chunk_size):
        r = r_idx[c0 : c0 + chunk_size]
        t = t_idx[c0 : c0 + chunk_size]
        n = r.numel()
        ids = sub.input_ids[r].clone()
        ids[torch.arange(n, device=ids.device), t] = mask_id
        am = sub.attention_mask[r]
        k_c = int(sub.answer_length[r].max()) + 1
        t0 = int(t.min()) if kv is not None else 0
        if t0 > 0:
            prefix = [(k[r, :, :t0], v[r, :, :t0]) for k, v in kv]
            logits_c, _ = _logits_tail(
                model,
                k_c,
                input_ids=ids[:, t0:],
                attention_mask=am,
                position_ids=pos[r, t0:],
                cache=_make_cache(prefix),
            )
        else:
            logits_c, _ = _logits_tail(model, k_c, input_ids=ids, attention_mask=am, position_ids=pos[r])
        new = outcome(logits_c, L - k_c, ids, sub.answer_mask[r], sub.last_index[r], mode)
        out[r, t] = _divergence(orig[r], new, mode)
    return out


# --------------------------------------------------------------------------------------------
# OAR-G
# --------------------------------------------------------------------------------------------


def _noise_start(reasoning_mask: torch.Tensor, tail: int) -> int:
    """First column that OAR-G's noisy forward must run: the first column where any row has a
    reasoning token (every earlier column gets no noise and no score), at most ``tail`` (the
    first column whose logits the outcome needs); 0 when no row has a reasoning token.

    Args:
        reasoning_mask: ``(N, L)`` bool reasoning positions of a probe chunk.
        tail: first absolute position of the kept logits.
    """
    cols = reasoning_mask.any(0)
    if not bool(cols.any()):
        return 0
    return min(int(cols.long().argmax()), tail)


def _shared_prefix_kv(model: torch.nn.Module, probe: Probe, start: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Keys and values of columns ``[0, start)`` of every probe row, computed once per prompt.

    The ``n`` responses of a prompt share its keys and values (position ids count real tokens, so
    a prompt token's key does not depend on the row's left padding). Rows are grouped by their
    prompt (the real tokens before their first reasoning token; a row without reasoning is its own
    group); the prefix forward runs only on the row of each group with the least left padding (the
    donor, whose window ``[0, start)`` holds the most prompt tokens), and every row gathers its
    columns from its donor's cache, shifted by the difference in padding. Padding columns take
    an arbitrary finite value: the attention mask hides them.

    Args:
        probe: ``(N, L)`` probe on the model's device; ``start``: prefix length, ``> 0`` and at most
            every row's first reasoning column.
    Returns:
        ``[(keys, values)]`` per layer, each ``(N, heads, start, head_dim)``, or None when the
        model's cache is not a plain full-attention DynamicCache.
    """
    N, L = probe.input_ids.shape
    pad = L - probe.attention_mask.long().sum(-1)  # (N,) left padding of each row
    has_r = probe.reasoning_mask.any(-1)
    first_r = torch.where(has_r, probe.reasoning_mask.long().argmax(-1), torch.full_like(pad, L))
    ids, pads, firsts = probe.input_ids.tolist(), pad.tolist(), first_r.tolist()
    groups: dict[tuple, int] = {}  # prompt -> donor row
    keys: list[tuple] = []
    for i in range(N):
        key: tuple = tuple(ids[i][pads[i] : firsts[i]]) if bool(has_r[i]) else ("row", i)
        d = groups.setdefault(key, i)
        if pads[i] < pads[d]:  # equal prompts: a row with less padding sees more of it
            groups[key] = i
        keys.append(key)
    donors = sorted(set(groups.values()))
    slot = {d: k for k, d in enumerate(donors)}
    drows = torch.tensor(donors, dtype=torch.long, device=pad.device)
    which = torch.tensor([slot[groups[key]] for key in keys], dtype=torch.long, device=pad.device)  # (N,)
    _, cache = _logits_tail(
        model,
        1,
        input_ids=probe.input_ids[drows, :start],
        attention_mask=probe.attention_mask[drows, :start],
        position_ids=probe.position_ids[drows, :start],
        use_cache=True,
    )
    kv = _plain_cache_layers(cache)
    if kv is None:
        return None
    cols = torch.arange(start, device=pad.device).unsqueeze(0)  # (1, start)
    src = (cols - pad.unsqueeze(1) + pad[drows][which].unsqueeze(1)).clamp(min=0, max=start - 1)  # (N, start)
    out = []
    for k, v in kv:
        idx = src[:, None, :, None].expand(N, k.shape[1], start, k.shape[3])
        out.append((k.index_select(0, which).gather(2, idx), v.index_select(0, which).gather(2, idx)))
    return out


def gradient_importance(
    model: torch.nn.Module,
    probe: Probe,
    *,
    mode: str = "answer_mean",
    noise_std: float = 1e-3,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    naive: bool = False,
) -> torch.Tensor:
    """OAR-G: gradient x input saliency ``s_t = |sum_h dJ/de_{t,h} * e_{t,h}|``.

    1. clean forward (no grad) -> ``P_0`` (or ``phi_0``);
    2. ``e`` = input embeddings, detached, requiring grad; Gaussian noise ``N(0, noise_std^2)``
       from ``generator`` (the global RNG when None) on reasoning positions only;
    3. forward from ``e + noise``; ``J = sum_rows KL(P_0 || P_noisy)`` (``answer_joint``:
       ``phi_0 - phi_noisy``); rows are independent, so each row's gradient is its own;
    4. ``torch.autograd.grad(J, e)`` only: parameters get no ``.grad``.

    Prefix cache: with ``s`` the first column where any row of a chunk has a reasoning token
    (at most the first column whose logits the outcome needs), columns ``< s`` get no noise and
    no score and (causal model) their keys/values do not depend on later embeddings. So they are
    computed once per prompt (:func:`_shared_prefix_kv`), and steps 1-4 run only on columns
    ``>= s`` with those keys/values (detached, which is exact: the gradient at columns ``>= s`` is
    unchanged). The noise is still drawn for the whole ``(N, L, H)``
    chunk, so a seeded ``generator`` gives the same scores as ``naive=True`` up to float rounding.

    The model runs in eval mode (no dropout) and its train/eval mode is restored afterwards.
    With ``noise_std=0`` the KL modes give exactly zero (the KL gradient vanishes at ``P_0``);
    ``answer_joint`` then gives the plain gradient x input of ``phi`` and is deterministic.

    Args:
        model: causal LM with ``get_input_embeddings`` and ``inputs_embeds`` support.
        probe: the outcome probe.
        mode: ``answer_mean`` (default) | ``last`` | ``answer_joint``.
        noise_std: standard deviation of the embedding noise.
        generator: torch generator for the noise (on the model's device).
        chunk_size: rows per forward/backward (None = all answered rows at once).
        naive: run the noisy forward over the whole probe instead of reusing the clean prefix's
            KV cache. The cached path needs a plain full-attention ``DynamicCache``
            (Llama/Qwen2-like models); for other caches it warns and falls back to the naive path.

    Returns:
        ``(B, L)`` float32 scores on the probe's device, 0 where ``probe.reasoning_mask`` is 0.
    """
    _check_mode(mode, "gradient_importance")
    if noise_std < 0:
        raise ValueError(f"oar.credit.importance.gradient_importance: noise_std must be >= 0, got {noise_std}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"oar.credit.importance.gradient_importance: chunk_size must be >= 1, got {chunk_size}")
    scores = torch.zeros(probe.input_ids.shape, dtype=torch.float32, device=probe.input_ids.device)
    rows_all, sub_all = _answered(probe)
    if rows_all.numel() == 0 or not bool(sub_all.reasoning_mask.any()):
        return scores
    dev = _model_device(model)
    step = rows_all.numel() if chunk_size is None else chunk_size
    embed = model.get_input_embeddings()
    with _eval_mode(model):
        for g0 in range(0, rows_all.numel(), step):
            rows = rows_all[g0 : g0 + step]
            sub = probe.select(rows).to(dev)
            s = _oar_g_group(model, embed, sub, mode=mode, noise_std=noise_std, generator=generator, naive=naive)
            # the group's probe may have dropped leading pad columns: align on the right
            scores[rows, scores.shape[1] - s.shape[1] :] = s.to(scores.device)
    return scores * probe.reasoning_mask


def _oar_g_group(
    model: torch.nn.Module,
    embed: torch.nn.Module,
    sub: Probe,
    *,
    mode: str,
    noise_std: float,
    generator: torch.Generator | None,
    naive: bool,
) -> torch.Tensor:
    """OAR-G scores ``(N, L)`` of a probe whose rows all have an answer (on the model device);
    columns before the noisy forward's first column are 0."""
    N, L = sub.input_ids.shape
    keep = _keep(sub)
    tail = L - keep
    pos = sub.position_ids
    start = 0 if naive else _noise_start(sub.reasoning_mask, tail)
    prefix = None
    with torch.no_grad():
        if start > 0:
            prefix = _shared_prefix_kv(model, sub, start)
            if prefix is None:
                _warn_naive_fallback("gradient_importance", stacklevel=4)
                start = 0
        logits0, _ = _logits_tail(
            model,
            keep,
            input_ids=sub.input_ids[:, start:],
            attention_mask=sub.attention_mask,
            position_ids=pos[:, start:],
            cache=None if prefix is None else _make_cache(prefix),
        )
        out0 = outcome(logits0, tail, sub.input_ids, sub.answer_mask, sub.last_index, mode)
        e = embed(sub.input_ids[:, start:]).detach()
    e.requires_grad_(True)
    # drawn over the whole chunk (N, L, H) whatever ``start``: the same RNG use as the naive path
    noise_dev = generator.device if generator is not None else e.device
    noise = torch.randn((N, L, e.shape[-1]), generator=generator, device=noise_dev, dtype=torch.float32)
    noise = (noise[:, start:].to(e.device) * noise_std * sub.reasoning_mask[:, start:].unsqueeze(-1)).to(e.dtype)
    with torch.enable_grad():
        logits1, _ = _logits_tail(
            model,
            keep,
            inputs_embeds=e + noise,
            attention_mask=sub.attention_mask,
            position_ids=pos[:, start:],
            cache=None if prefix is None else _make_cache(prefix),
        )
        out1 = outcome(logits1, tail, sub.input_ids, sub.answer_mask, sub.last_index, mode)
        J = _divergence(out0, out1, mode).sum()
        (grad,) = torch.autograd.grad(J, e)
    out = torch.zeros((N, L), dtype=torch.float32, device=sub.input_ids.device)
    out[:, start:] = (grad.float() * e.detach().float()).sum(-1).abs()
    return out


# --------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------

_COMMON_OPTIONS = ("norm_by_std", "eps", "quantile", "beta", "floor", "preserve_mass", "mode", "conclude")


def _oar_estimator(name: str, batch: CreditBatch, options: dict[str, Any]) -> CreditResult:
    from oar.credit.advantages import check_options, grpo_advantages
    from oar.credit.reshape import bilevel_weights

    extra = ("chunk_size",) if name == "oar_p" else ("noise_std", "seed", "chunk_size")
    check_options(name, options, _COMMON_OPTIONS + extra)
    for field in ("model", "tokenizer", "prompt_ids"):
        if getattr(batch, field) is None:
            raise ValueError(f"estimator {name!r}: CreditBatch.{field} is None (the OAR probe needs it)")
    mode = options.get("mode", "last" if name == "oar_p" else "answer_mean")
    _check_mode(mode, name)

    A = grpo_advantages(
        batch.rewards,
        batch.group_ids,
        norm_by_std=bool(options.get("norm_by_std", True)),
        eps=float(options.get("eps", 1e-6)),
    )
    rmask = batch.response_mask
    B, T = batch.response_ids.shape
    t_probe = time.perf_counter()
    probe = build_probe(
        batch.tokenizer,
        batch.prompt_ids,
        batch.response_ids,
        conclude=options.get("conclude", DEFAULT_CONCLUDE),
        prompt_mask=batch.prompt_mask,
        response_mask=rmask,
    )
    # Only responses with an answer and a nonzero advantage need importance scores.
    active = probe.has_answer & (A.to(probe.has_answer.device) != 0)
    scores = torch.zeros_like(probe.input_ids, dtype=torch.float32)
    t0 = time.perf_counter()
    probe_seconds = t0 - t_probe
    if bool(active.any()):
        sub = probe.select(active)
        if name == "oar_p":
            s = perturbation_importance(
                batch.model, sub, mode=mode, chunk_size=int(options.get("chunk_size", 128))
            )
        else:
            seed = options.get("seed")
            gen = None
            if seed is not None:
                gen = torch.Generator(device=_model_device(batch.model)).manual_seed(int(seed))
            cs = options.get("chunk_size")
            s = gradient_importance(
                batch.model,
                sub,
                mode=mode,
                noise_std=float(options.get("noise_std", 1e-3)),
                generator=gen,
                chunk_size=None if cs is None else int(cs),
            )
        if mode == "answer_joint":
            # phi differences are signed; the reshaping uses the size of the influence
            # (our choice, like the KL modes and OAR-G's |.|; bilevel_weights needs s > -1).
            s = s.abs()
        rows = active.nonzero().flatten()
        scores[rows, scores.shape[1] - s.shape[1] :] = s
    seconds = time.perf_counter() - t0

    scores_resp = probe.to_response(scores, T)
    reason_resp = probe.to_response(probe.reasoning_mask.float(), T)
    w = bilevel_weights(
        scores_resp.to(rmask.device),
        reason_resp.to(rmask.device),
        quantile=float(options.get("quantile", 0.25)),
        beta=float(options.get("beta", 1.0)),
        floor=float(options.get("floor", 0.1)),
        preserve_mass=bool(options.get("preserve_mass", True)),
    )
    m = rmask.to(w.dtype)
    # Rows that were not scored (no answer, or A_i == 0): weight 1 on every response token.
    weights = torch.where(active.to(w.device).unsqueeze(-1), w, torch.ones_like(w)) * m
    token_adv = A.to(weights.dtype).unsqueeze(-1) * weights
    return CreditResult(
        token_advantages=token_adv,
        seq_advantages=A,
        weights=weights,
        stats={
            "importance_s": float(seconds),
            "probe_s": float(probe_seconds),
            "probe_fraction": float(probe.has_answer.float().mean()) if B else 0.0,
            "scored_fraction": float(active.float().mean()) if B else 0.0,
        },
    )


@register_estimator("oar_p")
def oar_p_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """OAR-P: GRPO advantage reshaped by perturbation importance (METHODS 4.2, 4.4).

    Options: ``norm_by_std`` (True), ``eps`` (1e-6), ``quantile`` (0.25), ``beta`` (1.0),
    ``floor`` (0.1), ``preserve_mass`` (True), ``mode`` (``last``), ``conclude``
    (:data:`oar.credit.probe.DEFAULT_CONCLUDE`), ``chunk_size`` (128).

    Weights are 1 on response tokens of rows without an answer or with ``A_i == 0`` (not
    scored), 0 on padding. In ``answer_joint`` mode the reshaping uses
    ``|phi_orig - phi_masked|``. Stats: ``importance_s`` (model time), ``probe_s`` (probe
    construction), ``probe_fraction`` (share of responses with an answer), ``scored_fraction``
    (share actually scored).
    """
    return _oar_estimator("oar_p", batch, options)


@register_estimator("oar_g")
def oar_g_estimator(batch: CreditBatch, **options: Any) -> CreditResult:
    """OAR-G: GRPO advantage reshaped by gradient x input saliency (METHODS 4.3, 4.4).

    Options: as ``oar_p`` but ``mode`` defaults to ``answer_mean``, plus ``noise_std`` (1e-3),
    ``seed`` (None: global RNG; an int seeds a fresh generator on the model's device) and
    ``chunk_size`` (None: all scored rows in one forward/backward).
    """
    return _oar_estimator("oar_g", batch, options)
