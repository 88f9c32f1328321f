"""The package's layers: imports only run downward.

data, embedding, models and storage are the bottom layer; checkpoint sits above them, then ps, then
parallel (and the run config), then train, then serve, bench and the command line. A module may import
its own layer or any layer below it, never one above; the walk reads every ``import`` statement with
`ast` (those under ``if TYPE_CHECKING:`` and inside functions included), so a lazy import does not
hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "psrec"

# Top-level unit of psrec (a subpackage or a module) -> its layer; higher layers may import lower ones.
LAYERS: dict[str, int] = {
    "data": 0,
    "embedding": 0,
    "models": 0,
    "storage": 0,
    "allocator": 0,
    "threads": 0,
    "checkpoint": 1,
    "ps": 2,
    "parallel": 3,
    "config": 3,
    "train": 4,
    "serve": 5,
    "bench": 5,
    "cli": 5,
}
# Narrower rules on top of the layers: the PS moves arrays, it knows neither models nor batches.
FORBIDDEN: dict[str, tuple[str, ...]] = {"ps": ("psrec.models", "psrec.data.batch")}


def _unit(module: str) -> str | None:
    """The top-level unit of a dotted module name inside psrec (``psrec.ps.client`` -> ``ps``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "psrec" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported psrec module) of every import statement in `path`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "psrec":  # from psrec import checkpoint -> psrec.checkpoint
                found += [(node.lineno, f"psrec.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("psrec.")]


def _violations(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        unit = _unit(module)
        if unit is None:  # psrec/__init__.py: lazy public exports of every layer
            continue
        if unit not in LAYERS:
            problems.append(f"{relative}: {unit!r} has no layer in tests/test_layering.py")
            continue
        for line, imported in _imports(path):
            target = _unit(imported)
            if target is None or target == unit:
                continue
            if target not in LAYERS:
                problems.append(f"{relative}:{line}: imports {imported}, which has no layer")
            elif LAYERS[target] > LAYERS[unit]:
                problems.append(
                    f"{relative}:{line}: {unit} (layer {LAYERS[unit]}) imports {imported} "
                    f"(layer {LAYERS[target]})"
                )
            elif any(imported == f or imported.startswith(f + ".") for f in FORBIDDEN.get(unit, ())):
                problems.append(f"{relative}:{line}: {unit} must not import {imported}")
    return problems


def test_imports_only_run_downward() -> None:
    problems = _violations(PACKAGE)
    assert not problems, "upward or forbidden imports:\n" + "\n".join(problems)


def test_the_walk_finds_an_upward_import(tmp_path: Path) -> None:
    """The check itself fails on the kinds of import it exists to catch."""
    package = tmp_path / "psrec"
    (package / "ps").mkdir(parents=True)
    (package / "ps" / "__init__.py").write_text("")
    (package / "ps" / "actors.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from psrec.models.base import ModelInput\n"
        "def build():\n    from psrec.train.builders import build_tables\n"
    )
    (package / "embedding.py").write_text("from psrec import checkpoint\n")
    problems = _violations(package)
    assert any("psrec.train.builders" in p for p in problems)
    assert any("must not import psrec.models.base" in p for p in problems)
    assert any("imports psrec.checkpoint" in p for p in problems)


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_every_layer_is_a_real_unit_or_reserved(unit: str) -> None:
    """A layer names an existing subpackage/module, or one reserved for a coming capability."""
    reserved = {"serve"}
    assert unit in reserved or (PACKAGE / unit).is_dir() or (PACKAGE / f"{unit}.py").is_file()
