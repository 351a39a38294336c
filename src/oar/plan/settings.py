"""What the memory model reads from a validated config, built once: :class:`PlanSettings` (the
dtypes, the placement, the batch) and :class:`MicroBatchShape`, the largest forward the update's
layout (``train.packing``, :mod:`oar.models.packing`) builds."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from oar.plan.shape import ModelShape, PlanError, dtype_bytes

__all__ = ["VLLM_DEFAULTS", "MicroBatchShape", "PlanSettings", "micro_batch_shape", "train_layout", "world_size"]

#: vLLM defaults used when ``rollout.vllm`` does not set them.
VLLM_DEFAULTS = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                 "tensor_parallel_size": 1}


def train_layout(config: dict) -> tuple[int, int, int]:
    """(nodes, processes per node, GPUs per node) of a training job, from ``resources.train``:
    ``nodes`` (default 1), ``gpu`` (per node, default 0) and ``processes`` (per node; 0, the
    default, means one per GPU, or one without a GPU). The workflow launches by the same layout."""
    r = (config.get("resources") or {}).get("train") or {}
    nodes, gpu = int(r.get("nodes") or 1), int(r.get("gpu") or 0)
    return nodes, int(r.get("processes") or 0) or max(gpu, 1), gpu


#: ``plan.gpu_memory_gb`` when the config leaves it null and runs on GPUs: one 80 GB GPU (A100 / H100).
DEFAULT_GPU_GB = 80.0


def host_memory_gb() -> float | None:
    """This machine's memory in GiB (``MemTotal``), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3
    except (ValueError, OSError, AttributeError):
        return None


def memory_gb(config: dict, *, on_gpu: bool) -> tuple[float, str]:
    """The memory the plan holds a process to, and where it comes from: ``plan.gpu_memory_gb`` when
    set; else one GPU's :data:`DEFAULT_GPU_GB` for a GPU config, and for a CPU config this machine's
    memory shared by a node's training processes (:func:`train_layout`)."""
    given = config["plan"]["gpu_memory_gb"]
    if given is not None:
        return float(given), "plan.gpu_memory_gb"
    if on_gpu:
        return DEFAULT_GPU_GB, f"plan.gpu_memory_gb null: an {DEFAULT_GPU_GB:g} GiB GPU"
    host = host_memory_gb()
    if host is None:
        return DEFAULT_GPU_GB, f"plan.gpu_memory_gb null and this machine's memory unreadable: {DEFAULT_GPU_GB:g} GiB"
    procs = train_layout(config)[1]
    return host / procs, f"this machine's {host:.1f} GiB" + (f" / {procs} processes" if procs > 1 else "")


def world_size(config: dict) -> int:
    """Training processes: nodes x processes per node (:func:`train_layout`)."""
    nodes, per_node, _ = train_layout(config)
    return nodes * per_node


@dataclass(frozen=True)
class MicroBatchShape:
    """The largest forward of the policy update in its layout, as the memory model counts it.

    Attributes:
        packing: the layout (``train.packing``).
        rows, length: the ``(rows, length)`` input of the forward.
        sequences: responses in it.
        logit_positions: positions whose logits the lm_head computes (``none``: the last ``T`` of
            every row; the other layouts: only the positions that predict a response token).
        masked: an attention mask goes to the attention (``none``: the padding mask; ``shared_prompt``:
            its 4-D mask; ``packed``: the block-diagonal mask transformers builds from the restarting
            positions): SDPA then gets a float mask ``length`` wide, the boolean ``rows x length x
            length`` mask is alive, and k/v are repeated to the query heads. ``length_grouped`` rows are
            right-padded only and take sdpa's causal path, without a mask.
    """

    packing: str
    rows: int
    length: int
    sequences: int
    logit_positions: int
    masked: bool

    @property
    def tokens(self) -> int:
        """Positions the decoder layers compute (padding included)."""
        return self.rows * self.length

    def describe(self) -> str:
        return f"{self.rows} x {self.length} positions, {self.sequences} responses ({self.packing})"


def micro_batch_shape(packing: str, *, micro: int, prompt: int, response: int, n: int,
                      micro_batch_tokens: int | None, pack_length: int | None, whole: bool = False) -> MicroBatchShape:
    """An upper bound on the largest micro-batch :func:`oar.models.packing.plan_micro_batches` builds from
    full-length responses (``response`` tokens each, prompts of ``prompt`` tokens, groups of ``n``,
    mini-batches drawn at random), at most ``micro`` responses and (every layout but ``none``)
    ``micro_batch_tokens`` positions per forward (a test checks it against the planner). ``whole``:
    the mini-batch is the whole rollout, so every group is complete in it."""
    S = prompt + response
    cap = micro_batch_tokens
    if packing == "none":
        return MicroBatchShape(packing, micro, S, micro, micro * response, True)
    if packing == "length_grouped":
        rows = micro if cap is None else min(micro, max(1, cap // S))
        return MicroBatchShape(packing, rows, S, rows, rows * response, False)
    if packing == "packed":
        row_cap = pack_length if pack_length is not None else cap
        per_row = micro if row_cap is None else min(micro, max(1, row_cap // S))
        rows = math.ceil(micro / per_row) if cap is None else min(math.ceil(micro / per_row),
                                                                  max(1, cap // (per_row * S)))
        seqs = min(micro, rows * per_row)
        return MicroBatchShape(packing, rows, per_row * S, seqs, seqs * response, True)
    if packing == "shared_prompt":
        # a row holds one prompt and up to per_row of its responses, the last row of a group the rest;
        # a mini-batch drawn at random from a larger rollout may hold any part of a group; the largest
        # forward is the largest over those row sizes
        per_row = min(n, micro) if cap is None else min(n, micro, max(1, (cap - prompt) // response))
        sizes = sorted({per_row, n % per_row} - {0}) if whole else range(1, per_row + 1)
        shapes = []
        for k in sizes:
            length = prompt + k * response
            rows = math.ceil(micro / k) if cap is None else min(math.ceil(micro / k), max(1, cap // length))
            seqs = min(micro, rows * k)
            # a row's prompt end predicts the first token of each of its responses
            shapes.append(MicroBatchShape(packing, rows, length, seqs, rows + seqs * (response - 1), True))
        big = max(shapes, key=lambda b: (b.tokens, b.logit_positions))
        return MicroBatchShape(packing, big.rows, big.length, max(b.sequences for b in shapes),
                               max(b.logit_positions for b in shapes), True)
    raise PlanError(f"train.packing: unknown layout {packing!r}; valid: none, length_grouped, packed, shared_prompt")


@dataclass(frozen=True)
class PlanSettings:
    """Everything the memory formulas read, from a validated config (the schema holds the defaults):
    :meth:`from_config`. Byte counts are per element (``*_b``)."""

    world: int
    strategy: str
    fsdp: bool
    model_dtype: str
    model_b: int
    compute: str
    compute_b: int
    master: str
    master_b: int
    weight_b: int  # the weights a forward reads
    act_b: int  # activations
    autocast: bool  # ddp with float32 weights and a 16-bit compute dtype
    checkpointing: bool
    cpu_offload: bool
    reshard_after_forward: bool
    micro: int  # most responses per forward (train.micro_batch_size, at most the mini-batch)
    batch: MicroBatchShape
    micro_batches: int  # forwards per mini-batch
    prompt: int
    response: int
    n: int
    local_seqs: int  # responses per process per step
    engine: str
    rollout_batch: int
    sleep_mode: bool
    vllm: dict[str, Any]
    kl_methods: list[str]
    device: str
    gpu_gb: float
    memory_source: str  # where gpu_gb comes from (memory_gb)
    on_gpu: bool
    headroom: float

    @property
    def seq(self) -> int:
        """One sequence at full length: prompt + response tokens."""
        return self.prompt + self.response

    @property
    def per(self) -> str:
        """What the plan's bytes are for: one GPU, or (a CPU config) one training process."""
        return "per GPU" if self.on_gpu else "per process"

    @property
    def accumulate(self) -> bool:
        """Several forwards per mini-batch (gradients accumulate between optimizer steps)."""
        return self.micro_batches > 1

    @classmethod
    def from_config(cls, config: dict, world: int, shape: ModelShape) -> "PlanSettings":
        t, r, m, p = config["train"], config["rollout"], config["model"], config["plan"]
        model_dtype = shape.dtype if m["dtype"] == "auto" else m["dtype"]
        model_b = dtype_bytes(model_dtype, "model.dtype")
        compute = t["compute_dtype"]
        compute_b = dtype_bytes(compute, "train.compute_dtype")
        master = t["master_dtype"]
        master_b = 4 if master == "float32" else model_b
        strategy = t["strategy"]
        if strategy not in ("ddp", "fsdp"):
            raise PlanError(f"train.strategy: unknown strategy {strategy!r}; valid: ['ddp', 'fsdp']")
        fsdp = strategy == "fsdp"
        # the dtype of the weights a forward reads, and whether autocast (ddp) casts them
        weight_b = (compute_b if compute != "float32" else master_b) if fsdp else master_b
        autocast = not fsdp and compute != "float32" and master_b > compute_b
        act_b = compute_b if (fsdp and compute != "float32") or autocast else weight_b
        T = int(r["max_new_tokens"])
        prompt = int(p["prompt_tokens"])
        if shape.max_position_embeddings:
            prompt = max(1, min(prompt, int(shape.max_position_embeddings) - T))
        n = int(r["n"])
        local_seqs = math.ceil(int(t["prompts_per_step"]) / world) * n
        mini = min(int(t["mini_batch_size"]), local_seqs)
        micro = min(int(t["micro_batch_size"]), mini)
        batch = micro_batch_shape(t["packing"], micro=micro, prompt=prompt, response=T, n=n,
                                  micro_batch_tokens=t["micro_batch_tokens"], pack_length=t["pack_length"],
                                  whole=mini >= local_seqs)
        on_gpu = str(config["device"]).startswith("cuda") or train_layout(config)[2] > 0
        gpu_gb, memory_source = memory_gb(config, on_gpu=on_gpu)
        kl_methods: list[str] = []
        if config.get("methods"):
            from oar.config.methods import resolve_methods

            kl_methods = sorted(name for name, meth in resolve_methods(config).items() if meth.recipe["kl_coef"] > 0)
        return cls(
            world=world, strategy=strategy, fsdp=fsdp, model_dtype=model_dtype, model_b=model_b, compute=compute,
            compute_b=compute_b, master=master, master_b=master_b, weight_b=weight_b, act_b=act_b, autocast=autocast,
            checkpointing=bool(t["gradient_checkpointing"]), cpu_offload=fsdp and bool(t["fsdp"]["cpu_offload"]),
            reshard_after_forward=bool(t["fsdp"]["reshard_after_forward"]), micro=micro, batch=batch,
            micro_batches=math.ceil(mini / batch.sequences), prompt=prompt, response=T, n=n, local_seqs=local_seqs,
            engine=r["engine"], rollout_batch=min(int(r["batch_size"]), local_seqs),
            sleep_mode=bool(r["sleep_mode"]), vllm=dict(VLLM_DEFAULTS, **r["vllm"]), kl_methods=kl_methods,
            device=str(config["device"]), gpu_gb=gpu_gb, memory_source=memory_source, on_gpu=on_gpu,
            headroom=float(p["headroom"]))
