"""Benchmark oar.reward.score: score 1,000 typical responses with 2 worker processes.

Responses are synthetic: half arithmetic-chain-like ("12 + 7 = 19, 19 * 3 = 57 ... \\boxed{57}"),
half LaTeX-fraction-like ("... \\boxed{\\frac{3}{8}}", gold sometimes written "0.375"), in groups
of 8 per prompt (so golds repeat as in GRPO), 80% correct. Each repeat draws a fresh batch so that
caches inside the workers do not make later repeats look faster than a training step would be.

Prints the cold start (pool creation to the first batch scored, per start method), the median
seconds over the warm repeats, and ends with ``RATIOS reward_1000_s=<median>``.

    .venv/bin/python benchmarks/bench_reward.py [--n 1000] [--repeats 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from fractions import Fraction

from oar.reward.pool import RewardPool
from oar.reward.verify import score_one

if os.environ.get("OAR_BENCH_IMPORT_TORCH") == "1":  # look like a trainer: multiprocessing
    import torch  # noqa: F401  (forkserver/spawn) children re-import the main module, so torch

GROUP = 8


def make_batch(n: int, seed: int, correct_rate: float = 0.8) -> tuple[list[str], list[str], list[bool]]:
    """``n`` (response, gold, is_correct) triples as three lists; about ``correct_rate`` correct."""
    rng = random.Random(seed)
    responses: list[str] = []
    golds: list[str] = []
    truth: list[bool] = []
    while len(responses) < n:
        if rng.random() < 0.5:  # arithmetic chain
            x = rng.randint(10, 99)
            steps = []
            for _ in range(rng.randint(1, 3)):
                op, y = rng.choice("+-*"), rng.randint(2, 99)
                z = x + y if op == "+" else x - y if op == "-" else x * y
                steps.append(f"{x} {op} {y} = {z}")
                x = z
            gold, body = str(x), "First, " + ". Then ".join(steps) + "."
            wrong = str(x + rng.choice([-10, -1, 1, 2, 10]))
        else:  # fraction
            f = Fraction(rng.randint(1, 20), rng.randint(2, 40))
            while f.denominator == 1:
                f = Fraction(rng.randint(1, 20), rng.randint(2, 40))
            gold = f"\\frac{{{f.numerator}}}{{{f.denominator}}}"
            if rng.random() < 0.3 and f.denominator in (2, 4, 5, 8, 10, 20, 25, 40):
                gold = str(float(f))  # a decimal gold, compared to a fraction response
            body = (
                f"There are {f.denominator} equally likely outcomes and {f.numerator} favourable ones, "
                f"so the probability is $\\frac{{{f.numerator}}}{{{f.denominator}}}$."
            )
            wrong = f"\\frac{{{f.numerator + 1}}}{{{f.denominator}}}"
        right = gold if "frac" in gold or "." not in gold else body.split("$")[1]
        for _ in range(GROUP):
            ok = rng.random() < correct_rate
            ans = right if ok else wrong
            truth.append(ok)
            filler = " ".join(rng.choice(["so", "we", "now", "check", "again", "ok"]) for _ in range(rng.randint(0, 12)))
            responses.append(f"{body} {filler} Therefore the answer is \\boxed{{{ans}}}.")
            golds.append(gold)
    return responses[:n], golds[:n], truth[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--methods", default="subprocess,forkserver,spawn", help="start methods for the cold-start line")
    args = ap.parse_args()

    def check(scores: list[float], truth: list[bool]) -> str:
        bad = sum((s == 1.0) != t for s, t in zip(scores, truth))
        return f"correct={sum(scores) / len(scores):.3f} disagreements={bad}"

    responses, golds, truth = make_batch(args.n, seed=0)
    print(f"torch imported in main: {'torch' in sys.modules}")
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        with RewardPool(workers=args.workers, start_method=method) as pool:
            pool.score(["\\boxed{1}"] * args.workers, [str(i) for i in range(args.workers)])
            ready = time.perf_counter() - t0
            scores = pool.score(responses, golds)
            total = time.perf_counter() - t0
        print(f"cold ({method}): workers ready {ready:.2f} s, + first {args.n} = {total:.2f} s  {check(scores, truth)}")

    with RewardPool(workers=args.workers) as pool:
        pool.score(*make_batch(args.n, seed=1)[:2])  # warm-up
        times = []
        for r in range(args.repeats):
            responses, golds, truth = make_batch(args.n, seed=100 + r)
            t0 = time.perf_counter()
            scores = pool.score(responses, golds)
            times.append(time.perf_counter() - t0)
            print(f"repeat {r}: {times[-1]:.3f} s  {check(scores, truth)}")
        print(f"stats: {pool.stats.as_dict()}")
    # reference: the same work in this process, one item after another, no pool and no timeouts
    responses, golds, truth = make_batch(args.n, seed=100)
    score_one(responses[0], golds[0])  # warm-up
    t0 = time.perf_counter()
    seq = [1.0 if score_one(r, g) else 0.0 for r, g in zip(responses, golds)]
    print(f"in-process sequential reference (1 core, no pool): {time.perf_counter() - t0:.3f} s  {check(seq, truth)}")
    med = statistics.median(times)
    print(f"median over {args.repeats} warm repeats: {med:.3f} s for {args.n} responses, {args.workers} workers")
    print(f"RATIOS reward_1000_s={med:.3f}")


if __name__ == "__main__":
    main()
