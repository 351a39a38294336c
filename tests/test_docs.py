"""The documentation a user navigates: README.md and docs/**/*.md.

- docs/config-reference.md is what scripts/config_reference.py writes from the config schema;
- every relative link resolves to a file (and to a heading of it, by GitHub's anchor rules, when it
  names one);
- README.md stays short and links every page of docs/; docs/results/README.md indexes every results page;
- no user doc refers to an issue or pull-request number.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200


def _user_docs() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------- markdown parsing
_FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, inline-code markers, HTML tags
    and emphasis markers dropped (code spans keep their text), lower case, every character but letters, digits, ``_``, ``-`` and spaces dropped,
    spaces turned into ``-``."""
    parts = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).split("`")
    for i in range(0, len(parts), 2):  # outside code spans: HTML tags and emphasis markers go
        parts[i] = re.sub(r"<[^>]+>", "", parts[i]).replace("*", "")
    text = "".join(parts).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file, duplicates numbered ``-1``, ``-2``... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    return [(no, m.group(1)) for no, line in _prose_lines(path.read_text()) for m in _LINK.finditer(line)]


# ------------------------------------------------------------------------------------- the tests
def _config_reference_module():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current():
    module = _config_reference_module()
    expected = module.render(module.load_schema())
    page = DOCS / "config-reference.md"
    assert page.exists(), "docs/config-reference.md is missing: run `python scripts/config_reference.py`"
    assert page.read_text() == expected, (
        "docs/config-reference.md is not what the schema (src/oar/schemas/config.schema.yaml) gives: "
        "run `python scripts/config_reference.py`")


def test_config_reference_covers_every_schema_key():
    import yaml

    schema = yaml.safe_load((ROOT / "src" / "oar" / "schemas" / "config.schema.yaml").read_text())
    page = (DOCS / "config-reference.md").read_text()
    for key in schema["properties"]:
        assert f"| `{key}` |" in page, key
    for name in schema["$defs"]["credit_options"]:
        if name != "description":
            assert f"`credit: {name}`" in page, name


@pytest.mark.parametrize("doc", _user_docs(), ids=_rel)
def test_relative_links_resolve(doc: Path):
    problems = []
    for no, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.is_relative_to(ROOT.resolve()):
            problems.append(f"{_rel(doc)}:{no}: {target}: outside the repository (a clone does not have it)")
            continue
        if not dest.exists():
            problems.append(f"{_rel(doc)}:{no}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{_rel(doc)}:{no}: {target}: no heading with anchor #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_links_every_docs_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    missing = [_rel(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links no page {missing}"


def test_results_index_lists_every_results_page():
    index = DOCS / "results" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = [p for p in sorted((DOCS / "results").glob("*.md")) if p.name != "README.md"]
    assert pages, "docs/results/ holds no results page"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs/results/README.md does not index {missing}"
    undated = [p.name for p in pages if not re.match(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", p.name)]
    assert not undated, f"results pages are named <YYYY-MM-DD>-<study>.md: {undated}"


_ISSUE_REF = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+|(?<![\w&/])#\d{2,}(?![\w-])", re.I)


@pytest.mark.parametrize("doc", _user_docs(), ids=_rel)
def test_no_issue_numbers(doc: Path):
    hits = [f"{_rel(doc)}:{no}: {m.group(0)!r}" for no, line in _prose_lines(doc.read_text())
            for m in _ISSUE_REF.finditer(line)]
    assert not hits, "user docs name no issue or pull-request numbers:\n" + "\n".join(hits)


def test_the_checks_see_what_they_check(tmp_path: Path):
    """The link, anchor and issue-number rules on a small page."""
    page = tmp_path / "page.md"
    page.write_text("# Top `a.b` (x)\n\n## 4.4 Bi-Level reshaping\n\n## Top `a.b` (x)\n\n## `m.<name>` <b>x</b>\n\n"
                    "See [here](#44-bi-level-reshaping), [dup](#top-ab-x-1), `[code](nowhere.md)`.\n\n"
                    "```bash\n# see issue 12\n```\nFixed in issue 30 and #31; anchor x.md#42-y is fine.\n")
    assert anchors(page) == {"top-ab-x", "44-bi-level-reshaping", "top-ab-x-1", "mname-x"}
    assert [t for _, t in links(page)] == ["#44-bi-level-reshaping", "#top-ab-x-1"]
    hits = [m.group(0) for _, line in _prose_lines(page.read_text()) for m in _ISSUE_REF.finditer(line)]
    assert hits == ["issue 30", "#31"]


def test_the_contributor_guide_names_what_exists():
    """CONTRIBUTING.md's checks name test files that exist, its paths exist, and every ``oar.x.y`` it
    names imports (a move of a module or a symbol must move the guide too)."""
    import importlib

    text = (ROOT / "CONTRIBUTING.md").read_text()
    tests = set(re.findall(r"tests/test_\w+\.py", text))
    assert tests and all((ROOT / t).is_file() for t in tests), sorted(t for t in tests if not (ROOT / t).is_file())
    paths = set(re.findall(r"`((?:src|benchmarks|docs|config|workflow)/[\w./-]+)`", text))
    assert paths and all((ROOT / p).exists() for p in paths), sorted(p for p in paths if not (ROOT / p).exists())
    for dotted in sorted(set(re.findall(r"`(oar(?:\.\w+)+)`", text))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what the guide names wrongly
