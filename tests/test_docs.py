"""The user documentation points at things that exist, and reads as documentation, not a work log."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"`(psrec/[\w/]+(?:\.py|/))`")
NAMED = re.compile(r"`(psrec/[\w/]+\.py)` \(`(\w+)(?:\.(\w+))?`\)")
# Work-log phrasing that belongs in git history and issue notes, not in user docs or docstrings.
DIARY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)) session\b"
    r"|\bsession \d+\b|\boverturns\b|benchmarks-history",
    re.IGNORECASE,
)
# Lab-notebook phrasing in the user docs: numbered or lettered runs, "(kept)" headings, stops and
# sessions of work, first-person accounts of what was tried. Each pattern is searched line by line.
NOTEBOOK = [
    re.compile(r"\b[Rr]uns? [A-Z]\b(?![\w'-])"),  # "Run E", "Runs D, E and F", "run A/B"
    re.compile(r"\(kept\)", re.IGNORECASE),
    re.compile(r"\bsession \d+|\bthis session\b", re.IGNORECASE),
    re.compile(r"\bstop \d+\b", re.IGNORECASE),
    re.compile(r"\b(?:we (?:then )?tried|earlier we|we kept)\b", re.IGNORECASE),
    re.compile(r"\bagainst the targets?\b", re.IGNORECASE),  # an issue's targets, tracked in the docs
]
# What was tried and did not pay collapses into one section; the phrase appears at most once a file.
TRIED = re.compile(r"tried and rejected", re.IGNORECASE)


def test_architecture_names_only_files_that_exist() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = set(PATH.findall(text))
    assert len(paths) > 30  # the batch and checkpoint paths are spelled out
    reserved = {"psrec/serve/"}
    missing = sorted(p for p in paths if p not in reserved and not (ROOT / p).exists())
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


def test_architecture_names_every_module() -> None:
    """The map in ARCHITECTURE.md matches the tree: a new module is added to it, a moved one moved."""
    named = set(PATH.findall((ROOT / "ARCHITECTURE.md").read_text()))
    modules = {
        path.relative_to(ROOT).as_posix()
        if path.name != "__init__.py"
        else path.parent.relative_to(ROOT).as_posix() + "/"
        for path in (ROOT / "psrec").rglob("*.py")
    } - {"psrec/"}
    missing = sorted(modules - named)
    assert not missing, f"ARCHITECTURE.md does not name {missing}"


def test_architecture_names_only_functions_that_exist() -> None:
    for path, name, member in NAMED.findall((ROOT / "ARCHITECTURE.md").read_text()):
        tree = ast.parse((ROOT / path).read_text())
        defined = {
            node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef | ast.FunctionDef)
        }
        assert name in defined, f"{path} defines no {name}"
        if member:
            members = {n.name for n in ast.walk(defined[name]) if isinstance(n, ast.FunctionDef)}
            assert member in members, f"{path}: {name} has no {member}"


@pytest.mark.parametrize(
    "path", DOCS + sorted((ROOT / "psrec").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_work_log_entries(path: Path) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if DIARY.search(line)
    ]
    assert not hits, "work-log phrasing (history belongs in git):\n" + "\n".join(hits)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_do_not_read_as_a_lab_notebook(path: Path) -> None:
    lines = path.read_text().splitlines()
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in: {line.strip()}"
        for number, line in enumerate(lines, start=1)
        for pattern in NOTEBOOK
        for match in pattern.finditer(line)
    ]
    tried = [number for number, line in enumerate(lines, start=1) if TRIED.search(line)]
    if len(tried) > 1:
        hits += [f"{path.relative_to(ROOT)}:{n}: 'tried and rejected' (one section only)" for n in tried]
    assert not hits, "lab-notebook phrasing (docs say what is, history belongs in git):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line",
    [
        '(load 1.4; "Run E"):',
        "All rounds of Runs D, E and F pooled",
        "in Runs D / E / F",
        "### Shared memory between a trainer and its shards (kept)",
        "measured in session 12",
        "as we tried before",
        "after stop 3 the figures",
    ],
)
def test_lab_notebook_patterns_catch(line: str) -> None:
    assert any(pattern.search(line) for pattern in NOTEBOOK)


@pytest.mark.parametrize(
    "line",
    [
        "Chunked A/B in one runtime",
        "Run `psrec bench --dim 64` from the repository root.",
        "psrec runs TorchRec's systems in fresh processes",
        "rows kept in memory (the default)",
        "Runs on 2 vCPU",
    ],
)
def test_lab_notebook_patterns_spare(line: str) -> None:
    assert not any(pattern.search(line) for pattern in NOTEBOOK)
