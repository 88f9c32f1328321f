"""Fused sparse optimizers: sum duplicate gradients, then update each touched row once.

``aggregate_gradients`` turns (rows, grads) with duplicates and absent rows (-1) into unique rows with
summed gradients, and reports non-finite gradients before anything is mutated. ``SparseOptimizer``
then applies one of these per-row updates in a numba kernel (float32 math, ``g`` already including
``weight_decay * w``):

- ``sgd``:             ``w -= lr * g``
- ``adagrad``:         ``a += g**2;  w -= lr * g / (sqrt(a) + eps)``            (a per element)
- ``rowwise_adagrad``: ``a += mean(g**2);  w -= lr * g / (sqrt(a) + eps)``      (a per row)
- ``adam`` (lazy):     ``t += 1;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g**2;``
                       ``w -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``  (t per row,
                       the formula of ``torch.optim.Adam``)
- ``ftrl`` (FTRL-Proximal, McMahan et al. 2013, alpha = lr, per coordinate):
  ``sigma = (sqrt(n + g**2) - sqrt(n)) / alpha;  z += g - sigma w;  n += g**2;``
  ``w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)``

Weights are addressed through ``weight_rows`` and optimizer state through ``state_rows``, so the same
kernel updates fp32 storage in place or a dequantised fp32 scratch of low-precision rows. The same
pass records each row's metadata ``[count, last step]`` and prefetches the rows ``PREFETCH_DISTANCE``
ahead (the update is bound by memory latency: every touched row is a cache miss). Rows are unique,
so ``adagrad`` and ``rowwise_adagrad`` batches of at least ``PARALLEL_MIN_VALUES`` values update
chunks of rows on numba's threads, each row with the same math as on one thread (identical results);
the NaN/Inf check of large gradient arrays runs in parallel too.
``psrec.testing.embedding_reference`` holds the NumPy oracles.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np

from psrec.embedding.arrays import grow_rows
from psrec.embedding.prefetch import prefetch, prefetch_row
from psrec.embedding.specs import SparseOptimizerSpec
from psrec.threads import PARALLEL_LAUNCH

# Names of the state arrays each optimizer keeps, with their shape kind ("element" = (rows, dim),
# "row" = (rows,)) and dtype.
STATE_LAYOUT: dict[str, list[tuple[str, str, type]]] = {
    "sgd": [],
    "adagrad": [("accumulator", "element", np.float32)],
    "rowwise_adagrad": [("accumulator", "row", np.float32)],
    "adam": [
        ("exp_avg", "element", np.float32),
        ("exp_avg_sq", "element", np.float32),
        ("step", "row", np.int32),
    ],
    "ftrl": [("z", "element", np.float32), ("n", "element", np.float32)],
}


PREFETCH_DISTANCE = 16
# Batches of at least this many values (rows x dim) run the parallel kernels, in chunks of
# PARALLEL_CHUNK rows; smaller ones stay on the calling thread, where a launch costs more than it saves.
PARALLEL_MIN_VALUES = 1 << 16
PARALLEL_CHUNK = 512
REDUCTION_MATH = {"reassoc", "contract"}  # lets LLVM vectorise sums; results differ in the last bits


@numba.njit(cache=True, nogil=True)
def _all_finite_kernel(bits):  # pragma: no cover - numba
    """True when no float32 (given as its uint32 bits, flattened) is NaN or Inf; vectorises."""
    bad = np.uint32(0)
    exponent = np.uint32(0x7F800000)
    for k in range(bits.shape[0]):
        bad |= np.uint32((bits[k] & exponent) == exponent)
    return bad == 0


@numba.njit(cache=True, nogil=True, parallel=True)
def _all_finite_parallel(bits):  # pragma: no cover - numba
    """`_all_finite_kernel` over chunks on numba's threads."""
    count = bits.shape[0]
    chunk = PARALLEL_MIN_VALUES
    bad = 0
    for c in numba.prange((count + chunk - 1) // chunk):
        if not _all_finite_kernel(bits[c * chunk : min(count, (c + 1) * chunk)]):
            bad += 1
    return bad == 0


def _parallel(values: int) -> bool:
    """Whether a batch of `values` floats runs the parallel kernels (see PARALLEL_MIN_VALUES)."""
    return values >= PARALLEL_MIN_VALUES and numba.get_num_threads() > 1


def all_finite(values: np.ndarray) -> bool:
    """True when no value of the C-contiguous float32 array is NaN or Inf."""
    bits = values.reshape(-1).view(np.uint32)
    if _parallel(bits.shape[0]):
        with PARALLEL_LAUNCH:
            return bool(_all_finite_parallel(bits))
    return bool(_all_finite_kernel(bits))


@numba.njit(cache=True, nogil=True)
def _dedupe_kernel(rows, unique_rows, sources, occurrences, slot_of):  # pragma: no cover - numba
    """Unique rows (>= 0) in first-seen order; ``sources[k]`` is the first position of unique row k,
    ``slot_of[i]`` the unique index of position i (-1 if absent). Returns (unique, has_duplicates)."""
    count = rows.shape[0]
    bits = 4
    while (1 << bits) < 2 * count:
        bits += 1
    mask = (1 << bits) - 1
    table = np.full(1 << bits, -1, dtype=np.int32)
    unique = 0
    duplicates = False
    for i in range(count):
        row = rows[i]
        slot_of[i] = -1
        if row < 0:
            continue
        position = np.int64((np.uint64(row) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits))
        while True:
            slot = table[position]
            if slot < 0:
                table[position] = unique
                unique_rows[unique] = row
                sources[unique] = i
                occurrences[unique] = 1
                slot_of[i] = unique
                unique += 1
                break
            if unique_rows[slot] == row:
                occurrences[slot] += 1
                slot_of[i] = slot
                duplicates = True
                break
            position = (position + 1) & mask
    return unique, duplicates


@numba.njit(cache=True, nogil=True)
def _sum_duplicates_kernel(grads, slot_of, summed):  # pragma: no cover - numba
    summed[:] = 0.0
    for i in range(grads.shape[0]):
        slot = slot_of[i]
        if slot >= 0:
            target = summed[slot]
            source = grads[i]
            for j in range(grads.shape[1]):
                target[j] += source[j]


def aggregate_gradients(
    rows: np.ndarray, grads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Sum the gradients of duplicate rows and drop absent rows (-1).

    Returns (unique rows (k,), gradient array, gradient row of each unique row (k,), occurrences (k,),
    all gradients finite). Without duplicates the caller's ``grads`` is returned as is (no copy).
    """
    if not all_finite(grads):
        empty = np.zeros(0, dtype=np.int32)
        return empty, grads, empty, empty, False
    count = rows.shape[0]
    unique_rows = np.empty(count, dtype=np.int32)
    sources = np.empty(count, dtype=np.int32)
    occurrences = np.empty(count, dtype=np.int32)
    slot_of = np.empty(count, dtype=np.int32)
    unique, duplicates = _dedupe_kernel(rows, unique_rows, sources, occurrences, slot_of)
    unique_rows, sources, occurrences = unique_rows[:unique], sources[:unique], occurrences[:unique]
    if not duplicates:
        return unique_rows, grads, sources, occurrences, True
    summed = np.empty((unique, grads.shape[1]), dtype=np.float32)
    _sum_duplicates_kernel(grads, slot_of, summed)
    return unique_rows, summed, np.arange(unique, dtype=np.int32), occurrences, True


@numba.njit(cache=True, nogil=True, inline="always")
def _record(metadata, row, occurrences, clock):  # pragma: no cover - numba
    """Metadata row ``[count, last step]``: saturating ``count += occurrences``, ``last step = clock``."""
    metadata[row, 0] = np.uint32(
        min(np.uint64(metadata[row, 0]) + np.uint64(occurrences), np.uint64(0xFFFFFFFF))
    )
    metadata[row, 1] = clock


@numba.njit(cache=True, nogil=True)
def _sgd_kernel(
    weights, weight_rows, state_rows, grads, grad_rows, metadata, occurrences, clock, lr, weight_decay
):  # pragma: no cover - numba
    count = weight_rows.shape[0]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            prefetch_row(weights, weight_rows[i + PREFETCH_DISTANCE])
            prefetch(metadata, state_rows[i + PREFETCH_DISTANCE])
        _record(metadata, state_rows[i], occurrences[i], clock)
        w = weights[weight_rows[i]]
        g = grads[grad_rows[i]]
        for j in range(w.shape[0]):
            w[j] -= lr * (g[j] + weight_decay * w[j])


@numba.njit(cache=True, nogil=True, inline="always")
def _adagrad_rows(
    start,
    stop,
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    for i in range(start, stop):
        if i + PREFETCH_DISTANCE < stop:
            prefetch_row(weights, weight_rows[i + PREFETCH_DISTANCE])
            prefetch(metadata, state_rows[i + PREFETCH_DISTANCE])
            prefetch_row(accumulator, state_rows[i + PREFETCH_DISTANCE])
        _record(metadata, state_rows[i], occurrences[i], clock)
        w = weights[weight_rows[i]]
        a = accumulator[state_rows[i]]
        g = grads[grad_rows[i]]
        for j in range(w.shape[0]):
            gradient = g[j] + weight_decay * w[j]
            a[j] += gradient * gradient
            w[j] -= lr * gradient / (np.sqrt(a[j]) + eps)


@numba.njit(cache=True, nogil=True)
def _adagrad_kernel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    _adagrad_rows(
        0,
        weight_rows.shape[0],
        weights,
        weight_rows,
        state_rows,
        grads,
        grad_rows,
        metadata,
        occurrences,
        clock,
        accumulator,
        lr,
        eps,
        weight_decay,
    )


@numba.njit(cache=True, nogil=True, parallel=True)
def _adagrad_parallel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    count = weight_rows.shape[0]
    for chunk in numba.prange((count + PARALLEL_CHUNK - 1) // PARALLEL_CHUNK):
        start = chunk * PARALLEL_CHUNK
        _adagrad_rows(
            start,
            min(count, start + PARALLEL_CHUNK),
            weights,
            weight_rows,
            state_rows,
            grads,
            grad_rows,
            metadata,
            occurrences,
            clock,
            accumulator,
            lr,
            eps,
            weight_decay,
        )


@numba.njit(cache=True, nogil=True, fastmath=REDUCTION_MATH, inline="always")
def _rowwise_adagrad_rows(
    start,
    stop,
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    dim = weights.shape[1]
    inverse_dim = np.float32(1.0 / dim)
    for i in range(start, stop):
        if i + PREFETCH_DISTANCE < stop:
            prefetch_row(weights, weight_rows[i + PREFETCH_DISTANCE])
            prefetch(metadata, state_rows[i + PREFETCH_DISTANCE])
            prefetch(accumulator, state_rows[i + PREFETCH_DISTANCE])
        _record(metadata, state_rows[i], occurrences[i], clock)
        w = weights[weight_rows[i]]
        g = grads[grad_rows[i]]
        square_sum = np.float32(0.0)
        for j in range(dim):
            gradient = g[j] + weight_decay * w[j]
            square_sum += gradient * gradient
        row = state_rows[i]
        accumulator[row] += square_sum * inverse_dim
        step = lr / (np.sqrt(accumulator[row]) + eps)
        for j in range(dim):
            w[j] -= step * (g[j] + weight_decay * w[j])


@numba.njit(cache=True, nogil=True, fastmath=REDUCTION_MATH)
def _rowwise_adagrad_kernel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    _rowwise_adagrad_rows(
        0,
        weight_rows.shape[0],
        weights,
        weight_rows,
        state_rows,
        grads,
        grad_rows,
        metadata,
        occurrences,
        clock,
        accumulator,
        lr,
        eps,
        weight_decay,
    )


@numba.njit(cache=True, nogil=True, fastmath=REDUCTION_MATH, parallel=True)
def _rowwise_adagrad_parallel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    accumulator,
    lr,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    count = weight_rows.shape[0]
    for chunk in numba.prange((count + PARALLEL_CHUNK - 1) // PARALLEL_CHUNK):
        start = chunk * PARALLEL_CHUNK
        _rowwise_adagrad_rows(
            start,
            min(count, start + PARALLEL_CHUNK),
            weights,
            weight_rows,
            state_rows,
            grads,
            grad_rows,
            metadata,
            occurrences,
            clock,
            accumulator,
            lr,
            eps,
            weight_decay,
        )


@numba.njit(cache=True, nogil=True)
def _adam_kernel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    exp_avg,
    exp_avg_sq,
    steps,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
):  # pragma: no cover - numba
    count = weight_rows.shape[0]
    dim = weights.shape[1]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            ahead = state_rows[i + PREFETCH_DISTANCE]
            prefetch_row(weights, weight_rows[i + PREFETCH_DISTANCE])
            prefetch(metadata, state_rows[i + PREFETCH_DISTANCE])
            prefetch_row(exp_avg, ahead)
            prefetch_row(exp_avg_sq, ahead)
            prefetch(steps, ahead)
        _record(metadata, state_rows[i], occurrences[i], clock)
        w = weights[weight_rows[i]]
        row = state_rows[i]
        m = exp_avg[row]
        v = exp_avg_sq[row]
        g = grads[grad_rows[i]]
        steps[row] += 1
        t = steps[row]
        bias_correction1 = 1.0 - float(beta1) ** t
        bias_correction2 = 1.0 - float(beta2) ** t
        step_size = np.float32(lr / bias_correction1)
        inverse_root_bc2 = np.float32(1.0 / np.sqrt(bias_correction2))
        for j in range(dim):
            gradient = g[j] + weight_decay * w[j]
            m[j] = beta1 * m[j] + (np.float32(1.0) - beta1) * gradient
            v[j] = beta2 * v[j] + (np.float32(1.0) - beta2) * gradient * gradient
            w[j] -= step_size * m[j] / (np.sqrt(v[j]) * inverse_root_bc2 + eps)


@numba.njit(cache=True, nogil=True)
def _ftrl_kernel(
    weights,
    weight_rows,
    state_rows,
    grads,
    grad_rows,
    metadata,
    occurrences,
    clock,
    z_state,
    n_state,
    alpha,
    beta,
    l1,
    l2,
):  # pragma: no cover - numba
    count = weight_rows.shape[0]
    dim = weights.shape[1]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            ahead = state_rows[i + PREFETCH_DISTANCE]
            prefetch_row(weights, weight_rows[i + PREFETCH_DISTANCE])
            prefetch(metadata, state_rows[i + PREFETCH_DISTANCE])
            prefetch_row(z_state, ahead)
            prefetch_row(n_state, ahead)
        _record(metadata, state_rows[i], occurrences[i], clock)
        w = weights[weight_rows[i]]
        row = state_rows[i]
        z = z_state[row]
        n = n_state[row]
        g = grads[grad_rows[i]]
        for j in range(dim):
            gradient = g[j]
            new_n = n[j] + gradient * gradient
            sigma = (np.sqrt(new_n) - np.sqrt(n[j])) / alpha
            z[j] += gradient - sigma * w[j]
            n[j] = new_n
            if abs(z[j]) <= l1:
                w[j] = np.float32(0.0)
            else:
                sign = np.float32(1.0) if z[j] > 0 else np.float32(-1.0)
                w[j] = -(z[j] - sign * l1) / ((beta + np.sqrt(new_n)) / alpha + l2)


class SparseOptimizer:
    """Owns an optimizer's per-row state arrays and applies its fused update kernel."""

    def __init__(self, spec: SparseOptimizerSpec, dim: int) -> None:
        self.spec = spec
        self.dim = dim
        self.state: dict[str, np.ndarray] = {
            name: self._new_state(kind, dtype, 0) for name, kind, dtype in STATE_LAYOUT[spec.name]
        }

    def _new_state(self, kind: str, dtype: type, rows: int) -> np.ndarray:
        shape = (rows, self.dim) if kind == "element" else (rows,)
        return np.zeros(shape, dtype=dtype)

    def initial_value(self, name: str) -> float:
        """Value a state array starts at for a new row."""
        if (self.spec.name in ("adagrad", "rowwise_adagrad") and name == "accumulator") or (
            self.spec.name == "ftrl" and name == "n"
        ):
            return float(self.spec.initial_accumulator_value)
        return 0.0

    def grow(self, row_capacity: int) -> None:
        for name, array in self.state.items():
            if array.shape[0] < row_capacity:
                self.state[name] = grow_rows(array, row_capacity)

    def reset_rows(self, rows: np.ndarray) -> None:
        """Give rows the state of a freshly inserted row."""
        for name, array in self.state.items():
            array[rows] = self.initial_value(name)

    def nbytes(self) -> int:
        return int(sum(array.nbytes for array in self.state.values()))

    def update(
        self,
        weights: np.ndarray,
        weight_rows: np.ndarray,
        state_rows: np.ndarray,
        grads: np.ndarray,
        grad_rows: np.ndarray,
        metadata: np.ndarray,
        occurrences: np.ndarray,
        clock: int,
    ) -> None:
        """One step on ``weights[weight_rows[i]]`` with state ``[state_rows[i]]`` and gradient
        ``grads[grad_rows[i]]`` (one entry per unique row), also recording ``occurrences[i]`` and
        ``clock`` in the row's ``metadata[state_rows[i]] = [count, last step]``."""
        record = (metadata, occurrences, np.uint32(clock))
        spec = self.spec
        lr = np.float32(spec.lr)
        eps = np.float32(spec.eps)
        weight_decay = np.float32(spec.weight_decay)
        if spec.name == "sgd":
            _sgd_kernel(weights, weight_rows, state_rows, grads, grad_rows, *record, lr, weight_decay)
        elif spec.name in ("adagrad", "rowwise_adagrad"):
            # Rows are unique, so chunks of them update in parallel with the same per-row math.
            parallel = _parallel(weight_rows.shape[0] * weights.shape[1])
            kernel = {
                ("adagrad", False): _adagrad_kernel,
                ("adagrad", True): _adagrad_parallel,
                ("rowwise_adagrad", False): _rowwise_adagrad_kernel,
                ("rowwise_adagrad", True): _rowwise_adagrad_parallel,
            }[spec.name, parallel]
            arguments = (weights, weight_rows, state_rows, grads, grad_rows, *record)
            with PARALLEL_LAUNCH if parallel else contextlib.nullcontext():
                kernel(*arguments, self.state["accumulator"], lr, eps, weight_decay)
        elif spec.name == "adam":
            _adam_kernel(
                weights,
                weight_rows,
                state_rows,
                grads,
                grad_rows,
                *record,
                self.state["exp_avg"],
                self.state["exp_avg_sq"],
                self.state["step"],
                lr,
                np.float32(spec.beta1),
                np.float32(spec.beta2),
                eps,
                weight_decay,
            )
        else:
            _ftrl_kernel(
                weights,
                weight_rows,
                state_rows,
                grads,
                grad_rows,
                *record,
                self.state["z"],
                self.state["n"],
                lr,
                np.float32(spec.ftrl_beta),
                np.float32(spec.ftrl_l1),
                np.float32(spec.ftrl_l2),
            )
