"""Write docs/config-reference.md from the config schema (src/oar/schemas/config.schema.yaml).

Every key of the schema with its type, default and description; nested sections as headings; the
recipe and method keys and the options of every token-credit estimator from ``$defs``. The defaults
of the estimators with an options type (OAR-P, OAR-G and its nulls, ``mc_value``, and the
attribution signals' ``refine``) are not in the schema: they are read from those types
(:func:`with_option_defaults`), where each is written once.

    python scripts/config_reference.py           # (re)write docs/config-reference.md
    python scripts/config_reference.py --check   # exit 1 when docs/config-reference.md is not current

tests/test_docs.py renders the page in memory and fails when the file differs from it.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "src" / "oar" / "schemas" / "config.schema.yaml"
OUTPUT = ROOT / "docs" / "config-reference.md"

#: A default longer than this goes in a YAML block below its table instead of the table's cell.
_LONG_DEFAULT = 60


def load_schema(path: Path = SCHEMA) -> dict:
    return yaml.safe_load(path.read_text())


# ------------------------------------------------------------------------------------- cells
def _text(s: Any) -> str:
    """One line of markdown text: whitespace folded, pipes escaped, a ``<`` that opens a tag outside code
    spans written as ``&lt;`` (``results/<name>/`` would otherwise read as an HTML tag)."""
    parts = " ".join(str(s).split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i])
    return "`".join(parts)


def _flow(value: Any) -> str:
    """A value as one line: a string as it is, anything else as JSON (``[0, 1]``, ``{}``, ``null``)."""
    return value if isinstance(value, str) else json.dumps(value)


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(node: dict) -> str:
    """``integer, >= 1``; ``string: one of `a`, `b```; ``list of integer``; ``number or null``."""
    if "$ref" in node:
        return f"see `{_ref_name(node['$ref'])}`"
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    parts = []
    for t in types:
        if t == "array":
            items = node.get("items") or {}
            inner = items.get("type", "value") if isinstance(items, dict) else "value"
            inner = " or ".join(inner) if isinstance(inner, list) else inner
            if isinstance(items, dict) and items.get("enum"):
                inner += " (" + ", ".join(f"`{v}`" for v in items["enum"]) + ")"
            parts.append(f"list of {inner}")
        else:
            parts.append(t)
    out = " or ".join(parts) if parts else "any"
    if node.get("enum") is not None:
        out += ": one of " + ", ".join(f"`{_flow(v)}`" for v in node["enum"])
    bounds = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in node:
            bounds.append(f"{sign} {node[key]}")
    if node.get("minItems") is not None and node.get("minItems") == node.get("maxItems"):
        bounds.append(f"exactly {node['minItems']} items")
    else:
        if node.get("minItems") == 1:
            bounds.append("non-empty")
        elif "minItems" in node:
            bounds.append(f"at least {node['minItems']} items")
        if "maxItems" in node:
            bounds.append(f"at most {node['maxItems']} items")
    if node.get("minLength") == 1:
        bounds.append("non-empty")
    for key, word in (("minProperties", "at least {} entries"),):
        if key in node:
            bounds.append(word.format(node[key]))
    if "pattern" in node:
        bounds.append(f"pattern `{node['pattern']}`")
    if bounds:
        out += ", " + ", ".join(bounds)
    return out


def _is_section(node: Any) -> bool:
    """An object with named keys of its own: a section with its own heading."""
    return isinstance(node, dict) and isinstance(node.get("properties"), dict) and bool(node["properties"])


def _item_section(node: dict) -> dict | None:
    """The item schema of a list of objects with named keys, else None."""
    items = node.get("items")
    return items if _is_section(items) else None


def _map_section(node: dict) -> dict | None:
    """The value schema of a mapping of free names to objects (recipes, methods, resources), else None."""
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) and ("$ref" in extra or _is_section(extra)) else None


# ------------------------------------------------------------------------------------ render
class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def heading(self, level: int, text: str) -> None:
        self.add(f"{'#' * min(level, 6)} {text}", "")


def _section(page: _Page, path: str, node: dict, level: int) -> None:
    """A heading for ``path``, its description, one table row per key, then its subsections."""
    page.heading(level, f"`{path}`")
    if node.get("description"):
        page.add(_text(node["description"]), "")
    if node.get("x-task"):
        page.add(f"Only with `task.kind: {node['x-task']}`; a config that uses it on another task is refused.", "")
    required = set(node.get("required") or [])
    rows, subsections, long_defaults = [], [], []
    for key, child in node["properties"].items():
        child = child if isinstance(child, dict) else {}
        kind = _type(child)
        if key in required:
            kind += " (required)"
        sub_path = f"{path}.{key}"
        if _is_section(child):
            subsections.append((sub_path, child))
            kind += f", see [`{sub_path}`](#{slug(f'`{sub_path}`')})"
        elif _item_section(child) is not None:
            subsections.append((f"{sub_path}[]", _item_section(child)))
            kind += f", see [`{sub_path}[]`](#{slug(f'`{sub_path}[]`')})"
        elif _map_section(child) is not None:
            value = _map_section(child)
            if "$ref" in value:
                kind = f"mapping of names to `{_ref_name(value['$ref'])}`, see below"
            else:
                subsections.append((f"{sub_path}.<name>", value))
                kind += f", see [`{sub_path}.<name>`](#{slug(f'`{sub_path}.<name>`')})"
        default = "—"
        if "default" in child and not (_is_section(child) and child["default"] == {}):
            text = _flow(child["default"])
            if len(text) > _LONG_DEFAULT:
                long_defaults.append((key, child["default"]))
                default = "below"
            else:
                default = f"`{text}`"
        rows.append(f"| `{key}` | {_text(kind)} | {default} | {_text(child.get('description', ''))} |")
    page.add("| key | type | default | description |", "|---|---|---|---|", *rows, "")
    for key, value in long_defaults:
        page.add(f"Default of `{path}.{key}`:", "", "```yaml",
                 yaml.safe_dump(value, default_flow_style=None, sort_keys=False, width=110).rstrip(), "```", "")
    for sub_path, child in subsections:
        _section(page, sub_path, child, level + 1)


def with_option_defaults(schema: dict) -> dict:
    """A copy of ``schema`` with the defaults of the options types filled into the credit options (and
    the attribution signals' ``refine``) that they describe. A ``None`` default is shown only where the
    key may be null (elsewhere it means "unset": the caller decides)."""
    from oar.credit.importance import OarGOptions, OarPOptions, option_defaults
    from oar.credit.mc_value import McValueOptions

    out = copy.deepcopy(schema)
    credit = out["$defs"]["credit_options"]
    signal = out["properties"]["attribution"]["properties"]["signals"]["items"]["properties"]
    for props, cls in ((credit["oar_p"]["properties"], OarPOptions), (credit["oar_g"]["properties"], OarGOptions),
                       (credit["mc_value"]["properties"], McValueOptions),
                       (credit["mc_value"]["properties"]["refine"]["properties"], OarGOptions),
                       (signal["refine"]["properties"], OarGOptions)):
        for key, value in option_defaults(cls).items():
            node = props.get(key)
            types = node.get("type") if isinstance(node, dict) else None
            if node is None or "default" in node or (value is None and not (isinstance(types, list) and "null" in types)):
                continue
            node["default"] = value
    return out


def with_item_refs_inlined(schema: dict) -> dict:
    """A copy of ``schema`` in which a list whose items are a ``$ref`` (``eval.benchmarks``,
    ``eval.transfer.benchmarks``: ``$defs.benchmark``) holds that definition itself, so that each such
    list gets its ``[]`` section like a list written out in place."""
    out = copy.deepcopy(schema)
    defs = out.get("$defs", {})

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        items = node.get("items")
        if isinstance(items, dict) and "$ref" in items:
            node["items"] = copy.deepcopy(defs[_ref_name(items["$ref"])])
        for child in (node.get("properties") or {}).values():
            walk(child)

    walk(out)
    return out


def render(schema: dict) -> str:
    """The page, as text."""
    schema = with_item_refs_inlined(with_option_defaults(schema))
    page = _Page()
    page.heading(1, "Configuration reference")
    page.add(
        "Generated from [`src/oar/schemas/config.schema.yaml`](../src/oar/schemas/config.schema.yaml) by "
        "`python scripts/config_reference.py`; do not edit it by hand (`tests/test_docs.py` fails when it is "
        "not current). How configs combine (`extends`, overrides on the command line) is in "
        "[configuration.md](configuration.md).", "")
    if schema.get("description"):
        page.add(_text(schema["description"]), "")
    props = schema["properties"]
    required = set(schema.get("required") or [])
    page.heading(2, "Top level")
    rows = []
    for key, child in props.items():
        kind = _type(child) + (" (required)" if key in required else "")
        if _is_section(child):
            kind += f", see [`{key}`](#{slug(f'`{key}`')})"
        elif _map_section(child) is not None:
            value = _map_section(child)
            target = _ref_name(value["$ref"]) if "$ref" in value else None
            kind = (f"mapping of names to `{target}`, see [`{key}.<name>`](#{slug(f'`{key}.<name>`')})"
                    if target else kind + f", see [`{key}.<name>`](#{slug(f'`{key}.<name>`')})")
        default = "—"
        if "default" in child and not (_is_section(child) and child["default"] == {}):
            default = f"`{_flow(child['default'])}`"
        rows.append(f"| `{key}` | {_text(kind)} | {default} | {_text(child.get('description', ''))} |")
    page.add("| key | type | default | description |", "|---|---|---|---|", *rows, "")
    defs = schema.get("$defs", {})
    for key, child in props.items():
        if _is_section(child):
            _section(page, key, child, 2)
        elif _map_section(child) is not None:
            value = _map_section(child)
            if "$ref" in value:
                target = defs[_ref_name(value["$ref"])]
                entry = dict(target, description=_text(child.get("description", "")))
                _section(page, f"{key}.<name>", entry, 2)
                if key == "methods":
                    _credit_options(page, defs.get("credit_options", {}))
            else:
                _section(page, f"{key}.<name>", dict(value, description=_text(child.get("description", ""))), 2)
    return "\n".join(page.lines).rstrip() + "\n"


def _credit_options(page: _Page, options: dict) -> None:
    """One section per token-credit estimator: the options a method with that ``credit`` may set."""
    page.heading(3, "Credit options")
    page.add(_text(options.get("description", "")) + ". A method sets them beside `recipe` and `credit` "
             "(`oar_g_q50: {base: oar_g, quantile: 0.5}`); an estimator of your own code takes its keyword "
             "parameters as options ([adding-a-method.md](adding-a-method.md)).", "")
    for name, node in options.items():
        if name == "description" or not isinstance(node, dict):
            continue
        if _is_section(node):
            _section(page, f"credit: {name}", node, 4)
        else:
            page.heading(4, f"`credit: {name}`")
            page.add("No options.", "")


# ------------------------------------------------------------------------------------- slugs
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is not current; write nothing")
    args = parser.parse_args(argv)
    text = render(load_schema())
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not current: run `python scripts/config_reference.py`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
