"""Admission: which new ids get a trainable row.

- ``always``: every new id seen in a training pull.
- ``min_count``: a count-min sketch (``depth`` rows of ``width`` saturating uint32 counters, one hash
  per row) counts each occurrence of a missing id in training pulls; the id is admitted once its
  estimate (the minimum over the rows, never below the true count) reaches ``min_count``. Memory is
  ``4 * depth * width`` bytes whatever the number of ids.
- ``probability``: each training pull admits a missing id with probability ``p``, decided by a hash of
  (seed, id, the table's pull counter), so a run is reproducible.

``Admission.admit`` is the numba path; its oracles are ``sketch_positions_numpy`` (the same hashing
in NumPy) and the exact per-id counter of ``psrec.testing.embedding_reference.ReferenceTable``.
"""

from __future__ import annotations

import numba
import numpy as np

from psrec.embedding.hashing import fastrange32, hash_key, unit_float
from psrec.embedding.initializers import derived_seed
from psrec.embedding.specs import AdmissionSpec

SKETCH_DOMAIN = 0xC0C0_0001
PROBABILITY_DOMAIN = 0xC0C0_0002
COUNTER_MAX = np.uint32(0xFFFFFFFF)


@numba.njit(cache=True, nogil=True)
def _sketch_add_kernel(sketch, ids, seed, min_count, admitted):  # pragma: no cover - numba
    depth, width = sketch.shape
    for i in range(ids.shape[0]):
        estimate = np.uint32(0xFFFFFFFF)
        for level in range(depth):
            position = fastrange32(hash_key(ids[i], seed + np.uint64(level)), width)
            counter = sketch[level, position]
            if counter < np.uint32(0xFFFFFFFF):
                counter += np.uint32(1)
                sketch[level, position] = counter
            estimate = min(estimate, counter)
        admitted[i] = estimate >= min_count


@numba.njit(cache=True, nogil=True)
def _probability_kernel(ids, seed, probability, admitted):  # pragma: no cover - numba
    for i in range(ids.shape[0]):
        admitted[i] = unit_float(hash_key(ids[i], seed)) < probability


def sketch_positions_numpy(ids: np.ndarray, seed: int, depth: int, width: int) -> np.ndarray:
    """(depth, n) counter positions of each id; NumPy twin of the kernel's hashing."""
    from psrec.embedding.hashing import fastrange32_numpy, hash_key_numpy

    return np.stack(
        [fastrange32_numpy(hash_key_numpy(ids, (seed + level) % (1 << 64)), width) for level in range(depth)]
    )


class Admission:
    """Decides admission of missing ids; holds the sketch and the pull counter."""

    def __init__(self, spec: AdmissionSpec, seed: int) -> None:
        self.spec = spec
        self.sketch_seed = derived_seed(seed, SKETCH_DOMAIN)
        self.probability_seed = derived_seed(seed, PROBABILITY_DOMAIN)
        self.pull_counter = 0
        self.sketch = (
            np.zeros((spec.sketch_depth, spec.sketch_width), dtype=np.uint32)
            if spec.kind == "min_count"
            else None
        )

    def nbytes(self) -> int:
        return 0 if self.sketch is None else int(self.sketch.nbytes)

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask of missing ``ids`` admitted now; counts them (min_count) or draws (probability)."""
        admitted = np.empty(ids.shape[0], dtype=np.bool_)
        if self.spec.kind == "always":
            admitted[:] = True
        elif self.spec.kind == "min_count":
            _sketch_add_kernel(self.sketch, ids, np.uint64(self.sketch_seed), self.spec.min_count, admitted)
        else:
            seed = derived_seed(self.probability_seed, self.pull_counter)
            _probability_kernel(ids, np.uint64(seed), float(self.spec.probability), admitted)
            self.pull_counter += 1
        return admitted
