"""Time the credit-assignment tensor core on realistic sizes (CPU).

- ``bilevel_weights`` on 512 x 4096 scores with varying reasoning lengths;
- ``ktae_token_advantages`` on 64 groups of 16 x 3072 tokens, ids in a 152k vocabulary drawn from a
  Zipf-like distribution, right-padded masks of varying lengths, binary rewards.

Prints per-repeat times, medians, and a final line ``RATIOS bilevel_s=<median> ktae_s=<median>``
(plain medians in seconds).

    python benchmarks/bench_credit.py [--repeats 5] [--threads 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable

import torch

from oar.credit.ktae import ktae_token_advantages
from oar.credit.reshape import bilevel_weights


def _lengths(gen: torch.Generator, n: int, max_len: int, min_len: int) -> torch.Tensor:
    # mixture: many medium responses, some hitting the length limit
    lens = (torch.rand(n, generator=gen) ** 0.7 * (max_len - min_len) + min_len).long()
    hit = torch.rand(n, generator=gen) < 0.15
    return torch.where(hit, torch.full_like(lens, max_len), lens)


def bilevel_inputs(gen: torch.Generator, b: int = 512, t: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    lens = _lengths(gen, b, t, 64)
    mask = (torch.arange(t)[None, :] < lens[:, None]).float()
    # heavy-tailed importance scores (KL-like): mostly tiny, a few large
    scores = torch.distributions.Exponential(torch.tensor(1.0)).sample((b, t)) ** 3 * 1e-2
    return scores, mask


def ktae_inputs(
    gen: torch.Generator, groups: int = 64, group_size: int = 16, t: int = 3072, vocab: int = 152_000, zipf_s: float = 1.1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = groups * group_size
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-zipf_s)
    perm = torch.randperm(vocab, generator=gen)  # frequent ids are not the small ids
    ids = perm[torch.multinomial(probs / probs.sum(), b * t, replacement=True, generator=gen)].view(b, t)
    lens = _lengths(gen, b, t, 32)
    mask = (torch.arange(t)[None, :] < lens[:, None]).float()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, 151_643))  # pad with an eos-like id
    p_correct = torch.rand(groups, generator=gen).repeat_interleave(group_size)
    rewards = (torch.rand(b, generator=gen) < p_correct).float()
    group_ids = torch.arange(groups).repeat_interleave(group_size) * 7 + 3  # non-contiguous ids
    return ids, mask, rewards, group_ids


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_it  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)

    scores, mask = bilevel_inputs(gen)
    bl = time_it(lambda: bilevel_weights(scores, mask), args.repeats)
    print(f"bilevel_weights 512x4096 (masked {int(mask.sum())}): " + " ".join(f"{x:.3f}" for x in bl))

    ids, kmask, rewards, gids = ktae_inputs(gen)
    kt = time_it(lambda: ktae_token_advantages(ids, kmask, rewards, gids, ignore_token_ids=[151_643]), args.repeats)
    print(f"ktae_token_advantages 64x16x3072 (masked {int(kmask.sum())}): " + " ".join(f"{x:.3f}" for x in kt))

    bl_med, kt_med = statistics.median(bl), statistics.median(kt)
    print(f"threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"RATIOS bilevel_s={bl_med:.4f} ktae_s={kt_med:.4f}")


if __name__ == "__main__":
    main()
