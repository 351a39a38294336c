"""docs/adding-a-method.md, walked as written in a copy of the repository: the estimator file and the
config from its blocks, its commands as they are printed (the one command that trains and compares,
the dry run after an edit), and what it says appears where: the method's row and interval in
``main.md``, the footer naming the estimator's source, and after the edit exactly the method's
trainings and evaluations (and the report) planned, the GRPO runs untouched, the old runs kept.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, copy_repository

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]

DOC = ROOT / "docs" / "adding-a-method.md"


def sections() -> dict[str, str]:
    """The doc's ``## N. title`` sections by number (``"1"`` ...), each its text."""
    text = DOC.read_text()
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    out = {}
    for i in range(1, len(parts), 2):
        m = re.match(r"(\d+)\. ", parts[i])
        if m:
            out[m.group(1)] = parts[i + 1]
    return out


def blocks(section: str, lang: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", section, re.S | re.M)]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # the copy's workflow puts its own src/ first
    return env


def _sh(cmd: str, cwd: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _planned_jobs(dry_run_output: str) -> list[tuple[str, dict[str, str]]]:
    """``(rule, wildcards)`` of every job a ``snakemake -n`` output lists."""
    jobs = []
    for m in re.finditer(r"^(?:local)?rule (\w+):\n(.*?)(?=^\S|\Z)", dry_run_output, re.S | re.M):
        w = re.search(r"^\s+wildcards: (.*)$", m.group(2), re.M)
        wild = dict(kv.split("=", 1) for kv in w.group(1).split(", ")) if w else {}
        jobs.append((m.group(1), wild))
    return jobs


def test_the_walk_runs_as_written_and_an_edit_reruns_exactly_its_runs(tmp_path):
    s = sections()
    assert set(s) >= {"1", "2", "3", "4", "5"}
    repo = copy_repository(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], cwd=repo, check=True)

    # 1. the estimator, in the file the section names (the repository root)
    module = re.search(r"`(\w+\.py)`", s["1"]).group(1)
    (repo / module).write_text(blocks(s["1"], "python")[0])
    # 2. the config, at the path the section names, then the check it shows
    config = re.search(r"`(config/\w+\.yaml)`", s["2"]).group(1)
    (repo / config).write_text(blocks(s["2"], "yaml")[0])
    (methods_cmd,) = blocks(s["2"], "bash")
    out = _sh(methods_cmd.strip(), repo).stdout
    assert "late_credit" in out and "credit=my_credit:my_fn" in out

    # 3. the one command
    (train_cmd,) = blocks(s["3"], "bash")
    _sh(train_cmd.strip(), repo)
    name = re.search(r"^name: (\w+)", (repo / config).read_text(), re.M).group(1)
    main_md = (repo / "results" / name / "tables" / "main.md").read_text()
    # 4. where it appears: the row, its interval over the 2 seeds, the footer naming the source
    diff_section = main_md.split("### Difference from grpo (points), 95% interval over training seeds", 1)[1]
    row = next(ln for ln in diff_section.splitlines() if ln.startswith("| late_credit"))
    assert re.search(r"[-+]\d+\.\d \[[-+]\d+\.\d, [-+]\d+\.\d\]", row), row
    assert f"results/{name}/tables/main.md" in s["4"]  # the doc names the file it was read from
    footer = main_md.rstrip().splitlines()[-1]
    assert re.search(r"user estimator source: my_credit:my_fn sha256 [0-9a-f]{16} \(my_credit\.py untracked\) x 2",
                     footer), footer
    store_runs = repo / "results" / "store" / "runs"
    before = {p.name for p in store_runs.iterdir()}
    grpo_summary = repo / "results" / name / "grpo" / "seed0" / "train_summary.json"
    grpo_mtime = grpo_summary.stat().st_mtime_ns

    # 5. the edit the section shows, in the file, then the dry run: exactly the method's runs
    (edit,) = blocks(s["5"], "python")
    edit_line = edit.rstrip("\n")
    lines = (repo / module).read_text().splitlines()
    (old,) = difflib.get_close_matches(edit_line, lines, n=1, cutoff=0.6)
    assert old != edit_line
    (repo / module).write_text("\n".join(edit_line if ln == old else ln for ln in lines) + "\n")
    (dry_cmd,) = blocks(s["5"], "bash")
    jobs = _planned_jobs(_sh(dry_cmd.strip(), repo).stdout)
    trained = sorted((w.get("method"), w.get("seed")) for r, w in jobs if r == "train")
    evaluated = sorted((w.get("method"), w.get("seed")) for r, w in jobs if r == "evaluate")
    assert trained == [("late_credit", "0"), ("late_credit", "1")], jobs
    assert evaluated == trained, jobs
    assert {r for r, _ in jobs} <= {"train", "evaluate", "report", "all", "plan", "link_views"}, jobs
    assert not any(w.get("method") == "grpo" for _, w in jobs)

    # and the same command as step 3 reruns them: new store entries beside the old, GRPO untouched
    _sh(train_cmd.strip(), repo)
    after = {p.name for p in store_runs.iterdir()}
    assert before < after and all(n.startswith("late_credit") for n in after - before)
    assert grpo_summary.stat().st_mtime_ns == grpo_mtime
    footer2 = (repo / "results" / name / "tables" / "main.md").read_text().rstrip().splitlines()[-1]
    assert footer2 != footer and "my_credit:my_fn sha256" in footer2
