"""Tests for oar.reward.score: answer checking with math-verify in worker processes, DAPO overlong shaping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import oar.reward.pool as P
from helpers import (
    TEST_CRASH_MARKER,
    TEST_CRASH_ONCE_MARKER,
    TEST_HANG_MARKER,
    TEST_MV_TIMEOUT_MARKER,
    TEST_TERM_MARKER,
    hang_for_test,
)
from oar.reward.pool import PoolStats, RewardPool
from oar.reward.score import extracted_answer, overlong_penalty, score_batch
from oar.reward.verify import check_one, score_one

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=5.0) as p:
        yield p


# ----------------------------------------------------------------------------- reading rules


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("so \\boxed{0.5}", "\\frac12"),
        ("\\boxed{\\frac12}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{27.0}", "27"),
        ("\\boxed{27}", 27.0),  # amc23 stores float golds
        ("The answer is \\boxed{40}.", "40"),
        ("\\boxed{(3,4)}", "(3, 4)"),
        ("\\boxed{10\\%}", "10"),
        ("\\boxed{x = 5}", "5"),
        ("23 + 17 = 40. The final answer is 40", "40"),  # no box: math-verify's default extraction
        ("\\boxed{3} first, but then \\boxed{4}", "4"),  # the last box counts
        ("\\boxed{\\frac{\\pi}{2}}", "\\boxed{\\frac{\\pi}{2}}"),  # a boxed gold is unwrapped
    ],
)
def test_score_one_equivalent_forms(response, gold):
    assert score_one(response, str(gold)) is True


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("\\boxed{41}", "40"),
        ("\\boxed{3} first, but then \\boxed{4}", "3"),  # an earlier box does not count
        ("\\boxed{(4,3)}", "(3, 4)"),
        ("I do not know.", "40"),
        ("", "40"),
        (None, "40"),
        ("   \n", "40"),
        ("the sum is 40 so \\boxed{}", "40"),  # an empty box is the answer; no search around it
        ("the sum is 40 so \\boxed{forty}", "40"),  # a box that does not parse scores wrong
    ],
)
def test_score_one_wrong(response, gold):
    assert score_one(response, gold) is False


def test_truncated_box_falls_back_to_default_extraction_unless_required():
    text = "we get 40 and so \\boxed{4"  # cut off before the closing brace
    assert score_one(text, "40") is True  # math-verify's default extraction reads the 40
    assert score_one(text, "4") is False
    assert score_one(text, "40", require_boxed=True) is False
    assert score_one("The answer is 40", "40", require_boxed=True) is False
    assert score_one("so \\boxed{40}", "40", require_boxed=True) is True


def test_extracted_answer():
    assert extracted_answer("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extracted_answer("no box, 40") is None
    assert extracted_answer(None) is None
    assert extracted_answer("\\boxed{4") is None


# ----------------------------------------------------------------------------- the pool


def test_pool_scores_in_order_with_reward_values(pool):
    responses = ["\\boxed{0.5}", "\\boxed{41}", "", None, "\\boxed{27.0}", "no answer here", "\\boxed{1/2}"]
    golds = ["\\frac12", "40", "1", "1", "27", "40", "\\frac{1}{2}"]
    assert pool.score(responses, golds) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert pool.score(responses, golds, correct=1.0, wrong=-1.0) == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    assert pool.score([], []) == []


def test_pool_deduplicates_and_skips_empty(pool):
    before = pool.stats.scored
    responses = ["\\boxed{4}"] * 5 + ["\\boxed{5}"] * 3 + ["", None]
    golds = ["4"] * 5 + ["4"] * 3 + ["4", "4"]
    assert pool.score(responses, golds) == [1.0] * 5 + [0.0] * 3 + [0.0, 0.0]
    assert pool.stats.scored - before == 2  # two unique, non-empty pairs reached a worker
    # the same response against a different gold is a different pair
    assert pool.score(["\\boxed{4}", "\\boxed{4}"], ["4", "5"]) == [1.0, 0.0]


def test_pool_many_items_across_chunks(pool):
    n = 200
    responses = [f"{i} + 1 = {i + 1}, so \\boxed{{{i + 1 if i % 3 else i}}}" for i in range(n)]
    golds = [str(i + 1) for i in range(n)]
    assert pool.score(responses, golds) == [0.0 if i % 3 == 0 else 1.0 for i in range(n)]


def test_bad_input_errors(pool):
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        pool.score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="gold answer 1 is empty"):
        pool.score(["a", "b"], ["1", " "])
    with pytest.raises(TypeError, match="gold answer 0 is a list"):
        pool.score(["a"], [["1", "2"]])
    with pytest.raises(TypeError, match="response 1 is a int"):
        pool.score(["a", 3], ["1", "2"])
    with pytest.raises(ValueError, match="workers"):
        RewardPool(workers=0)
    with pytest.raises(ValueError, match="start_method"):
        RewardPool(start_method="fork")


def test_limits_follow_timeout_s():
    """math-verify's own limit in the worker is reward.timeout_s (whole seconds, rounded up), not a third
    of it; the parent's guard per item allows every long math-verify call of an item, plus a margin."""
    p = RewardPool(workers=1, timeout_s=5.0)
    assert p.inner_timeout_s == 5
    assert p.guard_s == P.CALLS_PER_ITEM * 5 + P.GUARD_MARGIN_S > p.inner_timeout_s
    assert RewardPool(workers=1, timeout_s=0.5).inner_timeout_s == 1
    assert RewardPool(workers=1, timeout_s=2.5, guard_s=0.5).guard_s == 0.5
    with pytest.raises(ValueError, match="guard_s"):
        RewardPool(workers=1, guard_s=0.0)


def test_a_slow_correct_answer_scores_right_under_the_configured_limit():
    """Issue 54: each of these answers needs about 1 s of math-verify's parse unloaded (the sum of 600
    ones) or more (the product of 900 twos, about 1.4 s), past the 1 s the worker used to get out of
    timeout_s=5; they scored wrong, and nothing counted it."""
    slow = ["\\boxed{" + "+".join(["1"] * 600) + "-595}", "\\boxed{" + "\\cdot ".join(["2"] * 900) + "}"]
    with RewardPool(workers=1, timeout_s=5.0) as p:
        assert p.score(slow, ["5", "2^{900}"]) == [1.0, 1.0]
        assert p.stats.timeouts == p.stats.retried == p.stats.marked == 0


def test_check_one_tells_math_verify_timeouts_apart():
    """math-verify's parse and verify return a failed parse / False on their own timeout; check_one
    sees it (None) in both, score_one keeps a plain False."""
    slow_parse = "\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(600)) + "}"  # about 5 s to parse
    slow_verify = "\\boxed{9^{9^{9^{9}}}}"  # parses at once; the comparison never ends
    assert check_one(slow_parse, "5", parsing_timeout=1) is None
    assert check_one(slow_verify, "5", parsing_timeout=1) is None
    assert score_one(slow_verify, "5", parsing_timeout=1) is False
    assert check_one("\\boxed{4}", "5", parsing_timeout=1) is False


def test_hung_item_is_retried_then_marked_and_pool_recovers():
    with RewardPool(workers=1, timeout_s=0.5, guard_s=0.5, work_fn=hang_for_test, chunk_size=8) as p:
        responses = ["\\boxed{3}", TEST_HANG_MARKER + " \\boxed{3}", "\\boxed{3}", "\\boxed{2}"]
        # the hung item would score "correct" if its verdict were ever read
        assert p.score(responses, ["3"] * 4) == [1.0, 0.0, 1.0, 0.0]
        # killed at the guard, retried on a new worker under twice the guard, killed again: marked
        assert (p.stats.timeouts, p.stats.retried, p.stats.marked, p.stats.crashes) == (2, 1, 1, 0)
        assert p.stats.restarts == 2
        assert p.score(["\\boxed{7}", "\\boxed{8}"], ["7", "7"]) == [1.0, 0.0]
        assert p.stats.timeouts == 2


def test_math_verify_timeout_is_retried_then_marked():
    with RewardPool(workers=1, timeout_s=1.0, work_fn=hang_for_test) as p:
        assert p.score(["\\boxed{1}", TEST_MV_TIMEOUT_MARKER + "\\boxed{1}"], ["1", "1"]) == [1.0, 0.0]
        assert (p.stats.timeouts, p.stats.retried, p.stats.marked, p.stats.restarts) == (2, 1, 1, 0)


def test_crashed_worker_is_counted_and_its_item_retried_on_a_new_worker(tmp_path):
    with RewardPool(workers=2, timeout_s=5.0, work_fn=hang_for_test) as p:
        once = f"{TEST_CRASH_ONCE_MARKER}{tmp_path / 'crashed'}>> \\boxed{{1}}"
        responses = ["\\boxed{1}", once, "\\boxed{1}", "\\boxed{2}"]
        assert p.score(responses, ["1"] * 4) == [1.0, 1.0, 1.0, 0.0]  # the retry scores it right
        assert (tmp_path / "crashed").exists()
        assert (p.stats.crashes, p.stats.retried, p.stats.marked, p.stats.timeouts) == (1, 1, 0, 0)
        # a worker that dies on every try: counted twice, then marked
        assert p.score(["\\boxed{1}", TEST_CRASH_MARKER, "\\boxed{1}"], ["1"] * 3) == [1.0, 0.0, 1.0]
        assert (p.stats.crashes, p.stats.retried, p.stats.marked, p.stats.timeouts) == (3, 2, 1, 0)
        assert p.score(["\\boxed{2}"], ["2"]) == [1.0]


def test_a_worker_stopped_from_outside_is_replaced_and_its_items_scored_again(tmp_path):
    """SLURM's --signal reaches every process of a job, the reward workers too: a worker stopped by
    SIGTERM while starting or while scoring is replaced, and the items it had not answered are scored
    by the new worker (not scored wrong, as an item that crashed its worker is)."""
    import os
    import signal

    with RewardPool(workers=1, timeout_s=10.0, work_fn=hang_for_test, chunk_size=8) as p:
        os.kill(p._workers[0].proc.popen.pid, signal.SIGTERM)  # still importing math-verify
        marker = f"{TEST_TERM_MARKER}{tmp_path / 'stopped'}>> "
        responses = ["\\boxed{1}", marker + "\\boxed{1}", "\\boxed{1}", "\\boxed{2}"]
        assert p.score(responses, ["1"] * 4) == [1.0, 1.0, 1.0, 0.0]
        assert (tmp_path / "stopped").exists()  # the second item's first worker was stopped while scoring it
        assert p.stats.stopped == 2 and p.stats.restarts == 2
        assert p.stats.crashes == 0 and p.stats.timeouts == 0


def test_pathological_inputs_score_wrong():
    responses = [
        "\\boxed{" + "{" * 5000,
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{(10^{10^{8}})!}",
        "x" * 200_000 + " \\boxed{5}",
        "\\boxed{5}",
    ]
    with RewardPool(workers=2, timeout_s=1.0) as p:  # 1 s, then 2 s on the retry: the powers never finish
        assert p.score(responses, ["5"] * 5) == [0.0, 0.0, 0.0, 1.0, 1.0]
        assert (p.stats.timeouts, p.stats.retried, p.stats.marked) == (4, 2, 2)


def test_score_batch_scores_in_the_callers_pool_or_in_one_of_its_own(monkeypatch):
    """No process-wide pool: a caller's pool (a run's, an evaluation's) scores every call it is given;
    a call without one starts a pool with its own settings and closes it after the call."""
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        assert score_batch(["\\boxed{2}", "\\boxed{3}"], ["2", "2"], correct=1.0, wrong=-1.0, pool=pool) == [1.0, -1.0]
        first = pool.stats.items
        assert score_batch(["\\boxed{4}"], ["4"], pool=pool) == [1.0]
        assert first > 0 and pool.stats.items > first  # both calls in the caller's pool
    made, real_close = [], RewardPool.close
    monkeypatch.setattr(RewardPool, "close", lambda self: made.append((self.timeout_s, self.workers)) or real_close(self))
    assert score_batch(["\\boxed{2}"], ["2"], workers=1, timeout_s=3.0) == [1.0]
    assert made == [(3.0, 1)]  # one pool for the call, with the call's settings, closed after it


def test_score_batch_adds_its_counts_to_stats():
    stats = PoolStats(timeouts=1)
    assert score_batch(["\\boxed{2}", "\\boxed{2}", None], ["2", "3", "2"], workers=1, stats=stats) == [1.0, 0.0, 0.0]
    assert stats == PoolStats(items=3, scored=2, timeouts=1)
    # the counts of the call only, not the pool's since it was created
    assert score_batch(["\\boxed{9^{9^{9^{9}}}}"], ["5"], workers=1, timeout_s=1.0) == [0.0]
    stats = PoolStats()
    assert score_batch(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{5}"], ["5", "5"], workers=1, timeout_s=1.0,
                       stats=stats) == [0.0, 1.0]
    assert (stats.timeouts, stats.retried, stats.marked, stats.crashes, stats.items) == (2, 1, 1, 0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_multiprocessing_start_methods(method):
    with RewardPool(workers=1, timeout_s=0.5, guard_s=0.5, start_method=method, work_fn=hang_for_test) as p:
        assert p.score(["\\boxed{1}", TEST_HANG_MARKER, "\\boxed{2}"], ["1", "1", "1"]) == [1.0, 0.0, 0.0]
        assert p.stats.timeouts == 2 and p.stats.marked == 1
        assert p.score(["\\boxed{2}"], ["2"]) == [1.0]


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "math500" / "test.jsonl").exists(), reason="shared data not present")
def test_math500_golds_verify_against_themselves(pool):
    golds = [json.loads(line)["answer"] for line in (DATA / "math500" / "test.jsonl").open()]
    assert len(golds) == 500
    ok = pool.score(["The answer is \\boxed{" + g + "}" for g in golds], golds)
    assert sum(ok) == 500
    # ... and a different problem's answer is (almost always) wrong
    shifted = pool.score(["\\boxed{" + g + "}" for g in golds[1:] + golds[:1]], golds)
    assert sum(shifted) < 25


# ----------------------------------------------------------------------------- overlong penalty


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([10, 16, 17, 18, 20, 22])
    before = lengths.clone()
    # expected length 20 - 4 = 16; -(len - 16) / 4 * factor, capped at 0
    out = overlong_penalty(lengths, max_length=20, cache_length=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.5]))
    out2 = overlong_penalty(lengths, max_length=20, cache_length=4, penalty_factor=2.0)
    torch.testing.assert_close(out2, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -3.0]))
    assert out.dtype == torch.float32 and out.shape == (6,)
    assert torch.equal(lengths, before)
    assert (out <= 0).all()


def test_overlong_penalty_disabled_and_errors():
    lengths = torch.tensor([5.0, 100.0], dtype=torch.float64)
    z = overlong_penalty(lengths, max_length=50, cache_length=0)
    assert torch.equal(z, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        overlong_penalty(torch.ones(2, 2), max_length=10, cache_length=2)
    with pytest.raises(ValueError, match="must not exceed"):
        overlong_penalty(lengths, max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(lengths, max_length=0, cache_length=0)
