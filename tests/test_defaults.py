"""Each config default exists once, in the schema: the code reads the validated config (or the
schema's section defaults), never a fallback of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from oar.config.validate import schema, section_defaults, validate_config

ROOT = Path(__file__).resolve().parents[1]

#: Modules that read validated config sections; none may carry a `.get("<schema key>", <fallback>)`.
READERS = ["plan/settings.py", "plan/shape.py", "plan/memory.py", "trainer/sft.py", "trainer/sft_stage.py", "tracking/stage_metrics.py", "attribution/settings.py", "plan/terms.py", "evaluate/evaluation.py",
           "report/regimes.py", "attribution/benchmark.py", "report/base.py", "trainer/loop.py", "trainer/strategy.py",
           "pipeline/launch.py", "evaluate/heldout.py", "report/build.py", "report/tables.py", "report/scores.py",
           "report/efficiency.py", "report/learning_curves.py", "pipeline/preflight.py", "models/fetch.py",
           "tracking/stage_runs.py", "core/provenance.py"]


def minimal_config() -> dict:
    """A config with only the required keys: every optional key comes from the schema."""
    return validate_config({"name": "minimal", "model": {"source": "tiny"}, "task": {"kind": "synthetic"},
                            "recipes": {"grpo": {}}, "methods": {"grpo": {"recipe": "grpo", "credit": "none"}}})


def _schema_keys() -> set[str]:
    """Every property name the schema gives a default."""
    keys: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for k, v in (node.get("properties") or {}).items():
                if isinstance(v, dict) and "default" in v:
                    keys.add(k)
                walk(v)
            for v in node.values():
                if isinstance(v, (dict, list)):
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema())
    return keys


@pytest.mark.parametrize("module", READERS)
def test_no_config_fallback_copies(module):
    """`.get("key", default)` on a schema key repeats the schema's default: a second copy that can drift."""
    keys = _schema_keys()
    tree = ast.parse((ROOT / "src" / "oar" / module).read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys
                # not a config: a model's config.json (cfg), an option dict, a table row, a saved summary
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("cfg", "o", "options", "cell",
                                                                                        "row", "entry", "prev", "r", "counts"))):
            found.append(f"line {node.lineno}: .get({node.args[0].value!r}, ...)")
    assert not found, f"src/oar/{module}: {found}"


def test_the_code_runs_on_the_schema_defaults_alone():
    """A config that omits every optional key: the readers find every key they need, and the values
    they use are the schema's."""
    from oar.attribution import AttributionSettings
    from oar.attribution.specs import signal_specs
    from oar.plan import PlanSettings, model_shape
    from oar.plan.settings import memory_gb
    from oar.report import REPORT_DEFAULTS

    cfg = minimal_config()
    assert REPORT_DEFAULTS == cfg["report"] == section_defaults("report")
    settings = AttributionSettings.from_config(cfg)
    attr = section_defaults("attribution")
    assert settings.n_sampled == attr["n_sampled"] and settings.top_k == tuple(attr["top_k"])
    assert [s.name for s in signal_specs(settings.signals)] == [s["name"] for s in attr["signals"]]
    assert settings.n_samples == cfg["rollout"]["n"] and settings.max_new_tokens == cfg["rollout"]["max_new_tokens"]
    shape = model_shape(cfg)
    tiny = cfg["model"]["tiny"]
    assert (shape.hidden_size, shape.num_layers) == (tiny["hidden_size"], tiny["num_layers"])
    s = PlanSettings.from_config(cfg, 1, shape)
    assert cfg["plan"]["gpu_memory_gb"] is None  # the schema's: this machine's memory for a CPU config
    assert (s.gpu_gb, s.memory_source) == memory_gb(cfg, on_gpu=False) and s.strategy == cfg["train"]["strategy"]
    assert s.batch.packing == cfg["train"]["packing"]
    assert s.prompt == min(cfg["plan"]["prompt_tokens"], tiny["max_position_embeddings"] - cfg["rollout"]["max_new_tokens"])


def test_the_default_config_leaves_the_signal_list_to_the_schema():
    """config.yaml does not repeat the schema's default signal list (it did, and the two had drifted)."""
    import yaml

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert "signals" not in raw["attribution"]


def test_package_map_matches_the_folders():
    """oar/__init__.py lists every subpackage and top-level module (and nothing that is gone)."""
    import re

    import oar

    src = ROOT / "src" / "oar"
    present = {p.stem for p in src.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists() or p.name == "schemas"}
    present.discard("__pycache__")
    listed = set(re.findall(r":mod:`oar\.(\w+)`", oar.__doc__))
    assert listed == present, f"missing: {sorted(present - listed)}, stale: {sorted(listed - present)}"


@pytest.mark.parametrize("section", ["train", "rollout", "eval", "sft", "plan", "report", "attribution", "reward"])
def test_section_defaults_are_what_validation_fills(section):
    """oar.config.section_defaults (used where a partial config is accepted, e.g. the typed settings of
    a test or benchmark) gives exactly what validating a config without the section fills in."""
    assert section_defaults(section) == minimal_config()[section]


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_unvalidated_loading_fills_what_validation_fills(path):
    """load_config(validate=False) (benchmarks/gpu_check.py's, without jsonschema) gives every config
    of config/ exactly as validation leaves it, and its methods resolve the same."""
    from oar.config.load import load_config
    from oar.config.methods import resolve_method

    checked, unchecked = load_config(path), load_config(path, validate=False)
    assert unchecked == checked
    for name in checked.get("only_methods") or checked["methods"]:
        assert resolve_method(unchecked, name, validate=False) == resolve_method(checked, name), name


#: Credit options described by an options type of the credit layer (the one place their defaults are written).
_OPTION_TYPES = {"oar_p": "OarPOptions", "oar_g": "OarGOptions", "shuffled": "OarGOptions", "inverted": "OarGOptions",
                 "mc_value": "McValueOptions"}


def _options_type(name: str) -> type:
    import oar.credit.importance as importance
    import oar.credit.mc_value as mc_value

    return getattr(importance, name, None) or getattr(mc_value, name)


@pytest.mark.parametrize("credit", sorted(_OPTION_TYPES))
def test_each_credit_option_default_is_written_once_in_its_options_type(credit):
    """The schema lists every option of the estimator's options type and gives none of them a default
    (the type holds it: scripts/config_reference.py shows it from there), and the estimator accepts
    exactly the schema's options."""
    from oar.credit.importance import OAR_G_OPTIONS, OAR_P_OPTIONS, option_names
    from oar.credit.mc_value import MC_VALUE_OPTIONS

    cls = _options_type(_OPTION_TYPES[credit])
    props = schema()["$defs"]["credit_options"][credit]["properties"]
    assert set(option_names(cls)) <= set(props), f"{credit}: the schema lacks {set(option_names(cls)) - set(props)}"
    assert not [k for k in option_names(cls) if "default" in props[k]], f"{credit}: a second copy of a default"
    refine = props.get("refine", {}).get("properties", {})
    assert not [k for k, v in refine.items() if "default" in v]
    allowed = {"oar_p": OAR_P_OPTIONS, "mc_value": MC_VALUE_OPTIONS}.get(credit, OAR_G_OPTIONS)
    seq = {"norm_by_std", "eps"}  # the sequence advantage's (the recipe's, or the estimator's own)
    assert set(allowed) - seq == set(props) - seq, credit


def test_no_option_fallbacks_beside_the_options_types():
    """The estimators and the benchmark's signals read their options from the options types, never
    through `.get("<option>", <constant>)` (a second copy of a default that can drift)."""
    from oar.credit.importance import option_names

    names = set()
    for cls in set(_OPTION_TYPES.values()):
        names |= set(option_names(_options_type(cls)))
    found = []
    for module in ("credit/importance/__init__.py", "credit/mc_value.py", "attribution/signals.py"):
        for node in ast.walk(ast.parse((ROOT / "src" / "oar" / module).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in names
                    and isinstance(node.args[1], ast.Constant)):
                found.append(f"{module} line {node.lineno}: .get({node.args[0].value!r}, {node.args[1].value!r})")
    assert not found, found
