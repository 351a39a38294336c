"""Tests for the benchmark loaders (oar.data.benchmarks) and the long-response case of the
step-time benchmarks (benchmarks/common.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from oar.data import synthetic
from oar.data.benchmarks import BENCHMARK_NAMES, HubUnavailableError, load_benchmark

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"{DATA} not present")

# Record counts from /work/shared/data/SOURCES.md.
COUNTS = {
    "aime24": 30,
    "amc23": 40,
    "math500": 500,
    "minerva_math": 272,
    "olympiadbench": 675,
    "gsm8k": 1319,
}


def _check_common(recs: list[dict], name: str) -> None:
    ids = [r["id"] for r in recs]
    assert len(set(ids)) == len(ids)
    for r in recs:
        assert r["source"] == name
        assert r["id"].startswith(f"{name}-")
        for k in ("id", "question", "answer"):
            assert isinstance(r[k], str) and r[k].strip(), (r["id"], k)


@needs_data
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_real_counts_and_fields(name):
    recs = load_benchmark(name, DATA / name)
    assert len(recs) == COUNTS[name]
    _check_common(recs, name)


@needs_data
def test_real_spot_values():
    aime = {r["id"]: r for r in load_benchmark("aime24", DATA / "aime24" / "test.jsonl")}
    assert aime["aime24-60"]["answer"] == "204"
    assert aime["aime24-60"]["question"].startswith("Every morning Aya goes for a $9$-kilometer-long walk")

    amc = load_benchmark("amc23", DATA / "amc23")
    assert amc[0]["id"] == "amc23-0" and amc[0]["answer"] == "27"  # 27.0 in the file
    assert amc[15]["answer"] == "-1"  # -1.0 in the file
    assert all("." not in r["answer"] for r in amc)  # all 40 AMC answers are integers

    m500 = load_benchmark("math500", DATA / "math500")
    assert m500[0]["id"] == "math500-test/precalculus/807.json"
    assert m500[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"

    minerva = load_benchmark("minerva_math", DATA / "minerva_math")
    assert minerva[0]["id"] == "minerva_math-0" and minerva[0]["answer"] == "1.6"

    olym = load_benchmark("olympiadbench", DATA / "olympiadbench")
    assert olym[0]["id"] == "olympiadbench-1606" and olym[0]["answer"] == "2"
    assert all(r["answers"] and ", ".join(r["answers"]) == r["answer"] for r in olym)

    gsm = load_benchmark("gsm8k", DATA / "gsm8k")
    assert gsm[0]["id"] == "gsm8k-0" and gsm[0]["answer"] == "18"
    assert gsm[0]["question"].startswith("Janet")
    assert all("," not in r["answer"] and "#" not in r["answer"] for r in gsm)
    raw = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()]
    i = next(i for i, r in enumerate(raw) if r["answer"].endswith("#### 2,125"))
    assert gsm[i]["answer"] == "2125"
    assert len(load_benchmark("gsm8k", DATA / "gsm8k" / "train.jsonl")) == 7473


@needs_data
def test_real_math_train_levels():
    # SOURCES.md: levels 3/4/5 hold 1584/1681/2298 = 5563 records. Four records have an empty or
    # null answer (file lines 887 and 1010 at level 3, lines 5329 and 5331 at level 5); they are
    # dropped, so 5563 - 4 = 5559 remain. Over all levels: 7474 - 4 = 7470.
    recs = load_benchmark("math_train", DATA / "math_train", levels=[3, 4, 5])
    assert len(recs) == 5559
    assert {r["level"] for r in recs} == {3, 4, 5}
    _check_common(recs, "math_train")
    assert "math_train-886" not in {r["id"] for r in recs}  # null answer, level 3
    assert len(load_benchmark("math_train", DATA / "math_train")) == 7470
    assert len(load_benchmark("math_train", DATA / "math_train", levels=[1])) == 564
    assert len(load_benchmark("math_train", DATA / "math_train", levels=[0])) == 2  # MATH "Level ?"


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_malformed_line_names_file_and_line(tmp_path):
    p = _write(tmp_path / "b.jsonl", ['{"problem": "1+1?", "answer": "2"}', '{"problem": "oops"', ""])
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}:2"):
        load_benchmark("math500", p)


def test_missing_key_names_file_line_and_key(tmp_path):
    # a blank line 2 must not shift the reported line number
    p = _write(tmp_path / "b.jsonl", ['{"problem": "1+1?", "answer": "2"}', "", '{"problem": "2+2?"}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}:3.*'answer'"):
        load_benchmark("math500", p)
    q = _write(tmp_path / "c.jsonl", ['{"question": "1+1?", "answer": "2 #### 2"}', '{"answer": "#### 4"}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(q))}:2.*'question'"):
        load_benchmark("gsm8k", q)


def test_bad_answers_are_rejected(tmp_path):
    p = _write(tmp_path / "m.jsonl", ['{"problem": "x?", "solution": "it is 3"}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}:1.*boxed"):
        load_benchmark("minerva_math", p)
    g = _write(tmp_path / "g.jsonl", ['{"question": "x?", "answer": "3"}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(g))}:1.*####"):
        load_benchmark("gsm8k", g)
    e = _write(tmp_path / "e.jsonl", ['{"problem": "x?", "answer": " "}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(e))}:1.*empty"):
        load_benchmark("aime24", e)
    o = _write(tmp_path / "o.jsonl", ['{"question": "x?", "final_answer": []}'])
    with pytest.raises(ValueError, match=rf"{re.escape(str(o))}:1.*final_answer"):
        load_benchmark("olympiadbench", o)


def test_small_files_each_benchmark(tmp_path):
    lines = {
        "minerva_math": ['{"problem": "p", "solution": "so \\\\boxed{\\\\frac{1}{2}} cm", "idx": 7}'],
        "olympiadbench": ['{"id": 5, "question": "q", "final_answer": ["$3$", "$4$"]}'],
        "gsm8k": ['{"question": "q", "answer": "a\\n#### 1,234,567"}'],
        "amc23": ['{"id": 1, "problem": "p", "answer": 2.5}'],
        "aime24": ['{"id": 9, "question": "q", "answer": 33}'],
    }
    got = {n: load_benchmark(n, _write(tmp_path / f"{n}.jsonl", ls))[0] for n, ls in lines.items()}
    assert got["minerva_math"] == {"id": "minerva_math-7", "question": "p", "answer": "\\frac{1}{2}", "source": "minerva_math"}
    assert got["olympiadbench"]["answer"] == "$3$, $4$" and got["olympiadbench"]["answers"] == ["$3$", "$4$"]
    assert got["gsm8k"]["answer"] == "1234567" and got["gsm8k"]["id"] == "gsm8k-0"
    assert got["amc23"]["answer"] == "2.5"
    assert got["aime24"]["answer"] == "33" and got["aime24"]["question"] == "q"


def test_math_train_filter_and_drop(tmp_path):
    p = _write(
        tmp_path / "t.jsonl",
        [
            '{"problem": "a", "answer": "1", "difficulty": 2.0}',
            '{"problem": "b", "answer": "2", "difficulty": 3.0}',
            '{"problem": "c", "answer": null, "difficulty": 4.0}',
            '{"problem": "d", "answer": "", "difficulty": 5.0}',
            '{"problem": "e", "answer": "5", "difficulty": 5.0}',
        ],
    )
    recs = load_benchmark("math_train", p, levels=[3, 4, 5])
    assert [(r["id"], r["answer"], r["level"]) for r in recs] == [("math_train-1", "2", 3), ("math_train-4", "5", 5)]
    assert [r["id"] for r in load_benchmark("math_train", p)] == ["math_train-0", "math_train-1", "math_train-4"]
    with pytest.raises(ValueError, match="levels"):
        load_benchmark("math_train", p, levels="345")


def test_json_array_object_and_parquet(tmp_path):
    recs = [{"problem": "p0", "answer": "1", "unique_id": "u0"}, {"problem": "p1", "answer": "2", "unique_id": "u1"}]
    a = tmp_path / "a.json"
    a.write_text(json.dumps(recs))
    assert [r["id"] for r in load_benchmark("math500", a)] == ["math500-u0", "math500-u1"]
    o = tmp_path / "o.json"
    o.write_text(json.dumps({"x": recs[0], "y": {"problem": "p1"}}))
    with pytest.raises(ValueError, match=r"o.json: record 'y'.*'answer'"):
        load_benchmark("math500", o)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"problem": "p",\n "answer": ]')
    with pytest.raises(ValueError, match=r"bad.json:2"):
        load_benchmark("math500", bad)

    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pq = tmp_path / "o.parquet"
    pd.DataFrame(
        {"id": [3, 4], "question": ["q3", "q4"], "final_answer": [["$1$"], ["$2$", "$5$"]]}
    ).to_parquet(pq)
    out = load_benchmark("olympiadbench", pq)
    assert [(r["id"], r["answer"], r["answers"]) for r in out] == [
        ("olympiadbench-3", "$1$", ["$1$"]),
        ("olympiadbench-4", "$2$, $5$", ["$2$", "$5$"]),
    ]


def test_missing_path_and_unknown_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark("math500", tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="data/nope.jsonl"):
        load_benchmark("math500", "data/nope.jsonl")  # has a slash but a file suffix: not a hub id
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_benchmark("math500", tmp_path)  # folder without the default file
    with pytest.raises(ValueError, match="math500") as e:
        load_benchmark("math5000", tmp_path)
    assert all(n in str(e.value) for n in BENCHMARK_NAMES)
    with pytest.raises(TypeError, match="levels"):
        load_benchmark("math500", tmp_path / "x.jsonl", levels=[3])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_benchmark("math500", tmp_path / "x.csv")


def test_hub_id_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError, match=r"'math500'.*HF_HUB_OFFLINE.*local path"):
        load_benchmark("math500", "HuggingFaceH4/MATH-500")


def test_hub_id_without_datasets(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(HubUnavailableError, match=r"'gsm8k'.*datasets.*local path"):
        load_benchmark("gsm8k", "openai/gsm8k")


def test_synthetic_entry_point():
    opts = dict(operands=[2, 3], long_operands=4, long_share=0.1, ood_operands=4, digits=2,
                operators=["+", "-"], filler_prob=0.3)
    for split in ("train", "test", "ood"):
        got = load_benchmark(f"synthetic-{split}", None, n=20, seed=5, **opts)
        assert got == synthetic.generate(split, 20, seed=5, **opts)
        _check_common(got, f"synthetic-{split}")
    with pytest.raises(TypeError, match="seed"):
        load_benchmark("synthetic-test", None, n=5)
    with pytest.raises(ValueError, match="source"):
        load_benchmark("synthetic-test", "x.jsonl", n=5, seed=0)
    with pytest.raises(TypeError, match="split"):
        load_benchmark("synthetic-test", None, n=5, seed=0, split="train")


# ---- the long-response SmolLM2 benchmark case (benchmarks/common.py, ``--model smollm2_long``)

def _bench_common():
    """``benchmarks/common.py`` as a module (imports only the standard library at load time)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("oar_bench_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_EQ = re.compile(r"(-?\d+)([+\-*])(\(-\d+\)|\d+)=(-?\d+)")


def _true_equations(line: str) -> int:
    """Number of ``a<op>b=c`` equations in ``line``; fails on a false one."""
    found = _EQ.findall(line)
    for a, op, b, c in found:
        x, y = int(a), int(b.strip("()"))
        assert {"+": x + y, "-": x - y, "*": x * y}[op] == int(c), (line, a, op, b, c)
    return len(found)


def test_smollm2_long_sft_targets():
    from oar.reward.answer import extract_boxed

    bc = _bench_common()
    # hand-counted: SmolLM2's tokenizer splits this into 26 tokens (Check, ' ', 3, :, ' ', 6, 5, -,
    # 1, 8, =, 4, 7, ',', ' so', ' ', 4, 7, +, 1, 8, =, 6, 5, ' holds', .), one per digit
    assert bc.token_lower_bound("Check 3: 65-18=47, so 47+18=65 holds.") == 26
    # pieces The, ' answer', ' is', ' \\', boxed, {, 6, 5, }: 9; the tokenizer splits box|ed, 10
    assert bc.token_lower_bound("The answer is \\boxed{65}") == 9
    assert bc.smollm2_long_solution({"solution": "47+18=65. \\boxed{65}", "answer": "65"}, checks=3) == (
        "Let me solve this step by step, then check the result several times.\n47+18=65.\n"
        "Check 1: 65-18=47, so 47+18=65 holds.\nCheck 2: 65-47=18, which agrees.\n"
        "Check 3: 18+47=65, the same result.\nThe answer is \\boxed{65}")

    recs = (synthetic.generate("train", 300, seed=bc.SMOLLM2_SFT_DATA_SEED, **bc.SMOLLM2_SYNTHETIC)
            + synthetic.generate("test", 50, seed=bc.SMOLLM2_SFT_DATA_SEED, **bc.SMOLLM2_SYNTHETIC))
    assert any(r["answer"].startswith("-") for r in recs) and any("+" in r["question"] for r in recs)
    lengths = []
    for r in recs:
        t = bc.smollm2_long_solution(r)
        assert t.endswith(f"\\boxed{{{r['answer']}}}"), t[-40:]
        assert extract_boxed(t) == r["answer"]
        assert t.count("\\boxed{") == 1  # the final answer is the only box: all before it is reasoning
        lines = t.split("\n")
        assert len(lines) == bc.SMOLLM2_LONG_CHECKS + 3
        assert lines[1] == r["solution"][: r["solution"].rindex("\\boxed{")].strip()
        assert all(_true_equations(x) >= 1 for x in lines[1:-1])
        n = bc.token_lower_bound(t)
        assert n >= bc.SMOLLM2_LONG_MIN_TOKENS, (n, t)
        lengths.append(n)
    # a lower bound; the tokenizer measured 268-338 tokens (mean 321, eos included) on 2,000 targets
    assert 280 <= sum(lengths) / len(lengths) <= 340

    # longer problems (three operands, *, negative intermediate values): every restatement is true
    multi = synthetic.generate("train", 100, seed=0, operands=[3], long_share=0.0, digits=2,
                               operators=["+", "-", "*"], filler_prob=0.0)
    assert any("(-" in bc.smollm2_long_solution(r) for r in multi)
    for r in multi:
        t = bc.smollm2_long_solution(r)
        assert extract_boxed(t) == r["answer"]
        assert all(_true_equations(x) >= 1 for x in t.split("\n")[2:-1])
    with pytest.raises(ValueError, match="no boxed answer or no step"):
        bc.smollm2_long_solution({"solution": "no steps here", "answer": "1"})


def test_smollm2_long_overrides(tmp_path):
    bc = _bench_common()
    (tmp_path / "smollm2_hf").mkdir()
    (tmp_path / "smollm2_hf" / "config.json").write_text("{}")  # a converted SmolLM2 in the cache
    short = bc.bench_overrides("smollm2", tmp_path / "w", steps=2, cache=tmp_path)
    long = bc.bench_overrides("smollm2_long", tmp_path / "w", steps=2, cache=tmp_path)
    assert long["rollout"] == {"n": 4, "max_new_tokens": 384, "temperature": bc.SMOLLM2_TEMPERATURE}
    assert short["rollout"]["max_new_tokens"] == 64
    assert (long["train"]["prompts_per_step"], long["train"]["micro_batch_size"]) == (2, 8)
    assert long["task"] == short["task"] and long["model"] == short["model"]  # same prompts, same model
    with pytest.raises(ValueError, match="smollm2_long"):
        bc.bench_overrides("smollm3", tmp_path / "w", steps=2, cache=tmp_path)
    with pytest.raises(ValueError, match="smollm2-long-sft-steps"):
        bc.start_model("smollm2_long", tmp_path, tiny_sft_steps=1, smollm2_sft_steps=1, smollm2_long_sft_steps=0)
