import os
import subprocess
import sys

import numpy as np
import pytest

from psrec import SparseBatch


def test_import_has_no_side_effects() -> None:
    code = (
        "import logging, sys, psrec; assert 'ray' not in sys.modules; assert not logging.getLogger().handlers"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_batch_worked_example() -> None:
    batch = SparseBatch.from_features(
        {"user": (np.array([11, 12]), np.array([1, 1])), "tags": (np.array([7, 8]), np.array([2, 0]))}
    )
    assert batch.keys == ("user", "tags")
    assert batch.ids.tolist() == [11, 12, 7, 8]
    assert batch.lengths.tolist() == [1, 1, 2, 0]
    assert batch.offsets.tolist() == [0, 1, 2, 4, 4]
    ids, lengths = batch.feature("tags")
    assert ids.tolist() == [7, 8] and lengths.tolist() == [2, 0]
    assert batch.batch_size == 2


def test_sparse_batch_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="lengths sum"):
        SparseBatch(("a",), np.array([1, 2], dtype=np.int64), np.array([1], dtype=np.int32))
    with pytest.raises(TypeError, match="int64"):
        SparseBatch(("a",), np.array([1], dtype=np.int32), np.array([1], dtype=np.int32))


def test_concat_batches_keeps_sample_order() -> None:
    from psrec.data.batch import Batch, concat_batches

    def batch(a: list[int], lengths: list[int], labels: list[float]) -> Batch:
        sparse = SparseBatch.from_features({"a": (np.array(a), np.array(lengths))})
        n = len(labels)
        return Batch(np.array(labels, np.float32), np.zeros((n, 1), np.float32), sparse, row_ids=np.arange(n))

    merged = concat_batches([batch([1, 2, 3], [2, 1], [0, 1]), batch([4], [1], [1])])
    assert merged.sparse.ids.tolist() == [1, 2, 3, 4]
    assert merged.sparse.lengths.tolist() == [2, 1, 1]
    assert merged.labels.tolist() == [0, 1, 1] and merged.row_ids.tolist() == [0, 1, 0]


def test_public_names_resolve_lazily() -> None:
    code = (
        "import sys, psrec; assert 'torch' not in sys.modules; "
        "assert set(psrec.__all__) == set(psrec._EXPORTS); [getattr(psrec, n) for n in psrec.__all__]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_command_line_imports_only_its_own_command() -> None:
    """`psrec train` builds its parser without the other commands' modules (psrec bench imports torch,
    psrec data rich): the training run imports what it needs when it starts."""
    code = (
        "import sys; from psrec.cli import build_parser, _command; "
        "argv = ['train', 'config.yaml', '--local']; args = build_parser(_command(argv)).parse_args(argv); "
        "assert args.local and args.command == 'train'; "
        "heavy = {'torch', 'rich', 'psrec.bench.cli', 'psrec.data.cli', 'psrec.serve.cli'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_full_parser_has_every_command() -> None:
    from psrec.cli import COMMAND_MODULES, _command, build_parser

    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(choices) == {*COMMAND_MODULES, "scale"}
    assert set(build_parser("scale")._subparsers._group_actions[0].choices) == {"scale"}  # type: ignore[union-attr]
    assert _command(["-v", "train", "x.yaml"]) == "train"
    assert _command(["--help", "train"]) is None and _command([]) is None


def test_shard_actors_start_without_torch() -> None:
    """A shard process imports only the shard side (the actor module and what it reaches): no torch,
    whose import (and its compiler stack) would cost every shard start seconds."""
    code = "import sys, psrec.ps.actors; assert 'torch' not in sys.modules, 'the shard side imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_built_shard_actor_has_not_imported_torch() -> None:
    """Building the actor (thread counts pinned, kernels warmed) imports no torch either."""
    code = (
        "import sys\n"
        "from psrec.embedding.specs import SparseOptimizerSpec, TableSpec\n"
        "from psrec.ps.actors import ShardActor\n"
        "spec = TableSpec('t', 4, SparseOptimizerSpec('rowwise_adagrad'))\n"
        "actor = ShardActor(0, [spec], num_trainers=1, mode='sync', threads=1)\n"
        "assert 'torch' not in sys.modules, 'building a shard actor imports torch'\n"
        "import numba\n"
        "assert numba.get_num_threads() == 1, numba.get_num_threads()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})


def test_every_runtime_dependency_is_one_psrec_imports() -> None:
    """`[project] dependencies` hold what psrec's own code imports, nothing only the tests use (those
    go in the `dev` extra): each installed package costs users disk and, like scipy beside numba (its
    CPU target imports scipy.linalg whenever it is installed, 0.1 s in every process), start-up."""
    import ast
    import importlib.metadata
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    imported: set[str] = set()
    for path in (root / "psrec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
    # A dependency psrec reaches through another package's module.
    used_through = {"tensorboard": "torch.utils.tensorboard"}
    providers = importlib.metadata.packages_distributions()
    used = {normal(dist) for module in imported for dist in providers.get(module.split(".")[0], [])}
    used |= {name for name, module in used_through.items() if module in imported}
    unused = [
        requirement
        for requirement in declared
        if normal(re.match(r"[A-Za-z0-9_.-]+", requirement).group()) not in used  # type: ignore[union-attr]
    ]
    assert unused == [], f"runtime dependencies psrec never imports (move them to the dev extra): {unused}"
