"""The seed derivations (oar.core.seeds): hand-computed values, and distinct draws for neighbouring seeds."""

from oar.core.seeds import CONTINUATIONS_SALT, SEED_STRIDE, UPDATE_SALT, step_seed, stream_seed


def test_stream_seed_hand_computed():
    assert stream_seed(0, 7) == 7
    assert stream_seed(2, 3) == 2 * 1_000_003 + 3 == 2_000_009


def test_step_seed_hand_computed():
    assert step_seed(1, 2, 5) == 1_000_003 + 2 * 101 + 5 == 1_000_210
    assert step_seed(0, 0) == 0
    assert step_seed(2**62, 0) == (2**62 * SEED_STRIDE) % (2**63 - 1)  # stays a valid 63-bit seed


def test_neighbouring_seeds_and_steps_do_not_share_draws():
    draws = {step_seed(seed, step, r) for seed in range(4) for step in range(200)
             for r in (0, 1, 2, CONTINUATIONS_SALT, UPDATE_SALT)}
    assert len(draws) == 4 * 200 * 5
