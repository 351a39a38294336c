"""Training the step verifier of credit ``step_verifier`` (``oar verifier``, the workflow's rule
``verifier``; docs/methods.md, 5.1): the start model fine-tuned on the task's demonstrations with the
next-token loss on the right steps' results only. Reading it during RL is the credit layer's
(:mod:`oar.credit.verifier`).

- :class:`VerifierSettings` -- the ``verifier`` section of the config (the schema holds the defaults);
- :func:`result_targets` -- the training targets of demonstration records: the right steps' result tokens;
- :func:`train_verifier` -- the verifier, fine-tuned from the start model (the same tokenizer and
  format), with its step accuracy on held-out demonstrations; :func:`save_verifier` writes it with
  ``save_pretrained``; :func:`verifier_from_config` is ``oar verifier``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from oar.config.tree import VERIFIER_SUMMARY_FILE
from oar.credit.verifier import encode_responses, span_positions, step_error_probs

__all__ = ["VerifierSettings", "result_targets", "train_verifier", "save_verifier", "verifier_from_config"]


@dataclass(frozen=True)
class VerifierSettings:
    """The ``verifier`` section (schema defaults filled): the fine-tuning of the verifier."""

    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    demonstrations: int
    eval_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "VerifierSettings":
        v = config["verifier"]
        return cls(**{k: v[k] for k in cls.__dataclass_fields__})


def result_targets(records: Sequence[Mapping[str, Any]], prompts: Sequence[str], tokenizer: Any
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, labels)`` of demonstration records (``solution``, ``result_spans``,
    ``demo_errors``): ``labels`` the next-token targets on the result tokens of the right steps, -100
    elsewhere (the wrong steps' results and everything else are context only)."""
    ids, mask, p_lens, maps = encode_responses(tokenizer, prompts, [r["solution"] for r in records])
    labels = torch.full_like(ids, -100)
    for i, rec in enumerate(records):
        wrong = set(rec.get("demo_errors") or ())
        for k, span in enumerate(rec["result_spans"]):
            if k not in wrong:
                for pos in span_positions(span, p_lens[i], maps[i]):
                    labels[i, pos] = ids[i, pos]
    return ids, mask, labels


def train_verifier(settings: VerifierSettings, records: Sequence[Mapping[str, Any]], prompts: Sequence[str],
                   tokenizer: Any, start_model: Any, *, progress: bool = False) -> tuple[Any, dict[str, Any]]:
    """Fine-tune ``start_model`` (a copy) into the verifier on the first ``demonstrations`` records
    (:func:`result_targets`; AdamW, warmup then cosine) and measure it on the last ``eval_size``
    records' steps: accuracy of "wrong at probability 0.5" (:func:`step_error_probs`) against the
    task's labels, and the recall of the wrong steps and of the right ones.

    Returns:
        ``(model in eval mode, summary)``.
    """
    import copy

    from tqdm.auto import tqdm

    from oar.trainer.optim import decay_groups, make_scheduler

    n_eval = min(settings.eval_size, max(0, len(records) - 1))
    train_recs = records[: len(records) - n_eval][: settings.demonstrations]
    train_prompts = prompts[: len(records) - n_eval][: settings.demonstrations]
    model = copy.deepcopy(start_model).train()
    opt = torch.optim.AdamW(decay_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.98))
    sched = make_scheduler(opt, warmup_steps=settings.warmup_steps, floor_step=settings.steps, schedule="cosine")
    gen = torch.Generator().manual_seed(settings.seed)
    t0 = time.perf_counter()
    losses = []
    for _ in tqdm(range(settings.steps), desc="verifier", disable=not progress, dynamic_ncols=True):
        idx = torch.randint(len(train_recs), (settings.batch_size,), generator=gen).tolist()
        ids, mask, labels = result_targets([train_recs[i] for i in idx], [train_prompts[i] for i in idx], tokenizer)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    eval_recs, eval_prompts = records[len(records) - n_eval:], prompts[len(records) - n_eval:]
    probs = step_error_probs(model, tokenizer, eval_prompts, [r["solution"] for r in eval_recs],
                             [r["result_spans"] for r in eval_recs])
    said = torch.tensor([p >= 0.5 for row in probs for p in row])
    truth = torch.tensor([k in set(r.get("demo_errors") or ()) for r in eval_recs for k in range(len(r["result_spans"]))])
    summary = {"train_records": len(train_recs), "eval_steps": int(len(truth)), "wrong_share": float(truth.float().mean()),
               "eval_accuracy": float((said == truth).float().mean()),
               "eval_recall_wrong": float(said[truth].float().mean()) if truth.any() else None,
               "eval_recall_right": float((~said[~truth]).float().mean()) if (~truth).any() else None,
               "final_loss_mean50": sum(losses[-50:]) / max(1, len(losses[-50:])),
               "loss_curve": [[i + 1, v] for i, v in enumerate(losses)],
               "seconds": time.perf_counter() - t0}
    return model, summary


def save_verifier(model: Any, tokenizer: Any, folder: str | Path, summary: Mapping[str, Any]) -> None:
    """``save_pretrained`` of the verifier and its tokenizer into ``folder`` (atomically), with
    :data:`oar.config.tree.VERIFIER_SUMMARY_FILE`."""
    from oar.core.io import atomic_path

    with atomic_path(Path(folder)) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / VERIFIER_SUMMARY_FILE).write_text(json.dumps(dict(summary), indent=2, default=str))


def verifier_from_config(config: Mapping[str, Any], model_dir: str | Path, output_dir: str | Path, *,
                         progress: bool = True) -> dict[str, Any]:
    """``oar verifier``: the verifier of ``config``'s task fine-tuned from the start model ``model_dir``
    on the task's training records (their demonstrations), saved into ``output_dir`` with its summary
    (the settings, the held-out accuracy, the start model and the provenance of this run).

    Raises:
        oar.core.io.OutputPathError, oar.models.ModelLoadError: from the checks of the output folder and
            the start model's files, before anything is written.
    """
    from datetime import datetime, timezone

    from oar.data.prompts import render_prompt
    from oar.data.records import training_records
    from oar.core.io import check_output_folder
    from oar.core.provenance import provenance, with_end_time
    from oar.models.checks import check_model_files
    from oar.models.loading import load_policy

    started = datetime.now(timezone.utc)
    check_output_folder(Path(output_dir), what="the verifier folder (--output)")
    spec = dict(config["model"], source=str(model_dir), gguf_file=None)
    check_model_files(spec)
    settings = VerifierSettings.from_config(config)
    model, tokenizer = load_policy(spec)
    records = training_records(config["task"])
    prompts = [render_prompt(config["task"]["template"], r["question"], tokenizer) for r in records]
    verifier, summary = train_verifier(settings, records, prompts, tokenizer, model, progress=progress)
    summary = {**summary, "settings": dict(settings.__dict__), "start_model": str(model_dir),
               "provenance": with_end_time(provenance(device="cpu", started=started))}
    save_verifier(verifier, tokenizer, output_dir, summary)
    return summary
