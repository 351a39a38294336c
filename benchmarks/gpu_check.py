"""GPU acceptance check (issue 22): FSDP2 with bfloat16 compute on float32 master weights and
gradient checkpointing, ``oar plan``'s memory prediction against measured peaks, rollout and update
throughput, and the OAR-G/GRPO and OAR-P/GRPO step-time ratios, on a randomly initialised model of
Qwen2.5-0.5B's shape. Prints ONE JSON line on stdout (progress goes to stderr)::

    PYTHONPATH=src python benchmarks/gpu_check.py > gpu_check.json            # GPU: --size qwen0.5b
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu                  # CPU: --size toy, < 1 min

Imports only torch, transformers (with its tokenizers), accelerate, PyYAML, the standard library and
the ``oar`` modules that need nothing else (``oar.strategy``, ``oar.rollout``, ``oar.packing``,
``oar.loss``, ``oar.credit``, ``oar.update``, ``oar.plan``, ``oar.models``, ``oar.data``,
``oar.config``), so it runs on a stock CUDA image without ``pip install``. The update is the
trainer's own ``oar.update.update_policy`` (:func:`update_policy` passes it this run's layout); the
settings are config/paper.yaml's, read by ``oar.config`` with the schema's defaults and without
validation, which would need jsonschema (:func:`paper_settings`); ``oar.reward`` (math-verify) is
not used: rewards are set, see below.

What runs (one process; ``oar.strategy.FSDPStrategy`` = ``fully_shard`` per decoder layer and on
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
   A step = rollout (``oar.rollout.HFEngine``, lean sampler) + credit + update (trainer layout), as
   ``oar.train`` times it, without the reward.

A random model never writes ``\\boxed{}``, and OAR-P/OAR-G score only responses with a boxed answer
and a nonzero advantage; so each sampled response is cut to a length drawn in
``[max_new_tokens/2, max_new_tokens]`` (one response of every batch full length) and ends with
``" \\boxed{k}"`` + eos, and the rewards alternate 1, 0, 1, 0 within each group: every response is
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
from typing import Any  # noqa: E402

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
    "toy": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
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
#: The loss settings of a method's recipe used here (the three methods share GRPO's).
RECIPE_KEYS = ("eps_low", "eps_high", "clip_ratio_c", "loss_agg")
#: The methods of :data:`PAPER_CONFIG` that are timed.
METHOD_NAMES = ("grpo", "oar_g", "oar_p")


def paper_settings() -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, dict[str, Any]]]]:
    """``(train, recipe, methods)`` of :data:`PAPER_CONFIG`: the :data:`TRAIN_KEYS` of its ``train``,
    the :data:`RECIPE_KEYS` of GRPO's recipe, and ``{method: (estimator, options)}`` of
    :data:`METHOD_NAMES` (``ResolvedMethod.estimator_options()``). Read with the schema's defaults but
    without validation (``oar.config.load_config(validate=False)``: the stock image has no jsonschema;
    the tests validate paper.yaml)."""
    from oar.config import load_config, resolve_method

    cfg = load_config(PAPER_CONFIG, validate=False)
    resolved = {name: resolve_method(cfg, name, source=str(PAPER_CONFIG), validate=False) for name in METHOD_NAMES}
    train = {k: cfg["train"][k] for k in TRAIN_KEYS}
    recipe = {k: resolved["grpo"].recipe[k] for k in RECIPE_KEYS}
    return train, recipe, {name: (m.estimator, m.estimator_options()) for name, m in resolved.items()}


TRAIN, RECIPE, METHODS = paper_settings()
MODEL_CREDITS = ("oar_g", "oar_p")  # estimators that call the policy (run inside Strategy.local_phase)
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
    """The tiny model's character tokenizer (``oar.models.build_tiny_tokenizer``: ``<pad>`` 0,
    ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the 96 characters) with filler tokens ``<k>`` up to
    ``vocab_size``, so every id a model of that vocabulary samples decodes (a filler is several
    characters: text never encodes to one, and none holds a brace or backslash)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from oar.models import TINY_CHARACTERS, TINY_SPECIAL_TOKENS

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
      hands over (``cache``, or ``past_key_values`` up to transformers 5.21: :func:`oar.models.cache_argument`);
      ``rollout_logprob_gap`` checks that the lean sampler's log-probs equal a fresh forward's.
    - ``logits_to_keep_mask``: whether the packed layouts pass ``logits_to_keep`` as a boolean
      ``(rows, length)`` mask (transformers >= 5.21) or compute every logit and select
      (``oar.packing.accepts_logits_to_keep``); the loss is the same either way.
    """
    import transformers

    from oar.models import cache_argument
    from oar.packing import accepts_logits_to_keep

    return {"transformers": transformers.__version__, "cache_argument": cache_argument(model),
            "logits_to_keep_mask": accepts_logits_to_keep(model), "fallbacks": []}


def run_config(size: str, run: dict[str, int], *, device: str, prompt_tokens: int, gpu_gb: float) -> dict:
    """The config ``oar.strategy.make_strategy`` and ``oar.plan`` read: :data:`TRAIN`, the run's batch,
    one process (``resources.train.gpu: 1``), the rest the schema's defaults
    (:func:`oar.config.section_defaults`; no validation: the stock image has no jsonschema)."""
    from oar.config import deep_merge, section_defaults

    given = {
        "model": {"source": f"gpu_check:{size}", "dtype": "float32"},
        "plan": {"model": plan_shape(size), "prompt_tokens": prompt_tokens, "gpu_memory_gb": gpu_gb, "headroom": 0.0},
        "train": dict(TRAIN, prompts_per_step=run["prompts"], mini_batch_size=run["mini_batch_size"],
                      micro_batch_size=run["micro_batch_size"]),
        "rollout": {"engine": "hf", "sampler": "lean", "n": run["n"], "max_new_tokens": run["max_new_tokens"],
                    "batch_size": run["prompts"] * run["n"], "temperature": 1.0, "top_p": 1.0},
    }
    return {"device": device, **{k: deep_merge(section_defaults(k), v) for k, v in given.items()},
            "resources": {"train": {"gpu": 1}}}


def prompt_sets(count: int, per_set: int, seed: int) -> list[list[str]]:
    """``count`` lists of ``per_set`` prompts: synthetic training problems (3 two-digit operands) in
    the ``qwen_boxed`` template."""
    from oar.data.prompts import render_prompt
    from oar.data.synthetic import generate

    recs = generate("train", count * per_set, seed=seed, operands=[3], long_share=0.0, digits=2,
                    operators=["+", "-"], filler_prob=0.0)
    texts = [render_prompt(TEMPLATE, r["question"]) for r in recs]
    return [texts[i * per_set : (i + 1) * per_set] for i in range(count)]


def with_answers(ro: Any, tok: Any, *, n: int, max_new_tokens: int, generator: Any) -> Any:
    """``ro`` with every response cut to a length drawn in ``[max_new_tokens/2, max_new_tokens]``
    (the first one full length) and ending with ``" \\boxed{k}"`` + eos (see the module doc).

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
        ans = tok(f" \\boxed{{{(i // n) * 37 % 1000}}}", add_special_tokens=False)["input_ids"] + [eos]
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


def alternating_rewards(ro: Any, n: int) -> Any:
    """1, 0, 1, 0, ... within each group (row ``i*n + j`` is response ``j`` of prompt ``i``): every group mixed."""
    import torch

    return torch.tensor([1.0 if (i % n) % 2 == 0 else 0.0 for i in range(ro.response_ids.shape[0])])


# ----------------------------------------------------------------------------------------- update


def update_policy(model: Any, optimizer: Any, strategy: Any, ro: Any, token_adv: Any, *, packing: str,
                  micro_batch_size: int, mini_batch_size: int, micro_batch_tokens: int | None,
                  pack_length: int | None, grad_clip: float, recipe: dict, generator: Any,
                  marks: Any = None, temperature: float = 1.0) -> dict[str, Any]:
    """One policy update by the trainer's own ``oar.update.update_policy``: one PPO epoch, no KL
    reference, the given layout and clipping.

    ``marks`` (a :class:`PhaseMarks`, optional) follows the update's events
    (``oar.update.UPDATE_EVENTS``): reset at each micro-batch's start, marked at its backward's end
    (``backward end``), reset before and marked after ``optimizer.step`` (``step``).

    Returns:
        ``tokens_real`` / ``tokens_computed`` (positions of the forwards, summed), ``loss`` and
        ``grad_norm`` per mini-batch, ``nonfinite`` (skipped updates).
    """
    from oar.update import update_policy as trainer_update

    def observe(event: str) -> None:
        if event in ("micro-batch", "step start"):
            marks.reset()
        else:
            marks.mark(event)

    tcfg = {"packing": packing, "micro_batch_size": micro_batch_size, "mini_batch_size": mini_batch_size,
            "micro_batch_tokens": micro_batch_tokens, "pack_length": pack_length, "grad_clip": grad_clip,
            "ppo_epochs": 1, "skip_zero_advantage": False}  # every row computed: the check times the whole update
    upd, nonfinite = trainer_update(model, optimizer, strategy, ro, token_adv, None, recipe=dict(recipe, kl_coef=0.0),
                                    tcfg=tcfg, temperature=temperature, agg_max_len=None, generator=generator,
                                    observe=observe if marks is not None else None)
    return {"tokens_real": int(sum(upd["tokens_real"])), "tokens_computed": int(sum(upd["tokens_computed"])),
            "loss": upd["loss"], "grad_norm": upd["grad_norm"], "nonfinite": nonfinite}


# ----------------------------------------------------------------------------------------- memory


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
        from oar.credit import get_estimator
        from oar.rollout import make_engine
        from oar.strategy import make_strategy

        torch = self.torch
        t0 = time.monotonic()
        self.strategy = make_strategy(self.cfg)
        self.tok = make_tokenizer(SHAPES[self.size]["vocab_size"])
        model = make_model(self.size, self.tok, self.strategy.device, self.args.seed)
        self.params = sum(p.numel() for p in model.parameters())
        compat = transformers_compat(model)
        self.sampler = self.args.sampler or "lean"
        self.packing = self.args.packing or TRAIN["packing"]
        self.report.data["compat"] = compat
        self.model, self.optimizer = self.strategy.prepare(model, lr=TRAIN["lr"], betas=tuple(TRAIN["betas"]),
                                                           weight_decay=TRAIN["weight_decay"])
        self.policy = self.strategy.policy(self.model)
        self.engine = make_engine("hf", self.policy, self.tok, batch_size=self.cfg["rollout"]["batch_size"],
                                  sampler=self.sampler)
        self.estimators = {m: get_estimator(est) for m, (est, _) in METHODS.items()}
        self.backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        rounds = self.run["rounds"] + 3  # + the fsdp step, the measured step and the warm-up round
        self.prompts = prompt_sets(rounds, self.run["prompts"], seed=self.args.seed + 1234)
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
        """One step of ``method`` on ``prompts``: rollout (+ answers, rewards), credit, update.
        ``measure``: record the plan's phases in ``self.marks`` (rollout and update)."""
        from oar.credit import CreditBatch

        torch = self.torch
        run, strategy, model = self.run, self.strategy, self.model
        marks = self.marks if measure else None
        t0 = self._sync()
        if marks is not None:
            marks.reset()
        with strategy.local_phase(model):
            raw = self.engine.generate(prompts, n=run["n"], temperature=1.0, top_p=1.0,
                                       max_new_tokens=run["max_new_tokens"], seed=seed)
            if marks is not None:
                marks.mark("rollout")
        t_gen = self._sync() - t0
        ro = with_answers(raw, self.tok, n=run["n"], max_new_tokens=run["max_new_tokens"], generator=self.gen)
        rewards = alternating_rewards(ro, run["n"])
        t1 = self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        est, options = METHODS[method]
        with strategy.local_phase(model) if method in MODEL_CREDITS else contextlib.nullcontext():
            credit = self.estimators[method](
                CreditBatch(response_ids=ro.response_ids, response_mask=ro.response_mask, rewards=rewards,
                            group_ids=ro.prompt_index.clone(), prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
                            model=self.policy, tokenizer=self.tok,
                            extras={"old_logprobs": ro.logprobs, "step": self.steps_done, "seed": self.args.seed}),
                **options)
            token_adv = credit.token_advantages.float()
        t2 = self._sync()
        credit_peak = int(torch.cuda.max_memory_allocated()) if self.cuda else None
        upd = update_policy(model, self.optimizer, strategy, ro, token_adv, packing=packing or self.packing,
                            micro_batch_size=run["micro_batch_size"], mini_batch_size=run["mini_batch_size"],
                            micro_batch_tokens=TRAIN["micro_batch_tokens"], pack_length=TRAIN["pack_length"],
                            grad_clip=TRAIN["grad_clip"], recipe=RECIPE,
                            generator=torch.Generator().manual_seed(seed), marks=marks)
        t3 = self._sync()
        self.steps_done += 1
        self.step_seconds.append(t3 - t0)
        self.method_seconds.setdefault(method, []).append(t3 - t0)
        return {"method": method, "step_s": t3 - t0, "rollout_s": t1 - t0, "generate_s": t_gen, "credit_s": t2 - t1,
                "update_s": t3 - t2, "sampled_tokens": int(raw.response_mask.sum()),
                "prompt_tokens": int(ro.prompt_ids.shape[1]), "update_tokens": upd["tokens_real"],
                "update_computed_tokens": upd["tokens_computed"], "loss": upd["loss"], "nonfinite": upd["nonfinite"],
                "scored_fraction": credit.stats.get("scored_fraction"), "credit_peak": credit_peak, "raw": raw}

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
        d["settings"] = {**self.run, "backend": getattr(self, "backend", None), "strategy": TRAIN["strategy"],
                         "compute_dtype": TRAIN["compute_dtype"], "master_dtype": TRAIN["master_dtype"],
                         "gradient_checkpointing": TRAIN["gradient_checkpointing"],
                         "packing": getattr(self, "packing", None), "sampler": getattr(self, "sampler", None),
                         "micro_batch_tokens": TRAIN["micro_batch_tokens"], "lr": TRAIN["lr"],
                         "methods": {m: o for m, (_, o) in METHODS.items()}}

    def need(self, method: str | None = None) -> float:
        """Seconds the next step (of ``method``) is expected to take: 1.3 x the longest step of
        ``method`` so far, else 2 x the longest step of any method (0 before any step)."""
        own = self.method_seconds.get(method)
        return 1.3 * max(own) if own else 2.0 * max(self.step_seconds, default=0.0)

    # ---------------------------------------------------------------- checks
    def check_fsdp(self) -> None:
        """One GRPO step (trainer layout): sharded float32 master weights, bfloat16 layers, weights moved."""
        from torch.distributed.tensor import DTensor

        from oar.strategy import decoder_layers

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
        ok = sharded and dtypes == ["float32"] and seen == {TRAIN["compute_dtype"]} and loss_ok and frac > 0 and ckpt
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
        sequences in the update's layout (``oar.packing``, no gradient, after the step's lr-1e-6
        update): both in bfloat16, so a few hundredths at most; far more means the rollout's
        decoding and the trainer's forward see different things (e.g. a dropped KV cache)."""
        from oar.packing import micro_batch_logprobs, plan_micro_batches

        torch = self.torch
        N = raw.response_ids.shape[0]
        diffs = []
        mbs = plan_micro_batches(raw.prompt_ids, raw.prompt_mask, raw.response_ids, raw.response_mask,
                                 torch.arange(N), packing=self.packing, micro_batch_size=self.run["micro_batch_size"],
                                 micro_batch_tokens=TRAIN["micro_batch_tokens"], pack_length=TRAIN["pack_length"])
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

    def timed_rounds(self, budget: Budget) -> None:
        """A warm-up round, then ``rounds`` timed rounds of every method (order rotating)."""
        names = list(METHODS)
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
        d["scored_fraction"] = {m: v[-1]["scored_fraction"] for m, v in by.items() if v and m in MODEL_CREDITS}
        if self.cuda:
            d["credit_peak_gib"] = {m: max(s["credit_peak"] for s in v) / GiB for m, v in by.items() if v}
        base = d["step_s"].get("grpo")
        d["ratios"] = {f"{m}/grpo": (d["step_s"][m] / base if base and d["step_s"].get(m) else None)
                       for m in MODEL_CREDITS}
        # OAR's credit seconds per GRPO step seconds (GRPO's own credit is a few arithmetic ops)
        d["credit_share_of_grpo_step"] = {m: (d["phase_s"][m]["credit"] / base if base and d["phase_s"].get(m) else None)
                                          for m in MODEL_CREDITS}


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
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # library prints go to stderr: stdout carries the JSON line only
    report = Report(real_stdout)
    args = parse_args(argv)
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
    except Exception as e:  # noqa: BLE001
        report.error("start", e)
        report.emit()
        return 1

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
               and not (d.get("compat") or {}).get("fallbacks"))
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
