"""Tests for the synthetic arithmetic task (oar.data.synthetic)."""

from __future__ import annotations

import ast
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.reward.answer import extract_boxed, last_boxed_span
from oar.data.synthetic import DEFAULT_FILLERS, answer_of, format_solution, generate, solve_steps

KEYS = {"id", "question", "answer", "solution", "source", "n_operands", "result_spans", "filler_spans", "demo_errors"}


def py_eval(question: str) -> int:
    """Independent reference: evaluate the expression of 'Compute <expr>.' with Python's precedence."""
    expr = re.fullmatch(r"Compute (.+)\.", question).group(1)
    node = ast.parse(expr, mode="eval").body

    def ev(x):
        if isinstance(x, ast.Constant):
            return x.value
        assert isinstance(x, ast.BinOp)
        a, b = ev(x.left), ev(x.right)
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(x.op)]

    return ev(node)


def test_format_solution_hand_example():
    sol, res, fil = format_solution([(47, "+", 18, 65), (65, "-", 25, 40)], ["so", None])
    assert sol == "47+18=65, so 65-25=40. \\boxed{40}"
    assert res == [[6, 8], [19, 21]]
    assert fil == [[10, 12]]
    assert [sol[a:b] for a, b in res] == ["65", "40"]


def test_format_solution_negative_and_filler_before_box():
    sol, res, fil = format_solution([(12, "-", 47, -35), (-35, "+", 20, -15)], [None, "ok"])
    assert sol == "12-47=-35, -35+20=-15. ok \\boxed{-15}"
    # digits only: the minus sign is outside the span
    assert [sol[a:b] for a, b in res] == ["35", "15"]
    assert res == [[7, 9], [19, 21]]
    assert [sol[a:b] for a, b in fil] == ["ok"]


def test_solve_steps_precedence():
    assert solve_steps([47, 18, 25], ["+", "-"]) == [(47, "+", 18, 65), (65, "-", 25, 40)]
    assert solve_steps([2, 3, 4], ["+", "*"]) == [(3, "*", 4, 12), (2, "+", 12, 14)]
    assert solve_steps([5, 3, 2, 1], ["-", "*", "-"]) == [(3, "*", 2, 6), (5, "-", 6, -1), (-1, "-", 1, -2)]
    assert solve_steps([2, 3, 4, 5], ["*", "+", "*"]) == [(2, "*", 3, 6), (4, "*", 5, 20), (6, "+", 20, 26)]


def test_answer_of():
    assert answer_of("Compute 47+18-25.") == "40"
    assert answer_of("Compute 12-47.") == "-35"
    assert answer_of("Compute 2+3*4.") == "14"
    for bad in ("47+18", "Compute 47+.", "Compute 4/2.", "Compute -4+2."):
        with pytest.raises(ValueError):
            answer_of(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=2, max_size=6), st.data())
def test_solve_steps_matches_python(nums, data):
    ops = data.draw(st.lists(st.sampled_from(["+", "-", "*"]), min_size=len(nums) - 1, max_size=len(nums) - 1))
    expr = str(nums[0]) + "".join(f"{o}{x}" for o, x in zip(ops, nums[1:]))
    steps = solve_steps(nums, ops)
    assert len(steps) == len(nums) - 1
    assert steps[-1][3] == py_eval(f"Compute {expr}.")
    for a, op, b, c in steps:
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op]


def _check_record(r: dict, fillers=DEFAULT_FILLERS) -> None:
    assert set(r) == KEYS
    q, sol = r["question"], r["solution"]
    assert isinstance(r["answer"], str)
    assert r["answer"] == str(py_eval(q)) == answer_of(q)
    assert extract_boxed(sol) == r["answer"]
    # result spans: independently re-parse every "=<result>" of the solution
    expected = [[m.start(1), m.end(1)] for m in re.finditer(r"=-?(\d+)", sol)]
    assert r["result_spans"] == expected
    assert len(r["result_spans"]) == r["n_operands"] - 1
    assert sol[slice(*r["result_spans"][-1])] == r["answer"].lstrip("-")
    box_start = last_boxed_span(sol)[0]
    assert all(e <= box_start - len("\\boxed{") for _, e in r["result_spans"])  # boxed copy excluded
    # filler spans hold filler words, each followed by a space
    for a, b in r["filler_spans"]:
        assert sol[a:b] in fillers and sol[b] == " "
    assert len(r["filler_spans"]) <= r["n_operands"] - 1
    # operands in the question: non-negative, count n_operands
    assert len(re.findall(r"\d+", q)) == r["n_operands"]


@pytest.mark.parametrize("split", ["train", "test", "ood"])
def test_records_are_consistent(split):
    recs = generate(split, 400, seed=3, operators=("+", "-", "*"))
    assert len(recs) == 400
    assert [r["id"] for r in recs] == [f"synthetic-{split}-{i}" for i in range(400)]
    assert {r["source"] for r in recs} == {f"synthetic-{split}"}
    for r in recs:
        _check_record(r)


def test_negatives_appear_and_are_consistent():
    recs = generate("test", 300, seed=0)
    neg = [r for r in recs if r["answer"].startswith("-")]
    assert neg, "2-digit subtraction should produce negative answers"
    for r in neg:
        _check_record(r)
        assert "=-" in r["solution"]


def test_operand_counts_per_split():
    train = generate("train", 4000, seed=1)
    counts = [r["n_operands"] for r in train]
    assert set(counts) == {2, 3, 4}
    share4 = counts.count(4) / len(counts)
    assert 0.08 < share4 < 0.12  # long_share=0.1
    assert {r["n_operands"] for r in generate("test", 300, seed=1)} == {2, 3}
    assert {r["n_operands"] for r in generate("ood", 100, seed=1)} == {4}
    assert {r["n_operands"] for r in generate("ood", 50, seed=1, ood_operands=5)} == {5}
    assert {r["n_operands"] for r in generate("train", 200, seed=1, long_share=0.0)} == {2, 3}


def test_same_seed_same_records_different_seed_different():
    a = generate("train", 200, seed=7)
    assert a == generate("train", 200, seed=7)
    b = generate("train", 200, seed=8)
    assert [r["question"] for r in a] != [r["question"] for r in b]
    assert generate("test", 50, seed=7) == generate("test", 50, seed=7)
    assert [r["question"] for r in generate("test", 50, seed=7)] != [r["question"] for r in generate("test", 50, seed=8)]
    # a prefix of a longer draw is the shorter draw
    assert generate("train", 300, seed=7)[:200] == a


def test_train_and_heldout_disjoint_in_small_space():
    # 1-digit, 2 operands, +/-: only 200 distinct questions, so a leak would show.
    opts = dict(digits=1, operands=(2,), long_share=0.0, ood_operands=2)
    train = {r["question"] for s in (0, 1, 2) for r in generate("train", 2000, seed=s, **opts)}
    test = {r["question"] for s in (0, 1, 2) for r in generate("test", 25, seed=s, **opts)}
    ood = {r["question"] for r in generate("ood", 25, seed=5, **opts)}
    assert not train & test and not train & ood
    assert len(train) + len(test | ood) <= 200
    assert len(train) > 120  # train covers (nearly) all of its ~160-question pool


def test_heldout_questions_are_distinct_and_space_limit():
    opts = dict(digits=1, operands=(2,))
    recs = generate("test", 30, seed=0, **opts)
    assert len({r["question"] for r in recs}) == 30
    with pytest.raises(ValueError, match="n"):
        generate("test", 500, seed=0, max_tries_per_record=20, **opts)


def test_fillers_carry_no_information():
    with_f = generate("train", 300, seed=4, filler_prob=0.5)
    without = generate("train", 300, seed=4, filler_prob=0.0)
    for a, b in zip(with_f, without):
        assert a["question"] == b["question"] and a["answer"] == b["answer"]
        assert b["filler_spans"] == []
        stripped = a["solution"]
        for s, e in reversed(a["filler_spans"]):
            stripped = stripped[:s] + stripped[e + 1 :]  # drop the word and its space
        assert stripped == b["solution"]


def test_filler_rate_and_full_rate():
    recs = generate("train", 3000, seed=2, filler_prob=0.3)
    gaps = sum(r["n_operands"] - 1 for r in recs)
    rate = sum(len(r["filler_spans"]) for r in recs) / gaps
    assert 0.27 < rate < 0.33
    full = generate("test", 100, seed=2, filler_prob=1.0, fillers=("um",))
    for r in full:
        assert len(r["filler_spans"]) == r["n_operands"] - 1
        _check_record(r, fillers=("um",))


def test_solutions_are_short():
    recs = generate("test", 500, seed=0)
    three = [len(r["solution"]) for r in recs if r["n_operands"] == 3]
    assert statistics.mean(three) < 45
    assert max(len(r["solution"]) for r in recs) < 60


def test_digits_bound_operands():
    for r in generate("test", 100, seed=0, digits=3):
        nums = [int(x) for x in re.findall(r"\d+", r["question"])]
        assert all(0 <= x < 1000 for x in nums)
    assert any(x >= 100 for r in generate("test", 100, seed=0, digits=3) for x in map(int, re.findall(r"\d+", r["question"])))


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(digits=0), "digits"),
        (dict(operators=()), "operators"),
        (dict(operators=("+", "/")), "operators"),
        (dict(filler_prob=1.5), "filler_prob"),
        (dict(long_share=-0.1), "long_share"),
        (dict(operands=(1, 2)), "operands"),
        (dict(ood_operands=1), "ood_operands"),
        (dict(fillers=("so", "4x")), "fillers"),
        (dict(test_share=0.0), "test_share"),
    ],
)
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        generate("train", 3, seed=0, **kwargs)


def test_bad_split_and_unknown_option():
    with pytest.raises(ValueError, match="split"):
        generate("dev", 3, seed=0)
    with pytest.raises(TypeError, match="num_digits"):
        generate("train", 3, seed=0, num_digits=2)
    with pytest.raises(ValueError, match="n"):
        generate("train", -1, seed=0)


def test_corrupt_steps_hand_example_continues_consistently():
    import random

    from oar.data.synthetic import ERROR_OFFSETS, corrupt_steps

    steps, wrong = corrupt_steps([2, 3, 4], ["+", "-"], 1.0, random.Random(0))
    assert wrong == [0, 1]
    (a0, _, b0, c0), (a1, op1, b1, c1) = steps
    assert (a0, b0) == (2, 3) and c0 - 5 in ERROR_OFFSETS
    assert a1 == c0 and op1 == "-" and b1 == 4 and c1 - (c0 - 4) in ERROR_OFFSETS  # builds on the wrong value
    assert corrupt_steps([2, 3, 4], ["+", "*"], 0.0, random.Random(0)) == (solve_steps([2, 3, 4], ["+", "*"]), [])


def test_demo_errors_only_in_train_at_the_rate_and_questions_unchanged():
    clean = generate("train", 3000, seed=5, digits=1)
    noisy = generate("train", 3000, seed=5, digits=1, demo_error_rate=0.3)
    assert [r["question"] for r in clean] == [r["question"] for r in noisy]
    assert [r["answer"] for r in clean] == [r["answer"] for r in noisy]  # rewards use the true answer
    n_steps = sum(r["n_operands"] - 1 for r in noisy)
    n_wrong = sum(len(r["demo_errors"]) for r in noisy)
    assert abs(n_wrong / n_steps - 0.3) < 0.03
    boxed_wrong = sum(extract_boxed(r["solution"]) != r["answer"] for r in noisy)
    assert boxed_wrong > 0.3 * len(noisy)
    for r in noisy[:300]:  # the wrong steps are the listed ones, and each step builds on the written value
        written = [(int(a), op, int(b), int(c)) for a, op, b, c in re.findall(r"(-?\d+)([+-])(\d+)=(-?\d+)", r["solution"])]
        assert len(written) == r["n_operands"] - 1
        off = [k for k, (a, op, b, c) in enumerate(written) if c != (a + b if op == "+" else a - b)]
        assert off == r["demo_errors"]
        assert all(written[k + 1][0] == written[k][3] for k in range(len(written) - 1))
        assert extract_boxed(r["solution"]) == str(written[-1][3])
    for split in ("test", "ood"):
        assert all(not r["demo_errors"] for r in generate(split, 200, seed=5, digits=1, demo_error_rate=0.3))
        assert all(extract_boxed(r["solution"]) == r["answer"] for r in generate(split, 200, seed=5, digits=1, demo_error_rate=0.3))
