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


def test_architecture_names_only_files_that_exist() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = set(PATH.findall(text))
    assert len(paths) > 30  # the batch and checkpoint paths are spelled out
    reserved = {"psrec/serve/"}
    missing = sorted(p for p in paths if p not in reserved and not (ROOT / p).exists())
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


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
