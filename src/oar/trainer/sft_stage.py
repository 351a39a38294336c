"""The SFT stage as the pipeline runs it: its data from the task or a dataset, its settings from the
config, held-out accuracy, and the cache that reuses a finished warm start (:func:`sft_or_cached`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from oar.config.identity import sft_cache_key
from oar.config.settings import RewardSettings, SFTSettings, TrainSettings
from oar.trainer.sft import LogFn, greedy_accuracy, run_sft, save_sft_model

__all__ = ["sft_from_config", "sft_or_cached"]


def sft_data(task: Mapping[str, Any], *, eval_size: int) -> tuple[list[dict], dict[str, list[dict]]]:
    """The warm-start SFT's training records and its held-out evaluation sets (``eval_size`` records
    each: ``sft.eval_size``), from ``task`` (the config's ``task`` section).

    - ``task.kind: synthetic``: ``task.train_size`` generated training records (seed ``task.seed``,
      options ``task.synthetic``); evaluation sets ``test`` and ``ood`` of ``sft.eval_size`` records.
    - ``task.kind: benchmark``: the records of ``task.benchmark`` (:func:`oar.data.records.training_records`),
      which must carry a reference ``solution`` (gsm8k's, rewritten to end in ``\\boxed{}``); the
      file's last ``sft.eval_size`` records are held out as the evaluation set ``heldout``, and the
      first ``task.train_size`` of the rest are trained on. A format warm-up on real data, so that the
      start of RL answers in the form the reward reads.

    Returns:
        ``(train_records, {split: eval_records})``; training records have ``question`` and ``solution``.

    Raises:
        ValueError: an unknown ``task.kind``; benchmark records without a ``solution`` (names the
            benchmark and its source); fewer records than ``sft.eval_size`` + 1.
    """
    from oar.data.records import training_records
    from oar.data.synthetic import generate

    kind, train_size = task["kind"], int(task["train_size"])
    if kind == "synthetic":
        options = dict(task["synthetic"])
        seed = int(task["seed"])
        evals = {split: generate(split, eval_size, seed=seed, **options) for split in ("test", "ood")}
        return training_records({**task, "synthetic": options, "seed": seed, "train_size": train_size}), evals
    if kind != "benchmark":
        raise ValueError(f"config: task.kind={kind!r}: SFT supports 'synthetic' and 'benchmark'")
    records = training_records(task)
    name, source = task["benchmark"]["name"], task["benchmark"].get("source")
    if "solution" not in records[0]:
        raise ValueError(f"config: task.benchmark: the {name!r} records of {source} carry no reference 'solution' "
                         f"to fine-tune on (gsm8k's do); set sft.enabled: false")
    if len(records) <= eval_size:
        raise ValueError(f"config: sft.eval_size={eval_size}: {source} has only {len(records)} {name} records, "
                         f"none left to train on")
    return records[:-eval_size][:train_size], {"heldout": records[-eval_size:]}


def sft_from_config(
    config: Mapping[str, Any],
    output_dir: str | os.PathLike,
    *,
    progress: bool = True,
    log_fn: LogFn | None = None,
    n_examples: int = 5,
) -> dict:
    """Warm-start SFT as the config says; save the model to ``output_dir`` atomically.

    Steps: build the policy from ``config["model"]`` (for ``source: tiny`` the initialisation
    seed is ``sft.seed``); the training records and held-out sets of :func:`sft_data`; :func:`run_sft`
    with ``config["sft"]``; greedy accuracy and the share of answers with an extractable final answer
    on each held-out set (``sft.max_new_tokens`` new tokens, reward settings from ``config["reward"]``);
    then write model, tokenizer and ``sft_summary.json`` into a temporary folder beside ``output_dir``
    and rename it onto ``output_dir`` (:func:`oar.core.io.atomic_path`), so ``output_dir`` is either
    complete or absent.

    Returns:
        The summary written to ``sft_summary.json``: ``accuracy`` and ``extracted`` (per held-out set:
        ``test``/``ood`` for the synthetic task, ``heldout`` for a benchmark), ``seconds`` (whole
        call), ``sft`` (the :func:`run_sft` result incl. ``loss_curve``), ``examples`` (first
        ``n_examples`` questions of the first set with response and gold), the ``sft`` config section
        used, model facts (parameters, attention implementation, threads), and ``provenance``
        (:func:`oar.core.provenance.provenance`, with the end time).
    Raises:
        oar.core.io.OutputPathError: ``output_dir`` cannot be a folder this process writes (checked first).
        oar.models.checks.ModelLoadError: a file of the model cannot be loaded.
    """
    from datetime import datetime, timezone

    from oar.core.io import check_output_folder
    from oar.models.loading import load_policy
    from oar.core.provenance import provenance, with_end_time
    from oar.trainer.strategy import make_strategy

    t0 = time.perf_counter()
    check_output_folder(output_dir, what="the SFT output folder (--output)")  # before the training, not after
    started = datetime.now(timezone.utc)
    model_spec = dict(config["model"])
    sft, reward = SFTSettings.from_config(config), RewardSettings.from_config(config)
    template = config["task"]["template"]
    train_records, eval_sets = sft_data(config["task"], eval_size=sft.eval_size)

    if model_spec.get("source") == "tiny":
        model_spec["tiny"] = {"seed": sft.seed, **dict(model_spec.get("tiny") or {})}
    model, tokenizer = load_policy(model_spec)
    # the training's strategy (train.strategy, its dtypes and device), in this one process
    strategy = make_strategy(TrainSettings.from_config(config), config["device"],
                             source=f"config {config.get('name', '')!r}")

    result = run_sft(model, tokenizer, train_records, strategy=strategy, **sft.optimisation(), seed=sft.seed,
                     micro_batch_size=sft.micro_batch_size, template=template, progress=progress, log_fn=log_fn)
    with strategy.local_phase(model):
        accuracy, extracted, examples = sft_heldout_accuracy(
            strategy.policy(model), tokenizer, eval_sets, reward, template=template,
            max_new_tokens=sft.max_new_tokens, step=result["steps"], log_fn=log_fn, n_examples=n_examples)
    summary = {
        "accuracy": accuracy,
        "extracted": extracted,
        "eval_size": sft.eval_size,
        "seconds": None,  # filled below
        "sft": result,
        "examples": examples,
        "config_sft": dict(config["sft"]),  # the section as the config gave it
        "model": _model_facts(model, model_spec.get("source")),
        "train_size": len(train_records),
        "template": template,
        "provenance": with_end_time(provenance(device=strategy.device.type, started=started)),
    }
    save_sft_model(output_dir, model, tokenizer, summary, started=t0, strategy=strategy)
    return summary


def _model_facts(model, source: Any) -> dict[str, Any]:
    """The summary's ``model`` entry: ``source`` (``model.source``), parameter count, attention
    implementation and torch's thread count."""
    return {
        "source": source,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(),
    }


def sft_heldout_accuracy(
    model,
    tokenizer,
    eval_sets: Mapping[str, Sequence[Mapping[str, Any]]],
    reward: RewardSettings,
    *,
    template: str,
    max_new_tokens: int,
    step: int,
    log_fn: LogFn | None,
    n_examples: int,
) -> tuple[dict[str, float], dict[str, float], list[dict]]:
    """Greedy accuracy (:func:`greedy_accuracy`, with ``reward``'s ``timeout_s`` and ``workers``) and the share of responses with an extractable final answer on each held-out set,
    each logged at ``step``; with the first ``n_examples`` questions of the first set, their responses
    and gold answers.

    Returns:
        ``(accuracy, extracted, examples)``, the first two keyed by set name.
    """
    from oar.reward.score import extracted_answer

    accuracy: dict[str, float] = {}
    extracted: dict[str, float] = {}
    examples: list[dict] = []
    for split, recs in eval_sets.items():
        acc, responses = greedy_accuracy(model, tokenizer, recs, template=template,
                                         max_new_tokens=max_new_tokens, timeout_s=reward.timeout_s,
                                         workers=reward.workers)
        accuracy[split] = acc
        extracted[split] = sum(extracted_answer(r) is not None for r in responses) / len(responses)
        if log_fn is not None:
            log_fn(step, {f"sft/accuracy_{split}": acc, f"sft/extracted_{split}": extracted[split]})
        if not examples:
            examples = [
                {"question": r["question"], "response": resp, "answer": r["answer"]}
                for r, resp in zip(recs[:n_examples], responses[:n_examples])
            ]
    return accuracy, extracted, examples


def sft_or_cached(config: Mapping[str, Any], output_dir: str | os.PathLike, *, progress: bool = True,
                  log_fn: LogFn | None = None) -> dict:
    """:func:`sft_from_config` through the cache ``config["sft"]["cache_dir"]`` (null: no cache).

    A cache entry is the folder ``<cache_dir>/<sft_cache_key(config)>/``
    (:func:`oar.config.identity.sft_cache_key`) holding a finished SFT (model, tokenizer,
    ``sft_summary.json``). When it exists it is copied to ``output_dir`` (atomically) instead of
    training; otherwise SFT runs and its output is copied into the cache (atomically: two runs filling
    one entry leave one complete copy). Settings that differ in anything the model, task or sft sections
    hold, or in the device, have another key, so a copy is always the model this config's SFT would
    train (up to the float-level differences of another machine or thread count).

    Returns:
        The summary, with ``cached_from`` (the entry's path) when it was copied from the cache.
    """
    import json
    import shutil

    from oar.core.io import atomic_path, atomic_write_json, check_output_folder

    check_output_folder(output_dir, what="the SFT output folder (--output)")
    cache_dir = SFTSettings.from_config(config).cache_dir
    if not cache_dir:
        return sft_from_config(config, output_dir, progress=progress, log_fn=log_fn)
    check_output_folder(cache_dir, what="the SFT cache (sft.cache_dir)")
    entry = Path(cache_dir) / sft_cache_key(config)
    if (entry / "sft_summary.json").is_file():
        summary = json.loads((entry / "sft_summary.json").read_text(encoding="utf-8"))
        summary["cached_from"] = str(entry)
        with atomic_path(output_dir) as tmp:
            shutil.copytree(entry, tmp)
            atomic_write_json(tmp / "sft_summary.json", summary)
        print(f"sft: copied {entry} (a finished SFT with the same model, task and sft settings) to {output_dir}",
              flush=True)
        return summary
    summary = sft_from_config(config, output_dir, progress=progress, log_fn=log_fn)
    with atomic_path(entry) as tmp:
        shutil.copytree(output_dir, tmp)
    return summary
