"""Growing per-row arrays without copying them.

Every per-row array of a table (stored ids, payload, optimizer state, metadata) grows along its
first axis as rows are inserted. ``grow_rows`` enlarges an array that owns its memory in place with
``ndarray.resize`` (``realloc``: for large blocks glibc moves pages with ``mremap`` instead of
copying), so growth by a small factor stays cheap and little capacity sits reserved but unused. The
tables never hand out views of these arrays (exports are copies), which is what makes the in-place
resize safe; anything else falls back to allocate-and-copy.
"""

from __future__ import annotations

import numpy as np


def grow_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with its first axis enlarged to ``rows`` (new rows zero); in place when possible."""
    if array.shape[0] >= rows:
        return array
    shape = (rows, *array.shape[1:])
    if array.base is None and array.flags.owndata and array.flags.c_contiguous:
        try:
            array.resize(shape, refcheck=False)
            return array
        except (ValueError, MemoryError):
            pass
    grown = np.zeros(shape, dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown
