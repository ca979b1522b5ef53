"""The documentation against the tree: docs/design.md's module map lists every package and module of the production
packages, and nothing else; the links of README.md and docs/ lead somewhere.

The map is the "Module map" section of docs/design.md: markdown table rows whose first cell is one path in
backticks, ``pkg/`` for a package or ``pkg/module.py`` for a module. The production packages are those
pyproject.toml installs. A module's ``__init__.py`` is its package's row; generated stubs (``*_pb2*.py``) are not
listed. A failure names every row to add and every row to drop."""

from __future__ import annotations

import re
import tomllib
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
MAP_HEADING = "## Module map"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*$")  # | `path` | what |
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), images excluded
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def production_packages() -> list[str]:
    """The top-level packages pyproject.toml installs (``cdb``, ``cdb_api``, ...), from its find patterns."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.split(".")[0].rstrip("*") for pattern in include})


def tree_paths() -> set[str]:
    """Every package (``pkg/sub/``) and module (``pkg/sub/name.py``) of the production packages, as the map
    spells them. Like setuptools' package finder, only folders with an ``__init__.py`` under a package are packages
    (so build folders such as ``cdb_scheduler/_native_build/`` and caches are not); no ``__init__.py`` rows, no
    generated ``*_pb2*.py``."""
    paths: set[str] = set()
    folders = [ROOT / package for package in production_packages()]
    while folders:
        folder = folders.pop()
        if not (folder / "__init__.py").is_file():
            continue
        paths.add(folder.relative_to(ROOT).as_posix() + "/")
        for entry in folder.iterdir():
            if entry.is_dir():
                folders.append(entry)
            elif entry.suffix == ".py" and entry.name != "__init__.py" and "_pb2" not in entry.name:
                paths.add(entry.relative_to(ROOT).as_posix())
    return paths


def map_rows(text: str) -> list[tuple[str, str]]:
    """``(path, what)`` of every row of the Module map section's tables."""
    start = text.index(MAP_HEADING + "\n")
    end = text.find("\n## ", start + len(MAP_HEADING))
    section = text[start : end if end != -1 else len(text)]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            rows.append((match.group(1), match.group(2)))
    return rows


def test_the_module_map_lists_every_package_and_module_and_nothing_else() -> None:
    rows = map_rows(DESIGN.read_text())
    listed = [path for path, _ in rows]
    tree = tree_paths()
    missing = sorted(tree - set(listed))
    stale = sorted(set(listed) - tree)
    twice = sorted({path for path in listed if listed.count(path) > 1})
    silent = sorted(path for path, what in rows if not what)
    problems = [
        (missing, "missing from the map (add a row `path` | what it holds)"),
        (stale, "stale (listed, no such package or module in the tree: drop or rename the row)"),
        (twice, "listed twice"),
        (silent, "listed without saying what it holds"),
    ]
    report = "\n".join(f"{what}:\n" + "\n".join(f"  {p}" for p in paths) for paths, what in problems if paths)
    if report:
        pytest.fail(f"docs/design.md's module map ({MAP_HEADING}) is out of date:\n{report}", pytrace=False)


def test_the_map_reads_the_tree_it_is_checked_against() -> None:
    """The parser and the walk themselves: a map with every row is found, the roots are pyproject's."""
    assert {"cdb", "cdb_api", "cdb_scheduler", "services", "clients"} <= set(production_packages())
    tree = tree_paths()
    assert {"cdb_scheduler/plan.py", "services/http/", "cdb_api/build.py"} <= tree
    assert not any(path.endswith("__init__.py") or "_pb2" in path for path in tree)
    assert len(tree) > 100 and len(map_rows(DESIGN.read_text())) > 100


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings (outside code blocks), repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_the_links_of_the_readme_and_the_docs_lead_somewhere() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no such heading in {dest.relative_to(ROOT)})")
    if broken:
        pytest.fail("broken links:\n" + "\n".join(broken), pytrace=False)
