"""Evaluation of a checkpoint on one or more benchmarks (``oar evaluate``).

For each benchmark: greedy pass@1 (one deterministic answer per problem) and, when
``eval.samples = k > 0``, sampled avg@k (mean accuracy of k samples at ``eval.temperature``) and
pass@k (share of problems with at least one correct sample). Answers are generated and scored
``eval.chunk_size`` at a time (bounded memory, a progress bar on stderr).
Writes, per benchmark, ``<bench>.jsonl`` (one row per answer: id, question, response, extracted
answer, gold, correct, sample; ``sample = -1`` is the greedy answer) and ``<bench>.json`` (its
summary), and ``summary.json`` over all benchmarks. A benchmark whose summary already exists with
the same settings is not evaluated again (resumable). Each summary counts the reward checks that
timed out, crashed their worker, were retried, and were scored wrong for it after the retry
(``reward``: :data:`REWARD_COUNTS`; :mod:`oar.reward.score`), with one line on stderr when any was.

The transfer evaluation (``transfer=True``, ``oar evaluate --transfer``) is the same evaluation of
``eval.transfer.benchmarks`` instead of ``eval.benchmarks``, with the same settings; the workflow
runs it on the start model and on the methods of ``eval.transfer.methods`` only.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from oar.config.settings import EvalSettings, RewardSettings
from oar.core.device import job_device
from oar.core.io import atomic_write_json, atomic_write_jsonl, read_recorded_json
from oar.core.seeds import stream_seed

if TYPE_CHECKING:
    from oar.reward.pool import PoolStats

__all__ = ["load_benchmark_entry", "load_benchmark_entry_located", "load_eval_benchmarks",
           "load_eval_benchmarks_located", "evaluate_records", "evaluate_from_config", "records_digest"]

#: The reward pool's counts in a summary's ``reward`` entry (:class:`oar.reward.pool.PoolStats`): checks
#: that timed out, whose worker died, items retried, and items scored wrong after their retry failed too.
REWARD_COUNTS: tuple[str, ...] = ("timeouts", "crashes", "retried", "marked")


def load_benchmark_entry(task: Mapping[str, Any], entry: Mapping[str, Any], *,
                         key: str = "eval.benchmarks") -> list[dict]:
    """The records of one benchmark entry ``{name, source, n, filters}`` (first ``n`` when ``n`` is set;
    :func:`load_benchmark_entry_located` without the places)."""
    return [rec for _, rec in load_benchmark_entry_located(task, entry, key=key)]


def load_benchmark_entry_located(task: Mapping[str, Any], entry: Mapping[str, Any], *,
                                 key: str = "eval.benchmarks") -> list[tuple[str, dict]]:
    """The records of one benchmark entry ``{name, source, n, filters}`` (first ``n`` when ``n`` is set),
    each with where it was read (:func:`oar.data.benchmarks.load_benchmark_located`).

    Synthetic splits (``synthetic-test``, ``synthetic-ood``) are generated with the options of
    ``task`` (the config's ``task`` section) and ``task.seed``, so every evaluation sees the same
    problems (and none of the training split's). ``key`` names the entry in errors.
    """
    from oar.data.benchmarks import load_benchmark_located

    name = entry["name"]
    if name.startswith("synthetic-"):
        if entry.get("n") is None:
            raise ValueError(f"{key}.n: required for the generated benchmark {name!r}")
        return load_benchmark_located(name, None, n=entry["n"], seed=task["seed"], **task["synthetic"])
    recs = load_benchmark_located(name, entry.get("source"), **(entry.get("filters") or {}))
    return recs[: entry["n"]] if entry.get("n") else recs


def load_eval_benchmarks(task: Mapping[str, Any], ev: EvalSettings, *, transfer: bool = False
                         ) -> dict[str, list[dict]]:
    """``ev.benchmarks`` (``transfer``: ``ev.transfer.benchmarks``) as ``{name: records}``
    (:func:`load_eval_benchmarks_located` without the places)."""
    return {name: [rec for _, rec in located]
            for name, located in load_eval_benchmarks_located(task, ev, transfer=transfer).items()}


def load_eval_benchmarks_located(task: Mapping[str, Any], ev: EvalSettings, *, transfer: bool = False
                                 ) -> dict[str, list[tuple[str, dict]]]:
    """``ev.benchmarks`` (``transfer``: ``ev.transfer.benchmarks``) as ``{name: [(where, record), ...]}``
    (see :func:`load_benchmark_entry_located`; ``task``: the config's ``task`` section).

    Raises:
        ValueError: ``transfer`` and the config has no transfer benchmark.
    """
    entries = ev.transfer.benchmarks if transfer else ev.benchmarks
    key = "eval.transfer.benchmarks" if transfer else "eval.benchmarks"
    if transfer and not entries:
        raise ValueError(f"{key}: empty; name the transfer benchmarks to evaluate")
    return {b["name"]: load_benchmark_entry_located(task, b, key=f"{key}.{i}") for i, b in enumerate(entries)}


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
    chunk_size: int = 1024,
    progress: bool = False,
    desc: str = "eval",
    keep_text: bool = True,
    pool: Any = None,
) -> tuple[dict, list[dict]]:
    """Generate and score answers for ``records`` with a rollout ``engine``, ``chunk_size`` answers at a time.

    Each pass (greedy, then ``samples`` sampled answers per problem) runs over chunks of
    ``max(1, chunk_size // answers_per_problem)`` problems: one ``engine.generate`` call and one scoring
    call per chunk, seeded ``oar.core.seeds.stream_seed(seed, chunk)`` (None: unseeded), so memory holds one chunk's
    rollout at a time (500 problems x 8 samples never sit in one generate call).

    Args:
        pool: the caller's :class:`oar.reward.pool.RewardPool` (None: one of ``workers`` and ``timeout_s``).
        progress: show a progress bar over answers.
        keep_text: put question, response and extracted answer into the rows (False: id, gold,
            correct and sample only, for the in-training held-out evaluation).

    Returns:
        ``(summary, rows)``: summary has ``n``, ``pass@1`` (greedy, or None), ``avg@k``, ``pass@k``
        (share of problems with at least one correct sample), ``k`` (None when ``samples`` is 0),
        ``answered`` (share of all answers with a final answer the reward can read, correct or not:
        a format check, e.g. a model that never writes ``\\boxed{}`` scores 0 everywhere),
        ``mean_response_tokens``, ``seconds`` and ``reward`` (the reward checks' counts,
        :data:`REWARD_COUNTS`); rows are per answer (``sample = -1``: greedy).
    """
    from tqdm.auto import tqdm

    from oar.data.prompts import render_prompt
    from oar.core.stats import pass_at_k
    from oar.reward.pool import PoolStats, RewardPool

    if chunk_size < 1:
        raise ValueError(f"eval.chunk_size: must be >= 1, got {chunk_size}")
    t0 = time.perf_counter()
    prompts = [render_prompt(template, r["question"], tokenizer) for r in records]
    golds = [r["answer"] for r in records]
    rows: list[dict] = []
    summary: dict[str, Any] = {"n": len(records), "pass@1": None, "avg@k": None, "pass@k": None, "k": samples or None}
    n_answered, lengths, reward_stats, passes = 0, [], PoolStats(), _passes(greedy, samples)
    bar = tqdm(total=len(records) * sum(per for _, per, _ in passes), desc=desc, disable=not progress,
               dynamic_ncols=True, unit="answer")
    # the caller's reward pool (a training run's, for its held-out evaluations), else one for this evaluation
    owned = contextlib.nullcontext(pool) if pool is not None else RewardPool(workers=workers, timeout_s=timeout_s)
    try:
        with owned as reward_pool:
            for kind, per, kw in passes:
                total, n_correct, answered = _evaluate_pass(
                    engine, records, prompts, golds, kind=kind, step=max(1, chunk_size // per), generate_kw=kw,
                    temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                    pool=reward_pool, keep_text=keep_text, rows=rows, lengths=lengths, bar=bar,
                    reward_stats=reward_stats)
                n_answered += answered
                acc = total / max(1, len(records) * per)
                if kind == "greedy":
                    summary["pass@1"] = acc
                else:
                    summary["avg@k"] = acc
                    summary["pass@k"] = pass_at_k(n_correct, per) if records else None
    finally:
        bar.close()
    summary.update(answered=n_answered / len(rows) if rows else None,
                   mean_response_tokens=float(sum(lengths) / max(1, len(lengths))), seconds=time.perf_counter() - t0,
                   reward={k: getattr(reward_stats, k) for k in REWARD_COUNTS})
    return summary, rows


def _passes(greedy: bool, samples: int) -> list[tuple[str, int, dict]]:
    """The passes of an evaluation: ``(kind, answers per problem, generate kwargs)``, greedy first."""
    return ([("greedy", 1, dict(n=1, greedy=True))] if greedy else []) + (
        [("sampled", samples, dict(n=samples, greedy=False))] if samples > 0 else [])


def _evaluate_pass(
    engine: Any,
    records: Sequence[dict],
    prompts: Sequence[str],
    golds: Sequence[str],
    *,
    kind: str,
    step: int,
    generate_kw: dict,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int | None,
    pool: Any,
    keep_text: bool,
    rows: list[dict],
    lengths: list[float],
    bar: Any,
    reward_stats: PoolStats | None = None,
) -> tuple[float, list[int], int]:
    """One pass of :func:`evaluate_records` (``kind`` ``greedy`` or ``sampled``), ``step`` problems per
    ``engine.generate`` call (``generate_kw``: its ``n`` and ``greedy``; chunk ``c`` seeded
    ``stream_seed(seed, c)``), each chunk scored at once.

    Appends a row per answer to ``rows`` and each answer's response length to ``lengths``, adds the
    reward pool's counts to ``reward_stats`` (when given), and advances ``bar`` by the answers of each chunk.

    Returns:
        ``(total, n_correct, n_answered)``: the summed score of the pass's answers, the correct
        answers per problem (in the order of ``records``), and the answers with a final answer the
        reward can read.
    """
    from oar.reward.score import extracted_answer, score_batch

    n_correct = [0] * len(records)
    total = 0.0
    n_answered = 0
    for c, lo in enumerate(range(0, len(records), step)):
        chunk = list(range(lo, min(lo + step, len(records))))
        ro = engine.generate([prompts[i] for i in chunk], temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens,
                             seed=None if seed is None else stream_seed(seed, c), **generate_kw)
        idx = [chunk[j] for j in ro.prompt_index.tolist()]
        scores = score_batch(ro.texts, [golds[i] for i in idx], correct=1.0, wrong=0.0, stats=reward_stats, pool=pool)
        counter: dict[int, int] = {}
        for i, text, s in zip(idx, ro.texts, scores):
            found = extracted_answer(text)
            n_answered += found is not None
            k = counter.get(i, 0)
            counter[i] = k + 1
            ok = bool(s > 0.5)
            n_correct[i] += ok
            row = {"id": records[i]["id"], "gold": golds[i], "correct": ok, "sample": -1 if kind == "greedy" else k}
            if keep_text:
                row.update(question=records[i]["question"], response=text, extracted=found)
            rows.append(row)
        lengths.extend(ro.response_mask.sum(1).float().tolist())
        total += float(sum(scores))
        bar.update(len(ro.texts))
        del ro
    return total, n_correct, n_answered


def records_digest(records: Sequence[dict]) -> str:
    """sha256 of the problems (id, question, gold answer) an evaluation scores."""
    import hashlib
    import json

    blob = json.dumps([[r.get("id"), r["question"], r["answer"]] for r in records], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _check_eval_prompts(model: Any, tokenizer: Any, located: dict[str, list[tuple[str, dict]]], *, template: str,
                        max_new_tokens: int, model_path: str, transfer: bool) -> None:
    """Every prompt of ``located`` (``{benchmark: [(where, record), ...]}``) fits the loaded ``model``'s
    context (:func:`oar.evaluate.prompt_checks.check_prompts`): a benchmark changed since ``oar data`` checked it
    is one line before anything is generated, not a failed generation after hours; prompts that leave
    fewer than ``eval.max_new_tokens`` are one warning line. Nothing is checked when the model's config
    gives no context length."""
    from oar.evaluate.prompt_checks import EVAL_BUDGET_KEY, check_prompts, loaded_prompt_model

    config_json = Path(model_path) / "config.json"
    origin = "model.tiny" if model_path == "tiny" else str(config_json) if config_json.is_file() else model_path
    fit = loaded_prompt_model(model, tokenizer, origin)
    if fit is None:
        return
    key = "eval.transfer.benchmarks" if transfer else "eval.benchmarks"
    for i, (name, pairs) in enumerate(located.items()):
        _, tight = check_prompts(pairs, template=template, model=fit, budget=max_new_tokens, budget_key=EVAL_BUDGET_KEY,
                                 what=f"{key}.{i} ({name})")
        if tight:
            print(f"oar evaluate: warning: {tight}", file=sys.stderr)


def evaluate_from_config(config: dict, model_dir: str | Path | None, output_dir: str | Path, *, seed: int = 0,
                         progress: bool = True, transfer: bool = False) -> dict:
    """Evaluate the checkpoint ``model_dir`` (None: the config's ``model``) on ``eval.benchmarks``
    (``transfer``: on ``eval.transfer.benchmarks``, with the same settings).

    Writes ``<output_dir>/<bench>.jsonl``, ``<output_dir>/<bench>.json`` and ``<output_dir>/summary.json``
    (``model``, ``model_identity``, ``benchmarks``, ``average``, ``reward``: the reward checks' counts
    (:data:`REWARD_COUNTS`) summed over the benchmarks, a cached one's from when it was scored, with one
    line on stderr when an answer was marked; and ``provenance``: this call's,
    :func:`oar.core.provenance.provenance`, also when every benchmark came from the folder's cache).

    Raises:
        oar.core.io.OutputPathError: ``output_dir`` cannot be a folder this process writes.
        oar.core.io.FolderLockedError: another evaluation (or training) writes into ``output_dir`` now.
        oar.models.checks.ModelLoadError: a file of the model cannot be loaded, or its tokenizer and its
            embeddings disagree.
        ValueError: ``transfer`` and ``eval.transfer.benchmarks`` is empty; a prompt does not fit the
            model's context with ``eval.max_new_tokens`` (:func:`oar.evaluate.prompt_checks.check_prompts`). All
            before anything is written: ``output_dir`` is made (and locked) only once the model has
            loaded and every prompt is checked.
    """
    from datetime import datetime, timezone

    from oar.core.io import check_output_folder, exclusive_lock
    from oar.models.checks import check_model_files
    from oar.models.loading import load_policy

    started = datetime.now(timezone.utc)
    output_dir = Path(output_dir)
    run = _EvalRun(eval=EvalSettings.from_config(config), reward=RewardSettings.from_config(config),
                   template=config["task"]["template"], device=job_device(config),
                   configured_device=str(config["device"]),
                   vllm_kwargs=dict(config["rollout"]["vllm"]), reward_section=dict(config["reward"]))
    spec = dict(config["model"], source=str(model_dir), gguf_file=None) if model_dir else config["model"]
    # the user's files first, before anything is written: a named error, and an existing folder as it was
    check_output_folder(output_dir, what="the evaluation folder (--output)")
    check_model_files(spec)
    located = load_eval_benchmarks_located(config["task"], run.eval, transfer=transfer)
    benches = {name: [rec for _, rec in pairs] for name, pairs in located.items()}
    model_path = str(model_dir) if model_dir else config["model"]["source"]
    model, tokenizer = load_policy(spec)
    _check_eval_prompts(model, tokenizer, located, template=run.template, max_new_tokens=run.eval.max_new_tokens,
                        model_path=model_path, transfer=transfer)
    # the same lock as the trainer's: a second evaluation into this folder stops at once, naming this one
    with exclusive_lock(output_dir, purpose=f"oar evaluate {model_path}"):
        return _evaluate_locked(run, benches, spec, output_dir, model, tokenizer, model_path=model_path,
                                seed=seed, progress=progress, started=started)


@dataclass(frozen=True)
class _EvalRun:
    """What :func:`evaluate_from_config` reads from the config, once: the typed ``eval`` and ``reward``
    settings, the task's template, the torch device and the configured one (the provenance's), the
    vLLM keywords, and the reward section as given (recorded in each benchmark's cache key, as it
    always was)."""

    eval: EvalSettings
    reward: RewardSettings
    template: str
    device: str
    configured_device: str
    vllm_kwargs: dict[str, Any]
    reward_section: dict[str, Any]


def _evaluate_locked(run: _EvalRun, benches: dict[str, list[dict]], spec: dict, output_dir: Path, model: Any,
                     tokenizer: Any, *, model_path: str, seed: int, progress: bool, started: Any) -> dict:
    """The body of :func:`evaluate_from_config`, while it holds the folder's lock."""
    from oar.config.identity import NEW_KEYS_AT_DEFAULT
    from oar.models.loading import model_identity
    from oar.core.provenance import provenance, with_end_time
    from oar.rollout import make_engine

    ev = run.eval
    # cached results are reused only for the same model content, generation and scoring settings
    settings = {k: getattr(ev, k) for k in ("greedy", "samples", "temperature", "top_p", "max_new_tokens", "chunk_size")}
    if ev.sampler != NEW_KEYS_AT_DEFAULT["eval"]["sampler"]:  # at its default, caches written before the key stay valid
        settings["sampler"] = ev.sampler
    settings.update(model_identity=model_identity(spec), seed=seed, template=run.template, reward=run.reward_section)
    model.to(run.device)
    engine = make_engine(ev.engine, model, tokenizer, batch_size=ev.batch_size, seed=seed,
                         model_path=model_path, vllm_kwargs=run.vllm_kwargs, sampler=ev.sampler)
    results: dict[str, dict] = {}
    # one reward pool for every benchmark of this evaluation; its workers start with the first answers it scores
    pool = run.reward.pool()
    try:
        for name, records in benches.items():
            done = output_dir / f"{name}.json"
            bench_settings = dict(settings, records=records_digest(records))
            prev = read_recorded_json(done)
            if prev is not None and prev.get("settings") == bench_settings and prev.get("n") == len(records):
                results[name] = prev
                continue
            summary, rows = evaluate_records(
                engine, tokenizer, records, template=run.template, greedy=ev.greedy,
                samples=ev.samples, temperature=ev.temperature, top_p=ev.top_p,
                max_new_tokens=ev.max_new_tokens, seed=seed, chunk_size=ev.chunk_size, progress=progress,
                desc=name, pool=pool,
            )
            summary.update(benchmark=name, model=model_path, settings=bench_settings)
            atomic_write_jsonl(output_dir / f"{name}.jsonl", rows)
            atomic_write_json(done, summary)
            results[name] = summary
    finally:
        pool.close()
    keys = [k for k in ("pass@1", "avg@k", "pass@k") if results and all(r.get(k) is not None for r in results.values())]
    average = {k: sum(r[k] for r in results.values()) / len(results) for k in keys if results}
    reward = {k: sum(int(r.get("reward", {}).get(k, 0)) for r in results.values()) for k in REWARD_COUNTS}
    out = {"model": model_path, "model_identity": settings["model_identity"], "benchmarks": results, "average": average,
           "reward": reward, "provenance": with_end_time(provenance(device=run.configured_device, started=started))}
    atomic_write_json(output_dir / "summary.json", out)
    _warn_marked(reward, run.reward.timeout_s, output_dir / "summary.json")
    return out


def _warn_marked(reward: dict[str, int], timeout_s: float, where: Path) -> None:
    """One line on stderr when answers were scored wrong without a verdict (``reward["marked"]`` > 0)."""
    if reward.get("marked", 0) > 0:
        print(f"oar evaluate: warning: {reward['marked']} answer(s) scored wrong because their check timed out or "
              f"crashed twice (reward.timeout_s = {timeout_s:g} s; a busy machine or a pathological answer); "
              f"counts in {where} under reward", file=sys.stderr)
