"""The package's layers: imports only run downward.

data, embedding, models and storage are the bottom layer; checkpoint sits above them, then ps, then
parallel (and the run config), then trainer (what runs in a trainer process), then cluster (Ray's
start, actor placement, the typed calls to groups of actors), then elastic (the job changing shape),
then train (the driver), then serve, bench, the command line and testing (fixtures). A module may import
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
    "machine": 0,
    "checkpoint": 1,
    "ps": 2,
    "parallel": 3,
    "config": 3,
    "config_embedding": 3,
    "config_ps": 3,
    "trainer": 4,
    "cluster": 5,
    "elastic": 6,
    "train": 7,
    "serve": 8,
    "bench": 8,
    "cli": 8,
    "testing": 8,
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
        "def build():\n    from psrec.trainer.builders import build_tables\n"
    )
    (package / "embedding.py").write_text("from psrec import checkpoint\n")
    problems = _violations(package)
    assert any("psrec.trainer.builders" in p for p in problems)
    assert any("must not import psrec.models.base" in p for p in problems)
    assert any("imports psrec.checkpoint" in p for p in problems)


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_every_layer_is_a_real_unit_or_reserved(unit: str) -> None:
    """A layer names an existing subpackage/module, or one reserved for a coming capability."""
    reserved = {"serve"}
    assert unit in reserved or (PACKAGE / unit).is_dir() or (PACKAGE / f"{unit}.py").is_file()


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _module_graph(root: Path) -> dict[str, set[str]]:
    """psrec module -> the psrec modules it imports (every import statement, lazy ones included;
    ``from psrec.x import y`` counts as an import of ``psrec.x.y`` where that is a module)."""
    modules = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _private_uses(root: Path) -> list[str]:
    """Uses of another psrec module's underscore names: ``from psrec.m import _x`` and ``m._x`` where
    ``m`` was imported as a psrec module."""
    modules = {_module_name(path, root) for path in root.rglob("*.py")}
    problems = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("psrec"):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    if child in modules:
                        aliases[alias.asname or alias.name] = child
                    elif alias.name.startswith("_") and node.module != name:
                        problems.append(
                            f"{path.relative_to(root.parent)}:{node.lineno}: {node.module}.{alias.name}"
                        )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                problems.append(
                    f"{path.relative_to(root.parent)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}"
                )
    return problems


def _string_dispatch(root: Path) -> list[str]:
    """Remote calls whose method is a computed name: ``getattr(actor, name).remote(...)``. Only the
    one fan-out (`psrec.cluster.groups`) turns a method into its name."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "cluster/groups.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "remote"
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "getattr"
            ):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return problems


def test_no_module_imports_another_in_a_cycle() -> None:
    cycles = _cycles(_module_graph(PACKAGE))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_no_module_uses_another_modules_underscore_names() -> None:
    problems = _private_uses(PACKAGE)
    assert not problems, "underscore names used across modules:\n" + "\n".join(problems)


def test_no_remote_call_goes_by_a_computed_name() -> None:
    problems = _string_dispatch(PACKAGE)
    assert not problems, "getattr(...).remote: call the method through psrec.cluster.groups\n" + "\n".join(
        problems
    )


def test_the_checks_find_a_cycle_a_private_use_and_string_dispatch(tmp_path: Path) -> None:
    """Each check fails on the kind of code it exists to catch, a lazy import included."""
    package = tmp_path / "psrec"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train" / "__init__.py").write_text("")
    (package / "train" / "runtime.py").write_text("from psrec.train import shard_set\n_get = 1\n")
    (package / "train" / "shard_set.py").write_text(
        "def f(actor, name):\n"
        "    from psrec.train.runtime import _get\n"
        "    from psrec.train import runtime as r\n"
        "    return getattr(actor, name).remote(r._get)\n"
    )
    assert _cycles(_module_graph(package)) == [["psrec.train.runtime", "psrec.train.shard_set"]]
    private = _private_uses(package)
    assert any("psrec.train.runtime._get" in p for p in private) and len(private) == 2
    assert _string_dispatch(package) == ["psrec/train/shard_set.py:4"]
