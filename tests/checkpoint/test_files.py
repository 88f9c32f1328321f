"""Array files read from several threads at once (as checkpoint loads read them)."""

from __future__ import annotations

import ast
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from psrec.checkpoint import files


def test_array_files_read_in_threads_never_parse_two_headers_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NumPy parses each .npy header with ast.literal_eval, which CPython 3.11 cannot run in two
    threads at once (python/cpython#106905: a spurious SystemError, seen in a checkpoint load).
    Reading files in a thread pool must never do so; every array comes back whole."""
    expected = {}
    for index in range(6):
        arrays = {f"a{k}": np.arange(k + index, dtype=np.float32).reshape(-1, 1) for k in range(8)}
        files.write_arrays(tmp_path / f"{index}.npz", arrays, sync_directory=False)
        expected[index] = arrays
    inside, most = 0, 0
    guard = threading.Lock()
    literal_eval = ast.literal_eval

    def watched(source: str) -> object:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.002)  # widens the window two unsynchronised parses would share
        try:
            return literal_eval(source)
        finally:
            with guard:
                inside -= 1

    monkeypatch.setattr(ast, "literal_eval", watched)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: files.read_arrays(tmp_path / f"{i}.npz"), range(6)))
    assert most == 1
    for index, arrays in enumerate(results):
        assert sorted(arrays) == sorted(expected[index])
        for name, array in arrays.items():
            np.testing.assert_array_equal(array, expected[index][name])
