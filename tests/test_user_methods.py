"""Methods from the user's own code (issue 30, failure 5 and item 6).

- a built-in estimator module that fails to import fails loudly when the config is loaded (``oar
  methods``, ``oar plan``, Snakemake's parse), not as an unknown estimator inside a training job;
- ``credit: module:function`` (or an ``oar.estimators`` entry point) names an estimator of the user's
  own code: imported, checked and registered when the config is loaded, its options its keyword
  parameters; every problem is one line naming the config key, exit 2;
- README's "Adding a method": the estimator below, in a file outside src/, trains for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, one_error_line, run_cli, small_overrides

CONFIG = ROOT / "config" / "config.yaml"
SRC = ROOT / "src"

#: The estimator of docs/adding-a-method.md (as ``oartest_credit.py``: a name no user module has).
README_ESTIMATOR = '''\
from oar.credit import CreditBatch, CreditResult
from oar.credit.advantages import broadcast_seq, grpo_advantages


def my_fn(batch: CreditBatch, *, norm_by_std: bool = True, late: float = 1.0) -> CreditResult:
    """GRPO's advantage on every token, later tokens of a response weighted up to `late` times more."""
    a = grpo_advantages(batch.rewards, batch.group_ids, norm_by_std=norm_by_std)   # (B,)
    mask = batch.response_mask.float()                                           # (B, T)
    pos = (mask.cumsum(1) - 1).clamp(min=0) / (mask.sum(1, keepdim=True) - 1).clamp(min=1)  # 0 .. 1
    w = (1 + (late - 1) * pos) * mask                                            # (B, T)
    w = w * mask.sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1e-8)   # mean 1 per response
    return CreditResult(token_advantages=broadcast_seq(a, batch.response_mask) * w, seq_advantages=a, weights=w)
'''

#: README "Adding a method": the config entry.
README_METHOD = {"late_credit": {"recipe": "grpo", "credit": "oartest_credit:my_fn", "late": 2.0}}

#: Appended to the README estimator in the training test: records each call (to $OARTEST_CREDIT_LOG).
RECORDER = '''
import json as _json, os as _os

_readme_fn = my_fn


def my_fn(batch: CreditBatch, *, norm_by_std: bool = True, late: float = 1.0) -> CreditResult:
    out = _readme_fn(batch, norm_by_std=norm_by_std, late=late)
    with open(_os.environ["OARTEST_CREDIT_LOG"], "a") as f:
        f.write(_json.dumps({"late": late, "norm_by_std": norm_by_std, "shape": list(batch.response_ids.shape),
                             "adv_shape": list(out.token_advantages.shape),
                             "w_min": float(out.weights[batch.response_mask.bool()].min()),
                             "w_max": float(out.weights[batch.response_mask.bool()].max())}) + "\\n")
    return out
'''


def _config(tmp_path: Path, methods: dict, name: str = "config.yaml") -> Path:
    """config/config.yaml shrunk to a few seconds (helpers.small_overrides) with ``methods`` as its
    only methods, written to ``tmp_path/name``."""
    from oar.config.source import deep_merge

    cfg = deep_merge(yaml.safe_load(CONFIG.read_text()), small_overrides(tmp_path, train={"steps": 2}))
    cfg["methods"] = methods
    cfg.pop("only_methods", None)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory, ``sys.path`` and the user modules of a test restored
    after it (every test writes its own ``oartest_credit``)."""
    monkeypatch.chdir(tmp_path)
    # the repository root is no import location here: a user's own module there (docs/adding-a-method.md
    # puts one in the working directory) must not stand in for a test's
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(ROOT))])
    import oar.credit as credit

    for mod in [m for m in sys.modules if m == "oartest_credit" or m.startswith(("oartest_credit.", "oartest_pkg"))]:
        monkeypatch.delitem(sys.modules, mod)
    # the registry as it was: a user method registered here must not reach another test of this process
    credit.list_estimators()  # the built-ins registered first: restoring must not drop them
    registered = dict(credit._REGISTRY)
    yield tmp_path
    for mod in [m for m in sys.modules if m == "oartest_credit" or m.startswith(("oartest_credit.", "oartest_pkg"))]:
        del sys.modules[mod]
    credit._REGISTRY.clear()
    credit._REGISTRY.update(registered)




def one_error_line(err: str, command: str = "methods") -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"oar {command}: error: "), err
    return lines[0]


# ------------------------------------------------------------- failure 5: built-in imports are loud
_BROKEN = """
import importlib.abc
import sys


class Broken(importlib.abc.MetaPathFinder):  # a built-in estimator module whose import fails
    def find_spec(self, name, path, target=None):
        if name == "oar.credit.mc_value":
            raise ImportError("oar.credit.mc_value: No module named 'some_dependency' (injected)")


sys.meta_path.insert(0, Broken())
which, config = sys.argv[1], sys.argv[2]
if which == "oar methods":
    from oar.cli import main
    rc = main(["methods", "--config", config])
    print("EXIT", rc)
elif which == "load_config":  # what the Snakefile (snakemake -n) and oar plan call first
    from oar.config.load import load_config
    load_config(config)
else:  # the trainer's lookup
    from oar.credit import get_estimator
    get_estimator("grpo")
print("CONTINUED")
"""


@pytest.mark.parametrize("which", ["oar methods", "load_config", "get_estimator"])
def test_a_builtin_estimator_module_that_does_not_import_fails_loudly(tmp_path, which):
    # the old _load_builtin swallowed the ImportError: `oar methods`, `oar plan` and `snakemake -n`
    # passed and the training job failed with "unknown estimator 'mc_value'"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _BROKEN, which, str(CONFIG)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert r.returncode != 0 and "CONTINUED" not in r.stdout, (r.stdout, r.stderr)
    assert "ImportError: oar.credit.mc_value: No module named 'some_dependency'" in r.stderr, r.stderr


def test_builtin_estimators_all_registered_and_in_the_schema():
    from oar.config.validate import schema
    from oar.credit import list_estimators

    builtin = set(schema()["$defs"]["credit_options"]) - {"description", "none"}
    assert builtin | {"grpo", "drgrpo"} <= set(list_estimators())


# ------------------------------------------------------------------- item 6: module:function credit
def test_user_estimator_resolves_registers_and_lists(user_dir, capsys):
    from oar.config.load import load_config
    from oar.config.methods import resolve_method
    from oar.credit import estimator_needs_model, get_estimator, list_estimators

    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR)
    path = _config(user_dir, README_METHOD)
    m = resolve_method(load_config(path), "late_credit")
    assert (m.credit, m.estimator, m.credit_options) == ("oartest_credit:my_fn", "oartest_credit:my_fn", {"late": 2.0})
    assert m.estimator_options() == {"norm_by_std": True, "late": 2.0}
    assert get_estimator("oartest_credit:my_fn") is sys.modules["oartest_credit"].my_fn
    assert "oartest_credit:my_fn" in list_estimators() and not estimator_needs_model("oartest_credit:my_fn")
    rc, out, err = run_cli(["methods", "--config", str(path)], capsys)
    assert rc == 0 and "credit=oartest_credit:my_fn" in out and "'late': 2.0" in out, err


def test_user_estimator_unknown_option_is_refused_at_load_naming_the_key(user_dir, capsys):
    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR)
    path = _config(user_dir, {"late_credit": {**README_METHOD["late_credit"], "lat": 3.0}})
    rc, _, err = run_cli(["methods", "--config", str(path)], capsys)
    line = one_error_line(err)
    assert rc == 2
    assert "key methods.late_credit.lat: not an option of recipe 'grpo' or credit 'oartest_credit:my_fn'" in line
    assert "'late'" in line  # the allowed options include the function's keyword parameters


_BAD = {
    "no module": ("nosuchmod:my_fn", None, "key methods.m.credit: cannot import module 'nosuchmod'"),
    "no attribute": ("oartest_credit:my_fun", README_ESTIMATOR, "key methods.m.credit: 'oartest_credit' ("),
    "raises on import": ("oartest_credit:my_fn", "x = undefined_name\n",
                         "key methods.m.credit: importing module 'oartest_credit' failed: NameError:"),
    "syntax error": ("oartest_credit:my_fn", "def my_fn(:\n", "importing module 'oartest_credit' failed: SyntaxError:"),
    "not callable": ("oartest_credit:my_fn", "my_fn = 3\n", "key methods.m.credit: 'oartest_credit:my_fn' ("),
    "no batch argument": ("oartest_credit:my_fn", "def my_fn(*, late=1.0): pass\n", "takes no positional batch argument"),
    "malformed": ("my credit:fn", None, "key methods.m.credit: 'my credit:fn' is not a reference"),
    "unknown name": ("mycredt", None, "key methods.m.credit: unknown credit 'mycredt'"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_user_estimator_problems_are_one_line_exit_2_naming_the_key(user_dir, capsys, case):
    credit, module, expected = _BAD[case]
    if module is not None:
        (user_dir / "oartest_credit.py").write_text(module)
    path = _config(user_dir, {"m": {"recipe": "grpo", "credit": credit}})
    rc, _, err = run_cli(["methods", "--config", str(path)], capsys)
    assert rc == 2 and expected in one_error_line(err), err


def test_user_estimator_option_types_and_required_options(user_dir, capsys):
    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR + "\n\ndef strict(batch, *, k: int, name: str = 'a'):\n"
                                          "    return my_fn(batch)\n")
    wrong = _config(user_dir, {"m": {"recipe": "grpo", "credit": "oartest_credit:my_fn", "late": "big"}})
    rc, _, err = run_cli(["methods", "--config", str(wrong)], capsys)
    assert rc == 2 and "key methods.m.late: 'big' is not of type 'number'" in one_error_line(err)
    missing = _config(user_dir, {"m": {"recipe": "grpo", "credit": "oartest_credit:strict"}})
    rc, _, err = run_cli(["methods", "--config", str(missing)], capsys)
    assert rc == 2 and "key methods.m.credit: 'oartest_credit:strict' (" in one_error_line(err)
    assert "needs option(s) ['k']" in err
    from oar.config.load import load_config

    ok = load_config(_config(user_dir, {"m": {"recipe": "grpo", "credit": "oartest_credit:strict", "k": 2}}))
    # strict takes no norm_by_std: the recipe's is not passed; an int is a float, a bool is not an int
    from oar.config.methods import resolve_method

    assert resolve_method(ok, "m").estimator_options() == {"k": 2}
    bool_k = _config(user_dir, {"m": {"recipe": "grpo", "credit": "oartest_credit:strict", "k": True}})
    rc, _, err = run_cli(["methods", "--config", str(bool_k)], capsys)
    assert rc == 2 and "key methods.m.k: True is not of type 'integer'" in err


def test_user_estimator_with_var_keywords_takes_any_option_and_keeps_its_flags(user_dir):
    from oar.config.load import load_config
    from oar.config.methods import resolve_method
    from oar.credit import estimator_needs_model

    pkg = user_dir / "oartest_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "credit.py").write_text(README_ESTIMATOR + (
        "\n\nfrom oar.credit import register_estimator\n\n\n"
        "@register_estimator('oartest_pkg_any', needs_model=True)\n"
        "def any_options(batch, **options):\n    return my_fn(batch)\n"))
    cfg = load_config(_config(user_dir, {"m": {"recipe": "grpo", "credit": "oartest_pkg.credit:any_options",
                                                "whatever": [1, 2], "kl_coef": 0.0}}))
    m = resolve_method(cfg, "m")
    # **options: every key that is not a recipe key is the estimator's; norm_by_std is passed
    assert m.credit_options == {"whatever": [1, 2]} and m.recipe["kl_coef"] == 0.0
    assert m.estimator_options() == {"norm_by_std": True, "whatever": [1, 2]}
    assert estimator_needs_model("oartest_pkg.credit:any_options")  # register_estimator's flag carried


def test_user_estimator_from_an_entry_point(user_dir):
    from oar.config.load import load_config
    from oar.config.methods import resolve_method
    from oar.credit import get_estimator

    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR)
    dist = user_dir / "site" / "oar_user_ep-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: oar-user-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[oar.estimators]\nlate_credit = oartest_credit:my_fn\n")
    sys.path.append(str(dist.parent))
    m = resolve_method(load_config(_config(user_dir, {"m": {"recipe": "grpo", "credit": "late_credit", "late": 3.0}})),
                       "m")
    assert (m.estimator, m.credit_options) == ("late_credit", {"late": 3.0})
    assert get_estimator("late_credit") is sys.modules["oartest_credit"].my_fn


def test_schema_accepts_the_module_attr_form(user_dir):
    import jsonschema

    from oar.config.load import load_config
    from oar.config.validate import schema

    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR)
    cfg = load_config(_config(user_dir, README_METHOD))
    jsonschema.Draft202012Validator(schema()).validate(cfg)  # what Snakemake's validate() checks
    assert cfg["methods"]["late_credit"]["credit"] == "oartest_credit:my_fn"


_WITHOUT_TORCH = """
import json, sys
for m in ("torch", "transformers", "accelerate", "mlflow", "vllm", "safetensors", "math_verify"):
    sys.modules[m] = None  # Snakemake's own process under --use-conda: none of the rules' software
from oar.config.load import load_config
from oar.config.methods import resolve_method
from oar.config.source import ConfigError
try:
    m = resolve_method(load_config(sys.argv[1]), sys.argv[2])
    print(json.dumps({"options": m.estimator_options()}))
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
print(json.dumps({"imported": sorted(k for k in sys.modules if k.startswith(("oartest_credit", "oartest_pkg", "oar.credit.")))}))
"""

_STATIC = {  # (the module, the method) -> what loading the config in a process without torch says
    "README": (README_ESTIMATOR, README_METHOD["late_credit"], {"norm_by_std": True, "late": 2.0}),
    "unknown option": (README_ESTIMATOR, {**README_METHOD["late_credit"], "lat": 1.0},
                       "key methods.m.lat: not an option of recipe 'grpo' or credit 'oartest_credit:my_fn'"),
    "wrong type": (README_ESTIMATOR, {**README_METHOD["late_credit"], "late": "x"},
                   "key methods.m.late: 'x' is not of type 'number'"),
    "no module": (None, {"recipe": "grpo", "credit": "nosuchmod:f"}, "key methods.m.credit: cannot import module"),
    "no attribute": (README_ESTIMATOR, {"recipe": "grpo", "credit": "oartest_credit:my_fun"},
                     "has no attribute 'my_fun'; define it there or fix the name after ':' (functions defined in "
                     "the module: ['my_fn'])"),
    "syntax error": ("def my_fn(:\n", {"recipe": "grpo", "credit": "oartest_credit:my_fn"},
                     "importing module 'oartest_credit' failed: SyntaxError:"),
    "required option": ("def my_fn(batch, *, k: int):\n    pass\n", {"recipe": "grpo", "credit": "oartest_credit:my_fn"},
                        "needs option(s) ['k']"),
    "**options": ("def my_fn(batch, **options):\n    pass\n", {"recipe": "grpo", "credit": "oartest_credit:my_fn", "z": 1},
                  {"norm_by_std": True, "z": 1}),
    "imported name": ("from os.path import join as my_fn\n", {"recipe": "grpo", "credit": "oartest_credit:my_fn", "z": 1},
                      {"norm_by_std": True, "z": 1}),  # not a def: left to the jobs
}


@pytest.mark.parametrize("case", list(_STATIC))
def test_user_estimator_checked_from_its_source_without_torch(tmp_path, case):
    # Snakemake plans the DAG without torch (tests/test_envs.py): the module is found and its source
    # read, not run (it imports oar.credit's estimators, hence torch); the same one-line errors
    module, method, expected = _STATIC[case]
    if module is not None:
        (tmp_path / "oartest_credit.py").write_text(module)
    path = _config(tmp_path, {"m": method})
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(path), "m"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    result, imported = (json.loads(line) for line in r.stdout.splitlines())
    if isinstance(expected, dict):
        assert result == {"options": expected}
    else:
        assert "error" in result and expected in result["error"] and "\n" not in result["error"], result
    assert imported["imported"] == ["oar.credit.user"]  # no estimator module ran, the user's neither


@pytest.mark.parametrize("where", ["working directory", "user PYTHONPATH"])
def test_user_module_is_found_inside_a_rule_job(tmp_path, where):
    # a rule runs `{oar_env(src)} python -m oar.cli ...` in the workflow's working directory
    # (oar.pipeline.launch.oar_env appends the user's PYTHONPATH after the repository's src/)
    from oar.pipeline.launch import oar_env

    home = tmp_path / ("lib" if where == "user PYTHONPATH" else "")
    home.mkdir(exist_ok=True)
    (home / "oartest_credit.py").write_text(README_ESTIMATOR)
    path = _config(tmp_path, README_METHOD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    if where == "user PYTHONPATH":
        env["PYTHONPATH"] = str(home)
    r = subprocess.run(["bash", "-c", f"{oar_env(str(SRC))} python -m oar.cli methods --config {path}"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "credit=oartest_credit:my_fn" in r.stdout, r.stderr


# ------------------------------------------------------------ README "Adding a method", trained for real
@pytest.mark.slow
def test_readme_adding_a_method_trains_with_the_user_estimator(tmp_path):
    (tmp_path / "oartest_credit.py").write_text(README_ESTIMATOR + RECORDER)  # outside src/, in the run's folder
    path = _config(tmp_path, README_METHOD)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "OARTEST_CREDIT_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "oar.cli", "train", "--config", str(path), "--method", "late_credit",
                        "--seed", "0", "--output", "run", "--steps", "2", "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2  # one call per step
    for c in calls:
        assert c["late"] == 2.0 and c["norm_by_std"] is True and c["adv_shape"] == c["shape"]
        assert c["w_min"] < 1 < c["w_max"] <= 2  # the weights ramp along each response
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["ess_ratio"] < 1 for row in rows)  # the metrics saw the user's weights, not GRPO's
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["method"] == "late_credit"


# ------------------------------------------------------------- an edit of the source reruns its runs
def test_the_estimator_source_is_part_of_its_runs_identity(user_dir):
    """The estimator's module and the modules of the user's tree it imports (not oar's, not installed
    ones) are hashed; editing either changes the run key of the methods that use it, and only theirs;
    the source read without running it (Snakemake's process under --use-conda) hashes the same."""
    from oar.config.load import load_config
    from oar.config.methods import resolve_methods
    from oar.credit.user import estimator_source
    from oar.config.identity import run_key

    (user_dir / "oartest_helpers.py").write_text("SCALE = 2.0\n")
    (user_dir / "oartest_credit.py").write_text("from oartest_helpers import SCALE\nimport json\n" + README_ESTIMATOR)
    path = _config(user_dir, {**README_METHOD, "grpo": {"recipe": "grpo"}})

    def keys() -> tuple[dict, dict]:
        for mod in [m for m in sys.modules if m.startswith("oartest_")]:
            del sys.modules[mod]
        cfg = load_config(path)
        methods = resolve_methods(cfg)
        return {m: run_key(cfg, r, sft=True) for m, r in methods.items()}, methods["late_credit"].credit_source

    before, src = keys()
    assert src["files"] == ["oartest_credit.py", "oartest_helpers.py"] and src["root"] == str(user_dir.resolve())
    assert len(src["sha256"]) == 16 and set(src["git"]) == set(src["files"])
    assert resolve_methods(load_config(path))["grpo"].credit_source is None
    static = estimator_source("oartest_credit:my_fn", "oartest_credit")
    assert static.sha256 == src["sha256"]
    (user_dir / "oartest_helpers.py").write_text("SCALE = 3.0\n")  # an imported helper of the user's tree
    after_helper, src2 = keys()
    assert src2["sha256"] != src["sha256"]
    assert after_helper["late_credit"] != before["late_credit"] and after_helper["grpo"] == before["grpo"]
    body = (user_dir / "oartest_credit.py").read_text().replace("later tokens", "the later tokens")
    (user_dir / "oartest_credit.py").write_text(body)  # the function's own module
    after_body, _ = keys()
    assert after_body["late_credit"] not in (before["late_credit"], after_helper["late_credit"])
    assert after_body["grpo"] == before["grpo"]


def test_the_source_is_in_the_provenance_and_its_git_state_is_named(user_dir):
    from oar.core.provenance import describe, path_git_state, provenance

    (user_dir / "oartest_credit.py").write_text(README_ESTIMATOR)
    assert path_git_state(user_dir / "oartest_credit.py") is None  # no checkout holds it
    subprocess.run(["git", "init", "-q", str(user_dir)], check=True)
    assert path_git_state(user_dir / "oartest_credit.py") == "untracked"
    from oar.credit.user import estimator_source

    src = estimator_source("oartest_credit:my_fn", "oartest_credit").as_dict()
    assert src["git"] == {"oartest_credit.py": "untracked"}
    prov = provenance(credit_source=src)
    line = describe([prov, prov])
    assert f"user estimator source: oartest_credit:my_fn sha256 {src['sha256']} (oartest_credit.py untracked) x 2" in line
    assert "user estimator" not in describe([provenance()])
