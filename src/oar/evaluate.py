"""Evaluation of a checkpoint on one or more benchmarks (``oar evaluate``).

For each benchmark: greedy pass@1 (one deterministic answer per problem) and, when
``eval.samples = k > 0``, sampled avg@k (mean accuracy of k samples at ``eval.temperature``).
Writes, per benchmark, ``<bench>.jsonl`` (one row per answer: id, question, response, extracted
answer, gold, correct, sample; ``sample = -1`` is the greedy answer) and ``<bench>.json`` (its
summary), and ``summary.json`` over all benchmarks. A benchmark whose summary already exists with
the same settings is not evaluated again (resumable).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from oar.io import atomic_write_json, atomic_write_jsonl

__all__ = ["load_eval_benchmarks", "evaluate_records", "evaluate_from_config", "records_digest"]


def load_eval_benchmarks(config: dict) -> dict[str, list[dict]]:
    """The config's ``eval.benchmarks`` as ``{name: records}`` (first ``n`` records when ``n`` is set).

    Synthetic splits (``synthetic-test``, ``synthetic-ood``) are generated with the task's options and
    ``task.seed``, so every evaluation sees the same problems.
    """
    from oar.data.benchmarks import load_benchmark

    out: dict[str, list[dict]] = {}
    for i, b in enumerate(config["eval"]["benchmarks"]):
        name = b["name"]
        if name.startswith("synthetic-"):
            if b.get("n") is None:
                raise ValueError(f"eval.benchmarks.{i}.n: required for the generated benchmark {name!r}")
            recs = load_benchmark(name, None, n=b["n"], seed=config["task"]["seed"], **config["task"]["synthetic"])
        else:
            recs = load_benchmark(name, b.get("source"), **(b.get("filters") or {}))
            if b.get("n"):
                recs = recs[: b["n"]]
        out[name] = recs
    return out


def evaluate_records(
    engine: Any,
    tokenizer: Any,
    records: Sequence[dict],
    *,
    template: str,
    greedy: bool = True,
    samples: int = 0,
    temperature: float = 0.6,
    top_p: float = 1.0,
    max_new_tokens: int = 96,
    seed: int | None = 0,
    timeout_s: float = 5.0,
    workers: int | None = None,
) -> tuple[dict, list[dict]]:
    """Generate and score answers for ``records`` with a rollout ``engine``.

    Returns:
        ``(summary, rows)``: summary has ``n``, ``pass@1`` (greedy, or None), ``avg@k`` and ``k``
        (None when ``samples`` is 0), ``mean_response_tokens`` and ``seconds``; rows are per answer.
    """
    from oar.data.prompts import render_prompt
    from oar.reward import extracted_answer, score_batch

    t0 = time.perf_counter()
    prompts = [render_prompt(template, r["question"], tokenizer) for r in records]
    golds = [r["answer"] for r in records]
    rows: list[dict] = []
    summary: dict[str, Any] = {"n": len(records), "pass@1": None, "avg@k": None, "k": samples or None}
    lengths: list[float] = []
    passes = []
    if greedy:
        passes.append(("greedy", dict(n=1, greedy=True)))
    if samples > 0:
        passes.append(("sampled", dict(n=samples, greedy=False)))
    for kind, kw in passes:
        ro = engine.generate(prompts, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, **kw)
        idx = ro.prompt_index.tolist()
        scores = score_batch(ro.texts, [golds[i] for i in idx], correct=1.0, wrong=0.0, timeout_s=timeout_s, workers=workers)
        counter: dict[int, int] = {}
        for j, (i, text, s) in enumerate(zip(idx, ro.texts, scores)):
            k = counter.get(i, 0)
            counter[i] = k + 1
            rows.append({
                "id": records[i]["id"], "question": records[i]["question"], "response": text,
                "extracted": extracted_answer(text), "gold": golds[i], "correct": bool(s > 0.5),
                "sample": -1 if kind == "greedy" else k,
            })
        lengths.extend(ro.response_mask.sum(1).float().tolist())
        acc = float(sum(scores) / max(1, len(scores)))
        summary["pass@1" if kind == "greedy" else "avg@k"] = acc
    summary["mean_response_tokens"] = float(sum(lengths) / max(1, len(lengths)))
    summary["seconds"] = time.perf_counter() - t0
    return summary, rows


def records_digest(records: Sequence[dict]) -> str:
    """sha256 of the problems (id, question, gold answer) an evaluation scores."""
    import hashlib
    import json

    blob = json.dumps([[r.get("id"), r["question"], r["answer"]] for r in records], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_cached(path: Path) -> dict | None:
    """A benchmark's cached summary, or None when it is missing or unreadable (it is recomputed)."""
    import json

    try:
        prev = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return prev if isinstance(prev, dict) else None


def evaluate_from_config(config: dict, model_dir: str | Path | None, output_dir: str | Path, *, seed: int = 0) -> dict:
    """Evaluate the checkpoint ``model_dir`` (None: the config's ``model``) on ``eval.benchmarks``.

    Writes ``<output_dir>/<bench>.jsonl``, ``<output_dir>/<bench>.json`` and ``<output_dir>/summary.json``.
    """
    from oar.models import load_policy, model_identity
    from oar.rollout import make_engine

    ev = config["eval"]
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(config["model"], source=str(model_dir), gguf_file=None) if model_dir else config["model"]
    # cached results are reused only for the same model content, generation and scoring settings
    settings = {k: ev[k] for k in ("greedy", "samples", "temperature", "top_p", "max_new_tokens")}
    settings.update(model_identity=model_identity(spec), seed=seed, template=config["task"]["template"],
                    reward=config["reward"])
    model_path = str(model_dir) if model_dir else config["model"]["source"]
    model, tokenizer = load_policy(spec)
    if config.get("device", "cpu") != "cpu":
        import torch

        model.to("cuda" if config["device"] == "auto" and torch.cuda.is_available() else config["device"])
    engine = make_engine(ev["engine"], model, tokenizer, batch_size=ev["batch_size"], seed=seed,
                         model_path=model_path, vllm_kwargs=config["rollout"].get("vllm"))
    benches = load_eval_benchmarks(config)
    results: dict[str, dict] = {}
    for name, records in benches.items():
        done = output_dir / f"{name}.json"
        bench_settings = dict(settings, records=records_digest(records))
        prev = _read_cached(done)
        if prev is not None and prev.get("settings") == bench_settings and prev.get("n") == len(records):
            results[name] = prev
            continue
        summary, rows = evaluate_records(
            engine, tokenizer, records, template=config["task"]["template"], greedy=ev["greedy"],
            samples=ev["samples"], temperature=ev["temperature"], top_p=ev["top_p"],
            max_new_tokens=ev["max_new_tokens"], seed=seed, timeout_s=config["reward"]["timeout_s"],
            workers=config["reward"]["workers"],
        )
        summary.update(benchmark=name, model=model_path, settings=bench_settings)
        atomic_write_jsonl(output_dir / f"{name}.jsonl", rows)
        atomic_write_json(done, summary)
        results[name] = summary
    keys = [k for k in ("pass@1", "avg@k") if any(r.get(k) is not None for r in results.values())]
    average = {k: sum(r[k] for r in results.values()) / len(results) for k in keys if results}
    out = {"model": model_path, "model_identity": settings["model_identity"], "benchmarks": results, "average": average}
    atomic_write_json(output_dir / "summary.json", out)
    return out
