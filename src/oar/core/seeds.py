"""The seed derivations: one run seed gives every random draw of a run its own seed.

- :func:`stream_seed` ``(seed, index)``: the ``index``-th draw of a stream seeded once per run (the
  prompt order of epoch ``index``, the ``index``-th chunk of an evaluation's samples);
- :func:`step_seed` ``(seed, step, round_)``: a training step's draws; ``round_`` is the rollout
  round (0, 1, ... for DAPO's extra rounds) or one of the salts below;
- :func:`rank_seed` ``(seed, rank)``: a training process's own generators (its colocated vLLM engine).

Token-level noise (OAR-G's draws per response) is keyed by hashing instead
(``oar.credit.importance.mix_seed``), so that it does not depend on batch composition.
"""

from __future__ import annotations

__all__ = ["SEED_STRIDE", "STEP_STRIDE", "CONTINUATIONS_SALT", "UPDATE_SALT", "RANK_SALT", "stream_seed", "step_seed",
           "rank_seed"]

#: The stride between two run seeds' streams (a prime, so neighbouring seeds do not share draws).
SEED_STRIDE = 1_000_003

#: The stride between two steps' draws within a run.
STEP_STRIDE = 101

#: Salts of the step's draws besides the rollout's rounds.
CONTINUATIONS_SALT = 104729  # mc_value's continuations
UPDATE_SALT = 7919  # the update's mini-batch shuffles
RANK_SALT = 65537  # a training process's own generators (its colocated vLLM engine's seed)


def stream_seed(seed: int, index: int) -> int:
    """The seed of draw ``index`` of a stream seeded by the run seed ``seed``: ``seed * SEED_STRIDE + index``."""
    return seed * SEED_STRIDE + index


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of a step's draw: ``round_`` is the rollout round or one of the salts above."""
    return stream_seed(seed, step * STEP_STRIDE + round_) % (2**63 - 1)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of training process ``rank``'s own generators (its colocated vLLM engine): the run seed
    itself on rank 0 (a one-process run is unchanged), a stream draw of it on the others (below 2**32,
    as numpy's seed must be)."""
    return seed if rank == 0 else stream_seed(seed, RANK_SALT + rank) % (2**32)
