"""OAR-G: input-gradient saliency (docs/methods.md, 4.3 OAR-G: input-gradient proxy), with per-response noise and a
variance-reduced variant.

:func:`gradient_importance` takes gradient x input saliency of the outcome divergence with respect
to the input embeddings. Per response ``i`` and draw ``j = 1..k`` (``draws``), one row of the
batched forward/backward evaluates the model at

- ``e + eps_ij`` (``baseline=None``, the paper's OAR-G; ``k = 1``): ``eps_ij ~ N(0, noise_std^2)``
  on reasoning positions, saliency ``s_t = mean_j |sum_h g_ijth e_th|`` (``k > 1``: the mean over
  ``k`` noise draws, a variance-reduced estimate of the same quantity);
- ``b + alpha_j (e - b) + eps_ij`` (``baseline="pad"`` or ``"zero"``: integrated gradients along
  the straight path from a baseline embedding ``b`` -- the pad token's embedding, OAR-P's neutral
  token, or 0 -- on reasoning positions, midpoint rule ``alpha_j = (j - 1/2) / k``): saliency
  ``s_t = |sum_h (e_th - b_h) mean_j g_ijth|``. Off the clean point the KL's gradient does not
  vanish, so the path needs no noise (``noise_std=0``: deterministic).

``g_ij = dJ_i/dx`` with ``J_i = KL(P_0 || P(x))`` (``answer_joint``: ``phi_0 - phi(x)``). The ``k``
rows of a response run in one batched forward and one backward.

Per-response noise: the noise of response ``i`` comes from its own generator, seeded by
``mix_seed(base_seed, row_keys[i], j)`` for draw ``j`` (:func:`draw_noise`), ``n_reasoning_i x H``
values placed on its reasoning positions in order, so a response's scores do not depend on how rows are split into
chunks or processes, nor on its padding. The estimator uses ``base_seed = mix_seed(seed, step)`` and
a key per (group id, rank of the response in its group) (:func:`noise_keys`).

Clean forward: only the KL modes need it (``P_0``). In ``answer_joint`` mode ``phi_0`` is a
constant of ``J``, so its gradient is ``-dphi/dx`` and no clean forward runs (identical scores,
one forward fewer; the rollout's log-probs are not needed for it either).

Prefix cache: positions before the first reasoning position of a chunk get no noise and no score,
so their keys/values are computed once per prompt (the responses of a prompt share them,
:func:`_shared_prefix_kv`) and the forward/backward runs only from that position on
(``naive=True``: full forwards; the two agree to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar.credit.importance.common import (
    answered,
    check_mode,
    divergence,
    eval_mode,
    logits_to_keep,
    logits_tail,
    make_cache,
    model_device,
    plain_cache_layers,
    warn_naive_fallback,
    outcome,
)
from oar.credit.probe import Probe

__all__ = ["BASELINES", "OarGOptions", "draw_noise", "gradient_importance", "mix_seed", "noise_keys", "oar_g_scores"]

#: Path baselines of :func:`gradient_importance` (None: noise draws around the clean embeddings).
BASELINES: tuple[str, ...] = ("pad", "zero")


@dataclass(frozen=True)
class OarGOptions:
    """OAR-G's scoring options, the one place their defaults are written (the ``oar_g`` estimator's,
    its nulls', ``mc_value``'s ``refine`` and the attribution benchmark's ``oar_g`` signals').

    Attributes:
        mode: outcome mode (:data:`oar.credit.importance.MODES`).
        noise_std: std of the embedding noise on reasoning positions.
        seed: base seed of the per-response noise; None: the caller's (the trainer's run seed
            combined with the step, the benchmark's seed), and the global RNG without one.
        chunk_size: responses per forward/backward (None: grouped by ``chunk_tokens``).
        chunk_tokens: with ``chunk_size`` None, at most this many computed positions per
            forward/backward (None: all rows in one chunk).
        draws: rows per response (noise draws, or path points with a ``baseline``).
        baseline: None | :data:`BASELINES` (integrated gradients from that embedding).
        conclude: the probe's conclude string; None: the caller's (as :class:`OarPOptions`).
    """

    mode: str = "answer_mean"
    noise_std: float = 1e-3
    seed: int | None = None
    chunk_size: int | None = None
    chunk_tokens: int | None = 512
    draws: int = 1
    baseline: str | None = None
    conclude: str | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode, "OarGOptions")
        if isinstance(self.draws, bool) or not isinstance(self.draws, int) or self.draws < 1:
            raise ValueError(f"oar.credit.importance.OarGOptions: draws must be an int >= 1, got {self.draws!r}")
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(f"oar.credit.importance.OarGOptions: unknown baseline {self.baseline!r}; use None or "
                             f"one of {list(BASELINES)}")
        object.__setattr__(self, "noise_std", float(self.noise_std))
        for key in ("seed", "chunk_size", "chunk_tokens"):
            v = getattr(self, key)
            object.__setattr__(self, key, None if v is None else int(v))


def oar_g_scores(model: torch.nn.Module, probe: Probe, options: OarGOptions,
                 row_keys: torch.Tensor | None = None) -> torch.Tensor:
    """OAR-G's scores of ``probe`` under ``options`` (:func:`gradient_importance`, ``options.seed``
    the base seed), the scorer of the ``oar_g`` estimator and of the benchmark's ``oar_g`` signals.

    Returns:
        ``(B, L)`` float32 on the probe's device.
    """
    return gradient_importance(model, probe, mode=options.mode, noise_std=options.noise_std, seed=options.seed,
                               row_keys=row_keys, draws=options.draws, baseline=options.baseline,
                               chunk_size=options.chunk_size, chunk_tokens=options.chunk_tokens)

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from a tuple of integers (splitmix64 chained over the parts): different tuples
    give unrelated seeds, e.g. ``mix_seed(step_seed, key)`` for one response's noise."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _M64))
    return h & ((1 << 63) - 1)


def noise_keys(group_ids: torch.Tensor) -> torch.Tensor:
    """A key per response: ``mix_seed(group_id, r)`` with ``r`` the rank of the response among the
    rows of its group (in row order), so the key does not depend on which other rows are scored.

    Args:
        group_ids: ``(B,)`` long group (prompt) id of each response.
    Returns:
        ``(B,)`` long keys on the CPU.
    """
    seen: dict[int, int] = {}
    out = []
    for g in group_ids.tolist():
        r = seen.get(int(g), 0)
        seen[int(g)] = r + 1
        out.append(mix_seed(int(g), r))
    return torch.tensor(out, dtype=torch.long)


def draw_noise(
    base_seed: int, key: int, n_tokens: int, hidden: int, draws: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard normal noise of one response: ``(draws, n_tokens, hidden)`` float32, draw ``j`` from
    a generator on ``device`` seeded by ``mix_seed(base_seed, key, j)`` (so a draw does not depend
    on ``draws``, nor on the rows it is batched with)."""
    out = torch.empty((draws, n_tokens, hidden), device=device, dtype=torch.float32)
    for j in range(draws):
        g = torch.Generator(device=device).manual_seed(mix_seed(base_seed, key, j))
        torch.randn((n_tokens, hidden), generator=g, device=device, dtype=torch.float32, out=out[j])
    return out


def _first_reasoning(reasoning_mask: torch.Tensor, default: int) -> torch.Tensor:
    """``(N,)`` first reasoning column of each row of an ``(N, L)`` mask; ``default`` for a row without one."""
    first = reasoning_mask.long().argmax(-1)
    return torch.where(reasoning_mask.any(-1), first, torch.full_like(first, default))


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
    first_r = _first_reasoning(probe.reasoning_mask, L)
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
    _, cache = logits_tail(
        model,
        1,
        input_ids=probe.input_ids[drows, :start],
        attention_mask=probe.attention_mask[drows, :start],
        position_ids=probe.position_ids[drows, :start],
        use_cache=True,
    )
    kv = plain_cache_layers(cache)
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
    mode: str = OarGOptions.mode,
    noise_std: float = OarGOptions.noise_std,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    row_keys: torch.Tensor | None = None,
    draws: int = 1,
    baseline: str | None = None,
    chunk_size: int | None = None,
    chunk_tokens: int | None = None,
    naive: bool = False,
) -> torch.Tensor:
    """OAR-G: gradient x input saliency ``s_t = |sum_h dJ/de_{t,h} * e_{t,h}|`` (module doc).

    1. clean forward (no grad) -> ``P_0`` (KL modes only; ``answer_joint`` needs no ``phi_0``);
    2. ``x`` = input embeddings plus Gaussian noise ``N(0, noise_std^2)`` on reasoning positions
       (``k = draws`` rows per response, each with its own draw; with a ``baseline``, the
       reasoning embeddings are moved to the ``k`` midpoints of the path from the baseline);
    3. forward from ``x``; ``J = sum_rows KL(P_0 || P(x))`` (``answer_joint``: ``phi_0 - phi(x)``);
       rows are independent, so each row's gradient is its own;
    4. ``torch.autograd.grad(J, x)`` only: parameters get no ``.grad``.

    The model runs in eval mode (no dropout) and its train/eval mode is restored afterwards.
    With ``noise_std=0`` and no baseline the KL modes give exactly zero (the KL gradient vanishes
    at ``P_0``); ``answer_joint`` then gives the plain gradient x input of ``phi`` and is
    deterministic.

    Cost, counting a backward as two forwards, of ``n`` responses: prefix forward (once per
    prompt) + ``n`` clean rows (KL modes) + ``3 k n`` rows for the forward/backward, on the
    columns from the chunk's first reasoning position. One default pass (``k = 1``, KL mode) is
    ``4 n``; ``answer_joint`` with ``k = 1`` is ``3 n`` (0.75x), ``k = 2`` ``6 n`` (1.5x); a KL
    mode with ``k = 2`` ``7 n`` (1.75x).

    Args:
        model: causal LM with ``get_input_embeddings`` and ``inputs_embeds`` support.
        probe: the outcome probe (``B`` rows).
        mode: ``answer_mean`` (default) | ``last`` | ``answer_joint``.
        noise_std: standard deviation of the embedding noise.
        generator: where the base seed comes from when ``seed`` is None (one draw from it per
            call; None and no ``seed``: the global RNG).
        seed: base seed of the per-response noise (:func:`draw_noise`).
        row_keys: ``(B,)`` long key of each row's noise (default: the row index); rows with equal
            keys get the same noise.
        draws: ``k >= 1`` rows per response (noise draws, or path points with a baseline).
        baseline: None (noise draws around the clean embeddings) | ``pad`` | ``zero`` (integrated
            gradients from the pad token's embedding or from 0).
        chunk_size: responses per forward/backward (None = all answered rows at once, or grouped by
            ``chunk_tokens``); a forward holds ``chunk_size * draws`` sequences.
        chunk_tokens: with ``chunk_size`` None: group the answered rows by the length each must run
            (from its first reasoning position to the end), longest first, into chunks of at most
            ``chunk_tokens`` computed positions (``rows x longest x draws``):
            :func:`oar.models.packing.group_by_length`. Rows of a left-padded probe then no longer compute
            the padding and prompt tokens of the longer rows beside them. None: one chunk.
        naive: run the forward over the whole probe instead of reusing the prompt prefix's KV
            cache. The cached path needs a plain full-attention ``DynamicCache``
            (Llama/Qwen2-like models); for other caches it warns and falls back to the naive path.

    Returns:
        ``(B, L)`` float32 scores on the probe's device, 0 where ``probe.reasoning_mask`` is 0.
    """
    B = probe.input_ids.shape[0]
    keys = _check_arguments(mode, noise_std, chunk_size, chunk_tokens, draws, baseline, row_keys, B).cpu()
    seed = _base_seed(seed, generator)
    scores = torch.zeros(probe.input_ids.shape, dtype=torch.float32, device=probe.input_ids.device)
    rows_all, sub_all = answered(probe)
    if rows_all.numel() == 0 or not bool(sub_all.reasoning_mask.any()):
        return scores
    dev, embed = model_device(model), model.get_input_embeddings()
    with eval_mode(model):
        for rows in _chunks(sub_all, rows_all, chunk_size, chunk_tokens, int(draws)):
            sub = probe.select(rows).to(dev)
            s = _oar_g_group(model, embed, sub, keys[rows.cpu()].tolist(), mode=mode, noise_std=noise_std,
                             seed=int(seed), draws=int(draws), baseline=baseline, naive=naive)
            # the group's probe may have dropped leading pad columns: align on the right
            scores[rows, scores.shape[1] - s.shape[1] :] = s.to(scores.device)
    return scores * probe.reasoning_mask


def _base_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """``seed``, or (None) one draw from ``generator`` (the global RNG without one)."""
    if seed is not None:
        return seed
    src = generator
    return int(torch.randint(0, 2**62, (1,), generator=src, device=src.device if src is not None else "cpu"))


def _check_arguments(mode: str, noise_std: float, chunk_size: int | None, chunk_tokens: int | None, draws: int,
                     baseline: str | None, row_keys: torch.Tensor | None, B: int) -> torch.Tensor:
    """Raise ``ValueError`` for an argument :func:`gradient_importance` cannot take; the ``(B,)`` row keys."""
    check_mode(mode, "gradient_importance")
    if noise_std < 0:
        raise ValueError(f"oar.credit.importance.gradient_importance: noise_std must be >= 0, got {noise_std}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"oar.credit.importance.gradient_importance: chunk_size must be >= 1, got {chunk_size}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"oar.credit.importance.gradient_importance: chunk_tokens must be >= 1, got {chunk_tokens}")
    if int(draws) < 1:
        raise ValueError(f"oar.credit.importance.gradient_importance: draws must be >= 1, got {draws}")
    if baseline is not None and baseline not in BASELINES:
        raise ValueError(
            f"oar.credit.importance.gradient_importance: unknown baseline {baseline!r}; use None or one of {list(BASELINES)}"
        )
    if row_keys is None:
        return torch.arange(B, dtype=torch.long)
    if row_keys.shape != (B,):
        raise ValueError(
            f"oar.credit.importance.gradient_importance: row_keys shape {tuple(row_keys.shape)} != ({B},)"
        )
    return row_keys


def _chunks(sub: Probe, rows: torch.Tensor, chunk_size: int | None, chunk_tokens: int | None,
            draws: int) -> list[torch.Tensor]:
    """Row chunks of :func:`gradient_importance`: consecutive ``chunk_size`` rows, or (``chunk_size``
    None) groups of similar run length under ``chunk_tokens`` positions, or all rows.

    Args:
        sub: the probe's answered rows (``R`` rows, aligned with ``rows``); rows: ``(R,)`` their
            indices in the full probe.
    """
    if chunk_size is not None:
        return [rows[g0 : g0 + chunk_size] for g0 in range(0, rows.numel(), chunk_size)]
    if chunk_tokens is None or rows.numel() <= 1:
        return [rows]
    from oar.models.packing import group_by_length

    L = sub.reasoning_mask.shape[1]
    lengths = (L - _first_reasoning(sub.reasoning_mask, L - 1)).tolist()
    groups = group_by_length(lengths, max_rows=rows.numel(), max_tokens=max(1, chunk_tokens // max(1, draws)))
    return [rows[torch.tensor(g, dtype=torch.long)] for g in groups]


def _oar_g_group(
    model: torch.nn.Module,
    embed: torch.nn.Module,
    sub: Probe,
    keys: list[int],
    *,
    mode: str,
    noise_std: float,
    seed: int,
    draws: int,
    baseline: str | None,
    naive: bool,
) -> torch.Tensor:
    """OAR-G scores ``(N, L)`` of a probe whose rows all have an answer (on the model device);
    columns before the forward's first column are 0. ``keys``: the ``N`` rows' noise keys."""
    N, L = sub.input_ids.shape
    k = draws
    keep = logits_to_keep(sub)
    tail = L - keep
    pos = sub.position_ids
    start = 0 if naive else _noise_start(sub.reasoning_mask, tail)
    prefix = None
    with torch.no_grad():
        if start > 0:
            prefix = _shared_prefix_kv(model, sub, start)
            if prefix is None:
                warn_naive_fallback("gradient_importance", stacklevel=4)
                start = 0
        out0 = None
        if mode != "answer_joint":  # phi_0 is a constant of J: its gradient needs no clean forward
            logits0, _ = logits_tail(
                model,
                keep,
                input_ids=sub.input_ids[:, start:],
                attention_mask=sub.attention_mask,
                position_ids=pos[:, start:],
                cache=None if prefix is None else make_cache(prefix),
            )
            out0 = outcome(logits0, tail, sub.input_ids, sub.answer_mask, sub.last_index, mode)
        e = embed(sub.input_ids[:, start:]).detach()  # (N, L', H)
        x, diff = _noisy_inputs(embed, sub, e, keys, start=start, noise_std=noise_std, seed=seed, draws=k,
                                baseline=baseline)
        H = e.shape[-1]
        x = x.reshape(N * k, L - start, H).contiguous()
    x.requires_grad_(True)

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t if k == 1 else t.repeat_interleave(k, 0)

    cache = None
    if prefix is not None:
        cache = make_cache([(rep(kk), rep(vv)) for kk, vv in prefix])
    with torch.enable_grad():
        logits1, _ = logits_tail(
            model,
            keep,
            inputs_embeds=x,
            attention_mask=rep(sub.attention_mask),
            position_ids=rep(pos[:, start:]),
            cache=cache,
        )
        out1 = outcome(logits1, tail, rep(sub.input_ids), rep(sub.answer_mask), rep(sub.last_index), mode)
        J = -out1.sum() if out0 is None else divergence(rep(out0), out1, mode).sum()
        (grad,) = torch.autograd.grad(J, x)
    g = grad.float().view(N, k, L - start, H)
    out = torch.zeros((N, L), dtype=torch.float32, device=sub.input_ids.device)
    if diff is None:
        out[:, start:] = (g * e.float().unsqueeze(1)).sum(-1).abs().mean(1)
    else:
        out[:, start:] = (g.mean(1) * diff.float()).sum(-1).abs()
    return out


def _noisy_inputs(embed: torch.nn.Module, sub: Probe, e: torch.Tensor, keys: list[int], *, start: int,
                  noise_std: float, seed: int, draws: int, baseline: str | None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(N, k, L', H)`` inputs of :func:`_oar_g_group`'s noisy forward: the clean embeddings ``e``
    (columns from ``start``) moved to the path points of ``baseline`` on reasoning positions, plus each
    row's noise; and ``e - b`` (None without a baseline)."""
    N, L = sub.input_ids.shape
    k = draws
    rm = sub.reasoning_mask[:, start:]  # (N, L')
    H = e.shape[-1]
    x = e.unsqueeze(1).expand(N, k, *e.shape[1:])  # (N, k, L', H)
    diff = None
    if baseline is not None:
        if baseline == "pad":
            b = embed(torch.tensor([sub.pad_token_id], device=e.device)).detach()[0]
        else:
            b = torch.zeros(H, dtype=e.dtype, device=e.device)
        diff = e - b  # (N, L', H)
        alphas = (torch.arange(k, device=e.device, dtype=torch.float32) + 0.5) / k
        path = b + alphas.to(e.dtype)[None, :, None, None] * diff.unsqueeze(1)
        x = torch.where(rm[:, None, :, None], path, x)
    if noise_std > 0:
        r_idx, c_idx = rm.nonzero(as_tuple=True)  # row-major: each row's reasoning in order
        counts = rm.sum(-1).tolist()
        vals = torch.cat(
            [draw_noise(seed, keys[i], counts[i], H, k, device=e.device).transpose(0, 1) for i in range(N)], 0
        )  # (sum n_r, k, H)
        noise = torch.zeros((N, L - start, k, H), dtype=torch.float32, device=e.device)
        noise[r_idx, c_idx] = vals
        x = x + (noise.transpose(1, 2) * noise_std).to(e.dtype)
    return x, diff
