"""Command-line interface: ``oar <command>``. Each command only wires config to library functions."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def _int_at_least(minimum: int, what: str):
    """An argparse ``type``: an int >= ``minimum``; otherwise argparse names the flag and exits 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = what  # argparse's fallback message names the type
    return parse


def _probability(text: str) -> float:
    """An argparse ``type``: a float strictly between 0 and 1 (a coverage)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {value}")
    return value


_probability.__name__ = "a number between 0 and 1"
_positive_int = _int_at_least(1, "a positive integer")
_seed = _int_at_least(0, "a non-negative integer")


def _assignment(text: str) -> str:
    """An argparse ``type`` for ``--set``: ``KEY.SUB=VALUE`` (checked here, typed by oar.config.load)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY.SUB=VALUE (e.g. train.lr=1e-3), got {text!r}")
    return text


_assignment.__name__ = "KEY.SUB=VALUE"


def _add_config(p: argparse.ArgumentParser, config_help: str | None = None) -> None:
    """``--config FILE`` and ``--set KEY.SUB=VALUE ...`` (dotted overrides, applied in order on top of
    the file before validation: oar.config.load.load_config)."""
    p.add_argument("--config", required=True, help=config_help)
    p.add_argument("--set", dest="set", action="extend", nargs="+", type=_assignment, default=[],
                   metavar="KEY.SUB=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-3 rollout.n=4 (repeatable; values are "
                        "typed as in YAML; applied in order on top of --config, before validation)")


def _load(args: argparse.Namespace, overrides: dict | None = None, overrides_source: str = "overrides") -> dict:
    """The validated config of ``--config`` with ``overrides`` and the ``--set`` assignments applied."""
    from oar.config.load import load_config

    return load_config(args.config, overrides, sets=args.set, overrides_source=overrides_source)


def _cmd_sft(args: argparse.Namespace) -> int:
    from oar.models.fetch import with_fetched_model
    from oar.trainer.sft_stage import sft_or_cached
    from oar.core.device import check_device
    from oar.tracking.stage_runs import log_sft_run

    # a hub model.source: the copy the workflow fetched (rule fetch_model), when there is one
    config = with_fetched_model(_load(args))
    check_device(config, source=args.config)  # the GPU it asks for is on this node (oar.pipeline.preflight)
    summary = sft_or_cached(config, args.output)
    log_sft_run(config, args.output, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "loss_curve"}, indent=2, default=str))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from oar.trainer.preemption import EXIT_INTERRUPTED, StopSignal
    from oar.pipeline.preflight import check_config

    overrides = {"train": {"steps": args.steps}} if args.steps is not None else None
    config = _load(args, overrides, f"command line: --steps {args.steps}")
    check_config(config, source=args.config, job=True)  # every path it names exists, its GPU is here
    # signals are caught from here on, before the slow imports and the model load: a SIGTERM while
    # starting stops the run before its first step instead of killing it
    with StopSignal(repeat_seconds=config["train"]["preemption"]["repeat_seconds"]) as stop:
        from oar.trainer.loop import train

        try:
            summary = train(config, args.method, args.seed, args.output, init=args.init, restart=args.restart,
                            progress=not args.no_progress, stop=stop)
        finally:
            from oar.trainer.strategy import shutdown

            shutdown()  # leave the process group cleanly (torchrun: a process may abort at exit otherwise)
    print(json.dumps(summary, indent=2, default=str))
    return EXIT_INTERRUPTED if "interrupted_at" in summary else 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from oar.evaluate.evaluation import evaluate_from_config
    from oar.pipeline.preflight import check_config
    from oar.tracking.stage_runs import log_evaluation_run

    config = _load(args)
    check_config(config, source=args.config, job=True)  # every path it names exists, its GPU is here
    out = evaluate_from_config(config, args.model, args.output, seed=args.seed, transfer=args.transfer)
    log_evaluation_run(config, args.model, args.output, out, seed=args.seed, transfer=args.transfer)
    for name, r in out["benchmarks"].items():
        print(f"{name:20s} n={r['n']:5d} pass@1={r['pass@1']} avg@k={r['avg@k']}")
    print(f"{'average':20s} {out['average']}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from oar.pipeline.data_stage import write_data_manifest
    from oar.pipeline.preflight import check_config

    config = _load(args)
    check_config(config, source=args.config)  # every path it names exists (oar.pipeline.preflight)
    manifest = write_data_manifest(config, args.output)
    print(json.dumps(manifest, indent=2, default=str))
    skipped = manifest["checks"]["prompts"].get("skipped")
    if skipped:
        print(f"oar data: note: {skipped}", file=sys.stderr)
    for warning in manifest["warnings"]:  # oar.evaluate.prompt_checks: gold answers the reward cannot read
        print(f"oar data: warning: {warning}", file=sys.stderr)
    return 0


def _cmd_attribution(args: argparse.Namespace) -> int:
    from oar.attribution import attribution_from_config, format_tables
    from oar.core.device import check_device
    from oar.tracking.stage_runs import log_attribution_run

    config = _load(args)
    check_device(config, source=args.config)  # the GPU it asks for is on this node (oar.pipeline.preflight)
    result = attribution_from_config(config, args.model, args.output)
    log_attribution_run(config, args.model, args.output, result.summary)
    print(format_tables(result))
    return 0


def _cmd_verifier(args: argparse.Namespace) -> int:
    from oar.trainer.verifier import verifier_from_config
    from oar.tracking.stage_runs import log_verifier_run

    config = _load(args)
    summary = verifier_from_config(config, args.model, args.output, progress=not args.no_progress)
    log_verifier_run(config, args.output, summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("provenance", "loss_curve")}, indent=2, default=str))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from oar.report import build_report
    from oar.report.logged import log_report_run

    config = _load(args)
    paths = build_report(config, args.results, reference=args.reference, seed=args.seed, metric=args.metric)
    log_report_run(config, paths, params={"reference": args.reference, "seed": args.seed, "metric": args.metric})
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from oar.report.compare import compare_markdown, compare_runs, load_reference, save_reference

    if args.save:
        ref = save_reference(args.results, args.reference, note=args.note)
        print(f"reference: {args.reference} ({len(ref['values'])} cells of {args.results})")
        return 0
    confidence = args.confidence
    if confidence is None:  # the run's own report.confidence (its resolved config), else the schema's default
        import yaml

        from oar.config.validate import section_defaults

        resolved = Path(args.results) / "config.yaml"
        own = (yaml.safe_load(resolved.read_text()) or {}).get("report", {}) if resolved.is_file() else {}
        confidence = float(own.get("confidence", section_defaults("report")["confidence"]))
    result = compare_runs(load_reference(args.reference), args.results, confidence=confidence)
    text = compare_markdown(result, reference_path=args.reference, results=args.results)
    if args.output:
        from oar.core.io import atomic_write_text

        atomic_write_text(args.output, text)
    print(text, end="")
    return 1 if result["counts"].get("differs") or result["counts"].get("missing") else 0


def _cmd_regimes(args: argparse.Namespace) -> int:
    from oar.config.overrides import assigned_values, parse_assignments
    from oar.report.regimes import write_cell_configs, write_regime_report

    config = _load(args)
    if args.action == "cells":
        # a cell config extends --config's file: it carries the --set values itself
        overrides = assigned_values(config, parse_assignments(args.set))
        for path in write_cell_configs(config, args.config, args.out, args.cells, overrides=overrides):
            print(path)
    else:
        if args.cells:
            raise ValueError(f"oar regimes report reads every finished cell; --cells "
                             f"({' '.join(args.cells)}) goes with 'oar regimes cells'")
        for name, path in write_regime_report(config, args.results).items():
            print(f"{name}: {path}")
    return 0


def _cmd_init_tracking(args: argparse.Namespace) -> int:
    from oar.tracking.client import ensure_experiment

    config = _load(args)
    tr = config["tracking"]
    if tr["enabled"]:
        exp_id = ensure_experiment(tr["uri"], tr["experiment"])
        print(f"MLflow store {tr['uri']}: experiment {tr['experiment']!r} (id {exp_id})")
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    from oar.config.methods import resolve_methods

    config = _load(args)
    for name, m in resolve_methods(config, source=args.config).items():
        print(f"{name:16s} recipe={m.recipe_name:7s} credit={m.credit:6s} estimator={m.estimator:7s} options={m.estimator_options()}")
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from oar.models.fetch import fetch_model

    marker = fetch_model(args.source, args.output, gguf_file=args.gguf_file)
    print(f"{args.source} ({marker['origin']}, commit {marker['commit']}): {len(marker['files'])} files in "
          f"{args.output}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from oar.core.io import atomic_write_text
    from oar.pipeline.launch import preemption_summary
    from oar.plan import format_plan, plan
    from oar.pipeline.preflight import check_config

    config = _load(args)
    check_config(config, source=args.config)  # every path it names exists (oar.pipeline.preflight)
    result = plan(config, args.gpus)
    text = format_plan(result, source=args.config,
                       footer=[preemption_summary(config, result.shape, slurm=result.settings.on_gpu)])
    print(text, end="")
    if not result.fits:
        if config["plan"]["check"]:
            print(f"oar plan: error: {args.config}: {result.message}", file=sys.stderr)
            return 1
        print(f"oar plan: warning (plan.check false): {args.config}: {result.message}", file=sys.stderr)
    if args.output:
        atomic_write_text(Path(args.output), text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``oar`` parser: one subcommand per stage (each sets ``fn``, the function that runs it)."""
    p = argparse.ArgumentParser(prog="oar", description="Fine-grained credit assignment for RL of LLMs on math reasoning.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_stage_commands(sub)
    _add_report_commands(sub)
    _add_tool_commands(sub)
    return p


def _add_stage_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The pipeline's stages: ``sft``, ``train``, ``evaluate``, ``data``, ``attribution``."""
    s = sub.add_parser("sft", help="warm-start SFT on reference solutions (the synthetic task, or a benchmark with solutions such as gsm8k)")
    _add_config(s)
    s.add_argument("--output", required=True, help="folder for the SFT model (save_pretrained) and sft_summary.json")
    s.set_defaults(fn=_cmd_sft)

    s = sub.add_parser("train", help="RL training of one method and seed (resumes from <output>/checkpoint); "
                                     "SIGTERM, SIGINT or SIGUSR1 stop it after its step with a checkpoint, exit 75")
    _add_config(s)
    s.add_argument("--method", required=True, help="a key of the config's 'methods'")
    s.add_argument("--seed", type=_seed, default=0)
    s.add_argument("--output", required=True)
    s.add_argument("--init", default=None, help="starting checkpoint (default: train.init, else model.source)")
    s.add_argument("--steps", type=_positive_int, default=None, help="override train.steps (>= 1)")
    s.add_argument("--restart", action="store_true",
                   help="discard <output>'s checkpoint, model and metrics and start over (needed when the settings "
                        "or the start model differ from the checkpoint's)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_cmd_train)

    s = sub.add_parser("evaluate", help="evaluate a checkpoint on the config's eval benchmarks")
    _add_config(s)
    s.add_argument("--model", default=None, help="checkpoint folder (default: the config's model)")
    s.add_argument("--output", required=True, help="folder for <bench>.jsonl, <bench>.json and summary.json")
    s.add_argument("--seed", type=_seed, default=0, help="sampling seed for avg@k")
    s.add_argument("--transfer", action="store_true",
                   help="evaluate on eval.transfer.benchmarks instead of eval.benchmarks (same settings)")
    s.set_defaults(fn=_cmd_evaluate)

    s = sub.add_parser("data", help="load every data set the config names; write a manifest (paths, sha256, counts)")
    _add_config(s)
    s.add_argument("--output", required=True, help="manifest JSON path")
    s.set_defaults(fn=_cmd_data)

    s = sub.add_parser("attribution", help="error localisation, stability and cost of the token-credit signals "
                       "(OAR-P, OAR-G variants, KTAE, baselines)")
    _add_config(s)
    s.add_argument("--model", required=True, help="warm-started model folder (e.g. results/tiny/sft/model)")
    s.add_argument("--output", required=True, help="folder for localisation/stability/cost/fidelity .csv, "
                   "attribution.md, localisation.png, fidelity.png, summary.json")
    s.set_defaults(fn=_cmd_attribution)

    s = sub.add_parser("verifier", help="the step verifier of credit step_verifier: the start model fine-tuned on the "
                       "demonstrations' right steps, with its step accuracy on held-out ones")
    _add_config(s)
    s.add_argument("--model", required=True, help="the start model's folder (e.g. results/<name>/sft/model)")
    s.add_argument("--output", required=True, help="folder for the verifier (save_pretrained) and verifier_summary.json")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=_cmd_verifier)


def _add_report_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """What reads finished runs: ``report``, ``compare``, ``regimes``."""
    s = sub.add_parser("report", help="comparison tables (main, efficiency) and figures from a results folder")
    _add_config(s)
    s.add_argument("--results", default=None, help="results folder of the config (default results_dir/name)")
    s.add_argument("--reference", default=None, help="method the paired differences are taken against "
                   "(default: report.reference)")
    s.add_argument("--seed", type=_seed, default=0, help="bootstrap seed")
    s.add_argument("--metric", default=None, choices=["pass@1", "avg@k", "pass@k"],
                   help="only this metric's tables (default: avg@k when eval.samples > 0, and pass@1 when eval.greedy)")
    s.set_defaults(fn=_cmd_report)

    s = sub.add_parser("compare", help="compare a finished run with a recorded reference, cell by cell, within "
                       "seed noise, with the provenance that differs; exits 1 when a cell differs (--save: write "
                       "the reference of a run)")
    s.add_argument("--results", required=True, help="the finished run's folder (results/<name>, with tables/main.csv)")
    s.add_argument("--reference", required=True, help="the reference file (e.g. docs/results/<date>-default-run.json)")
    s.add_argument("--save", action="store_true", help="write the reference of --results to --reference instead")
    s.add_argument("--note", default="", help="--save: a note stored in the reference (machine, command)")
    s.add_argument("--confidence", type=_probability, default=None,
                   help="coverage of the cells' intervals (default: the run's report.confidence)")
    s.add_argument("--output", default=None, help="also write the comparison (markdown) to this file")
    s.set_defaults(fn=_cmd_compare)

    s = sub.add_parser("regimes", help="the regime map: write one config per cell (cells), or the map's table and "
                       "figure from the finished cells (report)")
    s.add_argument("action", choices=["cells", "report"])
    _add_config(s, config_help="a config with regimes.cells (e.g. config/regimes.yaml)")
    s.add_argument("--out", default="results/regime_cells", help="cells: folder of the cell configs")
    s.add_argument("--results", default=None, help="report: the results folder (default: results_dir)")
    s.add_argument("--cells", nargs="*", default=[], metavar="CELL",
                   help="cells: the cells to write (default: every cell not marked optional)")
    s.set_defaults(fn=_cmd_regimes)


def _add_tool_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The tools around the stages: ``init-tracking``, ``plan``, ``fetch-model``, ``methods``."""
    s = sub.add_parser("init-tracking", help="create the MLflow store and experiment (once, before parallel jobs)")
    _add_config(s)
    s.set_defaults(fn=_cmd_init_tracking)

    s = sub.add_parser("plan", help="per-GPU memory of training and of the vLLM engine, term by term; exits 1 "
                                    "when the config cannot fit, naming the term")
    _add_config(s)
    s.add_argument("--gpus", type=_positive_int, default=None,
                   help="training processes, one per GPU (default resources.train.gpu x nodes)")
    s.add_argument("--output", default=None, help="also write the plan to this file (when it fits)")
    s.set_defaults(fn=_cmd_plan)

    s = sub.add_parser("fetch-model", help="download a hub model (or one GGUF file of it) into a folder, atomically, "
                       "from the hub or the local Hugging Face cache; exits 2 with one line when neither has it")
    s.add_argument("--source", required=True, help="the hub id (model.source), org/name")
    s.add_argument("--output", required=True, help="the folder (written complete or not at all; oar_fetch.json last)")
    s.add_argument("--gguf-file", default=None, help="only this file of the repository (model.gguf_file)")
    s.set_defaults(fn=_cmd_fetch_model)

    s = sub.add_parser("methods", help="list the config's methods as resolved (recipe, credit, options)")
    _add_config(s)
    s.set_defaults(fn=_cmd_methods)


def main(argv: list[str] | None = None) -> int:
    from oar.core.io import DISK_FULL_ERRNOS, DiskFullError, FolderLockedError, OutputPathError, SharedWriteError

    args = build_parser().parse_args(argv)
    from oar.trainer.preemption import restore_ignored_signals

    # a rule's shell ignores SIGTERM (oar.pipeline.launch.SHELL_PREFIX): every command ends on it again (the
    # trainer then catches it to stop after its step with a checkpoint)
    restore_ignored_signals()
    try:
        return int(args.fn(args) or 0)
    # the user's files: ConfigError, oar.models.checks.ModelLoadError, oar.tracking.client.TrackingStoreError and
    # oar.trainer.runs.CheckpointError are ValueErrors; OutputPathError an OSError (an --output that cannot be written)
    except (FileNotFoundError, ValueError, KeyError, FolderLockedError, DiskFullError, SharedWriteError,
            OutputPathError) as e:
        print(f"oar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk where no writer named it (an evaluation's file, a figure)
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        where = e.filename or getattr(args, "output", None) or getattr(args, "results", None) or "the output"
        print(f"oar {args.command}: error: the disk is full ({os.strerror(e.errno)}) writing {where}: free space "
              "there and run the same command again (what it finished is kept; it carries on from there)",
              file=sys.stderr)
        return 2
    except RuntimeError as e:  # a benchmark given as a hub id while the hub cannot be used
        from oar.data.benchmarks import HubUnavailableError

        if not isinstance(e, HubUnavailableError):
            raise
        print(f"oar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
