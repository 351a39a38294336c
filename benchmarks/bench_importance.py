"""Time OAR-P (prefix-KV-cached vs naive full forwards) and OAR-G on the tiny model (CPU).

Batch: ``--batch`` responses (default 64) of about 45 characters = tokens (character tokenizer):
``--reasoning`` (default 30) reasoning characters, then ``\\boxed{<2-3 digits>}`` and eos; prompts
of 15-25 characters. The tiny model is ``oar.models.tiny.build_tiny`` with its defaults (d=128, 4 layers)
unless overridden. The probe uses the default conclude text unless ``--conclude`` is given.

Also checks that the cached and naive OAR-P scores agree (max abs difference printed), and prints
a machine-independent cost proxy: the number of query token positions each OAR-P variant runs.

OAR-G variants (``--g-variants``, default :data:`G_VARIANTS`): ``name=mode:draws:baseline`` with
baseline ``-`` for noise draws (``noise_std`` 1e-3) or ``pad``/``zero`` for integrated gradients
(``noise_std`` 0). Each is timed, and its cost proxy printed: model rows per response, a backward
counted as two forwards (clean forward in the KL modes + 3 x draws; one default pass = 4).

Prints per-repeat times, medians, and a final line
``RATIOS oar_p_cached/naive=<x> oar_g/oar_p=<y> <variant>/oar_g=<z> ...`` where ``oar_p`` is the
cached OAR-P median and ``oar_g`` one default OAR-G pass (answer_mean, 1 draw; all ratios of
median seconds; smaller is cheaper).

    python benchmarks/bench_importance.py [--batch 64] [--reasoning 30] [--repeats 3] [--threads 2]
        [--mode last] [--chunk-size 128] [--conclude TEXT] [--seed 0] [--g-variants a=answer_joint:2:pad ...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable

import torch

from oar.credit.importance import gradient_importance, perturbation_importance
from oar.credit.probe import DEFAULT_CONCLUDE, Probe, build_probe
from oar.models.tiny import build_tiny


def make_probe(tok, batch: int, reasoning: int, conclude: str, seed: int) -> Probe:
    rng = random.Random(seed)
    digits = "0123456789"
    chars = digits + "+-*= abcdefghijklmnopqrstuvwxyz"
    prompts, responses = [], []
    for _ in range(batch):
        prompts.append("".join(rng.choice(chars) for _ in range(rng.randint(15, 25))))
        n = max(0, reasoning + rng.randint(-3, 3))
        ans = "".join(rng.choice(digits) for _ in range(rng.randint(2, 3)))
        responses.append("".join(rng.choice(chars) for _ in range(n)) + "\\boxed{" + ans + "}")
    pad, eos = tok.pad_token_id, tok.eos_token_id
    P = [list(tok(s, add_special_tokens=False)["input_ids"]) for s in prompts]
    R = [list(tok(s, add_special_tokens=False)["input_ids"]) + [eos] for s in responses]
    np_, nr = max(map(len, P)), max(map(len, R))
    p_ids = torch.tensor([[pad] * (np_ - len(p)) + p for p in P])
    p_mask = torch.tensor([[0] * (np_ - len(p)) + [1] * len(p) for p in P])
    r_ids = torch.tensor([r + [pad] * (nr - len(r)) for r in R])
    r_mask = torch.tensor([[1] * len(r) + [0] * (nr - len(r)) for r in R])
    return build_probe(tok, p_ids, r_ids, conclude=conclude, prompt_mask=p_mask, response_mask=r_mask)


#: OAR-G variants timed against one default pass: name -> (mode, draws, baseline or None).
G_VARIANTS: dict[str, tuple[str, int, str | None]] = {
    "oar_g_joint": ("answer_joint", 1, None),
    "oar_g_mean_k2": ("answer_mean", 2, None),
    "oar_g_mean_k4": ("answer_mean", 4, None),
    "oar_g_joint_ig1": ("answer_joint", 1, "pad"),
    "oar_g_joint_ig2": ("answer_joint", 2, "pad"),
    "oar_g_joint_ig4": ("answer_joint", 4, "pad"),
}


def parse_variants(items: list[str] | None) -> dict[str, tuple[str, int, str | None]]:
    """``name=mode:draws:baseline`` items (baseline ``-``: noise draws) -> :data:`G_VARIANTS` form."""
    if not items:
        return dict(G_VARIANTS)
    out = {}
    for it in items:
        name, spec = it.split("=", 1)
        mode, draws, base = spec.split(":")
        out[name] = (mode, int(draws), None if base == "-" else base)
    return out


def g_rows(mode: str, draws: int) -> int:
    """Model rows per response of an OAR-G pass, a backward counted as two forwards."""
    return (0 if mode == "answer_joint" else 1) + 3 * draws


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_it  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reasoning", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="last")
    ap.add_argument("--g-mode", default="answer_mean")
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--conclude", default=DEFAULT_CONCLUDE)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--g-variants", nargs="*", default=None, help="name=mode:draws:baseline (baseline - or pad|zero)")
    args = ap.parse_args()
    variants = parse_variants(args.g_variants)
    torch.set_num_threads(args.threads)

    model, tok = build_tiny(
        hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=4 * args.hidden_size, seed=args.seed
    )
    probe = make_probe(tok, args.batch, args.reasoning, args.conclude, args.seed)
    n_reason = int(probe.reasoning_mask.sum())
    print(
        f"batch={args.batch} probe_len={probe.input_ids.shape[1]} reasoning_tokens={n_reason} "
        f"(mean {n_reason / args.batch:.1f}/response) mode={args.mode} chunk_size={args.chunk_size} "
        f"model=d{args.hidden_size}x{args.num_layers} threads={args.threads}"
    )

    # Deterministic cost proxy (query token positions run through the model), mirroring the
    # library's chunking: perturbations sorted by position t, chunks of chunk_size, each chunk runs
    # positions >= its smallest t; plus the one unperturbed forward of every row.
    B, L = probe.input_ids.shape
    t_sorted = probe.reasoning_mask.nonzero()[:, 1].sort().values
    cs = args.chunk_size
    cached_pos = B * L + sum(int(c.numel()) * (L - int(c.min())) for c in t_sorted.split(cs))
    naive_pos = B * L + int(t_sorted.numel()) * L
    ideal_pos = B * L + int((L - t_sorted).sum())  # each copy only from its own t
    print(f"token positions run: cached {cached_pos} naive {naive_pos} ratio {cached_pos / naive_pos:.3f}; "
          f"ideal {ideal_pos} (cached/ideal {cached_pos / ideal_pos:.3f}: chunks recompute [t0, t); no padding queries)")

    cached = perturbation_importance(model, probe, mode=args.mode, chunk_size=args.chunk_size)
    naive = perturbation_importance(model, probe, mode=args.mode, chunk_size=args.chunk_size, naive=True)
    print(f"max |cached - naive| = {float((cached - naive).abs().max()):.3e} (max score {float(cached.abs().max()):.3e})")

    runs = {
        "oar_p_cached": lambda: perturbation_importance(model, probe, mode=args.mode, chunk_size=args.chunk_size),
        "oar_p_naive": lambda: perturbation_importance(
            model, probe, mode=args.mode, chunk_size=args.chunk_size, naive=True
        ),
        "oar_g": lambda: gradient_importance(model, probe, mode=args.g_mode, seed=args.seed),
    }
    for name, (mode, draws, base) in variants.items():
        noise = 0.0 if base is not None else 1e-3
        runs[name] = lambda m=mode, d=draws, b=base, z=noise: gradient_importance(
            model, probe, mode=m, draws=d, baseline=b, noise_std=z, seed=args.seed
        )
        print(f"{name}: mode={mode} draws={draws} baseline={base} rows/response {g_rows(mode, draws)} "
              f"= {g_rows(mode, draws) / g_rows(args.g_mode, 1):.2f}x one {args.g_mode} pass")
    med = {}
    for name, fn in runs.items():
        ts = time_it(fn, args.repeats)
        med[name] = statistics.median(ts)
        print(f"{name}: " + " ".join(f"{t:.3f}" for t in ts) + f" s; median {med[name]:.3f} s")
    print(
        f"RATIOS oar_p_cached/naive={med['oar_p_cached'] / med['oar_p_naive']:.3f} "
        f"oar_g/oar_p={med['oar_g'] / med['oar_p_cached']:.3f} "
        + " ".join(f"{name}/oar_g={med[name] / med['oar_g']:.3f}" for name in variants)
    )


if __name__ == "__main__":
    main()
