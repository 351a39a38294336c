"""Micro-batch layouts of the policy update (``train.packing``): how (prompt, response) sequences are
laid out for a forward, and the log-probs of their response tokens.

Four layouts, chosen by one key and built by one function (:func:`plan_micro_batches`):

- ``none``: the rollout's own layout, ``[left-padded prompt | right-padded response]``, chunks of
  ``micro_batch_size`` rows in the given order, each row padded to the longest prompt of the batch
  and the longest response of the chunk; logits of the last ``T + 1`` positions.
- ``length_grouped``: each row is one sequence, prompt and response tokens contiguous
  from position 0, padded on the right only; the rows sorted by length (longest first) and cut into
  micro-batches of at most ``micro_batch_tokens`` positions (rows x longest row, padding included)
  and ``micro_batch_size`` sequences. With right padding only a causal model needs no attention
  mask (a real token never sees a later one), so the forward takes sdpa's ``is_causal`` path.
- ``packed``: several sequences per row, first-fit decreasing into rows of at most ``pack_length``
  tokens (null: one row per micro-batch), position ids restarting at 0 for each sequence and no
  attention mask: transformers builds the block-diagonal causal mask from the restarts
  (``masking_utils.find_packed_sequence_indices``; flash-attention's varlen kernel on a GPU, which
  needs one row). A dense block mask on CPU sdpa costs ``rows x pack_length^2``, so long packed rows
  can cost more than the padding they save.
- ``shared_prompt`` (default): the ``n`` responses of a prompt share one copy of it, in a row
  ``[prompt | response 1 | response 2 | ...]`` (positions ``p..p+r-1`` for every response), each
  response attending to the prompt and causally to itself (a 4-D mask, sdpa or eager attention):
  the prompt's positions are computed once per group, not ``n`` times, and its last position's
  logits once for the ``n`` first response tokens. Rows (a prompt copy per at most
  ``micro_batch_size`` responses and ``micro_batch_tokens`` tokens) are grouped by length as in
  ``length_grouped``. How many positions it saves on the tiny default batch and on SmolLM2's
  few-shot prompts: benchmarks/README.md, "Measured numbers".

In every layout but ``none`` the lm_head (and the log-softmax) runs only on the positions that
predict a response token: ``logits_to_keep`` as a boolean ``(rows, length)`` mask, which
transformers' causal LMs apply to the last hidden states before the lm_head
(``slice_logits_to_keep``), inside the wrapped root module's forward, so FSDP2's root pre-forward hook still gathers the lm_head and DDP
still sees one forward. A model without ``logits_to_keep`` computes all logits, then selects.

Positions are those of the rollout (``cumsum(mask) - 1``: the prompt starts at 0 whatever its left
padding), so every layout gives the same log-probs up to float rounding.
"""

from __future__ import annotations

import functools

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "PACKINGS",
    "MicroBatch",
    "plan_micro_batches",
    "group_by_length",
    "pack_first_fit",
    "micro_batch_logprobs",
    "padding_report",
    "accepts_logits_to_keep",
]

#: Values of ``train.packing``.
PACKINGS: tuple[str, ...] = ("none", "length_grouped", "packed", "shared_prompt")


@dataclass
class MicroBatch:
    """One forward's inputs and where its outputs go.

    Attributes:
        rows: ``(b,)`` long, the rollout rows of its sequences, in the order of the ``(b, T)`` outputs.
        T: response width of the ``(b, T)`` outputs (the longest response of the micro-batch).
        input_ids, position_ids: ``(R, L)`` long, the model's input rows.
        attention_mask: ``(R, L)`` long for ``none``; ``(R, 1, L, L)`` bool (True: may attend) for
            ``shared_prompt``; None for ``length_grouped`` and ``packed``.
        logits_to_keep: ``T + 1`` (int, last positions) for ``none``; ``(R, L)`` bool otherwise,
            True at the ``K`` positions whose next token is a response token.
        targets: ``(b, T)`` response ids for ``none``; ``(K,)`` the response token each kept position
            predicts, in row-major order of ``logits_to_keep``, otherwise.
        index: ``(K,)`` long, flat index into ``(b, T)`` of each target token (None for ``none``).
        src: ``(K,)`` long, the kept position (row of the kept logits) that predicts each target
            token; None when it is the ``k``-th kept position itself (``shared_prompt``: a prompt's
            last position predicts the first token of every response of its group).
        real_tokens: prompt + response tokens of its sequences.
        computed_tokens: positions the decoder computes (``R x L``, padding included).
        logit_rows: positions the lm_head and log-softmax compute.
    """

    rows: torch.Tensor
    T: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logits_to_keep: int | torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor | None
    real_tokens: int
    computed_tokens: int
    logit_rows: int
    src: torch.Tensor | None = None


def group_by_length(lengths: Sequence[int], *, max_rows: int, max_tokens: int | None,
                    sizes: Sequence[int] | None = None) -> list[list[int]]:
    """Cut sequences, sorted longest first, into consecutive groups of at most ``max_rows`` sequences
    whose padded size (``rows x longest``) is at most ``max_tokens`` (None: no token limit; a
    sequence longer than ``max_tokens`` forms a group of its own): the fewest groups, and among
    those the fewest padded positions (exact, by dynamic programming over the sorted lengths).

    Args:
        lengths: ``(n,)`` sequence lengths.
        sizes: ``(n,)`` sequences each item holds (a shared-prompt row holds several), counted
            against ``max_rows``; default 1 each.
    Returns:
        Groups of indices into ``lengths``; every index appears once, each group longest first.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ls = [lengths[i] for i in order]
    sz = [1 if sizes is None else sizes[i] for i in order]
    n = len(ls)
    # best[i]: (groups, padded positions) of the first i sorted sequences; cut[i]: start of the last group
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        held = 0
        for j in range(i - 1, -1, -1):  # last group = sorted j .. i-1, width ls[j]
            size, held = i - j, held + sz[j]
            if size > 1 and (held > max_rows or (max_tokens is not None and size * ls[j] > max_tokens)):
                break  # a larger group (smaller j) is wider and longer still
            cand = (best[j][0] + 1, best[j][1] + size * ls[j])
            if cand < best[i]:
                best[i], cut[i] = cand, j
    groups: list[list[int]] = []
    i = n
    while i > 0:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]


def pack_first_fit(lengths: Sequence[int], capacity: int | None) -> list[list[int]]:
    """First-fit decreasing bin packing of sequences into rows of at most ``capacity`` tokens
    (None: all in one row); a sequence longer than ``capacity`` gets a row of its own.

    Returns:
        Rows of indices into ``lengths`` (each in the order placed).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if capacity is None:
        return [order] if order else []
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def _sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
               response_mask: torch.Tensor, rows: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Each row's contiguous ``prompt + response`` tokens and its prompt length.

    The response mask is a prefix (the rollout's: tokens up to and including eos), so the first
    ``response_mask.sum()`` response tokens are the response."""
    out = []
    for i in rows:
        p = prompt_ids[i][prompt_mask[i].bool()]
        r = response_ids[i][: int(response_mask[i].sum())]
        out.append((torch.cat([p, r]), p.numel()))
    return out


def _padded_micro_batch(prompt_ids, prompt_mask, response_ids, response_mask, rows: list[int]) -> MicroBatch:
    """The ``none`` layout: ``[left-padded prompt | right-padded response]`` trimmed to the chunk's
    longest response."""
    r = torch.as_tensor(rows, dtype=torch.long)
    rmask = response_mask[r]
    T = int(rmask.sum(1).max().clamp(min=1)) if len(rows) else 1
    resp, rmask = response_ids[r, :T], rmask[:, :T]
    input_ids = torch.cat([prompt_ids[r], resp], dim=1)
    attn = torch.cat([prompt_mask[r], rmask], dim=1)
    position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
    return MicroBatch(rows=r, T=T, input_ids=input_ids, position_ids=position_ids, attention_mask=attn,
                      logits_to_keep=T + 1, targets=resp, index=None, real_tokens=int(attn.sum()),
                      computed_tokens=input_ids.numel(), logit_rows=len(rows) * (T + 1))


def _free_micro_batch(seqs: list[tuple[torch.Tensor, int]], rows: list[int], layout: list[list[int]],
                      *, packed: bool, pad_id: int) -> MicroBatch:
    """Rows of ``layout`` (indices into ``seqs``/``rows``), no internal padding, right padding only.

    In a packed row each sequence's positions start at 0; the trailing padding restarts at 0 too (a
    block of its own that no real token sees). A row of one sequence has positions ``0..L-1``."""
    T = max([seqs[j][0].numel() - seqs[j][1] for row in layout for j in row] + [1])
    L = max(sum(seqs[j][0].numel() for j in row) for row in layout)
    R = len(layout)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.arange(L).repeat(R, 1)
    keep = torch.zeros((R, L), dtype=torch.bool)
    order = [j for row in layout for j in row]  # output row b of sequence j: its rank in this order
    out_row = {j: b for b, j in enumerate(order)}
    targets, index = [], []
    for ri, row in enumerate(layout):
        o = 0
        for j in row:
            ids, p = seqs[j]
            n = ids.numel()
            input_ids[ri, o : o + n] = ids
            position_ids[ri, o : o + n] = torch.arange(n)
            if n > p:  # positions o+p-1 .. o+n-2 predict response tokens 0 .. n-p-1
                keep[ri, o + p - 1 : o + n - 1] = True
                targets.append(ids[p:])
                index.append(out_row[j] * T + torch.arange(n - p))
            o += n
        if packed and o < L:
            position_ids[ri, o:] = torch.arange(L - o)
    real = sum(seqs[j][0].numel() for j in order)
    return MicroBatch(rows=torch.as_tensor([rows[j] for j in order], dtype=torch.long), T=T, input_ids=input_ids,
                      position_ids=position_ids, attention_mask=None, logits_to_keep=keep,
                      targets=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long),
                      index=torch.cat(index) if index else torch.zeros(0, dtype=torch.long),
                      real_tokens=real, computed_tokens=R * L, logit_rows=int(keep.sum()))


def _shared_prompt_micro_batch(prompts: list[torch.Tensor], responses: list[list[tuple[int, torch.Tensor]]],
                               *, pad_id: int) -> MicroBatch:
    """Rows ``[prompt | response 1 | response 2 | ...]`` of one prompt's responses each: positions
    ``0..p-1`` for the prompt and ``p..p+r-1`` for every response; a response attends to the prompt
    and causally to itself, the prompt causally to itself, padding to itself only.

    Args:
        prompts: one ``(p,)`` prompt per row.
        responses: per row, ``(rollout row, (r,) response tokens)`` of the responses sharing it.
    """
    lengths = [pr.numel() + sum(r.numel() for _, r in rs) for pr, rs in zip(prompts, responses)]
    R, L = len(prompts), max(lengths)
    T = max([r.numel() for rs in responses for _, r in rs] + [1])
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.arange(L).repeat(R, 1)
    segment = torch.full((R, L), -1, dtype=torch.long)  # 0 prompt, k >= 1 response k, -1 padding
    keep = torch.zeros((R, L), dtype=torch.bool)
    rows, targets, index, src_pos = [], [], [], []  # src_pos: flat (row, position) of each target's predictor
    for ri, (pr, rs) in enumerate(zip(prompts, responses)):
        p = pr.numel()
        input_ids[ri, :p] = pr
        segment[ri, :p] = 0
        if rs:
            keep[ri, p - 1] = True
        o = p
        for k, (row, r) in enumerate(rs, start=1):
            n, b = r.numel(), len(rows)
            rows.append(row)
            input_ids[ri, o : o + n] = r
            position_ids[ri, o : o + n] = torch.arange(p, p + n)
            segment[ri, o : o + n] = k
            keep[ri, o : o + n - 1] = True  # response token t+1 is predicted at its token t
            targets.append(r)
            index.append(b * T + torch.arange(n))
            src_pos.append(torch.cat([torch.tensor([ri * L + p - 1]), ri * L + torch.arange(o, o + n - 1)])[:n])
            o += n
        position_ids[ri, o:] = torch.arange(L - o)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    to_prompt = (segment[:, None, :] == 0) & (segment[:, :, None] >= 0)
    attn = ((same | to_prompt) & causal)[:, None]
    kept_row = keep.flatten().long().cumsum(0) - 1  # flat position -> its row in the kept logits
    return MicroBatch(rows=torch.as_tensor(rows, dtype=torch.long), T=T, input_ids=input_ids,
                      position_ids=position_ids, attention_mask=attn, logits_to_keep=keep,
                      targets=torch.cat(targets), index=torch.cat(index), src=kept_row[torch.cat(src_pos)],
                      real_tokens=sum(lengths), computed_tokens=R * L, logit_rows=int(keep.sum()))


def plan_micro_batches(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                       response_mask: torch.Tensor, rows: torch.Tensor | Sequence[int], *, packing: str,
                       micro_batch_size: int, micro_batch_tokens: int | None = None, pack_length: int | None = None,
                       pad_id: int = 0) -> list[MicroBatch]:
    """The micro-batches of one mini-batch in the layout ``packing`` (see the module doc).

    Args:
        prompt_ids, prompt_mask: ``(N, P)`` left-padded prompts (the rollout's).
        response_ids, response_mask: ``(N, T)`` right-padded responses; the mask is a prefix.
        rows: the mini-batch's rows (indices into ``N``).
        packing: one of :data:`PACKINGS`.
        micro_batch_size: most sequences per micro-batch (every layout).
        micro_batch_tokens: most positions per micro-batch, padding included (``length_grouped``,
            ``packed``; None: no limit). A longer sequence gets a micro-batch of its own.
        pack_length: most tokens per packed row (``packed``; None: one row per micro-batch).
        pad_id: token id of padding positions (never seen by a real token).
    Returns:
        Micro-batches covering ``rows`` once each; empty when ``rows`` is.
    Raises:
        ValueError: unknown ``packing``.
    """
    if packing not in PACKINGS:
        raise ValueError(f"train.packing: unknown layout {packing!r}; valid: {list(PACKINGS)}")
    rows = [int(i) for i in torch.as_tensor(rows).tolist()]
    if not rows:
        return []
    if packing == "none":
        return [_padded_micro_batch(prompt_ids, prompt_mask, response_ids, response_mask, rows[u : u + micro_batch_size])
                for u in range(0, len(rows), micro_batch_size)]
    if packing == "shared_prompt":
        return _plan_shared_prompt(prompt_ids, prompt_mask, response_ids, response_mask, rows,
                                   micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens, pad_id=pad_id)
    seqs = _sequences(prompt_ids, prompt_mask, response_ids, response_mask, rows)
    lengths = [s[0].numel() for s in seqs]
    if packing == "length_grouped":
        groups = group_by_length(lengths, max_rows=micro_batch_size, max_tokens=micro_batch_tokens)
        return [_free_micro_batch(seqs, rows, [[j] for j in g], packed=False, pad_id=pad_id) for g in groups]
    # packed: sequences into rows of <= pack_length, rows into micro-batches of <= micro_batch_tokens
    # positions (rows x longest row) and <= micro_batch_size sequences, longest rows first
    cap = pack_length if pack_length is not None else micro_batch_tokens
    packed_rows = pack_first_fit(lengths, cap)
    out: list[MicroBatch] = []
    cur: list[list[int]] = []
    for row in sorted(packed_rows, key=lambda r: -sum(lengths[j] for j in r)):
        width = sum(lengths[j] for j in cur[0]) if cur else 0
        n_seq = sum(len(r) for r in cur)
        if cur and (n_seq + len(row) > micro_batch_size or
                    (micro_batch_tokens is not None and (len(cur) + 1) * width > micro_batch_tokens)):
            out.append(_free_micro_batch(seqs, rows, cur, packed=True, pad_id=pad_id))
            cur = []
        if len(row) > micro_batch_size:  # a packed row never holds more than micro_batch_size sequences
            for u in range(0, len(row), micro_batch_size):
                out.append(_free_micro_batch(seqs, rows, [row[u : u + micro_batch_size]], packed=True, pad_id=pad_id))
            continue
        cur.append(row)
    if cur:
        out.append(_free_micro_batch(seqs, rows, cur, packed=True, pad_id=pad_id))
    return out


def _plan_shared_prompt(prompt_ids, prompt_mask, response_ids, response_mask, rows: list[int], *,
                        micro_batch_size: int, micro_batch_tokens: int | None, pad_id: int) -> list[MicroBatch]:
    """``shared_prompt``: rows of equal prompt tokens share one copy of the prompt (a copy per at
    most ``micro_batch_size`` responses and ``micro_batch_tokens`` tokens); the shared rows grouped by
    length into micro-batches (:func:`group_by_length`)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    prompts: dict[tuple[int, ...], torch.Tensor] = {}
    for i in rows:
        pr = prompt_ids[i][prompt_mask[i].bool()]
        key = tuple(pr.tolist())
        by_prompt.setdefault(key, []).append(i)
        prompts[key] = pr
    items: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = []
    for key, members in by_prompt.items():
        pr, chunk, width = prompts[key], [], prompts[key].numel()
        for i in members:  # a copy of the prompt per <= micro_batch_size responses, <= micro_batch_tokens tokens
            r = response_ids[i][: int(response_mask[i].sum())]
            if chunk and (len(chunk) == micro_batch_size or
                          (micro_batch_tokens is not None and width + r.numel() > micro_batch_tokens)):
                items.append((pr, chunk))
                chunk, width = [], pr.numel()
            chunk.append((i, r))
            width += r.numel()
        items.append((pr, chunk))
    lengths = [pr.numel() + sum(r.numel() for _, r in rs) for pr, rs in items]
    groups = group_by_length(lengths, max_rows=micro_batch_size, max_tokens=micro_batch_tokens,
                             sizes=[len(rs) for _, rs in items])
    return [_shared_prompt_micro_batch([items[j][0] for j in g], [items[j][1] for j in g], pad_id=pad_id)
            for g in groups]


def padding_report(micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
    """Token counts of a plan: real tokens, decoder positions computed, lm_head rows, padding share."""
    real = sum(m.real_tokens for m in micro_batches)
    computed = sum(m.computed_tokens for m in micro_batches)
    return {"micro_batches": len(micro_batches), "real_tokens": real, "computed_tokens": computed,
            "logit_rows": sum(m.logit_rows for m in micro_batches),
            "padding_share": 1.0 - real / computed if computed else 0.0}


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward takes a boolean ``(rows, length)`` ``logits_to_keep``: it names the
    argument and transformers slices by a 2-D mask (``slice_logits_to_keep``, transformers >= 5.21;
    earlier versions index with the mask as it is and fail, so they compute every logit instead)."""
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 keeps the module itself
    try:
        named = "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False
    return named and _slices_by_mask()


@functools.cache
def _slices_by_mask() -> bool:
    import transformers.modeling_utils as mu

    return hasattr(mu, "slice_logits_to_keep")


def _attn_implementation(model: Any) -> str:
    cfg = getattr(getattr(model, "module", model), "config", None)
    return str(getattr(cfg, "_attn_implementation", "") or "")


def _attention_mask_4d(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """``(R, 1, L, L)`` "may attend" mask in the form the model's attention takes a prepared 4-D mask:
    boolean for sdpa, additive (0 or the dtype's minimum) for eager."""
    impl = _attn_implementation(model)
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        dtype = torch.get_autocast_dtype(allowed.device.type) if torch.is_autocast_enabled(allowed.device.type) else dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"train.packing 'shared_prompt' needs sdpa or eager attention, not {impl!r} "
                     f"(use length_grouped, or packed with flash-attention)")


def micro_batch_logprobs(model: Any, mb: MicroBatch, *, temperature: float = 1.0, with_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the micro-batch's response tokens under ``model``.

    Calls ``model`` itself (the DDP/FSDP-wrapped root), so strategies see one ordinary forward.

    Returns:
        logp ``(b, T)`` and entropy ``(b, T)`` (or None), rows in ``mb.rows`` order, 0 outside the
        responses; ``logp`` carries the gradient.
    Raises:
        ValueError: a packed micro-batch of several rows under flash-attention (its varlen path
            reads sequence starts from position ids of one row only; set ``train.pack_length: null``).
    """
    device = next(model.parameters()).device
    b, T = len(mb.rows), mb.T
    kw: dict[str, Any] = {"input_ids": mb.input_ids.to(device), "position_ids": mb.position_ids.to(device),
                          "use_cache": False}
    if mb.attention_mask is not None and mb.attention_mask.dim() == 2:  # the padded layout
        kw["attention_mask"] = mb.attention_mask.to(device)
        logits = model(**kw, logits_to_keep=mb.logits_to_keep).logits[:, :-1]
        mask = mb.attention_mask[:, -T:].to(device)
        targets = mb.targets.to(device)
    else:
        keep = mb.logits_to_keep.to(device)
        if mb.input_ids.shape[0] > 1 and "flash" in _attn_implementation(model) and \
                bool((mb.position_ids[:, 1:] == 0).any()):
            raise ValueError("train.packing 'packed': flash-attention finds packed sequences only in one row; "
                             "set train.pack_length: null (one row per micro-batch)")
        if mb.attention_mask is not None:  # shared_prompt: a 4-D mask, passed to the attention as it is
            kw["attention_mask"] = _attention_mask_4d(model, mb.attention_mask.to(device))
        if accepts_logits_to_keep(model):
            logits = model(**kw, logits_to_keep=keep).logits
        else:
            logits = model(**kw).logits
        if logits.dim() == 3:  # a model that ignored the mask (or has no logits_to_keep): select here
            logits = logits[keep]
        targets = mb.targets.to(device)
        mask = None
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    if mb.src is None:
        lp = torch.gather(lsm, -1, targets.unsqueeze(-1)).squeeze(-1)
    else:  # a kept position may predict several target tokens
        src = mb.src.to(device)
        lp = lsm[src, targets]
    ent = None
    if with_entropy:
        with torch.no_grad():
            ls = lsm.detach()
            ent = -(ls.exp() * ls).sum(-1)
            if mb.src is not None:
                ent = ent[src]
    if mask is not None:  # (b, T) already
        m = mask.float()
        return lp * m, (ent * m if ent is not None else None)
    index = mb.index.to(device)
    logp = lp.new_zeros(b * T).index_copy(0, index, lp).view(b, T)
    if ent is not None:
        ent = ent.new_zeros(b * T).index_copy(0, index, ent).view(b, T)
    return logp, ent
