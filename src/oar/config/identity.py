"""What identifies each kind of result, in one place: the keys of the results store, the fingerprints
the workflow's rules rerun by, the trainer's own identity of a checkpoint, and which settings a run
may change and continue.

Every definition is a short hash (:func:`fingerprint`) of the settings a result was made from. The
workflow compares them between runs: a rule whose fingerprint changed reruns, a store key that
changed points a config at another store folder (:mod:`oar.pipeline.store`). So a *value* defined here is a
promise to every results tree already on disk: changing what one hashes, even by reordering or
renaming, reruns (or retrains) finished jobs. A new option therefore either joins a fingerprint
only when set away from a default that reproduces the old behaviour (:data:`NEW_KEYS_AT_DEFAULT`),
or stays out of every fingerprint because it only says where a result comes from
(:data:`NOT_FINGERPRINTED`), or, when it asks for a result of its own, stays out of the other
results' fingerprints and makes its own: ``eval.transfer`` (:data:`EVAL_KEYS_NOT_EVALUATED`) is in
no fingerprint but :func:`transfer_fingerprint`, so adding or changing a transfer evaluation reruns
the transfer jobs alone, and a config without one keeps every fingerprint it had.

What identifies what:

========================  ============================================================  ===============================
result                    identified by                                                 definition
========================  ============================================================  ===============================
prepared data             the ``task`` section and the benchmark list                   :func:`data_key`
warm-start SFT            the ``model``, ``task`` and ``sft`` sections (+ strategy)     :func:`sft_key`
an SFT in ``cache_dir``   :func:`sft_key`'s sections and the ``device``                 :func:`sft_cache_key`
the model RL starts from  the SFT's key, else ``train.init`` or ``model.source``        :func:`start_key`
a training run            its settings but the resumable keys, and its start model      :func:`run_key`
the trained step verifier the ``verifier`` and ``task`` sections, the start model       :func:`verifier_key`
the start model's eval    the evaluation settings and the start model                   :func:`base_key`
an eval folder's cache    the evaluation settings (the rule adds the model's checksum)  :func:`eval_fingerprint`
a transfer folder's cache the transfer benchmarks and the evaluation settings           :func:`transfer_fingerprint`
the memory plan           what ``oar plan`` reads                                       :func:`plan_fingerprint`
an attribution            the attribution, model, task, sft, rollout, reward sections   :func:`attribution_fingerprint`
the report                the bootstrap, the report section, the methods' labels        :func:`report_fingerprint`
a checkpoint (trainer)    method, seed, start model's content, model/task/train/...     :func:`run_identity`
========================  ============================================================  ===============================

Which keys a run may change and continue (:data:`RESUMABLE_TRAIN_KEYS`): how long it runs
(``steps``), how often it saves and how many checkpoints it keeps, when it gives up
(``max_nonfinite``), how it reacts to signals (``preemption``), and where its start model came from
(``init``: the start model is identified by its content instead). None of these changes what a step
computes, so a run that continues with another value is the same run, longer or saved more often.
They are left out of :func:`run_key` (the run keeps its store folder) and of :func:`run_identity`
(the trainer resumes the checkpoint); :func:`resumable_train_values` carries their values as the
train rule's params, so a changed value reruns the job, which continues the run.

Two definitions that look alike differ on purpose, and stay so (their values are on disk):

- :func:`method_fingerprint` leaves out only :data:`RESUMABLE_TRAIN_KEYS_ADDED_LATER`
  (``save_every_minutes``, ``preemption``), not every resumable key: it was the train rule's whole
  fingerprint before the results store, and dropping the keys added after results existed kept
  those runs' fingerprints. Its one role now is the inner part of :func:`run_key`, which hands it
  a ``train`` section without any :data:`RESUMABLE_TRAIN_KEYS`, so there its own filter removes
  nothing; removing the filter would change the value of :func:`method_fingerprint` alone (which
  nothing on disk holds) but not of :func:`run_key`; it stays so that both read as they were written.
- :func:`run_identity` (the trainer's check that a checkpoint is this run's) and :func:`run_key`
  (the workflow's store key) identify the same run from two sides. The trainer knows the start
  model's content hash, so it drops the ``model`` keys that only locate it
  (:data:`MODEL_LOCATION_KEYS`) and names the seed and method; the workflow knows only the config,
  so it keeps ``model.source`` (through :func:`start_key` or the model section), and the seed and
  method name are the run folder's and entry's names. :func:`run_identity` reads its ``train``
  section through :func:`config_sections` (a new key at its default, such as
  ``skip_zero_advantage``, is left out, so a checkpoint saved before the key existed still resumes)
  and the other sections raw. It is compared key by key (:func:`oar.trainer.runs.identity_diff` names what
  changed), not hashed, so it may grow a key without rerunning anything: an old checkpoint then
  reads it as ``<absent>`` and is refused, never resumed silently.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Mapping

from oar.core.flatten import flatten
from oar.core.io import VERIFIER_TRAINED

if TYPE_CHECKING:
    from oar.config.methods import ResolvedMethod

__all__ = [
    "fingerprint",
    "NEW_KEYS_AT_DEFAULT",
    "NOT_FINGERPRINTED",
    "config_sections",
    "RESUMABLE_TRAIN_KEYS",
    "RESUMABLE_TRAIN_KEYS_ADDED_LATER",
    "MODEL_LOCATION_KEYS",
    "resumable_train_values",
    "data_key",
    "sft_key",
    "sft_cache_key",
    "sft_strategy_settings",
    "start_key",
    "method_fingerprint",
    "run_key",
    "run_identity",
    "EVAL_KEYS_NOT_EVALUATED",
    "eval_fingerprint",
    "transfer_fingerprint",
    "base_key",
    "plan_fingerprint",
    "attribution_fingerprint",
    "report_fingerprint",
    "verifier_key",
    "uses_trained_verifier",
    "attribution_uses_trained_verifier",
]


def fingerprint(*parts: Any) -> str:
    """Short hash of config sections; a rule's params carry it, so changing them reruns the rule.

    The first 16 hex digits of the SHA-256 of ``parts`` as JSON (keys sorted, anything JSON cannot
    write as its ``str``): equal settings give equal fingerprints in any process and on any machine.
    """
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: Options added after results existed whose default reproduces the old behaviour exactly, per section:
#: :func:`config_sections` leaves such a key out while it holds that default, so upgrading oar does not
#: rerun every finished job (set to anything else, it joins the fingerprint and the job reruns).
NEW_KEYS_AT_DEFAULT: dict[str, dict[str, Any]] = {
    "sft": {"micro_batch_size": None},
    "eval": {"sampler": "lean"},
    "train": {"skip_zero_advantage": False},
    "report": {"pairing": "seed"},
}


#: Options that change where a result comes from, or whether the workflow starts at all, not what it is,
#: per section: never in a fingerprint.
NOT_FINGERPRINTED: dict[str, frozenset[str]] = {
    "sft": frozenset({"cache_dir"}),
    "plan": frozenset({"disk_check"}),  # the disk check before the first job (oar.pipeline.launch.disk_problems)
}


def config_sections(config: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The named top-level sections of ``config`` (None for an absent one), without the options of
    :data:`NEW_KEYS_AT_DEFAULT` that hold their default and those of :data:`NOT_FINGERPRINTED`."""
    out = {}
    for k in keys:
        section = config.get(k)
        inert = NEW_KEYS_AT_DEFAULT.get(k, {})
        left_out = NOT_FINGERPRINTED.get(k, frozenset())
        if isinstance(section, Mapping):
            section = {o: v for o, v in section.items()
                       if o not in left_out and not (o in inert and v == inert[o])}
        out[k] = section
    return out


# ------------------------------------------------------------------------ what a run may change

#: ``train`` keys a run may change and continue: how long it runs, how often it saves, when it gives
#: up, how it reacts to signals, and where the start model came from (its content is part of the
#: identity instead). A longer ``steps`` continues the run; the schedule is then computed for the new
#: total. Left out of :func:`run_key` and :func:`run_identity`; :func:`resumable_train_values` rerun
#: the train job when they change.
RESUMABLE_TRAIN_KEYS: tuple[str, ...] = ("steps", "save_every", "save_every_minutes", "keep_checkpoints",
                                         "max_nonfinite", "init", "preemption")

#: The :data:`RESUMABLE_TRAIN_KEYS` added after runs existed, the only ones :func:`method_fingerprint`
#: leaves out (so the runs started before them kept their fingerprints; see the module docstring for
#: why this differs from :data:`RESUMABLE_TRAIN_KEYS` and stays so).
RESUMABLE_TRAIN_KEYS_ADDED_LATER: tuple[str, ...] = ("save_every_minutes", "preemption")

#: ``model`` keys that only say where the start model is; in :func:`run_identity` its content hash
#: stands for them.
MODEL_LOCATION_KEYS: tuple[str, ...] = ("source", "gguf_file")


def resumable_train_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train`` keys a run may change and continue, with this config's values: the train rule's
    params carry them, so a changed value reruns the job, which continues the run. (``init`` is not
    among them: the start model is the rule's input, checksummed into its fingerprint.)"""
    return {k: config["train"].get(k) for k in RESUMABLE_TRAIN_KEYS if k != "init"}


# ----------------------------------------------------------------------------- data, SFT, start

def data_key(config: Mapping[str, Any]) -> str:
    """What identifies the prepared data: the task section and the benchmark list (the data rule's
    fingerprint and the data's store key)."""
    return fingerprint(config_sections(config, "task"), config["eval"]["benchmarks"])


def sft_strategy_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train`` keys of the strategy the warm-start SFT runs on (:func:`oar.trainer.sft.run_sft`)
    that make it train otherwise than SFT did before it ran on that strategy (one process, float32
    compute, the weights stepped in ``model.dtype``): ``strategy`` other than ddp, ``compute_dtype``
    other than float32, and ``master_dtype`` float32 where ``model.dtype`` is not. Empty for every
    config whose SFT is unchanged, so its keys stay as they were."""
    train = config.get("train") or {}
    out = {k: train[k] for k, old in (("strategy", "ddp"), ("compute_dtype", "float32"))
           if train.get(k, old) != old}
    model_dtype = (config.get("model") or {}).get("dtype", "float32")
    if train.get("master_dtype", "float32") == "float32" and model_dtype != "float32":
        out["master_dtype"] = "float32"
    return out


def _sft_parts(config: Mapping[str, Any]) -> tuple[Any, ...]:
    """What :func:`sft_key` hashes: the model, task and sft sections, and the strategy's settings
    (:func:`sft_strategy_settings`) only where there are any."""
    strategy = sft_strategy_settings(config)
    return (config_sections(config, "model", "task", "sft"), *([{"train": strategy}] if strategy else []))


def sft_key(config: Mapping[str, Any]) -> str:
    """What identifies the warm-start SFT: the model, task and sft sections, and the training
    strategy's settings that change how it trains (:func:`sft_strategy_settings`); the sft rule's
    fingerprint and the SFT's store key."""
    return fingerprint(*_sft_parts(config))


def sft_cache_key(config: Mapping[str, Any]) -> str:
    """The key of this config's SFT in ``sft.cache_dir`` (:func:`oar.trainer.sft_stage.sft_or_cached`): the sections
    of :func:`sft_key` and the device. Unlike :func:`sft_key` (which a changed device does not
    change), it holds the device, so a cache that several configs or machines share never hands a
    config an SFT trained on another device."""
    sections, *strategy = _sft_parts(config)
    return fingerprint(sections, config["device"], *strategy)


def start_key(config: Mapping[str, Any], *, sft: bool) -> str:
    """What identifies the model RL starts from: the SFT's key, else ``train.init`` or ``model.source``
    (a path or hub id: its content is checked by the train rule's input checksum and the trainer)."""
    if sft:
        return f"sft-{sft_key(config)}"
    return str(config["train"].get("init") or config["model"]["source"])


# ------------------------------------------------------------------------------------ training runs

def method_fingerprint(config: Mapping[str, Any], method: ResolvedMethod, *, sft: bool) -> str:
    """The fingerprint of a training run's settings: the model, task, sft, rollout, train (without
    :data:`RESUMABLE_TRAIN_KEYS_ADDED_LATER`) and reward sections, the method's recipe, credit and
    credit options, a user estimator's source hash (``ResolvedMethod.credit_source``), and whether
    it starts from the SFT. The inner part of :func:`run_key`."""
    sections = config_sections(config, "model", "task", "sft", "rollout", "train", "reward")
    sections["train"] = {k: v for k, v in sections["train"].items() if k not in RESUMABLE_TRAIN_KEYS_ADDED_LATER}
    # a user estimator's source (its hash) joins, so an edit retrains its runs; a built-in has none
    # (its code is the commit's), so their fingerprints are as they were before sources counted
    source = {"source": method.credit_source["sha256"]} if method.credit_source else {}
    # the verifier this config trains (credit step_verifier, option verifier: trained) joins by its
    # key, so retraining it with other settings retrains its runs; no other method has one
    verifier = {"verifier": verifier_key(config, sft=sft)} if uses_trained_verifier(method) else {}
    return fingerprint(sections, {"recipe": method.recipe, "credit": method.credit, "options": method.credit_options,
                                  "sft": sft, **source, **verifier})


def run_key(config: Mapping[str, Any], method: ResolvedMethod, *, sft: bool) -> str:
    """What identifies a training run of ``method``: its settings without the keys a run may change and
    continue (:data:`RESUMABLE_TRAIN_KEYS`), and its start model (:func:`start_key`). The run's store
    key and the train rule's fingerprint (a folder whose key changed is moved aside). The seed is the
    run folder's name inside the entry, the method's name the entry's prefix."""
    identity_config = dict(config)
    identity_config["train"] = {k: v for k, v in config["train"].items() if k not in RESUMABLE_TRAIN_KEYS}
    return fingerprint(method_fingerprint(identity_config, method, sft=sft), start_key(config, sft=sft))


def uses_trained_verifier(method: ResolvedMethod) -> bool:
    """Whether ``method``'s credit reads the step verifier its config trains (estimator
    ``step_verifier`` with the option ``verifier`` at :data:`oar.core.io.VERIFIER_TRAINED`)."""
    return method.estimator == "step_verifier" and method.credit_options.get("verifier") in (None, VERIFIER_TRAINED)


def attribution_uses_trained_verifier(config: Mapping[str, Any]) -> bool:
    """Whether the config's attribution benchmark (when enabled) scores a ``step_verifier`` signal with the
    verifier the config trains (its option ``verifier`` at :data:`oar.core.io.VERIFIER_TRAINED`)."""
    attr = config.get("attribution") or {}
    return bool(attr.get("enabled")) and any(
        s.get("kind") == "step_verifier" and s.get("verifier") in (None, VERIFIER_TRAINED) for s in attr.get("signals") or ())


def verifier_key(config: Mapping[str, Any], *, sft: bool) -> str:
    """What identifies the step verifier a config trains (``oar verifier``): its settings (the
    ``verifier`` section), the task whose demonstrations it learns from, and the start model it is
    fine-tuned from (:func:`start_key`). Its store key and the verifier rule's fingerprint."""
    return fingerprint(config_sections(config, "verifier", "task"), start_key(config, sft=sft))


def run_identity(config: Mapping[str, Any], method: ResolvedMethod, seed: int, start_model: str) -> dict[str, str]:
    """What defines a training run to the trainer, flattened to ``{"train.lr": "1e-05", ...}``
    (:func:`oar.core.flatten.flatten`): a checkpoint stores it, and resuming with another one is refused
    (:meth:`oar.trainer.runs.RunFolder.check_identity`).

    Args:
        config: validated config.
        method: the method being trained.
        seed: run seed.
        start_model: :func:`oar.models.loading.model_identity` of the model training starts from.
    """
    train = {k: v for k, v in config_sections(config, "train")["train"].items() if k not in RESUMABLE_TRAIN_KEYS}
    model = {k: v for k, v in config["model"].items() if k not in MODEL_LOCATION_KEYS}
    verifier = {"verifier": config["verifier"]} if uses_trained_verifier(method) else {}
    return flatten({
        **verifier,
        "method": method.as_params(),
        "seed": seed,
        "start_model": start_model,
        "model": model,
        "task": config["task"],
        "train": train,
        "rollout": config["rollout"],
        "reward": config["reward"],
    })


# ------------------------------------------------------------------------------------- evaluation

#: ``eval`` keys that are not settings of an evaluation: the report's ``bootstrap``, and ``transfer``
#: (a result of its own, :func:`transfer_fingerprint`; added after results existed, so leaving it out
#: keeps every :func:`eval_fingerprint` and :func:`base_key` as it was, whatever its value).
EVAL_KEYS_NOT_EVALUATED: tuple[str, ...] = ("bootstrap", "transfer")


def _evaluation_fingerprint(config: Mapping[str, Any], benchmarks: Any) -> str:
    """The fingerprint of an evaluation of ``benchmarks`` with the config's settings: ``eval`` but
    :data:`EVAL_KEYS_NOT_EVALUATED`, its ``benchmarks`` being ``benchmarks``; the reward; the task's
    template, seed and synthetic options."""
    ev = {k: v for k, v in config_sections(config, "eval")["eval"].items() if k not in EVAL_KEYS_NOT_EVALUATED}
    ev["benchmarks"] = benchmarks
    task = config["task"]
    return fingerprint(ev, config_sections(config, "reward"), task.get("template"), task.get("seed"),
                       task.get("synthetic"))


def eval_fingerprint(config: Mapping[str, Any]) -> str:
    """The fingerprint of the evaluation settings (``eval`` but its bootstrap and transfer, the
    reward, the task's template, seed and synthetic options). The evaluate rules add the model's
    checksum (and evaluate_base its start model's path), so an eval folder's cached per-benchmark
    results are reused only for this model and these settings."""
    return _evaluation_fingerprint(config, config["eval"]["benchmarks"])


def transfer_fingerprint(config: Mapping[str, Any]) -> str:
    """The fingerprint of the transfer evaluation: :func:`eval_fingerprint`'s settings with
    ``eval.transfer.benchmarks`` in place of ``eval.benchmarks`` (not ``eval.transfer.methods``: which
    methods are evaluated does not change what each evaluation is). The transfer rules add the
    model's checksum, as the evaluate rules do."""
    return _evaluation_fingerprint(config, config["eval"]["transfer"]["benchmarks"])


def base_key(config: Mapping[str, Any], *, sft: bool) -> str:
    """What identifies the start model's evaluation: the evaluation settings and the start model."""
    return fingerprint(eval_fingerprint(config), start_key(config, sft=sft))


# ------------------------------------------------------------------------------- plan and reports

def plan_fingerprint(config: Mapping[str, Any]) -> str:
    """What ``oar plan`` reads; the plan rule reruns when it changes."""
    return fingerprint(config_sections(config, "device", "model", "train", "rollout", "plan", "methods", "recipes"),
                       (config.get("resources") or {}).get("train"))


def attribution_fingerprint(config: Mapping[str, Any]) -> str:
    """What an attribution (of the start model or a trained one) is computed from besides its model:
    the attribution, model, task, sft, rollout and reward sections, and the verifier's key when a
    signal reads the verifier the config trains. The attribution rules rerun when it changes."""
    sections = config_sections(config, "attribution", "model", "task", "sft", "rollout", "reward")
    if attribution_uses_trained_verifier(config):  # the verifier it scores with joins (none: as before)
        return fingerprint(sections, {"verifier": verifier_key(config, sft=bool(config["sft"]["enabled"]))})
    return fingerprint(sections)


def report_fingerprint(config: Mapping[str, Any], methods: Mapping[str, ResolvedMethod]) -> str:
    """What the report reads besides the results: the bootstrap settings, the report section and
    each method's label. The report rule reruns when it changes."""
    return fingerprint(config["eval"].get("bootstrap"), config_sections(config, "report")["report"],
                       {m: v.label for m, v in methods.items()})
