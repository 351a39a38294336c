"""The memory model: the bytes one GPU (or, on a CPU config, one training process) holds in each
phase of training and for the vLLM engine, as :class:`Term` rows (see :mod:`oar.plan` for what
each term counts), and :func:`plan`, the verdict against ``plan.gpu_memory_gb``."""

from __future__ import annotations

import math
from typing import Any

from oar.plan.settings import PlanSettings, world_size
from oar.plan.shape import ModelShape, dtype_bytes, model_shape
from oar.plan.terms import GiB, MEMORY_PHASES, PlanResult, Term, gib, layer_activation_bytes

__all__ = ["LOGITS_COPIES", "FSDP_UNSHARDED_ACCUMULATION", "CREDIT_PASSES", "PROBE_TAIL_TOKENS", "training_terms", "training_memory", "engine_terms", "engine_memory", "credit_terms", "plan"]


_ALL = MEMORY_PHASES
_ROLLOUT = ("rollout", "credit")
_UPDATE = ("forward", "logits", "backward", "backward end")
_SAVED = ("forward", "logits", "backward")
#: float32 ``positions x V`` tensors alive at the end of ``oar.trainer.update.policy_forward(with_entropy=True)``:
#: the logits, the log-softmax the backward keeps, and the entropy's log-softmax, exp and product.
LOGITS_COPIES = 5
#: ``oar.trainer.strategy.FSDPStrategy.sync_context`` turns gradient sync off for all but the last
#: micro-batch of a mini-batch; FSDP2 then accumulates every gradient unsharded, in float32.
FSDP_UNSHARDED_ACCUMULATION = True
#: The credit estimators that run passes of their own through the policy, and what the passes are
#: (every estimator registered with ``needs_model``; a test checks the two agree). They run in the
#: ``credit`` phase, on the gathered policy; each is a :class:`Term` of its own (:func:`credit_terms`).
CREDIT_PASSES: dict[str, str] = {
    "oar_p": "OAR-P perturbation passes",
    "oar_g": "OAR-G input-gradient pass",
    "shuffled": "OAR-G input-gradient pass",
    "inverted": "OAR-G input-gradient pass",
    "mc_value": "mc_value continuations and refine pass",
}
#: Positions at the end of a credit probe whose logits the outcome reads (the conclude string and a
#: boxed answer's tokens: ``oar.credit.importance.common.logits_to_keep``), as the plan counts them.
PROBE_TAIL_TOKENS = 16


def _activation_terms(shape: ModelShape, s: PlanSettings, *, padded: bool, lm_head_grad: int) -> list[Term]:
    mb, L, h, c = s.batch, shape.num_layers, shape.hidden_size, s.act_b
    I = shape.intermediate_size
    tokens = mb.tokens
    masked = padded and mb.masked
    per_layer = layer_activation_bytes(shape, act_bytes=c, seq=mb.length, autocast=s.autocast, padded=masked)
    final_norm = (8 * h + c * h) if s.autocast else (4 * h + 2 * c * h)
    stream_b = 4 if s.autocast else c
    mask = mb.rows * mb.length * mb.length if masked else 0  # the boolean 4-D mask every layer reads
    shape_note = mb.describe()
    terms = []
    if s.checkpointing:
        terms.append(Term("activations", tokens * L * stream_b * h + mask, _SAVED,
                          f"checkpointed: each layer's input ({L} x {stream_b} B x {h} per token), {shape_note}",
                          "a smaller train.micro_batch_size or rollout.max_new_tokens"))
        terms.append(Term("one layer's intermediates", tokens * 3 * c * I, ("forward",),
                          f"a checkpointed layer's MLP intermediates while it runs (3 x {c} B x {I} per token)",
                          "a smaller train.micro_batch_size"))
        cast = shape.layer_linear_params * c if s.autocast else 0  # the recompute's autocast copies
        terms.append(Term("recompute (one layer)", tokens * per_layer + cast, ("backward",),
                          f"one layer's saved tensors ({per_layer / 1024:.1f} KiB per token) rebuilt in the backward"
                          + (" + its autocast weight copies" if cast else ""), "a smaller train.micro_batch_size"))
    else:
        terms.append(Term("activations", tokens * L * per_layer + mask, _SAVED,
                          f"{L} layers x {per_layer / 1024:.1f} KiB per token, {shape_note}",
                          "train.gradient_checkpointing: true, or a smaller train.micro_batch_size"))
    # end of the forward: LOGITS_COPIES copies; start of the backward: one fewer, and the lm_head's
    # weight gradient
    copy = mb.logit_positions * shape.vocab_size * 4
    logits = max(LOGITS_COPIES * copy, (LOGITS_COPIES - 1) * copy + lm_head_grad)
    terms.append(Term("logits", logits + tokens * final_norm, ("logits",),
                      f"{LOGITS_COPIES} float32 copies of {mb.logit_positions} positions x {shape.vocab_size} vocab "
                      f"(or {LOGITS_COPIES - 1} and the lm_head gradient, if more) + the final norm's saved tensors",
                      "a smaller train.micro_batch_size (or train.micro_batch_tokens) or rollout.max_new_tokens"))
    terms.append(Term("backward workspace", tokens * (2 * c * I + 4 * 4 * h), ("backward",),
                      f"gradients of one layer's MLP intermediates (2 x {c} B x {I} per token) and of the "
                      f"residual stream", "a smaller train.micro_batch_size"))
    return terms


def training_terms(config: dict, world: int | None = None, *, padded: bool = True,
                   shape: ModelShape | None = None) -> list[Term]:
    """The training side of the plan, one :class:`Term` per row, bytes per GPU (see the module doc).

    Args:
        world: training processes (default :func:`world_size`).
        padded: plan for micro-batches with padding (the usual case; see :func:`layer_activation_bytes`).
        shape: the model's shape (default :func:`model_shape`).
    """
    shape = shape or model_shape(config)
    world = world or world_size(config)
    s = PlanSettings.from_config(config, world, shape)
    return _training_terms(shape, s, padded=padded)


def _placement(shape: ModelShape, s: PlanSettings) -> tuple[int, int, str, str]:
    """How the training state is placed: (this process's parameters, shards, the note saying where,
    the hint saying what to change)."""
    P, W = shape.num_params, s.world
    shard = W if s.fsdp else 1
    where = f"/ {W} {'GPUs' if s.on_gpu else 'processes'} (fsdp)" if s.fsdp else \
        f"(whole model per {'GPU' if s.on_gpu else 'process'}, ddp)"
    more = "more GPUs (resources.train.gpu) or train.fsdp.cpu_offload: true" if s.fsdp else \
        "train.strategy: fsdp (shards it over the GPUs)"
    return math.ceil(P / shard), shard, where, more


def _training_terms(shape: ModelShape, s: PlanSettings, *, padded: bool) -> list[Term]:
    """Every term of the training memory model: the training state, the forward's weights, the
    embedding and lm_head gradients, the activations, the optimizer step and the rollout."""
    wb = s.weight_b
    terms = _state_terms(shape, s) + _forward_weight_terms(shape, s)
    vh = shape.vocab_size * shape.hidden_size * wb
    terms += _head_gradient_terms(shape, s, vh)
    terms += _activation_terms(shape, s, padded=padded, lm_head_grad=vh)
    return terms + _step_and_rollout_terms(shape, s)


def _state_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """Master weights, gradients, optimizer states and the KL reference."""
    P, W, mb = shape.num_params, s.world, s.master_b
    local, _, where, more = _placement(shape, s)
    off = s.cpu_offload

    def placed(name: str, nbytes: int, note: str, hint: str, phases: tuple[str, ...] = _ALL) -> Term:
        return Term(name, 0 if off else nbytes, phases, note + (" -- in CPU memory (cpu_offload)" if off else ""),
                    hint, nbytes if off else 0)

    terms = [placed("master weights", local * mb, f"{P / 1e9:.3g}B x {mb} B ({s.master}) {where}", more)]
    grads = local * mb
    gnote = f"{P / 1e9:.3g}B x {mb} B {where}"
    if not s.fsdp and W > 1:
        grads *= 2
        gnote += " + DDP's bucket copy"
    if s.fsdp and s.accumulate and FSDP_UNSHARDED_ACCUMULATION:
        # no reduce-scatter between the micro-batches of a mini-batch: FSDP2 keeps every gradient
        # unsharded in the reduce dtype (float32) until the last one; the sharded ones exist after it
        terms.append(placed("gradients", grads, gnote + "; from the last micro-batch to the next mini-batch",
                            more, ("step", *_ROLLOUT)))
        terms.append(Term("accumulated gradients (unsharded)", P * 4, _UPDATE,
                          f"{P / 1e9:.3g}B x 4 B: FSDP2 accumulates unsharded float32 gradients while gradient sync "
                          f"is off ({s.micro_batches} micro-batches per mini-batch)",
                          "train.micro_batch_size = train.mini_batch_size (one micro-batch per mini-batch), or "
                          "reduce-scatter every micro-batch (oar.trainer.strategy.FSDPStrategy.sync_context)"))
    else:
        terms.append(placed("gradients", grads, gnote, more))
    terms.append(placed("optimizer states", 2 * local * mb, f"AdamW exp_avg + exp_avg_sq, 2 x {mb} B {where}", more))
    if s.kl_methods:
        ref_b = mb if s.fsdp else s.model_b
        terms.append(Term("reference model", local * ref_b, _ALL,
                          f"KL reference of {', '.join(s.kl_methods)}: {P / 1e9:.3g}B x {ref_b} B {where}",
                          "kl_coef 0, or train.strategy: fsdp"))

    return terms


def _forward_weight_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """Weights the forward reads besides the master weights (FSDP's gathered ones, autocast's copies)."""
    P, wb = shape.num_params, s.weight_b
    terms: list[Term] = []
    if s.fsdp:
        if s.reshard_after_forward:
            n = shape.root_params + 2 * shape.layer_params
            note = f"all-gathered in {wb} B: embeddings + lm_head + 2 layers"
            hint = "train.compute_dtype: bfloat16"
        else:
            n = P
            note = f"all-gathered in {wb} B: every layer (reshard_after_forward false)"
            hint = "train.fsdp.reshard_after_forward: true"
        terms.append(Term("compute weights", n * wb, _UPDATE, note, hint))
        terms.append(Term("gradient buffers", shape.layer_params * (wb + 4), ("backward",),
                          f"one layer's unsharded gradients ({wb} B) and their float32 reduce-scatter input",
                          "train.compute_dtype: bfloat16"))
    elif s.autocast:
        # kept by the matmuls that saved them until their layer's backward; with checkpointing only
        # autocast's cache holds them, until the forward leaves autocast (the recompute casts again)
        terms.append(Term("compute weights", shape.linear_params * s.compute_b,
                          ("forward", "logits") if s.checkpointing else _SAVED,
                          f"autocast's {s.compute} copy of every linear weight", "train.strategy: fsdp"))

    return terms


def _head_gradient_terms(shape: ModelShape, s: PlanSettings, vh: int) -> list[Term]:
    """The lm_head's and the embedding's weight gradients (``vh``: vocab x hidden x weight bytes)."""
    wb = s.weight_b
    terms: list[Term] = []
    # the lm_head's weight gradient, kept until the backward ends (fsdp: the root's gradients are
    # reduced last; a tied weight: autograd holds it until the embedding's gradient is added), then
    # the embedding's dense gradient (and, tied, their sum) at the end of the backward
    terms.append(Term("lm_head gradient", vh, ("backward", "backward end"),
                      f"vocab x hidden in {wb} B, from the start of the backward (in the logits phase: see logits)",
                      "train.compute_dtype: bfloat16"))
    k = 2 if shape.tie_word_embeddings else 1
    terms.append(Term("embedding gradient", k * vh + s.batch.tokens * shape.hidden_size * 4,
                      ("backward end",),
                      f"vocab x hidden in {wb} B at the end of the backward"
                      + (" (x 2: the tied weight's two gradients' sum)" if k == 2 else "")
                      + " + the gradient of the embedding output", "train.compute_dtype: bfloat16"))
    return terms


def _step_and_rollout_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """The optimizer step's temporaries and the rollout and credit passes' memory."""
    P, mb, wb = shape.num_params, s.master_b, s.weight_b
    local, shard, _, more = _placement(shape, s)
    off = s.cpu_offload
    terms: list[Term] = []
    # optimizer step
    if not off:
        foreach = s.device.startswith("cuda") or s.device == "auto"
        largest = max(shape.embedding_params, shape.hidden_size * shape.intermediate_size)
        tmp = local * mb if foreach else 2 * math.ceil(largest / shard) * mb
        terms.append(Term("optimizer step temporaries", tmp, ("step",),
                          "AdamW foreach: one temporary of the local master weights (sqrt of exp_avg_sq)" if foreach
                          else "AdamW on CPU (one tensor at a time): 2 temporaries of the largest tensor", more))

    # rollout and credit passes
    if s.fsdp:
        terms.append(Term("rollout: gathered policy", P * wb, _ROLLOUT,
                          f"the whole policy gathered in {wb} B for the rollout and credit passes",
                          "train.compute_dtype: bfloat16"))
    elif s.autocast:
        terms.append(Term("rollout: autocast copies", shape.linear_params * s.compute_b, _ROLLOUT,
                          f"autocast's {s.compute} weight copies for the rollout and credit passes",
                          "train.strategy: fsdp"))
    if s.engine == "hf":
        seqs = s.rollout_batch
        kv = seqs * s.seq * shape.kv_bytes_per_token(s.act_b)
        step_logits = 3 * seqs * shape.vocab_size * 4
        terms.append(Term("rollout: generate KV cache", kv + step_logits, ("rollout",),
                          f"{seqs} sequences x {s.seq} tokens of K/V + last-token logits (engine hf)",
                          "rollout.batch_size"))
    return terms


def training_memory(config: dict, world: int | None = None, *, padded: bool = True) -> dict[str, int]:
    """Bytes per GPU of every training term (:func:`training_terms` as a dict)."""
    return {t.name: t.bytes for t in training_terms(config, world, padded=padded)}


def engine_terms(config: dict, world: int | None = None, *, shape: ModelShape | None = None) -> list[Term]:
    """The vLLM engine of ``rollout.engine: vllm`` (empty for ``hf``): what it holds inside its share
    of the GPU, the share itself last (``name == 'vLLM share'``)."""
    shape = shape or model_shape(config)
    s = PlanSettings.from_config(config, world or world_size(config), shape)
    return _engine_terms(shape, s)


def _engine_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    if s.engine != "vllm":
        return []
    v = s.vllm
    tp = int(v.get("tensor_parallel_size") or 1)
    eb = dtype_bytes(v.get("dtype") or s.model_dtype, "rollout.vllm.dtype")
    kvb = eb if v.get("kv_cache_dtype", "auto") == "auto" else 1
    share = int(float(v["gpu_memory_utilization"]) * s.gpu_gb * GiB)
    weights = math.ceil(shape.num_params / tp) * eb
    tokens = int(v["max_num_batched_tokens"])
    seqs_max = int(v["max_num_seqs"])
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    act = tokens * (3 * i + q + 2 * kv + 2 * h) * eb // tp + 2 * seqs_max * shape.vocab_size * 4
    per_token = shape.kv_bytes_per_token(kvb) // tp
    one = s.seq * per_token
    in_flight = min(seqs_max, s.local_seqs)
    all_seqs = in_flight * one
    free = share - weights - act
    fits_seqs = max(0, free) // one if one else 0
    # asleep from the credit phase on (sleep mode), unless the method samples through it (Term.engine)
    phases = ("rollout",) if s.sleep_mode else _ALL
    key = "rollout.vllm.gpu_memory_utilization"
    return [
        Term("weights", weights, phases, f"{shape.num_params / 1e9:.3g}B x {eb} B" + (f" / tp {tp}" if tp > 1 else ""),
             key),
        Term("activation profile", act, phases,
             f"{tokens} batched tokens (max_num_batched_tokens) + sampler logits of {seqs_max} sequences", key),
        Term("KV cache, 1 sequence", one, phases, f"{s.seq} tokens x {per_token / 1024:.0f} KiB (needed to start)",
             key),
        Term(f"KV cache, {in_flight} sequences", all_seqs, phases,
             f"all in flight at full length; the share holds {fits_seqs} (vLLM queues the rest)", key),
        Term("vLLM share", share, phases,
             f"gpu_memory_utilization {v['gpu_memory_utilization']} x {s.gpu_gb:g} GiB"
             + (" -- freed during the update (sleep_mode)" if s.sleep_mode else ""), key),
    ]


def engine_memory(config: dict, world: int | None = None) -> dict[str, int]:
    """Bytes per GPU of the vLLM engine's terms (:func:`engine_terms` as a dict; empty for ``hf``)."""
    return {t.name: t.bytes for t in engine_terms(config, world)}


def credit_terms(config: dict, world: int | None = None, *, shape: ModelShape | None = None) -> list[Term]:
    """The credit estimators' own passes through the policy (:data:`CREDIT_PASSES`), one :class:`Term`
    per pass, each at the largest options among the config's methods that run it, alive in the
    ``credit`` phase only, and never beside another (``credit_pass``). Empty when no method runs one.

    Each counts the tensors of its largest chunk (``S`` = prompt + response tokens, ``c`` compute
    bytes, ``kv`` the K/V bytes of a token over all layers):

    - OAR-P (no gradient): the unperturbed probe's KV cache and a chunk's copy of it
      (``2 x chunk_size x S x kv``), one layer's MLP intermediates and projections for the chunk
      (``chunk_size x S x c(3I + q + 2kv + 2h)``: no gradient, one layer at a time), and the float32
      logits of the :data:`PROBE_TAIL_TOKENS` tail positions;
    - OAR-G (a backward to the input embeddings, the model in eval mode, so without gradient
      checkpointing): every layer's saved activations for the chunk's positions
      (:func:`layer_activation_bytes`), the backward workspace, the input embeddings and their
      gradient in float32, and three float32 copies of the tail logits; the chunk is
      ``chunk_size x draws`` rows of ``S``, or (``chunk_size`` null) ``chunk_tokens`` positions;
    - ``mc_value``: its continuations run on the rollout engine (engine hf: the KV cache of
      ``rollout.batch_size`` sequences and their last-token logits, as the rollout; engine vllm: in
      the engine's share, awake for it), plus its ``refine`` pass, counted as OAR-G's.
    """
    shape = shape or model_shape(config)
    s = PlanSettings.from_config(config, world or world_size(config), shape)
    return _credit_terms(shape, s, config)


def _credit_terms(shape: ModelShape, s: PlanSettings, config: dict) -> list[Term]:
    if not config.get("methods"):
        return []
    from oar.config.methods import resolve_methods
    from oar.credit.importance import OarGOptions, OarPOptions
    from oar.credit.importance.common import option_names
    from oar.credit.mc_value import McValueOptions

    def opts(cls: type, given: dict) -> Any:
        return cls(**{k: v for k, v in given.items() if k in option_names(cls)})

    found: dict[str, tuple[int, str, list[str], bool]] = {}  # pass -> (bytes, note, methods, engine awake)
    for name, meth in resolve_methods(config).items():
        what = CREDIT_PASSES.get(meth.estimator)
        if what is None:
            continue
        given = meth.estimator_options()
        engine = False
        if meth.estimator == "oar_p":
            nbytes, note = _oar_p_pass(shape, s, opts(OarPOptions, given))
        elif meth.estimator == "mc_value":
            mc = opts(McValueOptions, given)
            nbytes, note, engine = _continuation_pass(shape, s)
            if mc.refine is not None:
                rb, rnote = _oar_g_pass(shape, s, opts(OarGOptions, dict(mc.refine)))
                nbytes, note = nbytes + rb, f"{note}; refine: {rnote}"
        else:
            nbytes, note = _oar_g_pass(shape, s, opts(OarGOptions, given))
        old = found.get(what)
        if old is None or nbytes > old[0]:
            found[what] = (nbytes, note, (old[2] if old else []) + [name], engine)
        else:
            old[2].append(name)
    hint = "the method's chunk_size (or chunk_tokens), or rollout.max_new_tokens"
    return [Term(f"credit: {what}", nbytes, ("credit",),
                 f"{note} (method{'s' if len(names) > 1 else ''} {', '.join(names)})", hint,
                 credit_pass=True, engine=engine)
            for what, (nbytes, note, names, engine) in found.items()]


def _oar_p_pass(shape: ModelShape, s: PlanSettings, o: Any) -> tuple[int, str]:
    """OAR-P's largest chunk (see :func:`credit_terms`)."""
    c, S, rows = s.act_b, s.seq, int(o.chunk_size)
    kv = 2 * rows * S * shape.kv_bytes_per_token(c)
    layer = rows * S * c * (3 * shape.intermediate_size + shape.q_dim + 2 * shape.kv_dim + 2 * shape.hidden_size)
    logits = rows * PROBE_TAIL_TOKENS * shape.vocab_size * 4
    return kv + layer + logits, f"{rows} sequences x {S} tokens: 2 KV caches + one layer's tensors + tail logits"


def _oar_g_pass(shape: ModelShape, s: PlanSettings, o: Any) -> tuple[int, str]:
    """OAR-G's largest chunk (see :func:`credit_terms`)."""
    c, S, h = s.act_b, s.seq, shape.hidden_size
    if o.chunk_size is not None:
        rows = int(o.chunk_size) * int(o.draws)
        tokens, what = rows * S, f"{o.chunk_size} responses x {o.draws} draws x {S} tokens"
    else:
        tokens = max(int(o.chunk_tokens), S * int(o.draws)) if o.chunk_tokens is not None else s.local_seqs * S
        rows, what = max(1, tokens // S), f"{tokens} positions (chunk_tokens)"
    per_layer = layer_activation_bytes(shape, act_bytes=c, seq=S, padded=True)
    saved = tokens * shape.num_layers * per_layer
    work = tokens * (2 * c * shape.intermediate_size + 4 * 4 * h) + 2 * tokens * h * 4
    logits = 3 * rows * PROBE_TAIL_TOKENS * shape.vocab_size * 4
    return saved + work + logits, (f"{what}: every layer's saved activations ({per_layer / 1024:.1f} KiB per "
                                   f"token), no checkpointing (eval mode)")


def _continuation_pass(shape: ModelShape, s: PlanSettings) -> tuple[int, str, bool]:
    """``mc_value``'s continuations on the rollout engine (see :func:`credit_terms`)."""
    if s.engine == "vllm":
        return 0, "continuations in the vLLM engine's share (awake)", True
    seqs = s.rollout_batch
    kv = seqs * s.seq * shape.kv_bytes_per_token(s.act_b) + 3 * seqs * shape.vocab_size * 4
    return kv, f"continuations: {seqs} sequences x {s.seq} tokens of K/V + last-token logits (engine hf)", False


def plan(config: dict, world: int | None = None, *, padded: bool = True) -> PlanResult:
    """Plan ``config`` (validated, defaults filled) on ``world`` GPUs (default :func:`world_size`)."""
    shape = model_shape(config)
    world = world or world_size(config)
    s = PlanSettings.from_config(config, world, shape)
    terms = _training_terms(shape, s, padded=padded)
    engine = _engine_terms(shape, s)
    credit = _credit_terms(shape, s, config)
    gpu = int(s.gpu_gb * GiB)
    headroom = int(s.headroom * gpu)
    share = next((t for t in engine if t.name == "vLLM share"), None)
    totals = {}
    for ph in MEMORY_PHASES:
        totals[ph] = sum(t.bytes for t in terms if ph in t.phases) + headroom
        if share is not None and ph in share.phases and ph != "credit":  # credit: below
            totals[ph] += share.bytes
    # the credit phase: its shared terms plus the largest pass (one method's at a time), with the
    # engine's share when the engine stays awake for it (no sleep mode, or a pass that samples)
    base_credit = totals["credit"]
    awake = share is not None and "credit" in share.phases
    credit_totals = {t.name: base_credit + t.bytes + (share.bytes if share is not None and (awake or t.engine) else 0)
                     for t in credit}
    totals["credit"] = max(credit_totals.values(), default=base_credit + (share.bytes if awake else 0))
    peak = max(MEMORY_PHASES, key=lambda ph: totals[ph])
    fits, breaker, message = True, None, ""
    if totals[peak] > gpu:
        fits = False
        live = [t for t in terms if peak in t.phases]
        if peak == "credit":
            worst_pass = max(credit, key=lambda t: credit_totals[t.name], default=None)
            live += [worst_pass] if worst_pass is not None else []
            if share is not None and (awake or (worst_pass is not None and worst_pass.engine)):
                live.append(share)
        elif share is not None and peak in share.phases:
            live.append(share)
        worst = max(live, key=lambda t: t.bytes)
        breaker = worst.name
        message = (f"does not fit: {gib(totals[peak])} GiB {s.per} at the peak ({peak}) > {s.gpu_gb:g} GiB "
                   f"(plan.gpu_memory_gb, with {s.headroom:g} kept free); largest term: {worst.name} "
                   f"{gib(worst.bytes)} GiB ({worst.note}); to shrink it: {worst.hint}")
        always = [t for t in terms if set(t.phases) == set(MEMORY_PHASES) and t.bytes]
        if sum(t.bytes for t in always) + headroom > gpu:
            message += (f"; the terms alive in every phase alone ({', '.join(t.name for t in always)}) take "
                        f"{gib(sum(t.bytes for t in always))} GiB: {always[0].hint}")
    if fits and engine:
        need = sum(t.bytes for t in engine if t.name in ("weights", "activation profile", "KV cache, 1 sequence"))
        if need > share.bytes:
            fits, breaker = False, "vLLM share"
            message = (f"does not fit: the vLLM engine needs {gib(need)} GiB (weights, activation profile and "
                       f"the KV cache of one {s.seq}-token sequence) > its share {gib(share.bytes)} GiB "
                       f"({share.note}); raise rollout.vllm.gpu_memory_utilization or shorten rollout.max_new_tokens")
    return PlanResult(shape=shape, world_size=world, gpu_bytes=gpu, headroom_bytes=headroom, terms=terms,
                      engine=engine, phase_totals=totals, peak_phase=peak, fits=fits, breaker=breaker,
                      message=message, settings=s, padded=padded, credit=credit, credit_totals=credit_totals)
