"""Memory plan of a config: what one GPU holds while training and for the vLLM engine (``oar plan``).

The package: :mod:`oar.plan.shape` (the model's shape: ``plan.model``, a ``config.json``, GGUF
metadata or a known hub id), :mod:`oar.plan.settings` (what the formulas read, typed, built once
from the validated config, and the update's largest forward in its ``train.packing`` layout),
:mod:`oar.plan.memory` (the terms, the per-phase totals and the verdict) and
:mod:`oar.plan.format` (the text ``oar plan`` prints). When SLURM signals a training job before
its time limit is the workflow's business (:mod:`oar.pipeline.launch`).

Every number here is arithmetic on the model's shape and the config; nothing is loaded and no
accelerator is needed, so the workflow can refuse a config that cannot fit before any GPU job runs.

Terms (bytes per GPU; ``P`` parameters, ``W`` processes = ``resources.train.gpu`` x nodes, ``L``
layers, hidden ``h``, query width ``q = heads x head_dim``, key/value width ``kv``, MLP width ``I``,
vocabulary ``V``; ``T`` response tokens, ``S = prompt + T``; the micro-batch is the largest forward
the update builds in its layout (:class:`~oar.plan.settings.MicroBatchShape`: ``none`` pads
``micro_batch_size`` rows to ``S``; ``length_grouped``, ``packed`` and ``shared_prompt`` fill at
most ``train.micro_batch_tokens`` positions, the last writing a group's prompt once per row; the
activations count its ``rows x length`` positions, the logits only the positions that predict a
response token except under ``none``):

- **master weights** ``P x master`` (``/ W`` with fsdp): the weights AdamW steps, float32 unless
  ``train.master_dtype: model``.
- **gradients** the same size (plus DDP's bucket copy of every gradient when ``W > 1``). Under fsdp
  with several micro-batches per mini-batch, gradient sync is off until the last one
  (``oar.trainer.strategy.FSDPStrategy.sync_context``) and FSDP2 then keeps every gradient **unsharded in
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
  compute dtype; plus the boolean ``rows x length x length`` mask (layouts with a mask). Autocast adds float32 copies (the
  residual stream and the norms stay float32) and casts the norm output once per projection.
  With gradient checkpointing only each layer's input survives (``L x stream x h`` per token);
  a layer's MLP intermediates (``3cI``) exist while it runs (**one layer's intermediates**) and
  one layer is rebuilt in the backward (**recompute**).
- **logits**: ``positions x V x 4`` bytes per float32 copy and :data:`LOGITS_COPIES` copies alive at
  the end of the trainer's forward (``oar.trainer.update.policy_forward`` with the entropy): the float32
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
backward at its end; the optimizer step; the rollout; the credit estimators' own passes), each phase
summing the terms alive in it, plus ``plan.headroom`` of the GPU kept free for the CUDA context,
NCCL buffers and allocator fragmentation; the peak phase must fit in ``plan.gpu_memory_gb`` (a CPU
config: the host memory of one training process, and the plan speaks of host memory). The credit
phase holds the policy as in the rollout and the largest chunk of one method's passes (OAR-P's
perturbed forwards, OAR-G's input-gradient backward, ``mc_value``'s continuations and refine pass:
:func:`~oar.plan.memory.credit_terms`, one term per pass, the phase's total with each), with the
vLLM engine asleep (``rollout.sleep_mode``; the trainer sleeps it before the credit phase unless the
method samples continuations through it). Not modelled: FSDP's all-gather staging buffers (a
transient ~2.5 x the gathered module at its pre-forward), CUDA graphs, and allocator rounding.

``benchmarks/bench_memory.py`` checks these formulas against the measured peak of live tensor
memory of a training micro-batch on CPU (tiny model and SmolLM2-135M, ddp and 2-process fsdp,
with and without gradient checkpointing, float32 and bfloat16); the ratios it measured are in
benchmarks/README.md, "Measured numbers".
"""

from oar.plan.format import format_plan
from oar.plan.memory import CREDIT_PASSES, FSDP_UNSHARDED_ACCUMULATION, LOGITS_COPIES, PROBE_TAIL_TOKENS, credit_terms, engine_memory, engine_terms, plan, training_memory, training_terms
from oar.plan.terms import MEMORY_PHASES, GiB, PlanResult, Term, gib, layer_activation_bytes
from oar.plan.settings import (VLLM_DEFAULTS, MicroBatchShape, PlanSettings, micro_batch_shape, train_layout,
                               world_size)
from oar.plan.shape import KNOWN_MODELS, TINY_VOCAB_SIZE, ModelShape, PlanError, dtype_bytes, model_shape

__all__ = [
    "GiB", "MEMORY_PHASES", "LOGITS_COPIES", "FSDP_UNSHARDED_ACCUMULATION", "CREDIT_PASSES", "PROBE_TAIL_TOKENS",
    "VLLM_DEFAULTS",
    "KNOWN_MODELS", "TINY_VOCAB_SIZE", "PlanError", "ModelShape", "MicroBatchShape", "PlanSettings", "Term",
    "PlanResult", "dtype_bytes", "gib", "model_shape", "train_layout", "world_size", "micro_batch_shape",
    "layer_activation_bytes", "training_terms", "training_memory", "engine_terms", "engine_memory",
    "credit_terms", "plan", "format_plan",
]
