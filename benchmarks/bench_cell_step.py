"""GRPO's step on the ranking cell (config/ranking_budget_240.yaml, the committed start model), as d354b90
ran it against as this checkout runs it, side by side on one machine (issue 55, item 2).

- ``baseline``: a checkout of the commit before (``--baseline-src``, e.g. a git worktree of d354b90)
  with that commit's settings for the cell (``rollout.sampler: lean``, ``train.skip_zero_advantage:
  false``), scheduled as ``scripts/ranking.sh`` ran it there: two trainings at once on the 2 cores,
  one thread each;
- ``current``: this checkout with the cell's settings as config/ranking_budget_240.yaml gives them
  now, scheduled the same way (``--current-schedule concurrent``, the default) or one training at a
  time with both cores (``sequential``).

Both train ``grpo`` with seeds 0 and 1 from ``models/ranking_hard_n8_start`` for ``--steps`` steps
(held-out evaluation as the config says), through ``python -m oar.cli train`` of their own source
tree with their own copy of the config, tracking off. Printed: per variant the seconds per step of each training (``time_step`` of
``metrics.jsonl``, the first step left out) and per phase, the wall seconds of the whole variant
(both trainings) and so its steps per wall second, and whether the two variants' per-step rewards
agree (the tolerance: the same rewards step for step, to 1e-9, for the steps compared). Last line::

    RATIOS step=<current s/step / baseline s/step> wall=<current wall / baseline wall> rewards_equal=<0|1>

    python benchmarks/bench_cell_step.py --baseline-src /path/to/d354b90-checkout [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "ranking_budget_240.yaml"
START = ROOT / "models" / "ranking_hard_n8_start"
PHASES = ("rollout", "reward", "importance", "update", "step")


def _train(src: Path, out: Path, seed: int, steps: int, threads: int, sets: list[str]) -> subprocess.Popen:
    """``oar train`` of ``grpo`` with ``seed`` from ``src``'s library and ``src``'s own copy of the
    cell's config, from the committed start model; the process (not waited for)."""
    env = dict(os.environ, PYTHONPATH=str(src / "src"), OMP_NUM_THREADS=str(threads))
    config = src / CONFIG.relative_to(ROOT)
    cmd = [sys.executable, "-m", "oar.cli", "train", "--config", str(config), "--method", "grpo", "--seed", str(seed),
           "--output", str(out), "--steps", str(steps), "--init", str(START), "--no-progress",
           "--set", "tracking.enabled=false", "sft.enabled=false", *sets]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))


def _rows(out: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "time_step" in r]


def run_variant(name: str, src: Path, folder: Path, *, steps: int, concurrent: bool, threads: int,
                sets: list[str]) -> dict:
    """Both seeds' trainings of one variant (at once, or one after the other); their rows and wall time."""
    outs = [folder / f"{name}-seed{s}" for s in (0, 1)]
    t0 = time.perf_counter()
    if concurrent:
        procs = [_train(src, o, s, steps, threads, sets) for s, o in enumerate(outs)]
        codes = [p.wait() for p in procs]
    else:
        codes = [_train(src, o, s, steps, threads, sets).wait() for s, o in enumerate(outs)]
    wall = time.perf_counter() - t0
    if any(codes):
        raise SystemExit(f"{name}: a training failed (exit {codes}); see {folder}/*.log")
    rows = [_rows(o) for o in outs]
    timed = [r for rs in rows for r in rs[1:]]
    return {"wall": wall, "rows": rows,
            "per_step": {ph: statistics.fmean(r[f"time_{ph}"] for r in timed) for ph in PHASES}}


def matmul_peak(m: int, k: int, n: int, *, threads: int = 1, repeats: int = 5) -> float:
    """GFLOP/s of ``(m, k) @ (k, n)`` float32 matmuls on this machine with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(2):
        a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n / ((time.perf_counter() - t0) / repeats) / 1e9


def roofline(rows: list[dict], *, prompts: int, prompt_tokens: float, skip_zero: bool) -> dict[str, float]:
    """The step's forward/backward and sampling FLOPs (dense layers: ``2 x parameters`` per position
    forward, ``6 x`` forward and backward; attention left out, a few percent at these lengths) over the
    phases' seconds, against the matmul peak at the shapes they run (one thread): the update's
    ``(positions, 128) @ (128, 512)``, the sampler's ``(256, 128) @ (128, 512)``. ``skip_zero``: the
    update computes the credited responses only (``credited_share`` of them)."""
    import json as _json

    cfg = _json.loads((START / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    params = layers * (4 * h * h + 3 * h * inter) + h * vocab
    responses = statistics.fmean(r["response_length"] for r in rows) * 256
    computed = responses * (statistics.fmean(r["credited_share"] for r in rows) if skip_zero else 1.0)
    positions = computed + prompts * prompt_tokens  # shared_prompt: each group's prompt once
    update_s = statistics.fmean(r["time_update"] for r in rows)
    rollout_s = statistics.fmean(r["time_rollout"] for r in rows)
    update_flops, sample_flops = 6 * params * positions, 2 * params * (responses + 256 * prompt_tokens)
    peak_update, peak_sample = matmul_peak(int(positions), h, inter), matmul_peak(256, h, inter)
    return {"params": params, "positions": positions, "update_gflop": update_flops / 1e9,
            "update_gflops": update_flops / update_s / 1e9, "peak_update_gflops": peak_update,
            "update_floor_s": update_flops / peak_update / 1e9, "sample_gflop": sample_flops / 1e9,
            "sample_gflops": sample_flops / rollout_s / 1e9, "peak_sample_gflops": peak_sample,
            "sample_floor_s": sample_flops / peak_sample / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-src", required=True, help="a checkout of the commit compared with (d354b90)")
    ap.add_argument("--steps", type=int, default=12, help="steps per training (the first is left out of s/step)")
    ap.add_argument("--current-schedule", choices=["concurrent", "sequential"], default="concurrent",
                    help="the current variant's two trainings at once with a thread each (as the baseline), or one "
                         "after the other with both threads")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="oar-cell-step-"))
    base = run_variant("baseline", Path(args.baseline_src), folder, steps=args.steps, concurrent=True, threads=1,
                       sets=["rollout.sampler=lean", "train.skip_zero_advantage=false"])
    concurrent = args.current_schedule == "concurrent"
    cur = run_variant("current", ROOT, folder, steps=args.steps, concurrent=concurrent, threads=1 if concurrent else 2,
                      sets=[])
    print(f"{'variant':10s} {'wall s':>8s} {'steps/wall s':>12s} " + " ".join(f"{p:>10s}" for p in PHASES))
    for name, v in (("baseline", base), ("current", cur)):
        rate = 2 * args.steps / v["wall"]
        print(f"{name:10s} {v['wall']:8.1f} {rate:12.3f} " + " ".join(f"{v['per_step'][p]:10.3f}" for p in PHASES))
    equal = all(abs(a["reward"] - b["reward"]) < 1e-9 for s in (0, 1) for a, b in zip(base["rows"][s], cur["rows"][s]))
    for s in (0, 1):
        print(f"seed {s} rewards baseline {[round(r['reward'], 4) for r in base['rows'][s]]}")
        print(f"seed {s} rewards current  {[round(r['reward'], 4) for r in cur['rows'][s]]}")
    sys.path.insert(0, str(ROOT / "src"))
    from oar.config.load import load_config
    from oar.data.prompts import render_prompt
    from oar.data.records import training_records
    from transformers import AutoTokenizer

    cfg = load_config(CONFIG)
    tok = AutoTokenizer.from_pretrained(START)
    sample = training_records(cfg["task"])[:512]
    prompt_tokens = statistics.fmean(len(tok(render_prompt(cfg["task"]["template"], r["question"], tok))["input_ids"])
                                     for r in sample)
    for name, v in (("baseline", base), ("current", cur)):
        rf = roofline([r for rs in v["rows"] for r in rs[1:]], prompts=int(cfg["train"]["prompts_per_step"]),
                      prompt_tokens=prompt_tokens, skip_zero=name == "current" and cfg["train"]["skip_zero_advantage"])
        print(f"roofline {name}: {rf['params'] / 1e6:.2f}M dense parameters, {rf['positions']:.0f} update positions; "
              f"update {rf['update_gflop']:.0f} GFLOP at {rf['update_gflops']:.0f} GFLOP/s (matmul peak at its shape "
              f"{rf['peak_update_gflops']:.0f}: floor {rf['update_floor_s']:.2f} s); sampling {rf['sample_gflop']:.0f} "
              f"GFLOP at {rf['sample_gflops']:.0f} GFLOP/s (peak {rf['peak_sample_gflops']:.0f}: floor "
              f"{rf['sample_floor_s']:.2f} s)")
    print(f"RATIOS step={cur['per_step']['step'] / base['per_step']['step']:.3f} "
          f"wall={cur['wall'] / base['wall']:.3f} rewards_equal={int(equal)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
